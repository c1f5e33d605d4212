// The f32 tile product: one rank-1-update micro-kernel serves both products of the flash
// forward (st = K q^T, ot = alpha ot + V^T p; see tile_geometry-inl.h for the layout) and those of
// the backward (Highway, one copy per target).

#if defined(QKV_KERNELS_CPU_TILE_PRODUCTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_TILE_PRODUCTS_INL_H_
#undef QKV_KERNELS_CPU_TILE_PRODUCTS_INL_H_
#else
#define QKV_KERNELS_CPU_TILE_PRODUCTS_INL_H_
#endif

#include <cstdint>

#include "hwy/highway.h"
#include "kernels/cpu/tile_geometry-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace tiles {

// The micro-kernel's inner loop: acc[r][x] += sum_{t in [t0, t1)} b(r, t) * a[t][x lanes] for
// the query vectors x in [X0, X1) (the others are neither read nor touched).
template <int R, int X0, int X1>
HWY_INLINE void MulAddVecs(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b,
                           std::int64_t b_row_stride, std::int64_t b_depth_stride, std::int64_t t0,
                           std::int64_t t1, VF (&acc)[R][kQueryVecs]) {
  const DF df;
  for (std::int64_t t = t0; t < t1; ++t) {
    VF a_vec[kQueryVecs];
    HWY_UNROLL(4)
    for (int x = X0; x < X1; ++x) a_vec[x] = hn::Load(df, a + t * kBlockQ + x * kLanes);
    const float* b_col = b + t * b_depth_stride;
    HWY_UNROLL(8)
    for (int r = 0; r < R; ++r) {
      const VF b_val = hn::Set(df, b_col[r * b_row_stride]);
      HWY_UNROLL(4)
      for (int x = X0; x < X1; ++x) acc[r][x] = hn::MulAdd(b_val, a_vec[x], acc[r][x]);
    }
  }
}

// MulAddVecs over depth segments: vectors in [X, X1) take [t0, depth_end[X]), those in
// [X + 1, X1) then take [depth_end[X], depth_end[X + 1]), and so on, so vector x sums depth
// [t0, depth_end[x]).
template <int R, int X, int X1>
HWY_INLINE void MulAddSegments(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b,
                               std::int64_t b_row_stride, std::int64_t b_depth_stride,
                               const std::int64_t* depth_end, std::int64_t t0,
                               VF (&acc)[R][kQueryVecs]) {
  MulAddVecs<R, X, X1>(a, b, b_row_stride, b_depth_stride, t0, depth_end[X], acc);
  if constexpr (X + 1 < X1) {
    MulAddSegments<R, X + 1, X1>(a, b, b_row_stride, b_depth_stride, depth_end, depth_end[X], acc);
  }
}

// c[r][:] = (alpha ? alpha * c[r][:] : accumulate ? c[r][:] : 0) + sum_t b(r, t) * a[t][:]
// for r in [0, R), t in [0, depth), where b(r, t) = b[r * b_row_stride + t * b_depth_stride],
// on the query vectors x in [X0, X1) only (the lanes of the others are left as they are). With
// depth_end (non-decreasing, each <= depth), vector x sums t in [0, depth_end[x]) only.
//   a: [depth][kBlockQ]   c: [R][kBlockQ]   alpha: [kBlockQ] or null
template <int R, int X0, int X1>
HWY_INLINE void OuterProductRows(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b,
                                 std::int64_t b_row_stride, std::int64_t b_depth_stride,
                                 std::int64_t depth, const std::int64_t* depth_end,
                                 float* HWY_RESTRICT c, const float* HWY_RESTRICT alpha,
                                 bool accumulate) {
  const DF df;
  VF acc[R][kQueryVecs];
  HWY_UNROLL(4)
  for (int x = X0; x < X1; ++x) {
    const VF scale = alpha != nullptr ? hn::Load(df, alpha + x * kLanes) : hn::Set(df, 1.0f);
    HWY_UNROLL(8)
    for (int r = 0; r < R; ++r) {
      acc[r][x] =
          accumulate ? hn::Mul(hn::Load(df, c + r * kBlockQ + x * kLanes), scale) : hn::Zero(df);
    }
  }
  if (depth_end == nullptr) {
    MulAddVecs<R, X0, X1>(a, b, b_row_stride, b_depth_stride, 0, depth, acc);
  } else {
    MulAddSegments<R, X0, X1>(a, b, b_row_stride, b_depth_stride, depth_end, 0, acc);
  }
  HWY_UNROLL(8)
  for (int r = 0; r < R; ++r) {
    HWY_UNROLL(4)
    for (int x = X0; x < X1; ++x) hn::Store(acc[r][x], df, c + r * kBlockQ + x * kLanes);
  }
}

// OuterProductRows on the query vectors [first_vec, end_vec) chosen at run time: first_vec in
// [0, kQueryVecs), end_vec = kQueryVecs; or, with kTrim, end_vec in [1, kQueryVecs) too, and
// then vectors [0, end_vec) (the vectors before first_vec compute rows they do not need, which
// OuterProduct's callers allow: the masks set those scores to -inf).
template <int R, bool kTrim, int X0 = 0, int X1 = kQueryVecs>
HWY_INLINE void OuterProductRowsIn(int first_vec, int end_vec, const float* a, const float* b,
                                   std::int64_t b_row_stride, std::int64_t b_depth_stride,
                                   std::int64_t depth, const std::int64_t* depth_end, float* c,
                                   const float* alpha, bool accumulate) {
  if constexpr (kTrim && X0 == 0 && X1 > 1) {
    if (end_vec < X1) {
      OuterProductRowsIn<R, kTrim, 0, X1 - 1>(first_vec, end_vec, a, b, b_row_stride,
                                              b_depth_stride, depth, depth_end, c, alpha,
                                              accumulate);
      return;
    }
  }
  if constexpr (X1 == kQueryVecs && X0 + 1 < kQueryVecs) {
    if (first_vec > X0) {
      OuterProductRowsIn<R, false, X0 + 1, X1>(first_vec, end_vec, a, b, b_row_stride,
                                               b_depth_stride, depth, depth_end, c, alpha,
                                               accumulate);
      return;
    }
  }
  OuterProductRows<R, X0, X1>(a, b, b_row_stride, b_depth_stride, depth, depth_end, c, alpha,
                              accumulate);
}

// OuterProductRowsIn<n> for a run-time n in [1, R]: the tail of OuterProduct, one block.
template <int R, bool kTrim>
HWY_INLINE void OuterProductTail(std::int64_t n, int first_vec, int end_vec, const float* a,
                                 const float* b, std::int64_t b_row_stride,
                                 std::int64_t b_depth_stride, std::int64_t depth,
                                 const std::int64_t* depth_end, float* c, const float* alpha,
                                 bool accumulate) {
  if constexpr (R > 1) {
    if (n < R) {
      OuterProductTail<R - 1, kTrim>(n, first_vec, end_vec, a, b, b_row_stride, b_depth_stride,
                                     depth, depth_end, c, alpha, accumulate);
      return;
    }
  }
  OuterProductRowsIn<R, kTrim>(first_vec, end_vec, a, b, b_row_stride, b_depth_stride, depth,
                               depth_end, c, alpha, accumulate);
}

// Runs OuterProductRows over `rows` rows: blocks of kRows, then the rows left, so no row past
// `rows` is ever read (keys past the tile may be padding garbage or out of bounds). With kRows =
// 6 (AVX2, AVX-512) the rows left are one block (64 keys or D = 64 leave 4: as single rows, 2
// or 4 chains each, they cost 6-10% of a product; 128 keys or D = 128 leave 2); with kRows = 4
// (scalar) single rows: tail blocks there would only add instantiations to compile.
// With row_end (non-decreasing, the last = rows), query vector x computes rows [0, row_end[x])
// only: a block of rows starts at the first vector that still needs its first row. With
// depth_end, see OuterProductRows. (The causal diagonal: docs/kernels.md, "Causal diagonal".)
// With kTrim, only the query vectors [0, end_vec) are computed (a block whose rows fill fewer:
// the lanes of the others are left as they are), where they would otherwise start at row_end's
// first vector, any rows the earlier vectors do not need included.
// Every output element sums its depth in the same order whatever the blocking, so the results
// do not depend on kRows. With prefetch_next_rows (b's rows with unit stride along depth),
// each block of rows first asks for the next block's lines toward L1, the first block for its
// own (rows that come from memory otherwise arrive a line at a time, as the depth loop reaches
// them). (Copies with a constant depth for head_dim 64/128 and full key tiles measured no
// faster: 182/195 vs 185/194 GFLOP/s at L = 4096, D = 64/128, so the one generic loop stays.)
template <bool kTrim = false>
HWY_INLINE void OuterProduct(const float* a, const float* b, std::int64_t rows,
                             std::int64_t b_row_stride, std::int64_t b_depth_stride,
                             std::int64_t depth, float* c, const float* alpha, bool accumulate,
                             const std::int64_t* row_end = nullptr,
                             const std::int64_t* depth_end = nullptr, int end_vec = kQueryVecs,
                             bool prefetch_next_rows = false) {
  const auto first_vec = [&](std::int64_t r) {
    int x = 0;
    while (row_end != nullptr && x + 1 < kQueryVecs && row_end[x] <= r) ++x;
    return x;
  };
  const auto ask_for_rows = [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t n = lo; n < std::min(rows, hi); ++n) {
      PrefetchLinesL1(b + n * b_row_stride, depth * std::int64_t{sizeof(float)});
    }
  };
  if (prefetch_next_rows) ask_for_rows(0, kRows);
  std::int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    if (prefetch_next_rows) ask_for_rows(r + kRows, r + 2 * kRows);
    OuterProductRowsIn<kRows, kTrim>(first_vec(r), end_vec, a, b + r * b_row_stride, b_row_stride,
                                     b_depth_stride, depth, depth_end, c + r * kBlockQ, alpha,
                                     accumulate);
  }
  if constexpr (kRows > 4) {
    if (r < rows) {
      OuterProductTail<kRows - 1, kTrim>(rows - r, first_vec(r), end_vec, a, b + r * b_row_stride,
                                         b_row_stride, b_depth_stride, depth, depth_end,
                                         c + r * kBlockQ, alpha, accumulate);
    }
  } else {
    for (; r < rows; ++r) {
      OuterProductRowsIn<1, kTrim>(first_vec(r), end_vec, a, b + r * b_row_stride, b_row_stride,
                                   b_depth_stride, depth, depth_end, c + r * kBlockQ, alpha,
                                   accumulate);
    }
  }
}

}  // namespace tiles
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_TILE_PRODUCTS_INL_H_
