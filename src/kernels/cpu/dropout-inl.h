// kernels/dropout_mask.h's keep bits on vectors of u32 lanes (Highway, one copy per target).
#if defined(QKV_KERNELS_CPU_DROPOUT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_DROPOUT_INL_H_
#undef QKV_KERNELS_CPU_DROPOUT_INL_H_
#else
#define QKV_KERNELS_CPU_DROPOUT_INL_H_
#endif

#include <cstdint>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace dropout {

namespace hn = hwy::HWY_NAMESPACE;

template <class DU>
HWY_INLINE hn::Vec<DU> Fmix32(DU du, hn::Vec<DU> x) {
  x = hn::Xor(x, hn::ShiftRight<16>(x));
  x = hn::Mul(x, hn::Set(du, 0x85EBCA6Bu));
  x = hn::Xor(x, hn::ShiftRight<13>(x));
  x = hn::Mul(x, hn::Set(du, 0xC2B2AE35u));
  return hn::Xor(x, hn::ShiftRight<16>(x));
}

// fmix32(lo ^ fmix32(j ^ hi)) lane-wise.
template <class DU>
HWY_INLINE hn::Vec<DU> Bits(DU du, hn::Vec<DU> lo, hn::Vec<DU> hi, hn::Vec<DU> j) {
  return Fmix32(du, hn::Xor(lo, Fmix32(du, hn::Xor(j, hi))));
}

// x * scale where bits >= threshold, else 0 (unsigned compare through the sign flip).
template <class DF, class DU>
HWY_INLINE hn::Vec<DF> Apply(DF df, DU du, hn::Vec<DF> x, hn::Vec<DU> bits,
                             std::uint32_t threshold, float scale) {
  const hn::RebindToSigned<DU> di;
  const auto flip = hn::Set(du, 0x80000000u);
  // dropped: threshold > bits (this Highway has no Ge on integers)
  const auto dropped = hn::Gt(hn::BitCast(di, hn::Xor(hn::Set(du, threshold), flip)),
                              hn::BitCast(di, hn::Xor(bits, flip)));
  return hn::IfThenZeroElse(hn::RebindMask(df, dropped), hn::Mul(x, hn::Set(df, scale)));
}

}  // namespace dropout
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_DROPOUT_INL_H_
