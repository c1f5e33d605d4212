// splitmix64 (Steele, Lea and Flood, 2014): the project's one small pseudo-random generator.
// A 64-bit state advanced by a fixed odd gamma, each value passed through a bijective
// finaliser with full avalanche. Used wherever a draw must be reproducible from a seed alone and
// cheap to re-derive elsewhere (Python tests re-implement it in three lines): FAVOR+ features,
// BigBird's random blocks, dropout masks, benchmark inputs.
#pragma once

#include <cstdint>

namespace qkv {

inline constexpr std::uint64_t kSplitMix64Gamma = 0x9E3779B97F4A7C15ull;

// The finaliser: a bijection on 64 bits with full avalanche.
constexpr std::uint64_t splitmix64_mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// One step: state += gamma, then the finaliser of the new state.
constexpr std::uint64_t splitmix64_next(std::uint64_t& state) {
  state += kSplitMix64Gamma;
  return splitmix64_mix(state);
}

class SplitMix64 {
 public:
  explicit constexpr SplitMix64(std::uint64_t seed) : state_(seed) {}
  constexpr std::uint64_t next() { return splitmix64_next(state_); }
  // Uniform in [0, 1) with 53 random bits.
  constexpr double uniform53() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Uniform in [0, 1) with 24 random bits (exactly representable as float).
  constexpr float uniform24() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }

 private:
  std::uint64_t state_;
};

}  // namespace qkv
