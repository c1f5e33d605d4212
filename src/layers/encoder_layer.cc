// EncoderLayer / Encoder: MultiHeadAttention + LayerNorm + a two-Linear feed-forward, Post-LN
// or Pre-LN. The activation is fused into Linear1 (a oneDNN post-op); the residual add is fused
// into LayerNorm for Post-LN.
//
//   x: [rows = B * L, E]   a: [rows, E] (attention / FFN output)   h: [rows, d_ff]
//   n: [rows, E] (Pre-LN normalised input)
#include "qkv/layers/encoder_layer.h"

#include <string>

#include "core/aligned_buffer.h"
#include "layers/encoder_layer_impl.h"
#include "layers/scratch.h"
#include "qkv/error.h"
#include "qkv/layers/dropout.h"
#include "qkv/layers/linear.h"

namespace qkv {

using enum layers::Site;
using layers::add_in_place;

namespace {

// Builds a sub-layer, prefixing its validation errors with the layer and field names.
template <typename Make>
auto named(const char* field, Make make) {
  try {
    return make();
  } catch (const Error& e) {
    throw Error(std::string("EncoderLayer: ") + field + ": " + e.what());
  }
}

}  // namespace


EncoderLayer::EncoderLayer(const EncoderLayerConfig& c, const EncoderLayerWeights& w) {
  if (c.d_ff <= 0) throw Error("EncoderLayer: d_ff = " + std::to_string(c.d_ff) + " must be > 0");
  if (!(c.dropout >= 0.0f && c.dropout < 1.0f)) {
    throw Error("EncoderLayer: dropout = " + std::to_string(c.dropout) + " must be in [0, 1)");
  }
  const std::int64_t E = c.embed_dim;
  impl_.reset(new Impl{
      .config = c,
      .attention =
          named("attention",
                [&] {
                  return MultiHeadAttention({.embed_dim = E,
                                             .num_heads = c.num_heads,
                                             .num_kv_heads = c.num_kv_heads,
                                             .matmul_dtype = c.matmul_dtype},
                                            w.attention);
                }),
      .norm1 = named("norm1", [&] { return LayerNorm(w.norm1_gamma, w.norm1_beta, E, c.eps); }),
      .norm2 = named("norm2", [&] { return LayerNorm(w.norm2_gamma, w.norm2_beta, E, c.eps); }),
      .ff1 = named("ff1",
                   [&] {
                     return Linear({.weight = w.ff1_weight,
                                    .bias = w.ff1_bias,
                                    .in_features = E,
                                    .out_features = c.d_ff,
                                    .activation = c.activation,
                                    .dtype = c.matmul_dtype});
                   }),
      .ff2 = named("ff2", [&] {
        return Linear({.weight = w.ff2_weight,
                       .bias = w.ff2_bias,
                       .in_features = c.d_ff,
                       .out_features = E,
                       .dtype = c.matmul_dtype});
      })});
}

EncoderLayer::~EncoderLayer() = default;
EncoderLayer::EncoderLayer(EncoderLayer&&) noexcept = default;
EncoderLayer& EncoderLayer::operator=(EncoderLayer&&) noexcept = default;

const EncoderLayerConfig& EncoderLayer::config() const { return impl_->config; }
bool EncoderLayer::training() const { return impl_->training; }

void EncoderLayer::set_training(bool training, std::uint64_t seed) {
  impl_->training = training;
  impl_->seed = seed;
  impl_->step = 0;
}

void EncoderLayer::share_scratch_with(const EncoderLayer& other) {
  impl_->scratch = other.impl_->scratch;
  impl_->attention.share_scratch_with(other.impl_->attention);
}

void EncoderLayer::forward(float* x, std::int64_t batch, std::int64_t seq,
                           const MhaOptions& options) const {
  // x: [B, L, E] in place
  Impl& m = *impl_;
  if (batch < 0 || seq < 0) {
    throw Error("EncoderLayer::forward: batch = " + std::to_string(batch) +
                " and seq = " + std::to_string(seq) + " must be >= 0");
  }
  const std::int64_t rows = batch * seq, E = m.config.embed_dim;
  if (rows == 0) return;
  if (x == nullptr) throw Error("EncoderLayer::forward: x is null");
  const layers::ScratchPool::Lease scratch(*m.scratch);
  float* a = layers::scratch_floats(scratch->a, rows * E);
  float* h = layers::scratch_floats(scratch->h, rows * m.config.d_ff);
  if (!m.config.norm_first) {
    // Post-LN: x = LN1(x + Drop(MHA(x))); x = LN2(x + Drop(FFN(x)))
    m.attention.forward(x, batch, seq, a, m.attention_options(options, m.step));
    m.maybe_dropout(a, rows * E, kAfterAttention);
    m.norm1.forward(a, x, rows, x);
    m.feed_forward(x, rows, h, a);
    m.maybe_dropout(a, rows * E, kAfterFeedForward);
    m.norm2.forward(a, x, rows, x);
  } else {
    // Pre-LN: x = x + Drop(MHA(LN1(x))); x = x + Drop(FFN(LN2(x)))
    float* n = layers::scratch_floats(scratch->n, rows * E);
    m.norm1.forward(x, nullptr, rows, n);
    m.attention.forward(n, batch, seq, a, m.attention_options(options, m.step));
    m.maybe_dropout(a, rows * E, kAfterAttention);
    add_in_place(x, a, rows * E);
    m.norm2.forward(x, nullptr, rows, n);
    m.feed_forward(n, rows, h, a);
    m.maybe_dropout(a, rows * E, kAfterFeedForward);
    add_in_place(x, a, rows * E);
  }
  if (m.training) ++m.step;
}

Encoder::Encoder(std::vector<EncoderLayer> layers, std::optional<LayerNorm> final_norm)
    : layers_(std::move(layers)), final_norm_(std::move(final_norm)) {
  // The layers run one after another: one set of scratch serves them all.
  for (std::size_t i = 1; i < layers_.size(); ++i) layers_[i].share_scratch_with(layers_[0]);
  for (std::size_t i = 1; i < layers_.size(); ++i) {
    if (layers_[i].config().embed_dim != layers_[0].config().embed_dim) {
      throw Error("Encoder: layer " + std::to_string(i) +
                  " has embed_dim = " + std::to_string(layers_[i].config().embed_dim) +
                  ", layer 0 has " + std::to_string(layers_[0].config().embed_dim));
    }
  }
  if (final_norm_ && !layers_.empty() && final_norm_->features() != layers_[0].config().embed_dim) {
    throw Error("Encoder: final_norm has features = " + std::to_string(final_norm_->features()) +
                ", layers have embed_dim = " + std::to_string(layers_[0].config().embed_dim));
  }
}

void Encoder::forward(float* x, std::int64_t batch, std::int64_t seq,
                      const MhaOptions& options) const {
  // x: [B, L, E] in place
  MhaOptions inner = options;
  inner.attn_weights = nullptr;  // only the last layer's weights are returned
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    layers_[i].forward(x, batch, seq, i + 1 == layers_.size() ? options : inner);
  }
  if (final_norm_) final_norm_->forward(x, nullptr, batch * seq, x);
}

void Encoder::set_training(bool training, std::uint64_t seed) {
  for (std::size_t i = 0; i < layers_.size(); ++i) layers_[i].set_training(training, seed + i);
}

}  // namespace qkv
