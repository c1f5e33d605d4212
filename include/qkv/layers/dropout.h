// Inverted dropout with a counter-based RNG: element i of stream `stream` under `seed` is
// kept iff u(seed, stream, i) >= p, where u is a 24-bit uniform in [0, 1) computed by hashing
// (splitmix64 finaliser) the three numbers. No RNG state: the mask depends only on (seed,
// stream, i), so it is reproducible and independent of the thread count and of chunking.
// Kept elements are scaled by 1 / (1 - p).
#pragma once

#include <cstdint>

namespace qkv {

// x: [n] in place; p in [0, 1). p == 0 leaves x unchanged.
//
// Backward: dropout is linear with the mask and scale fixed by (seed, stream), so the gradient
// is dropout(dy) with the same p, seed and stream (the same elements kept, the same scale).
void dropout(float* x, std::int64_t n, float p, std::uint64_t seed, std::uint64_t stream);

}  // namespace qkv
