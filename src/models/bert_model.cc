#include "qkv/models/bert_model.h"

#include <algorithm>
#include <deque>
#include <span>
#include <string>

#include "core/huge_pages.h"
#include "core/parallel.h"
#include "io/safetensors.h"
#include "qkv/error.h"

namespace qkv::models {
namespace {

// Reads BertModel tensors by their names, under the "bert." prefix when the file uses it.
class WeightReader {
 public:
  explicit WeightReader(const io::SafetensorsFile& file) : file_(file) {
    if (!file.contains("embeddings.word_embeddings.weight") &&
        file.contains("bert.embeddings.word_embeddings.weight")) {
      prefix_ = "bert.";
    }
  }
  // The tensor `name` as f32 after checking it has `shape`: in place in the file's mapping where
  // it is f32, else converted into storage this reader keeps (SafetensorsFile::view_f32). Valid
  // while the file and this reader live; the layers copy what they keep.
  std::span<const float> read(const std::string& name,
                              std::initializer_list<std::int64_t> shape) const {
    const std::vector<std::int64_t> expected(shape);
    return file_.view_f32(prefix_ + name, expected, storage_.emplace_back());
  }

 private:
  const io::SafetensorsFile& file_;
  std::string prefix_;
  mutable std::deque<std::vector<float>> storage_;  // (a deque: earlier views stay valid)
};

// An owned copy of values; a large one (the word embeddings, 47 MB in all-MiniLM-L6-v2) on huge
// pages (core/huge_pages.h): 2 MiB faults instead of 4 KiB ones while it is copied, and fewer
// TLB misses when rows are looked up.
std::vector<float> copy_of(std::span<const float> values) {
  std::vector<float> copy;
  reserve_on_huge_pages(copy, values.size());
  copy.assign(values.begin(), values.end());
  return copy;
}

Activation activation_of(HiddenAct act) {
  switch (act) {
    case HiddenAct::kGelu:
      return Activation::kGeluErf;
    case HiddenAct::kGeluTanh:
      return Activation::kGeluTanh;
    case HiddenAct::kRelu:
      return Activation::kRelu;
  }
  return Activation::kGeluErf;
}

LayerNorm read_layer_norm(const WeightReader& reader, const std::string& name, std::int64_t dim,
                          double eps) {
  const std::span<const float> gamma = reader.read(name + ".weight", {dim});
  const std::span<const float> beta = reader.read(name + ".bias", {dim});
  return LayerNorm(gamma, beta, dim, static_cast<float>(eps));
}

// One BertLayer: self-attention (separate Q/K/V), attention.output (dense + LayerNorm),
// intermediate (dense + act), output (dense + LayerNorm): a Post-LN encoder layer.
EncoderLayer read_layer(const WeightReader& reader, const BertConfig& config, std::int64_t index,
                        DType matmul_dtype) {
  const std::string at = "encoder.layer." + std::to_string(index) + ".";
  const std::int64_t e = config.hidden_size, f = config.intermediate_size;
  // The tensors in the file's order of sub-modules (so a missing one is reported in that order),
  // as spans the reader keeps valid until the layer has copied them.
  EncoderLayerWeights weights;
  MultiHeadAttentionWeights& attention = weights.attention;
  attention.packing = QkvPacking::kSeparate;
  attention.q_weight = reader.read(at + "attention.self.query.weight", {e, e});
  attention.q_bias = reader.read(at + "attention.self.query.bias", {e});
  attention.k_weight = reader.read(at + "attention.self.key.weight", {e, e});
  attention.k_bias = reader.read(at + "attention.self.key.bias", {e});
  attention.v_weight = reader.read(at + "attention.self.value.weight", {e, e});
  attention.v_bias = reader.read(at + "attention.self.value.bias", {e});
  attention.out_weight = reader.read(at + "attention.output.dense.weight", {e, e});
  attention.out_bias = reader.read(at + "attention.output.dense.bias", {e});
  weights.norm1_gamma = reader.read(at + "attention.output.LayerNorm.weight", {e});
  weights.norm1_beta = reader.read(at + "attention.output.LayerNorm.bias", {e});
  weights.ff1_weight = reader.read(at + "intermediate.dense.weight", {f, e});
  weights.ff1_bias = reader.read(at + "intermediate.dense.bias", {f});
  weights.ff2_weight = reader.read(at + "output.dense.weight", {e, f});
  weights.ff2_bias = reader.read(at + "output.dense.bias", {e});
  weights.norm2_gamma = reader.read(at + "output.LayerNorm.weight", {e});
  weights.norm2_beta = reader.read(at + "output.LayerNorm.bias", {e});

  const EncoderLayerConfig layer_config{
      .embed_dim = e,
      .num_heads = config.num_attention_heads,
      .d_ff = f,
      .activation = activation_of(config.hidden_act),
      .norm_first = false,
      .eps = static_cast<float>(config.layer_norm_eps),
      .matmul_dtype = matmul_dtype,
  };
  return EncoderLayer(layer_config, weights);
}

}  // namespace

BertModel::BertModel(const BertConfig& config, std::vector<float> word_embeddings,
                     std::vector<float> position_embeddings,
                     std::vector<float> token_type_embedding, LayerNorm embeddings_norm,
                     Encoder encoder)
    : config_(config),
      word_embeddings_(std::move(word_embeddings)),
      position_embeddings_(std::move(position_embeddings)),
      token_type_embedding_(std::move(token_type_embedding)),
      embeddings_norm_(std::move(embeddings_norm)),
      encoder_(std::move(encoder)) {}

BertModel BertModel::from_safetensors(const BertConfig& config, const io::SafetensorsFile& weights,
                                      DType matmul_dtype) {
  const WeightReader reader(weights);
  const std::int64_t e = config.hidden_size;
  // Row 0 of the token types: every token is segment A.
  std::vector<float> token_types =
      copy_of(reader.read("embeddings.token_type_embeddings.weight", {config.type_vocab_size, e})
                  .first(static_cast<std::size_t>(e)));
  std::vector<EncoderLayer> layers;
  // config.json may claim 2^31 - 1 layers: reserve no more than real models have, so that the
  // first missing layer is reported before gigabytes are set aside for the rest.
  layers.reserve(static_cast<std::size_t>(std::min<std::int64_t>(config.num_hidden_layers, 256)));
  for (std::int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers.push_back(read_layer(reader, config, i, matmul_dtype));
  }
  return BertModel(
      config, copy_of(reader.read("embeddings.word_embeddings.weight", {config.vocab_size, e})),
      copy_of(reader.read("embeddings.position_embeddings.weight",
                          {config.max_position_embeddings, e})),
      std::move(token_types),
      read_layer_norm(reader, "embeddings.LayerNorm", e, config.layer_norm_eps),
      Encoder(std::move(layers)));
}

void BertModel::forward(std::span<const std::int32_t> ids, std::span<const std::int64_t> lengths,
                        std::int64_t batch, std::int64_t seq, float* hidden) const {
  std::string shape = "[";  // built with += (GCC 12 warns falsely on "[" + std::string&&)
  shape += std::to_string(batch) + ", " + std::to_string(seq) + "]";
  if (batch < 1 || seq < 1) throw Error("BertModel: ids shape " + shape + " is empty");
  if (seq > config_.max_position_embeddings) {
    throw Error("BertModel: sequence length " + std::to_string(seq) +
                " exceeds max_position_embeddings " +
                std::to_string(config_.max_position_embeddings));
  }
  if (static_cast<std::int64_t>(ids.size()) != batch * seq) {
    throw Error("BertModel: ids hold " + std::to_string(ids.size()) + " values, shape " + shape +
                " needs " + std::to_string(batch * seq));
  }
  if (static_cast<std::int64_t>(lengths.size()) != batch) {
    throw Error("BertModel: lengths hold " + std::to_string(lengths.size()) +
                " values, expected batch " + std::to_string(batch));
  }
  for (std::int64_t b = 0; b < batch; ++b) {
    if (lengths[b] < 1 || lengths[b] > seq) {
      throw Error("BertModel: lengths[" + std::to_string(b) + "] = " +
                  std::to_string(lengths[b]) + " is outside 1.." + std::to_string(seq));
    }
  }
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= config_.vocab_size) {
      throw Error("BertModel: ids[" + std::to_string(i / seq) + ", " + std::to_string(i % seq) +
                  "] = " + std::to_string(ids[i]) + " is outside the vocabulary (size " +
                  std::to_string(config_.vocab_size) + ")");
    }
  }

  // Embeddings: hidden[b, t] = word[ids[b, t]] + position[t] + token_type[0], then LayerNorm.
  const std::int64_t e = config_.hidden_size;
  const std::int64_t rows = batch * seq;
  parallel_for_blocks(rows, e, resolve_num_threads(0), [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      const float* word = word_embeddings_.data() + ids[r] * e;
      const float* position = position_embeddings_.data() + (r % seq) * e;
      const float* type = token_type_embedding_.data();
      float* out = hidden + r * e;
      // BertEmbeddings' order: (word + token_type) + position.
      for (std::int64_t c = 0; c < e; ++c) out[c] = (word[c] + type[c]) + position[c];
    }
  });
  embeddings_norm_.forward(hidden, nullptr, rows, hidden);

  MhaOptions options;
  options.key_lengths = lengths;
  encoder_.forward(hidden, batch, seq, options);
}

}  // namespace qkv::models
