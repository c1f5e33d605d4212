// EncoderLayer's state, shared by its inference (encoder_layer.cc) and training
// (encoder_layer_train.cc) halves.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>

#include "core/parallel.h"
#include "layers/scratch.h"
#include "qkv/layers/dropout.h"
#include "qkv/layers/encoder_layer.h"
#include "qkv/layers/layer_norm.h"
#include "qkv/layers/linear.h"
#include "qkv/layers/multi_head_attention.h"

namespace qkv {
namespace layers {

// Dropout sites of one forward call; stream = step * kSites + site.
enum Site : std::uint64_t { kAfterAttention = 0, kAfterActivation = 1, kAfterFeedForward = 2 };
constexpr std::uint64_t kSites = 3;

// Element-wise passes over a layer's activations, in chunks over the threads from 64 Ki
// floats on (element by element: the same bits on any thread count). Serial, they left the
// other thread waiting through a training step's copies.
template <class F>
void for_chunks(std::int64_t n, F f) {
  constexpr std::int64_t kChunk = 1 << 16;
  if (n <= kChunk) return f(std::int64_t{0}, n);
  parallel_for((n + kChunk - 1) / kChunk, resolve_num_threads(0),
               [&](std::int64_t c, int) { f(c * kChunk, std::min(n, (c + 1) * kChunk)); });
}

inline void add_in_place(float* x, const float* a, std::int64_t n) {
  for_chunks(n, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) x[i] += a[i];  // GCC vectorises this
  });
}

// dst[0, n) = src[0, n) (not overlapping).
inline void copy_floats(const float* src, float* dst, std::int64_t n) {
  for_chunks(n, [&](std::int64_t begin, std::int64_t end) {
    std::copy(src + begin, src + end, dst + begin);
  });
}

}  // namespace layers

struct EncoderLayer::Impl {
  EncoderLayerConfig config;
  MultiHeadAttention attention;
  LayerNorm norm1, norm2;
  Linear ff1, ff2;
  bool training = false;
  std::uint64_t seed = 0;
  std::uint64_t step = 0;  // forward calls since set_training
  std::shared_ptr<layers::ScratchPool> scratch = layers::make_scratch_pool();

  void maybe_dropout(float* x, std::int64_t n, layers::Site site) const { dropout_at(x, n, site, step); }
  // Whether the FFN's hidden activations go to ff2 as bf16 bits (forward, forward_train and
  // backward): bf16 products and no dropout on them. They are the rounding ff2 would apply
  // anyway: the same bits, half the bytes, no second pass.
  bool hidden_as_bf16() const {
    return ff1.dtype() == DType::kBF16 && ff2.dtype() == DType::kBF16 &&
           !(training && config.dropout > 0.0f);
  }
  // out = ff2(Drop(ff1(in))) over `rows` rows, the hidden activations in h (rows * d_ff
  // floats; bf16 bits where hidden_as_bf16()).
  void feed_forward(const float* in, std::int64_t rows, float* h, float* out) const {
    if (hidden_as_bf16()) {
      auto* bits = reinterpret_cast<std::uint16_t*>(h);
      ff1.forward_to_bf16(in, rows, bits);
      ff2.forward_from_bf16(bits, rows, out);
      return;
    }
    ff1.forward(in, rows, h);
    maybe_dropout(h, rows * config.d_ff, layers::kAfterActivation);
    ff2.forward(h, rows, out);
  }
  // Dropout at `site` of forward call `at_step` (the backward replays a tape's step).
  void dropout_at(float* x, std::int64_t n, layers::Site site, std::uint64_t at_step) const {
    if (training && config.dropout > 0.0f)
      dropout(x, n, config.dropout, seed, at_step * layers::kSites + site);
  }
  // The attention options of forward call `at_step`: in training, dropout on the attention
  // probabilities too (p = config.dropout, keyed by seed and step).
  MhaOptions attention_options(const MhaOptions& options, std::uint64_t at_step) const {
    MhaOptions o = options;
    if (training && config.dropout > 0.0f) {
      o.dropout_p = config.dropout;
      o.dropout_seed = seed;
      o.dropout_offset = at_step;
    }
    return o;
  }
};

}  // namespace qkv
