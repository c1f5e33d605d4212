// Grow-only scratch for the layers: a layer keeps a few of these and reuses them across calls,
// so once warm (the largest shape seen) no call allocates.
#pragma once

#include <cstdint>
#include <memory>

#include "core/aligned_buffer.h"

namespace qkv::layers {

// At least `floats` floats of `buffer`, reallocating (contents lost) only when it is too small.
inline float* scratch_floats(AlignedBuffer& buffer, std::int64_t floats) {
  const std::size_t bytes = sizeof(float) * static_cast<std::size_t>(floats > 0 ? floats : 1);
  if (buffer.bytes() < bytes) buffer = AlignedBuffer(bytes);
  return buffer.as<float>();
}

// The grow-only buffers of the layers, by role. A layer holds them through a shared_ptr so that
// layers which run one after another (an Encoder's) can share one set: share_scratch_with().
// Roles never overlap within one call: EncoderLayer uses a, h, n; MultiHeadAttention the rest.
struct Scratch {
  AlignedBuffer a, h, n;                // EncoderLayer: sub-layer output, FFN hidden, Pre-LN input
  AlignedBuffer qkv, k, v, ctx, probs;  // MultiHeadAttention: projections, core output, weights
};

inline std::shared_ptr<Scratch> make_scratch() { return std::make_shared<Scratch>(); }

}  // namespace qkv::layers
