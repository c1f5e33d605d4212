#include "qkv/layers/dropout.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/parallel.h"
#include "core/splitmix64.h"
#include "qkv/error.h"

namespace qkv {
void dropout(float* x, std::int64_t n, float p, std::uint64_t seed, std::uint64_t stream) {
  if (!(p >= 0.0f && p < 1.0f)) {
    throw Error("dropout: p = " + std::to_string(p) + " must be in [0, 1)");
  }
  if (n < 0) throw Error("dropout: n = " + std::to_string(n) + " is negative");
  if (p == 0.0f || n == 0) return;
  // Keep iff the top 24 bits, as an integer, are >= p * 2^24 (exact for that resolution).
  const std::uint64_t threshold = static_cast<std::uint64_t>(std::ceil(double(p) * (1 << 24)));
  const float scale = 1.0f / (1.0f - p);
  const std::uint64_t key = splitmix64_mix(seed ^ splitmix64_mix(stream + kSplitMix64Gamma));
  constexpr std::int64_t kChunk = 1 << 14;
  parallel_for((n + kChunk - 1) / kChunk, resolve_num_threads(0), [&](std::int64_t chunk, int) {
    const std::int64_t end = std::min(n, (chunk + 1) * kChunk);
    for (std::int64_t i = chunk * kChunk; i < end; ++i) {
      const std::uint64_t bits = splitmix64_mix(key + static_cast<std::uint64_t>(i) * 0xD1B54A32D192ED03ull);
      x[i] = (bits >> 40) >= threshold ? x[i] * scale : 0.0f;
    }
  });
}

}  // namespace qkv
