// Deterministic pseudo-random inputs for the benchmarks and the demo: splitmix64 bits turned into
// uniform or roughly normal floats. The same seed gives the same data on every machine.
#pragma once

#include <cstdint>
#include <span>

#include "core/splitmix64.h"

namespace qkv::tools {

// Approximately standard normal: the sum of 4 uniforms, centred and scaled to variance 1
// (Irwin-Hall; tails end at +-3.46, which keeps attention logits moderate).
inline float irwin_hall_normal(SplitMix64& rng) {
  const float sum = rng.uniform24() + rng.uniform24() + rng.uniform24() + rng.uniform24();
  return (sum - 2.0f) * 1.7320508f;  // sqrt(12 / 4)
}

// Fills `values` with approximately standard normal floats from `seed`.
inline void fill_normal(std::span<float> values, std::uint64_t seed) {
  SplitMix64 rng(seed);
  for (float& value : values) value = irwin_hall_normal(rng);
}

}  // namespace qkv::tools
