// qkv's vectorised exp for the softmax (Highway, one copy per target).
//
// The softmax only ever exponentiates s - max <= 0, or -inf for a masked pair, so this exp
// covers exactly that domain and nothing else: no overflow handling, no denormal results.
//
//   exp(x) = 2^n * p(r),  n = round(x * log2(e)),  r = x - n * ln2  in [-ln2/2, ln2/2]
//
// - Range reduction: n by the "magic number" rounding (x * log2e + 1.5 * 2^23 in one FMA rounds
//   to the nearest integer and leaves n in the low mantissa bits, so no float->int conversion is
//   needed); r by Cody-Waite with ln2 = kLn2Hi + kLn2Lo: kLn2Hi has its low 8 mantissa bits zero,
//   so n * kLn2Hi is exact for |n| < 256 and x - n * kLn2Hi loses nothing.
// - p(r) = 1 + (r + r^2 * (c2 + r * (c3 + r * (c4 + r * c5)))): degree 5, minimax for the
//   relative error with c0 = c1 = 1 pinned, coefficients derived by scripts/fit_exp_poly.py
//   (Lawson's algorithm). Degree 5 is the smallest within 2 ulp (1.05e-7 in real arithmetic,
//   1.8e-7 in float32; degree 4: 5.4e-6). The pinned form costs one op more than plain Horner
//   (p = 1 + r * q) but is monotone between adjacent floats: every step is a monotone function
//   followed by one rounding, where Horner's rounding of q (times r) can jitter the last bit
//   the wrong way. exp(0) is exactly 1.
// - 2^n: n << 23 added to p's bits, i.e. to its exponent field (p is in [0.7, 1.5], n >= -126).
//
// Measured (tests/cpp/test_fast_exp.cc, every 7th float of [-87.33, 0] against double exp):
// max relative error 1.82e-7 on AVX3 and AVX2, 1.79e-7 on SCALAR (hwy::Exp: 8.4e-8), no
// inversion between adjacent floats; docs/kernels.md, section "exp". Cost: 14 vector ops (2 + 2
// reduction, 6 polynomial, shift + add, compare + zeroing select); hwy::Exp about 26.

#if defined(QKV_KERNELS_CPU_FAST_EXP_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_KERNELS_CPU_FAST_EXP_INL_H_
#undef QKV_KERNELS_CPU_FAST_EXP_INL_H_
#else
#define QKV_KERNELS_CPU_FAST_EXP_INL_H_
#endif

#include <type_traits>

#include "hwy/highway.h"
#include "kernels/cpu/fast_exp.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace fastexp {

namespace hn = hwy::HWY_NAMESPACE;

// The constants (coefficients, cuts) are in fast_exp.h, where the AMX softmax reads them too.
using namespace ::qkv::fastexp;

// The range reduction of exp: k = n + 1.5 * 2^23 exactly (the add rounds x * log2e to
// the nearest integer, ties to even), r = x - n * ln2 (Cody-Waite). For x = -inf everything is
// inf/NaN; ScaleByPow2's final select discards it.
// Whether D is a whole AVX-512 vector of floats (the base-2 functions below then use
// vreduceps and vscalefps on AVX3 targets).
template <class D>
constexpr bool kNative512 = std::is_same_v<hn::TFromD<D>, float> && hn::MaxLanes(D()) == 16;

template <class D>
struct Reduced {
  hn::Vec<D> k, r;
};
template <class D>
HWY_INLINE Reduced<D> Reduce(D d, hn::Vec<D> x) {
  const auto k = hn::MulAdd(x, hn::Set(d, kLog2e), hn::Set(d, kRoundMagic));
  const auto n = hn::Sub(k, hn::Set(d, kRoundMagic));
  auto r = hn::NegMulAdd(n, hn::Set(d, kLn2Hi), x);  // exact
  r = hn::NegMulAdd(n, hn::Set(d, kLn2Lo), r);
  return {k, r};
}

// p * 2^n, and +0 where x < min_arg (kMinArg for exp, kMinPow2Arg for 2^x). The low 9 bits of
// k's pattern are n mod 2^9 (k's ulp is 1); shifted left by 23 they are n << 23 mod 2^32, and the
// rest of k's pattern is shifted out. Unsigned: wrap-around, no UB.
template <class D>
HWY_INLINE hn::Vec<D> ScaleByPow2(D d, hn::Vec<D> x, hn::Vec<D> k, hn::Vec<D> p,
                                 float min_arg = kMinArg) {
  const hn::RebindToUnsigned<D> du;
  const auto scaled =
      hn::BitCast(d, hn::Add(hn::BitCast(du, p), hn::ShiftLeft<23>(hn::BitCast(du, k))));
  return hn::IfThenZeroElse(hn::Lt(x, hn::Set(d, min_arg)), scaled);
}

// exp(x) for x <= 0, lane-wise. x = -inf (or any x < kMinArg, about -87.3365) gives exactly +0;
// otherwise the result is a normal float within the relative error bound above. x > 0 and NaN
// are outside the contract (the result is unspecified, not necessarily NaN).
template <class D>
HWY_INLINE hn::Vec<D> ExpNonPositive(D d, hn::Vec<D> x) {
  const Reduced<D> a = Reduce(d, x);
  auto q = hn::MulAdd(hn::Set(d, kC5), a.r, hn::Set(d, kC4));
  q = hn::MulAdd(q, a.r, hn::Set(d, kC3));
  q = hn::MulAdd(q, a.r, hn::Set(d, kC2));
  const auto p = hn::Add(hn::MulAdd(q, hn::Mul(a.r, a.r), a.r), hn::Set(d, 1.0f));
  return ScaleByPow2(d, x, a.k, p);
}

// ---------------------------------------------------------------------------------------------
// 2^x, for the online softmax: p = exp(s * scale - max) is computed as 2^(s * c - max * log2e)
// with c = scale * log2e, so the scale and the change of base are one FMA and the range reduction
// needs no Cody-Waite split:
//
//   2^x = 2^n * p(r),  n = round(x) (the magic-number add),  r = x - n  in [-1/2, 1/2], exact
//   p(r) = 1 + r * (c1 + r * (c2 + ...)), Horner, minimax for the relative error with p(0) = 1
//
// That is 5 multiply-adds for degree 5 where ExpNonPositive takes 9 (its reduction's 3, its
// pinned form's extra multiply), and the argument's FMA replaces the scale's: the f32 flash
// kernel ran 1.4-2.3% faster on Zen 4 (docs/kernels.md, "exp").
// Coefficients: scripts/fit_exp_poly.py --base2 (the natural fit with r scaled by ln2).
// Accuracy: 1.7e-7 relative in float32 (degree 5), 2.9e-6 (degree 4); 2^0 = 1 exactly. Horner is
// not monotone between every pair of adjacent floats (one ulp jitters, as for Horner above);
// the softmax does not need it. The argument x = s * c - m2 (m2: the running max in base 2, as
// the online softmax stores it) is rounded once, which puts the same relative error into p as
// the rounding of s - max did in the natural form; c's own rounding (1.3e-8 relative) scales
// every score alike.
//
// Domain: x <= 16 (the lazy running max of online_softmax-inl.h passes up to 12);
// x < kMinPow2Arg (-inf included) gives exactly +0; otherwise the result is a normal float.
// NaN is outside the contract.
// k = n + 1.5 * 2^23 exactly (n = round(x), ties to even; see ScaleByPow2 for how k's low bits
// become 2^n) and r = x - n (exact: |r| <= 1/2).
template <class D>
HWY_INLINE Reduced<D> ReduceBase2(D d, hn::Vec<D> x) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (kNative512<D>) {  // r = x - round(x) in one vreduceps; k = n = x - r
    const hn::Vec<D> r{_mm512_reduce_round_ps(x.raw, _MM_FROUND_TO_NEAREST_INT,
                                              _MM_FROUND_CUR_DIRECTION)};
    return {hn::Sub(x, r), r};
  }
#endif
  const auto k = hn::Add(x, hn::Set(d, kRoundMagic));
  return {k, hn::Sub(x, hn::Sub(k, hn::Set(d, kRoundMagic)))};
}

// 2^x = p * 2^n from ReduceBase2's k and p = 2^r; +0 below kMinPow2Arg. On AVX-512 one vscalefps
// under the x >= kMinPow2Arg mask (k holds n there): p * 2^n is normal above the cut, so the
// bits are those of the exponent add (ScaleByPow2), in 2 instructions instead of 4.
template <class D>
HWY_INLINE hn::Vec<D> ScaleBase2(D d, hn::Vec<D> x, hn::Vec<D> k, hn::Vec<D> p) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (kNative512<D>) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x.raw, _mm512_set1_ps(kMinPow2Arg), _CMP_NLT_UQ);
    return hn::Vec<D>{_mm512_maskz_scalef_ps(keep, p.raw, k.raw)};
  }
#endif
  return ScaleByPow2(d, x, k, p, kMinPow2Arg);
}

// 2^x = p(r) * 2^n with p = 1 + r * (kP1 + r * (kP2 + ...)), of N vectors at once: each step
// for all N before the next, so N chains lie side by side in the instruction stream (the
// softmax's pass takes 4 at a time: docs/kernels.md, "exp"). Each vector's operations and bits
// are those of Pow2 on it alone.
template <int N, class D>
HWY_INLINE void Pow2Group(D d, const hn::Vec<D> (&x)[N], hn::Vec<D> (&p)[N]) {
  hn::Vec<D> k[N], r[N];
  for (int i = 0; i < N; ++i) {
    const Reduced<D> a = ReduceBase2(d, x[i]);
    k[i] = a.k;
    r[i] = a.r;
  }
  for (int i = 0; i < N; ++i) p[i] = hn::MulAdd(hn::Set(d, kP5), r[i], hn::Set(d, kP4));
  for (int i = 0; i < N; ++i) p[i] = hn::MulAdd(p[i], r[i], hn::Set(d, kP3));
  for (int i = 0; i < N; ++i) p[i] = hn::MulAdd(p[i], r[i], hn::Set(d, kP2));
  for (int i = 0; i < N; ++i) p[i] = hn::MulAdd(p[i], r[i], hn::Set(d, kP1));
  for (int i = 0; i < N; ++i) p[i] = hn::MulAdd(p[i], r[i], hn::Set(d, 1.0f));
  for (int i = 0; i < N; ++i) p[i] = ScaleBase2(d, x[i], k[i], p[i]);
}

template <class D>
HWY_INLINE hn::Vec<D> Pow2(D d, hn::Vec<D> x) {
  const hn::Vec<D> xs[1] = {x};
  hn::Vec<D> p[1];
  Pow2Group(d, xs, p);
  return p[0];
}

// The same with degree 4 (2.9e-6), for the product paths that round the probabilities to bf16
// (relative error up to 3.9e-3) before the value product: there the last bits are rounded away,
// and the row sums (hence lse) move by at most the 2.9e-6. One multiply-add fewer; and its
// argument comes shifted by one half, xh = x + 1/2 (the softmax folds the half into its shift,
// so it costs nothing): with n = floor(xh) and t = xh - n in [0, 1), 2^x = 2^n * q(t) where
// q(t) = p(t - 1/2) is the same minimax polynomial in the shifted variable (fast_exp.h,
// kHalfP*). On AVX-512, t is one vreduceps rounding down and 2^n one vscalefps, which takes
// floor(xh) itself: the subtraction n = x - r of Pow2 goes (7 instructions; bf16 flash on AMX
// 1.03x at D = 64 and 1.04x at D = 128, B = 1, H = 8, L = 4096, on the Intel AMX Xeon).
// Integers x (t = 1/2) give 2^x exactly; +0 where xh < kMinPow2HalfArg (x < -126).
template <class D>
HWY_INLINE hn::Vec<D> HalfPoly(D d, hn::Vec<D> t) {  // q(t), Horner
  auto q = hn::MulAdd(hn::Set(d, kHalfP4), t, hn::Set(d, kHalfP3));
  q = hn::MulAdd(q, t, hn::Set(d, kHalfP2));
  q = hn::MulAdd(q, t, hn::Set(d, kHalfP1));
  return hn::MulAdd(q, t, hn::Set(d, kHalfP0));
}
template <class D>
HWY_INLINE hn::Vec<D> Pow2CoarseHalf(D d, hn::Vec<D> xh) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (kNative512<D>) {  // vscalefps scales by 2^floor(xh) itself
    const hn::Vec<D> t{_mm512_reduce_round_ps(xh.raw, _MM_FROUND_TO_NEG_INF,
                                              _MM_FROUND_CUR_DIRECTION)};
    const __mmask16 keep =
        _mm512_cmp_ps_mask(xh.raw, _mm512_set1_ps(kMinPow2HalfArg), _CMP_NLT_UQ);
    return hn::Vec<D>{_mm512_maskz_scalef_ps(keep, HalfPoly(d, t).raw, xh.raw)};
  }
#endif
  const auto n = hn::Floor(xh);
  // k = n + 1.5 * 2^23 (exact: n is an integer well inside the magic number's range, or the
  // lane is zeroed by the cut); its low bits become 2^n as in ScaleByPow2.
  return ScaleByPow2(d, xh, hn::Add(n, hn::Set(d, kRoundMagic)), HalfPoly(d, hn::Sub(xh, n)),
                     kMinPow2HalfArg);
}

// 2^x with Pow2CoarseHalf's polynomial (x + 1/2 rounded once more): what pow2_coarse_cpu and
// the tests call; the kernels pass the shifted argument themselves.
template <class D>
HWY_INLINE hn::Vec<D> Pow2Coarse(D d, hn::Vec<D> x) {
  return Pow2CoarseHalf(d, hn::Add(x, hn::Set(d, kHalfShift)));
}

// The 2^x a softmax takes: Pow2, or where the probabilities are rounded to bf16 afterwards
// Pow2CoarseHalf, whose argument is x + kHalfShift (the caller folds it into the max).
template <bool kCoarse, class D>
HWY_INLINE hn::Vec<D> Pow2ForProbs(D d, hn::Vec<D> x_or_xh) {
  if constexpr (kCoarse) {
    return Pow2CoarseHalf(d, x_or_xh);
  } else {
    return Pow2(d, x_or_xh);
  }
}

}  // namespace fastexp
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#endif  // QKV_KERNELS_CPU_FAST_EXP_INL_H_
