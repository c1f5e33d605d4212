// A square of 32-bit lanes transposed in registers (Highway, one copy per target): the flash and
// chunked kernels pack q^T and unpack out^T with it (tile_staging-inl.h, query_block-inl.h), where
// element by element the block's rows, Hq * D floats apart, cost about 1 store per element.

#if defined(QKV_KERNELS_CPU_TRANSPOSE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_TRANSPOSE_INL_H_
#undef QKV_KERNELS_CPU_TRANSPOSE_INL_H_
#else
#define QKV_KERNELS_CPU_TRANSPOSE_INL_H_
#endif

#include <cstddef>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {

#if HWY_TARGET == HWY_AVX2
// An 8 x 8 square of 32-bit lanes in 24 instructions, 8 of them crossing the 128-bit halves:
// pairs of rows interleaved (unpcklps/unpckhps), then pairs of those as 64-bit lanes
// (unpcklpd/unpckhpd), which leaves column c's first four entries in one half of a vector and
// its last four in the same half of another; the halves joined (vperm2f128). The perfect
// shuffle below takes 24 ConcatEven/ConcatOdd, two instructions each on AVX2 (a vshufps and a
// lane-crossing vpermq). The same permutation, so the same bits.
template <class D>
HWY_INLINE void TransposeSquare8(D d, hwy::HWY_NAMESPACE::Vec<D>* v) {
  namespace hn = hwy::HWY_NAMESPACE;
  const hn::Repartition<double, D> dd;
  hn::Vec<decltype(dd)> t[8];
  HWY_UNROLL(4)
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = hn::BitCast(dd, hn::InterleaveLower(d, v[2 * i], v[2 * i + 1]));
    t[2 * i + 1] = hn::BitCast(dd, hn::InterleaveUpper(d, v[2 * i], v[2 * i + 1]));
  }
  // s[4 * h + c]: columns c (low half) and c + 4 (high half) of rows 4h..4h+3.
  hn::Vec<D> s[8];
  HWY_UNROLL(2)
  for (int h = 0; h < 2; ++h) {
    s[4 * h + 0] = hn::BitCast(d, hn::InterleaveLower(dd, t[4 * h], t[4 * h + 2]));
    s[4 * h + 1] = hn::BitCast(d, hn::InterleaveUpper(dd, t[4 * h], t[4 * h + 2]));
    s[4 * h + 2] = hn::BitCast(d, hn::InterleaveLower(dd, t[4 * h + 1], t[4 * h + 3]));
    s[4 * h + 3] = hn::BitCast(d, hn::InterleaveUpper(dd, t[4 * h + 1], t[4 * h + 3]));
  }
  HWY_UNROLL(4)
  for (int c = 0; c < 4; ++c) {
    v[c] = hn::ConcatLowerLower(d, s[4 + c], s[c]);
    v[c + 4] = hn::ConcatUpperUpper(d, s[4 + c], s[c]);
  }
}
#endif

// v[r] holds row r of an N x N square (N = the lanes of a full vector of D); afterwards v[c]
// holds its column c. log2(N) rounds of the perfect shuffle: rows 2i and 2i + 1 become row i
// (their even lanes, ConcatEven) and row N / 2 + i (their odd lanes, ConcatOdd).
template <class D>
HWY_INLINE void TransposeSquare(D d, hwy::HWY_NAMESPACE::Vec<D>* v) {
  namespace hn = hwy::HWY_NAMESPACE;
#if HWY_TARGET == HWY_SCALAR
  (void)d;
  (void)v;  // one lane: a 1 x 1 square is its own transpose
#else
  constexpr std::size_t kN = hn::MaxLanes(d);
#if HWY_TARGET == HWY_AVX2
  if constexpr (kN == 8 && sizeof(hn::TFromD<D>) == 4) {  // the classic 24 shuffles
    TransposeSquare8(d, v);
    return;
  }
#endif
  {
    HWY_UNROLL(4)
    for (std::size_t width = 1; width < kN; width *= 2) {
      hn::Vec<D> w[kN];
      HWY_UNROLL(16)
      for (std::size_t i = 0; i < kN / 2; ++i) {
        w[i] = hn::ConcatEven(d, v[2 * i + 1], v[2 * i]);
        w[kN / 2 + i] = hn::ConcatOdd(d, v[2 * i + 1], v[2 * i]);
      }
      HWY_UNROLL(16)
      for (std::size_t i = 0; i < kN; ++i) v[i] = w[i];
    }
  }
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_TRANSPOSE_INL_H_
