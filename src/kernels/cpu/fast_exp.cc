// Array entry points of the vectorised exp (see fast_exp.h), one copy per Highway target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/fast_exp.cc"
#include "kernels/cpu/fast_exp.h"

#include <algorithm>
#include <cstdint>

#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
// Re-included per target, so after foreach_target.
#include "hwy/contrib/math/math-inl.h"
#include "kernels/cpu/fast_exp-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

// y[i] = fn(df, x[i]) a vector at a time; the tail goes through a zero-padded copy so nothing
// past n is read or written.
template <class Fn>
HWY_INLINE void ApplyArray(const float* x, float* y, std::int64_t n, Fn fn) {
  const DF df;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(fn(df, hn::LoadU(df, x + i)), df, y + i);
  if (i < n) {
    HWY_ALIGN float tail[HWY_LANES(float)] = {};
    std::copy(x + i, x + n, tail);
    hn::Store(fn(df, hn::Load(df, tail)), df, tail);
    std::copy(tail, tail + (n - i), y + i);
  }
}

void ExpNonPositiveArray(const float* x, float* y, std::int64_t n) {
  ApplyArray(x, y, n, [](DF df, hn::Vec<DF> v) { return fastexp::ExpNonPositive(df, v); });
}

void Pow2Array(const float* x, float* y, std::int64_t n) {
  ApplyArray(x, y, n, [](DF df, hn::Vec<DF> v) { return fastexp::Pow2(df, v); });
}

void Pow2CoarseArray(const float* x, float* y, std::int64_t n) {
  ApplyArray(x, y, n, [](DF df, hn::Vec<DF> v) { return fastexp::Pow2Coarse(df, v); });
}

void Pow2CoarseHalfArray(const float* x, float* y, std::int64_t n) {
  ApplyArray(x, y, n, [](DF df, hn::Vec<DF> v) { return fastexp::Pow2CoarseHalf(df, v); });
}

void ExpHwyArray(const float* x, float* y, std::int64_t n) {
  ApplyArray(x, y, n, [](DF df, hn::Vec<DF> v) { return hn::Exp(df, v); });
}

const char* FastExpTargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv {

HWY_EXPORT(ExpNonPositiveArray);
HWY_EXPORT(Pow2Array);
HWY_EXPORT(Pow2CoarseArray);
HWY_EXPORT(Pow2CoarseHalfArray);
HWY_EXPORT(ExpHwyArray);
HWY_EXPORT(FastExpTargetName);

void exp_nonpositive_cpu(const float* x, float* y, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(ExpNonPositiveArray)(x, y, n);
}

void pow2_cpu(const float* x, float* y, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(Pow2Array)(x, y, n);
}

void pow2_coarse_cpu(const float* x, float* y, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(Pow2CoarseArray)(x, y, n);
}

void pow2_coarse_half_cpu(const float* xh, float* y, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(Pow2CoarseHalfArray)(xh, y, n);
}

void exp_hwy_cpu(const float* x, float* y, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(ExpHwyArray)(x, y, n);
}

const char* fast_exp_cpu_target_name() { return HWY_DYNAMIC_DISPATCH(FastExpTargetName)(); }

}  // namespace qkv
#endif  // HWY_ONCE
