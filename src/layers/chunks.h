// Element-wise passes over the threads: a layer's activations, weights and gradients copied or
// added in chunks of 64 Ki floats (element by element: the same bits on any thread count).
// Serial, they left the other thread waiting through a training step's copies.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/parallel.h"

namespace qkv::layers {

// f(begin, end) over [0, n) in chunks, on the threads from 64 Ki floats on.
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

}  // namespace qkv::layers
