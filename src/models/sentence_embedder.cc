#include "qkv/models/sentence_embedder.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>

#include "io/safetensors.h"
#include "qkv/error.h"

namespace qkv::models {
namespace {

// Whether an optional file is there, of any type: one that is there but is not a regular file
// (a FIFO, a directory) is then refused by its reader, never silently skipped.
bool exists(const std::string& path) {
  std::error_code error;
  return std::filesystem::exists(path, error);
}

}  // namespace

SentenceEmbedder::SentenceEmbedder(WordPieceTokenizer tokenizer, BertModel model,
                                   PoolingConfig pooling, bool normalize,
                                   std::int64_t max_length, std::int64_t batch_size)
    : tokenizer_(std::move(tokenizer)),
      model_(std::move(model)),
      pooling_(pooling),
      normalize_(normalize),
      max_length_(max_length),
      batch_size_(batch_size) {}

SentenceEmbedder SentenceEmbedder::load(const std::string& dir, const EmbedderOptions& options) {
  if (options.batch_size < 1) {
    throw Error("batch size " + std::to_string(options.batch_size) + " must be >= 1");
  }
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error)) {
    throw Error(dir + ": not a directory (expected a Hugging Face model folder)");
  }
  // Read the small files first, so that a broken one is reported before the weights load.
  const BertConfig config = read_bert_config(dir + "/config.json");

  TokenizerConfig tokenizer_config;
  if (exists(dir + "/tokenizer_config.json")) {
    tokenizer_config = read_tokenizer_config(dir + "/tokenizer_config.json");
  }
  std::optional<std::int64_t> sentence_max;
  if (exists(dir + "/sentence_bert_config.json")) {
    sentence_max = read_sentence_max_seq_length(dir + "/sentence_bert_config.json");
  }
  PoolingConfig pooling{.mean_tokens = true};
  if (exists(dir + "/1_Pooling/config.json")) {
    pooling = read_pooling_config(dir + "/1_Pooling/config.json");
    if (pooling.word_embedding_dimension && *pooling.word_embedding_dimension != config.hidden_size) {
      throw Error(dir + "/1_Pooling/config.json: word_embedding_dimension " +
                  std::to_string(*pooling.word_embedding_dimension) +
                  " does not match config.json's hidden_size " +
                  std::to_string(config.hidden_size));
    }
  }
  bool normalize = false;
  if (exists(dir + "/modules.json")) normalize = read_modules_normalize(dir + "/modules.json");
  if (options.normalize) normalize = *options.normalize;

  std::int64_t max_length = options.max_length;
  if (max_length == 0) {
    max_length = sentence_max.value_or(
        tokenizer_config.model_max_length.value_or(config.max_position_embeddings));
    max_length = std::min(max_length, config.max_position_embeddings);
  }
  if (max_length < 2 || max_length > config.max_position_embeddings) {
    throw Error("max length " + std::to_string(max_length) + " must be in 2.." +
                std::to_string(config.max_position_embeddings) +
                " (the model's max_position_embeddings)");
  }

  WordPieceOptions tokenizer_options;
  tokenizer_options.lower_case = tokenizer_config.do_lower_case;
  tokenizer_options.strip_accents =
      tokenizer_config.strip_accents.value_or(tokenizer_config.do_lower_case);
  tokenizer_options.split_cjk = tokenizer_config.tokenize_chinese_chars;
  WordPieceTokenizer tokenizer = WordPieceTokenizer::from_file(dir + "/vocab.txt", tokenizer_options);
  if (tokenizer.vocab_size() != config.vocab_size) {
    throw Error(dir + "/vocab.txt: holds " + std::to_string(tokenizer.vocab_size()) +
                " tokens but config.json's vocab_size is " + std::to_string(config.vocab_size));
  }

  const io::SafetensorsFile weights(dir + "/model.safetensors");
  BertModel model = BertModel::from_safetensors(config, weights, options.matmul_dtype);
  return SentenceEmbedder(std::move(tokenizer), std::move(model), pooling, normalize, max_length,
                          options.batch_size);
}

std::int64_t SentenceEmbedder::dimension() const {
  const std::int64_t modes = int{pooling_.cls_token} + int{pooling_.max_tokens} +
                             int{pooling_.mean_tokens};
  return modes * model_.hidden_size();
}

void SentenceEmbedder::embed(std::span<const std::string> texts, float* out,
                             const std::function<void(std::int64_t, std::int64_t)>& progress,
                             std::int64_t batch_size) const {
  std::vector<std::vector<std::int32_t>> ids(texts.size());
  for (std::size_t i = 0; i < texts.size(); ++i) {
    ids[i] = tokenizer_.encode(texts[i], static_cast<int>(max_length_));
  }
  embed_ids(ids, out, progress, batch_size);
}

void SentenceEmbedder::embed_ids(std::span<const std::vector<std::int32_t>> ids, float* out,
                                 const std::function<void(std::int64_t, std::int64_t)>& progress,
                                 std::int64_t batch_size) const {
  if (batch_size < 0) {
    throw Error("batch size " + std::to_string(batch_size) + " must be >= 1 (0 = as loaded)");
  }
  if (batch_size == 0) batch_size = batch_size_;
  const std::int64_t count = static_cast<std::int64_t>(ids.size());
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t length = static_cast<std::int64_t>(ids[i].size());
    if (length < 1 || length > max_length_) {
      throw Error("ids[" + std::to_string(i) + "] holds " + std::to_string(length) +
                  " tokens, expected 1.." + std::to_string(max_length_));
    }
  }
  // Longest first (stable), so each batch pads only to texts of about its own length.
  std::vector<std::int64_t> order(static_cast<std::size_t>(count));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return ids[a].size() > ids[b].size();
  });

  const std::int64_t e = model_.hidden_size();
  const std::int64_t dim = dimension();
  std::vector<std::int32_t> batch_ids;
  std::vector<std::int64_t> lengths;
  std::vector<float> hidden;
  std::vector<float*> rows;
  for (std::int64_t first = 0; first < count; first += batch_size) {
    const std::int64_t n = std::min(batch_size, count - first);
    const std::int64_t seq = static_cast<std::int64_t>(ids[order[first]].size());
    batch_ids.assign(static_cast<std::size_t>(n * seq), tokenizer_.pad_id());
    lengths.resize(static_cast<std::size_t>(n));
    rows.resize(static_cast<std::size_t>(n));
    for (std::int64_t b = 0; b < n; ++b) {
      const std::vector<std::int32_t>& text = ids[order[first + b]];
      std::copy(text.begin(), text.end(), batch_ids.begin() + b * seq);
      lengths[b] = static_cast<std::int64_t>(text.size());
      rows[b] = out + order[first + b] * dim;
    }
    hidden.resize(static_cast<std::size_t>(n * seq * e));
    model_.forward(batch_ids, lengths, n, seq, hidden.data());
    pool(hidden.data(), lengths, seq, rows);
    if (progress) progress(first + n, count);
  }
}

void SentenceEmbedder::pool(const float* hidden, std::span<const std::int64_t> lengths,
                            std::int64_t seq, std::span<float* const> rows) const {
  // sentence-transformers' Pooling: cls = token 0; max and mean over the real tokens only;
  // concatenated in the order cls, max, mean. Then Normalize: x / max(|x|_2, 1e-12).
  const std::int64_t e = model_.hidden_size();
  std::vector<double> sum(static_cast<std::size_t>(e));
  for (std::size_t b = 0; b < rows.size(); ++b) {
    const float* tokens = hidden + static_cast<std::int64_t>(b) * seq * e;
    const std::int64_t length = lengths[b];
    float* row = rows[b];
    float* next = row;
    if (pooling_.cls_token) {
      std::copy(tokens, tokens + e, next);
      next += e;
    }
    if (pooling_.max_tokens) {
      std::copy(tokens, tokens + e, next);
      for (std::int64_t t = 1; t < length; ++t) {
        for (std::int64_t c = 0; c < e; ++c) next[c] = std::max(next[c], tokens[t * e + c]);
      }
      next += e;
    }
    if (pooling_.mean_tokens) {
      std::fill(sum.begin(), sum.end(), 0.0);
      for (std::int64_t t = 0; t < length; ++t) {
        for (std::int64_t c = 0; c < e; ++c) sum[c] += tokens[t * e + c];
      }
      for (std::int64_t c = 0; c < e; ++c) next[c] = static_cast<float>(sum[c] / length);
      next += e;
    }
    if (normalize_) {
      double norm2 = 0;
      for (float* x = row; x < next; ++x) norm2 += double{*x} * *x;
      const double inv = 1.0 / std::max(std::sqrt(norm2), 1e-12);
      for (float* x = row; x < next; ++x) *x = static_cast<float>(*x * inv);
    }
  }
}

}  // namespace qkv::models
