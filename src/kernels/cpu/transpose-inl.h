// A square of floats transposed in registers (Highway, one copy per target): the flash and
// chunked kernels pack q^T and unpack out^T with it (tile_staging-inl.h, query_block-inl.h), where element by
// element the block's rows, Hq * D floats apart, cost about 1 store per element.

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
