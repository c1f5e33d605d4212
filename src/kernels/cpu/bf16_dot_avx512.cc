// The AVX512-BF16 micro-kernel (bf16_dot.h), in raw intrinsics: Highway 1.0.3 does not emit
// vdpbf16ps (DESIGN.md section 7). This file alone is compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mavx512bf16 (CMakeLists.txt); callers reach it only after available().
//
// ODR trap: any inline function or template instantiated here AND in another translation unit
// (std::min, std::vector, ...) may be linked from this file's AVX-512 copy and then crash on
// CPUs without AVX-512. So this file uses only intrinsics, plain loops and builtins: no STL, no
// qkv header but bf16_dot.h, and its own helpers have internal linkage. available() and
// set_enabled() live in bf16_dot.cc, compiled without the AVX-512 flags: they run on any x86-64.
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/bf16_dot.h"

namespace qkv::bf16dot {
namespace {

constexpr int kVecs = 4;       // zmm vectors per block of kLanes floats
constexpr int kVecLanes = 16;  // floats per zmm
static_assert(kVecs * kVecLanes == kLanes);
constexpr int kRows = 4;  // rows per micro-kernel call: 4 x 4 = 16 accumulators (of 32 zmm)

// 16 pair words as vdpbf16ps's operand type (a reinterpretation: both are 64-byte vectors).
inline __m512bh as_pairs(__m512i words) { return (__m512bh)words; }

// acc[r][x] += sum_{t in [t0, t1)} dot2(a[t][x lanes], b(r, t)) for the vectors x >= X0: 16
// bf16 pairs of a per load, each b word broadcast to all lanes (vpbroadcastd from memory), up to
// R x kVecs independent accumulator chains.
template <int R, int X0>
__attribute__((always_inline)) inline void dot_vecs(const std::uint32_t* __restrict a,
                                                    const std::uint32_t* __restrict b,
                                                    std::int64_t b_row_stride,
                                                    std::int64_t b_depth_stride, std::int64_t t0,
                                                    std::int64_t t1, __m512 (&acc)[R][kVecs]) {
  for (std::int64_t t = t0; t < t1; ++t) {
    __m512bh a_vec[kVecs];
#pragma GCC unroll 4
    for (int x = X0; x < kVecs; ++x) {
      a_vec[x] = as_pairs(_mm512_load_si512(a + t * kLanes + x * kVecLanes));
    }
    const std::uint32_t* b_col = b + t * b_depth_stride;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512bh b_pair =
          as_pairs(_mm512_set1_epi32(static_cast<int>(b_col[r * b_row_stride])));
#pragma GCC unroll 4
      for (int x = X0; x < kVecs; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], a_vec[x], b_pair);
    }
  }
}

// dot_vecs over depth segments: vector x sums [t0, depth_end[x]) (as MulAddSegments in
// tile_products-inl.h).
template <int R, int X>
__attribute__((always_inline)) inline void dot_segments(const std::uint32_t* __restrict a,
                                                        const std::uint32_t* __restrict b,
                                                        std::int64_t b_row_stride,
                                                        std::int64_t b_depth_stride,
                                                        const std::int64_t* depth_end,
                                                        std::int64_t t0, __m512 (&acc)[R][kVecs]) {
  dot_vecs<R, X>(a, b, b_row_stride, b_depth_stride, t0, depth_end[X], acc);
  if constexpr (X + 1 < kVecs) {
    dot_segments<R, X + 1>(a, b, b_row_stride, b_depth_stride, depth_end, depth_end[X], acc);
  }
}

// The R-row body of outer_product (see bf16_dot.h), on the vectors x >= X0 only.
//   a: [depth][kLanes]   c: [R][kLanes]   alpha: [kLanes] or null
template <int R, int X0>
__attribute__((always_inline)) inline void outer_product_rows(
    const std::uint32_t* __restrict a, const std::uint32_t* __restrict b, std::int64_t b_row_stride,
    std::int64_t b_depth_stride, std::int64_t depth, const std::int64_t* depth_end,
    float* __restrict c, const float* __restrict alpha, bool accumulate, float out_scale) {
  __m512 acc[R][kVecs];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int x = X0; x < kVecs; ++x) acc[r][x] = _mm512_setzero_ps();
  }
  if (depth_end == nullptr) {
    dot_vecs<R, X0>(a, b, b_row_stride, b_depth_stride, 0, depth, acc);
  } else {
    dot_segments<R, X0>(a, b, b_row_stride, b_depth_stride, depth_end, 0, acc);
  }
  // c = init + out_scale * sum, one rounding (fused multiply-add). The sum starts from zero
  // rather than init / out_scale, which would round once more.
  const __m512 scale = _mm512_set1_ps(out_scale);
#pragma GCC unroll 4
  for (int x = X0; x < kVecs; ++x) {
    const __m512 alpha_vec = alpha != nullptr ? _mm512_load_ps(alpha + x * kVecLanes) : scale;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float* c_vec = c + r * kLanes + x * kVecLanes;
      __m512 init = _mm512_setzero_ps();
      if (alpha != nullptr) {
        init = _mm512_mul_ps(alpha_vec, _mm512_load_ps(c_vec));
      } else if (accumulate) {
        init = _mm512_load_ps(c_vec);
      }
      _mm512_store_ps(c_vec, _mm512_fmadd_ps(acc[r][x], scale, init));
    }
  }
}

// outer_product_rows<R, first_vec> for a run-time first_vec in [0, kVecs).
template <int R, int X = 0>
__attribute__((always_inline)) inline void outer_product_rows_from(
    int first_vec, const std::uint32_t* a, const std::uint32_t* b, std::int64_t b_row_stride,
    std::int64_t b_depth_stride, std::int64_t depth, const std::int64_t* depth_end, float* c,
    const float* alpha, bool accumulate, float out_scale) {
  if constexpr (X + 1 < kVecs) {
    if (first_vec > X) {
      outer_product_rows_from<R, X + 1>(first_vec, a, b, b_row_stride, b_depth_stride, depth,
                                        depth_end, c, alpha, accumulate, out_scale);
      return;
    }
  }
  outer_product_rows<R, X>(a, b, b_row_stride, b_depth_stride, depth, depth_end, c, alpha,
                           accumulate, out_scale);
}

// The first vector that still needs row r (row_end: see bf16_dot.h; null: all rows).
inline int first_vec(const std::int64_t* row_end, std::int64_t r) {
  int x = 0;
  while (row_end != nullptr && x + 1 < kVecs && row_end[x] <= r) ++x;
  return x;
}

}  // namespace

// a: [depth][kLanes] pair words   b: b(r, t) = b[r * b_row_stride + t * b_depth_stride]
// c: [rows][kLanes]   alpha: [kLanes] or null
void outer_product(const std::uint32_t* a, const std::uint32_t* b, std::int64_t rows,
                   std::int64_t b_row_stride, std::int64_t b_depth_stride, std::int64_t depth,
                   float* c, const float* alpha, bool accumulate, float out_scale,
                   const std::int64_t* row_end, const std::int64_t* depth_end) {
  // Blocks of kRows rows, then single rows for the tail (as OuterProduct in
  // tile_products-inl.h), so no b row past `rows` is read: keys past a tile may be padding or
  // out of bounds.
  std::int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    outer_product_rows_from<kRows>(first_vec(row_end, r), a, b + r * b_row_stride, b_row_stride,
                                   b_depth_stride, depth, depth_end, c + r * kLanes, alpha,
                                   accumulate, out_scale);
  }
  for (; r < rows; ++r) {
    outer_product_rows_from<1>(first_vec(row_end, r), a, b + r * b_row_stride, b_row_stride,
                               b_depth_stride, depth, depth_end, c + r * kLanes, alpha, accumulate,
                               out_scale);
  }
}

// st: [num_k][kLanes] floats   pt: [ceil(num_k / 2)][kLanes] pair words (may be st)
void pack_probs(const float* st, std::int64_t num_k, int vecs, std::uint32_t* pt) {
  // vcvtne2ps2bf16(hi, lo) gives 16-bit words [bf16(lo) x 16, bf16(hi) x 16]; this vpermw index
  // interleaves them into pairs: word 2i <- lo[i] (word i), word 2i + 1 <- hi[i] (word 16 + i).
  alignas(64) static const std::uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (std::int64_t t = 0; 2 * t < num_k; ++t) {
    const float* lo_row = st + 2 * t * kLanes;
    const bool has_hi = 2 * t + 1 < num_k;  // odd num_k: the last pair's high half is +0.0
    for (int x = 0; x < vecs; ++x) {
      const __m512 lo = _mm512_load_ps(lo_row + x * kVecLanes);
      const __m512 hi =
          has_hi ? _mm512_load_ps(lo_row + kLanes + x * kVecLanes) : _mm512_setzero_ps();
      // Round to nearest even; subnormal inputs become zero (the instruction's implied DAZ).
      const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      _mm512_store_si512(pt + t * kLanes + x * kVecLanes,
                         _mm512_permutexvar_epi16(interleave, halves));
    }
  }
}

double peak_probe(std::int64_t iterations) {
  // 12 independent chains cover vdpbf16ps latency x throughput on current cores, as the fp32
  // probe's FmaChains. Each step adds 2^-11 * 2^-11 twice = 2^-21 per lane (each product is two
  // ulps of a value in [1, 2), so no rounding happens while a chain stays there; tests use that):
  // after 2^31 steps a chain is ~1025, so values stay normal and finite for any realistic run.
  constexpr int kChains = 12;
  const std::uint32_t small = 0x3a003a00u;  // bf16 pair (2^-11, 2^-11)
  const __m512bh x = as_pairs(_mm512_set1_epi32(static_cast<int>(small)));
  const __m512bh y = as_pairs(_mm512_set1_epi32(static_cast<int>(small)));
  __m512 acc[kChains];
#pragma GCC unroll 12
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1.0f + 0.01f * static_cast<float>(i));
  for (std::int64_t step = 0; step < iterations; ++step) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
  }
  __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int i = 0; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  // Lanes summed by hand: GCC 12's _mm512_reduce_add_ps warns (-Wuninitialized, spuriously).
  alignas(64) float lanes[kVecLanes];
  _mm512_store_ps(lanes, sum);
  double total = 0.0;
  for (int i = 0; i < kVecLanes; ++i) total += lanes[i];
  return total;
}

}  // namespace qkv::bf16dot
