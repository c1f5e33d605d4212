// TokenTagger (qkv/models/token_tagger.h).
//
//   x = embed[tokens] + pos[0:L]                [B, L, E]
//   x = layer_i(x), i = 0 .. num_layers - 1     Pre-LN EncoderLayers, GELU
//   logits = head(LN(x))                        [B, L, num_classes]
//
// The parameters live here as plain vectors (the optimizer's view); after each step they are
// handed to the layers (EncoderLayer::set_parameters, LayerNorm::set_affine,
// Linear::set_weights). The attention uses the fused [Wq; Wk; Wv] packing.
#include "qkv/models/token_tagger.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "io/safetensors.h"
#include "qkv/error.h"
#include "qkv/layers/encoder_layer.h"
#include "qkv/layers/layer_norm.h"
#include "qkv/layers/linear.h"
#include "qkv/layers/loss.h"

namespace qkv {
namespace {

constexpr float kInitStd = 0.02f;

void check_config(const TokenTaggerConfig& c) {
  if (c.vocab < 1 || c.num_classes < 1 || c.max_seq < 1 || c.embed_dim < 1 || c.num_heads < 1 ||
      c.num_layers < 0 || c.d_ff < 1 || c.embed_dim % c.num_heads != 0) {
    throw Error("TokenTagger: config vocab = " + std::to_string(c.vocab) + ", num_classes = " +
                std::to_string(c.num_classes) + ", max_seq = " + std::to_string(c.max_seq) +
                ", embed_dim = " + std::to_string(c.embed_dim) + ", num_heads = " +
                std::to_string(c.num_heads) + ", num_layers = " + std::to_string(c.num_layers) +
                ", d_ff = " + std::to_string(c.d_ff) +
                " (need all >= 1, num_layers >= 0, embed_dim a multiple of num_heads)");
  }
  if (!(c.dropout >= 0.0f && c.dropout < 1.0f)) {
    throw Error("TokenTagger: dropout = " + std::to_string(c.dropout) + " must be in [0, 1)");
  }
  if (c.matmul_dtype != DType::kF32 && c.matmul_dtype != DType::kBF16) {
    throw Error(std::string("TokenTagger: matmul_dtype ") + dtype_name(c.matmul_dtype) +
                " is not a product type (f32 or bf16)");
  }
}

EncoderLayerConfig layer_config(const TokenTaggerConfig& c) {
  return {.embed_dim = c.embed_dim,
          .num_heads = c.num_heads,
          .d_ff = c.d_ff,
          .activation = Activation::kGeluErf,
          .norm_first = true,
          .dropout = c.dropout,
          .matmul_dtype = c.matmul_dtype};
}

// The model's metadata keys, in the file.
const char* const kConfigKeys[] = {"vocab",     "num_classes", "max_seq", "embed_dim",
                                   "num_heads", "num_layers",  "d_ff",    "causal"};

}  // namespace

struct TokenTagger::Impl {
  TokenTaggerConfig config;
  // Parameters (the optimizer's view) and their gradients.
  std::vector<float> embed, pos, norm_gamma, norm_beta, head_weight, head_bias;
  std::vector<EncoderLayerParams> layer_params;
  std::vector<float> g_embed, g_pos, g_norm_gamma, g_norm_beta, g_head_weight, g_head_bias;
  std::vector<EncoderLayerParams> layer_grads;
  // train_step's tapes, kept from step to step: their buffers are reused, not allocated and
  // first touched again each step.
  std::vector<EncoderLayerTape> tapes;
  std::vector<float> x, normed, logits, d_logits, d_normed, dx;  // train_step's activations
  // The layers built from them.
  std::vector<EncoderLayer> layers;
  std::optional<LayerNorm> norm;
  std::optional<Linear> head;
  std::int64_t steps = 0;

  // Builds layers, norm and head from the parameters.
  void build() {
    layers.clear();
    for (const EncoderLayerParams& p : layer_params) {
      layers.emplace_back(layer_config(config), p.weights());
    }
    for (std::size_t i = 1; i < layers.size(); ++i) layers[i].share_scratch_with(layers[0]);
    norm.emplace(norm_gamma, norm_beta, config.embed_dim, 1e-5f);
    head.emplace(LinearParams{.weight = head_weight,
                              .bias = head_bias,
                              .in_features = config.embed_dim,
                              .out_features = config.num_classes});
    layer_grads.clear();
    for (const EncoderLayer& layer : layers) layer_grads.push_back(layer.zero_grads());
    g_embed.assign(embed.size(), 0.0f);
    g_pos.assign(pos.size(), 0.0f);
    g_norm_gamma.assign(norm_gamma.size(), 0.0f);
    g_norm_beta.assign(norm_beta.size(), 0.0f);
    g_head_weight.assign(head_weight.size(), 0.0f);
    g_head_bias.assign(head_bias.size(), 0.0f);
  }

  void check_call(const std::int32_t* tokens, std::int64_t batch, std::int64_t seq,
                  const char* where) const {
    if (batch < 0 || seq < 0 || seq > config.max_seq) {
      throw Error(std::string("TokenTagger::") + where + ": batch = " + std::to_string(batch) +
                  ", seq = " + std::to_string(seq) + " (need >= 0, seq <= max_seq = " +
                  std::to_string(config.max_seq) + ")");
    }
    if (batch * seq > 0 && tokens == nullptr) {
      throw Error(std::string("TokenTagger::") + where + ": tokens is null");
    }
    for (std::int64_t i = 0; i < batch * seq; ++i) {
      if (tokens[i] < 0 || tokens[i] >= config.vocab) {
        throw Error(std::string("TokenTagger::") + where + ": tokens[" + std::to_string(i) +
                    "] = " + std::to_string(tokens[i]) + " is outside [0, vocab = " +
                    std::to_string(config.vocab) + ")");
      }
    }
  }

  // x [B, L, E] = embed[tokens] + pos
  std::vector<float> embed_tokens(const std::int32_t* tokens, std::int64_t batch,
                                  std::int64_t seq) const {
    std::vector<float> x;
    embed_tokens(tokens, batch, seq, x);
    return x;
  }
  // The same into x (resized; its memory reused from call to call), rows over the threads.
  void embed_tokens(const std::int32_t* tokens, std::int64_t batch, std::int64_t seq,
                    std::vector<float>& x) const {
    const std::int64_t E = config.embed_dim;
    x.resize(static_cast<std::size_t>(batch * seq * E));
    parallel_for_blocks(batch * seq, E, resolve_num_threads(0),
                        [&](std::int64_t r0, std::int64_t r1) {
                          for (std::int64_t r = r0; r < r1; ++r) {
                            const float* e = embed.data() + tokens[r] * E;
                            const float* p = pos.data() + r % seq * E;
                            float* row = x.data() + r * E;
                            for (std::int64_t d = 0; d < E; ++d) row[d] = e[d] + p[d];
                          }
                        });
  }

  // Every parameter and its gradient, in one fixed order.
  void tensors(std::vector<std::vector<float>*>& params, std::vector<std::vector<float>*>& grads) {
    params = {&embed, &pos};
    grads = {&g_embed, &g_pos};
    for (std::size_t i = 0; i < layer_params.size(); ++i) {
      for (std::vector<float>* t : layer_params[i].tensors()) params.push_back(t);
      for (std::vector<float>* t : layer_grads[i].tensors()) grads.push_back(t);
    }
    for (auto* t : {&norm_gamma, &norm_beta, &head_weight, &head_bias}) params.push_back(t);
    for (auto* t : {&g_norm_gamma, &g_norm_beta, &g_head_weight, &g_head_bias}) grads.push_back(t);
  }
};

TokenTagger::TokenTagger() : impl_(std::make_unique<Impl>()) {}

TokenTagger::TokenTagger(const TokenTaggerConfig& config, std::uint64_t seed)
    : impl_(std::make_unique<Impl>()) {
  check_config(config);
  Impl& m = *impl_;
  m.config = config;
  const std::int64_t E = config.embed_dim, F = config.d_ff;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, kInitStd);
  auto random = [&](std::int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) x = normal(rng);
    return v;
  };
  auto zeros = [](std::int64_t n) { return std::vector<float>(static_cast<std::size_t>(n), 0.0f); };
  auto ones = [](std::int64_t n) { return std::vector<float>(static_cast<std::size_t>(n), 1.0f); };
  m.embed = random(config.vocab * E);
  m.pos = random(config.max_seq * E);
  for (std::int64_t i = 0; i < config.num_layers; ++i) {
    EncoderLayerParams p;
    p.attention.packing = QkvPacking::kFusedBlocks;
    p.attention.qkv_weight = random(3 * E * E);
    p.attention.qkv_bias = zeros(3 * E);
    p.attention.out_weight = random(E * E);
    p.attention.out_bias = zeros(E);
    p.norm1_gamma = ones(E), p.norm1_beta = zeros(E), p.norm2_gamma = ones(E);
    p.norm2_beta = zeros(E);
    p.ff1_weight = random(F * E), p.ff1_bias = zeros(F);
    p.ff2_weight = random(E * F), p.ff2_bias = zeros(E);
    m.layer_params.push_back(std::move(p));
  }
  m.norm_gamma = ones(E);
  m.norm_beta = zeros(E);
  m.head_weight = random(config.num_classes * E);
  m.head_bias = zeros(config.num_classes);
  m.build();
}

TokenTagger::~TokenTagger() = default;
TokenTagger::TokenTagger(TokenTagger&&) noexcept = default;
TokenTagger& TokenTagger::operator=(TokenTagger&&) noexcept = default;

const TokenTaggerConfig& TokenTagger::config() const { return impl_->config; }

std::int64_t TokenTagger::num_parameters() const {
  std::vector<std::vector<float>*> params, grads;
  impl_->tensors(params, grads);
  std::int64_t n = 0;
  for (const std::vector<float>* t : params) n += static_cast<std::int64_t>(t->size());
  return n;
}

void TokenTagger::forward(const std::int32_t* tokens, std::int64_t batch, std::int64_t seq,
                          float* logits) const {
  const Impl& m = *impl_;
  m.check_call(tokens, batch, seq, "forward");
  const std::int64_t rows = batch * seq;
  if (rows == 0) return;
  if (logits == nullptr) throw Error("TokenTagger::forward: logits is null");
  std::vector<float> x = m.embed_tokens(tokens, batch, seq);
  for (const EncoderLayer& layer : m.layers) {
    layer.forward(x.data(), batch, seq, {.causal = m.config.causal});
  }
  m.norm->forward(x.data(), nullptr, rows, x.data());
  m.head->forward(x.data(), rows, logits);
}

TrainStepResult TokenTagger::train_step(const std::int32_t* tokens, const std::int32_t* targets,
                                        std::int64_t batch, std::int64_t seq, AdamW& optimizer,
                                        std::uint64_t seed) {
  Impl& m = *impl_;
  m.check_call(tokens, batch, seq, "train_step");
  const std::int64_t rows = batch * seq, E = m.config.embed_dim, C = m.config.num_classes;
  TrainStepResult result;
  if (rows == 0) return result;
  if (targets == nullptr) throw Error("TokenTagger::train_step: targets is null");
  // Forward, keeping every layer's tape.
  std::vector<float>& x = m.x;
  m.embed_tokens(tokens, batch, seq, x);
  std::vector<EncoderLayerTape>& tapes = m.tapes;
  tapes.resize(m.layers.size());
  for (std::size_t i = 0; i < m.layers.size(); ++i) {
    m.layers[i].set_training(m.config.dropout > 0.0f,
                             seed ^ (static_cast<std::uint64_t>(m.steps) * m.layers.size() + i) *
                                        0x9E3779B97F4A7C15ull);
    m.layers[i].forward_train(x.data(), batch, seq, {.causal = m.config.causal}, tapes[i]);
  }
  std::vector<float>& normed = m.normed;
  std::vector<float>& logits = m.logits;
  normed.resize(x.size());
  logits.resize(static_cast<std::size_t>(rows * C));
  m.norm->forward(x.data(), nullptr, rows, normed.data());
  m.head->forward(normed.data(), rows, logits.data());
  std::vector<float>& d_logits = m.d_logits;
  d_logits.resize(logits.size());
  result.loss = cross_entropy(logits.data(), rows, C, targets, d_logits.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    if (targets[r] < 0) continue;
    ++result.counted;
    const float* row = logits.data() + r * C;
    result.correct += std::max_element(row, row + C) - row == targets[r];
  }
  // Backward.
  std::vector<float>& d_normed = m.d_normed;
  std::vector<float>& dx = m.dx;
  d_normed.resize(x.size());
  dx.resize(x.size());
  m.head->backward(normed.data(), rows, d_logits.data(), d_normed.data(), m.g_head_weight.data(),
                   m.g_head_bias.data());
  m.norm->backward(x.data(), nullptr, rows, d_normed.data(), dx.data(), m.g_norm_gamma.data(),
                   m.g_norm_beta.data());
  for (std::size_t i = m.layers.size(); i-- > 0;) {
    m.layers[i].backward(tapes[i], dx.data(), m.layer_grads[i]);
  }
  // The embeddings' gradients: every element sums its rows in row order; tasks of 64 columns
  // (rows of one token never race).
  constexpr std::int64_t kColumns = 64;
  parallel_for((E + kColumns - 1) / kColumns, resolve_num_threads(0), [&](std::int64_t t, int) {
    const std::int64_t e0 = t * kColumns, e1 = std::min(E, e0 + kColumns);
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* d = dx.data() + r * E;
      float* ge = m.g_embed.data() + tokens[r] * E;
      float* gp = m.g_pos.data() + r % seq * E;
      for (std::int64_t e = e0; e < e1; ++e) {
        ge[e] += d[e];
        gp[e] += d[e];
      }
    }
  });
  // The update, handed to the layers; gradients back to zero.
  std::vector<std::vector<float>*> params, grads;
  m.tensors(params, grads);
  optimizer.step(params, grads);
  for (std::size_t i = 0; i < m.layers.size(); ++i) m.layers[i].set_parameters(m.layer_params[i]);
  m.norm->set_affine(m.norm_gamma, m.norm_beta);
  m.head->set_weights(m.head_weight, m.head_bias);
  parallel_for(static_cast<std::int64_t>(grads.size()), resolve_num_threads(0),
               [&](std::int64_t i, int) { std::fill(grads[i]->begin(), grads[i]->end(), 0.0f); });
  ++m.steps;
  return result;
}

void TokenTagger::save(const std::string& path) const {
  const Impl& m = *impl_;
  const TokenTaggerConfig& c = m.config;
  const std::int64_t E = c.embed_dim, F = c.d_ff;
  std::vector<io::SafetensorsEntry> entries;
  auto add = [&](const std::string& name, const std::vector<float>& data,
                 std::vector<std::int64_t> shape) {
    entries.push_back({name, io::SafetensorsDType::kF32, std::move(shape), data.data()});
  };
  add("embed.weight", m.embed, {c.vocab, E});
  add("pos.weight", m.pos, {c.max_seq, E});
  for (std::size_t i = 0; i < m.layer_params.size(); ++i) {
    const EncoderLayerParams& p = m.layer_params[i];
    const std::string l = "layers." + std::to_string(i) + ".";
    add(l + "attention.qkv_weight", p.attention.qkv_weight, {3 * E, E});
    add(l + "attention.qkv_bias", p.attention.qkv_bias, {3 * E});
    add(l + "attention.out_weight", p.attention.out_weight, {E, E});
    add(l + "attention.out_bias", p.attention.out_bias, {E});
    add(l + "norm1.gamma", p.norm1_gamma, {E});
    add(l + "norm1.beta", p.norm1_beta, {E});
    add(l + "ff1.weight", p.ff1_weight, {F, E});
    add(l + "ff1.bias", p.ff1_bias, {F});
    add(l + "ff2.weight", p.ff2_weight, {E, F});
    add(l + "ff2.bias", p.ff2_bias, {E});
    add(l + "norm2.gamma", p.norm2_gamma, {E});
    add(l + "norm2.beta", p.norm2_beta, {E});
  }
  add("norm.gamma", m.norm_gamma, {E});
  add("norm.beta", m.norm_beta, {E});
  add("head.weight", m.head_weight, {c.num_classes, E});
  add("head.bias", m.head_bias, {c.num_classes});
  const std::int64_t values[] = {c.vocab,     c.num_classes, c.max_seq, c.embed_dim,
                                 c.num_heads, c.num_layers,  c.d_ff,    c.causal ? 1 : 0};
  std::map<std::string, std::string> metadata = {{"model", "qkv.TokenTagger"}};
  for (std::size_t k = 0; k < std::size(kConfigKeys); ++k) {
    metadata[kConfigKeys[k]] = std::to_string(values[k]);
  }
  io::write_safetensors(path, entries, metadata);
}

TokenTagger TokenTagger::load(const std::string& path, DType matmul_dtype) {
  const io::SafetensorsFile file(path);
  const auto& metadata = file.metadata();
  auto value = [&](const char* key) -> std::int64_t {
    const auto it = metadata.find(key);
    if (it == metadata.end()) {
      throw Error(path + ": metadata has no '" + key + "' (not a file of TokenTagger::save)");
    }
    try {
      std::size_t used = 0;
      const long long v = std::stoll(it->second, &used);
      if (used != it->second.size()) throw std::invalid_argument("trailing");
      return v;
    } catch (const std::exception&) {
      throw Error(path + ": metadata '" + key + "' = '" + it->second + "' is not an integer");
    }
  };
  TokenTaggerConfig c;
  c.vocab = value("vocab"), c.num_classes = value("num_classes"), c.max_seq = value("max_seq");
  c.embed_dim = value("embed_dim"), c.num_heads = value("num_heads");
  c.num_layers = value("num_layers"), c.d_ff = value("d_ff"), c.causal = value("causal") != 0;
  c.matmul_dtype = matmul_dtype;
  try {
    check_config(c);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
  if (c.num_layers > 1024 || c.embed_dim > (1 << 16) || c.d_ff > (1 << 20) ||
      c.vocab > (1 << 24) || c.max_seq > (1 << 24) || c.num_classes > (1 << 24)) {
    throw Error(path + ": config is implausibly large");
  }
  const std::int64_t E = c.embed_dim, F = c.d_ff;
  auto read = [&](const std::string& name, std::vector<std::int64_t> shape) {
    return file.read_f32(name, shape);
  };
  TokenTagger model;
  Impl& m = *model.impl_;
  m.config = c;
  m.embed = read("embed.weight", {c.vocab, E});
  m.pos = read("pos.weight", {c.max_seq, E});
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    EncoderLayerParams p;
    p.attention.packing = QkvPacking::kFusedBlocks;
    p.attention.qkv_weight = read(l + "attention.qkv_weight", {3 * E, E});
    p.attention.qkv_bias = read(l + "attention.qkv_bias", {3 * E});
    p.attention.out_weight = read(l + "attention.out_weight", {E, E});
    p.attention.out_bias = read(l + "attention.out_bias", {E});
    p.norm1_gamma = read(l + "norm1.gamma", {E});
    p.norm1_beta = read(l + "norm1.beta", {E});
    p.ff1_weight = read(l + "ff1.weight", {F, E});
    p.ff1_bias = read(l + "ff1.bias", {F});
    p.ff2_weight = read(l + "ff2.weight", {E, F});
    p.ff2_bias = read(l + "ff2.bias", {E});
    p.norm2_gamma = read(l + "norm2.gamma", {E});
    p.norm2_beta = read(l + "norm2.beta", {E});
    m.layer_params.push_back(std::move(p));
  }
  m.norm_gamma = read("norm.gamma", {E});
  m.norm_beta = read("norm.beta", {E});
  m.head_weight = read("head.weight", {c.num_classes, E});
  m.head_bias = read("head.bias", {c.num_classes});
  m.build();
  return model;
}

}  // namespace qkv
