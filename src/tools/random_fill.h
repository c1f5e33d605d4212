// Deterministic pseudo-random inputs for the benchmarks and the demo: splitmix64 bits turned into
// uniform or roughly normal floats. The same seed gives the same data on every machine.
#pragma once

#include <cstdint>
#include <span>

namespace qkv::tools {

class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  // Uniform in [0, 1) with 24 random bits (exactly representable as float).
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }

  // Approximately standard normal: the sum of 4 uniforms, centred and scaled to variance 1
  // (Irwin-Hall; tails end at +-3.46, which keeps attention logits moderate).
  float normal() {
    const float sum = uniform() + uniform() + uniform() + uniform();
    return (sum - 2.0f) * 1.7320508f;  // sqrt(12 / 4)
  }

 private:
  std::uint64_t state_;
};

// Fills `values` with approximately standard normal floats from `seed`.
inline void fill_normal(std::span<float> values, std::uint64_t seed) {
  SplitMix64 rng(seed);
  for (float& value : values) value = rng.normal();
}

}  // namespace qkv::tools
