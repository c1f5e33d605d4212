// Dropout on the attention probabilities (qkv/attention.h, AttentionParams::dropout_p): which
// (batch, head, query, key) pairs are kept, from a counter-based hash of (seed, offset, b, h,
// i, j), so the forward and the backward see the same mask without storing it, on any thread
// count and in any kernel. The definition (the kernels' vector code computes exactly this):
//
//   base  = splitmix64_mix(seed + offset * gamma)              gamma = 0x9E3779B97F4A7C15
//   row   = splitmix64_mix(base ^ (((b * Hq + h) * Lq + i) * 0xD1B54A32D192ED03))
//   u     = fmix32(row_lo ^ fmix32(uint32(j) ^ row_hi))        (row's low and high 32 bits)
//   keep  = u >= threshold,   threshold = min(2^32 - 1, round(dropout_p * 2^32))
//
// fmix32 is MurmurHash3's finaliser. A kept probability is scaled by 1 / (1 - dropout_p).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/splitmix64.h"

namespace qkv {

constexpr std::uint32_t fmix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

// The row hash of query row (b, h, i) of a problem with Hq heads and Lq queries.
inline std::uint64_t dropout_row(std::uint64_t seed, std::uint64_t offset, std::int64_t b,
                                 std::int64_t h, std::int64_t i, std::int64_t num_heads_q,
                                 std::int64_t seq_q) {
  const std::uint64_t base = splitmix64_mix(seed + offset * kSplitMix64Gamma);
  const std::uint64_t linear = static_cast<std::uint64_t>((b * num_heads_q + h) * seq_q + i);
  return splitmix64_mix(base ^ (linear * 0xD1B54A32D192ED03ull));
}

inline std::uint32_t dropout_bits(std::uint64_t row, std::int64_t j) {
  const auto lo = static_cast<std::uint32_t>(row), hi = static_cast<std::uint32_t>(row >> 32);
  return fmix32(lo ^ fmix32(static_cast<std::uint32_t>(j) ^ hi));
}

// threshold for dropout_p in [0, 1).
inline std::uint32_t dropout_threshold(float dropout_p) {
  const double t = std::round(static_cast<double>(dropout_p) * 4294967296.0);
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<std::uint32_t>(t);
}

}  // namespace qkv
