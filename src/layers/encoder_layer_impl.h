// EncoderLayer's state, shared by its inference (encoder_layer.cc) and training
// (encoder_layer_train.cc) halves.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>

#include "core/parallel.h"
#include "layers/chunks.h"
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
