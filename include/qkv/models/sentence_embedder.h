// Sentence embeddings from a sentence-transformers / Hugging Face BERT folder, the way
// sentence-transformers computes them:
//
//   text -> WordPiece ids ([CLS] .. [SEP], truncated to max_length)     (tokenizer_config.json)
//        -> BertModel -> token vectors [L, E]
//        -> pooling over the real tokens: cls / max / mean, concatenated in that order
//                                                                      (1_Pooling/config.json)
//        -> L2 normalisation if modules.json lists a Normalize module
//
// Folder files: config.json, model.safetensors, vocab.txt (required); tokenizer_config.json,
// sentence_bert_config.json, 1_Pooling/config.json, modules.json (optional: without a pooling
// config the pooling is mean, without modules.json there is no normalisation).
//
// Batching: texts are sorted by token count and cut into batches of batch_size, each padded
// only to its own longest text; padding is passed to attention as key lengths, so it is never
// attended. Outputs come back in input order, and each text's embedding does not depend on
// which other texts share its batch beyond f32 rounding of the shared GEMMs.
//
// Threads: one SentenceEmbedder may be shared by threads; embed() and embed_ids() are const and
// safe to call at once (each call gets its own layer scratch; tests/cpp/test_concurrency.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "qkv/models/bert_config.h"
#include "qkv/models/bert_model.h"
#include "qkv/models/wordpiece_tokenizer.h"

namespace qkv::models {

struct EmbedderOptions {
  // Tokens per text including [CLS] and [SEP]; 0 = sentence_bert_config.json's max_seq_length,
  // else tokenizer_config.json's model_max_length, capped by max_position_embeddings.
  std::int64_t max_length = 0;
  std::int64_t batch_size = 32;       // texts per forward pass
  std::optional<bool> normalize = {};  // nullopt: as modules.json says
  DType matmul_dtype = DType::kF32;    // the model's products: f32 or bf16 (BertModel)
};

class SentenceEmbedder {
 public:
  // Loads the folder; throws qkv::Error naming the file and what is wrong in it.
  static SentenceEmbedder load(const std::string& dir, const EmbedderOptions& options = {});

  std::int64_t dimension() const;  // embedding size: hidden_size x number of pooling modes
  std::int64_t max_length() const { return max_length_; }
  bool normalize() const { return normalize_; }
  const WordPieceTokenizer& tokenizer() const { return tokenizer_; }
  const BertModel& model() const { return model_; }

  // out: [texts.size(), dimension()], written. `progress(done, total)` (optional) is called after
  // each batch with the number of texts finished so far. `batch_size`: texts per forward pass,
  // 0 = the one given at load (EmbedderOptions); >= 1 otherwise.
  void embed(std::span<const std::string> texts, float* out,
             const std::function<void(std::int64_t, std::int64_t)>& progress = {},
             std::int64_t batch_size = 0) const;

  // The same on token ids already made ([CLS] .. [SEP], each 1..max_length() long).
  void embed_ids(std::span<const std::vector<std::int32_t>> ids, float* out,
                 const std::function<void(std::int64_t, std::int64_t)>& progress = {},
                 std::int64_t batch_size = 0) const;

 private:
  SentenceEmbedder(WordPieceTokenizer tokenizer, BertModel model, PoolingConfig pooling,
                   bool normalize, std::int64_t max_length, std::int64_t batch_size);

  // hidden: [batch, seq, E] of one batch; writes each text's pooled (and normalised) row.
  void pool(const float* hidden, std::span<const std::int64_t> lengths, std::int64_t seq,
            std::span<float* const> rows) const;

  WordPieceTokenizer tokenizer_;
  BertModel model_;
  PoolingConfig pooling_;
  bool normalize_;
  std::int64_t max_length_;
  std::int64_t batch_size_;
};

}  // namespace qkv::models
