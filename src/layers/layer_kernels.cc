// Highway kernels for activations, LayerNorm and the rounding to bf16; one copy per target (CMakeLists.txt lists
// the targets), chosen at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "layers/layer_kernels.cc"
#include "layers/layer_kernels.h"

#include <algorithm>
#include <cmath>

#include "core/float16.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
// Per-target headers: must come after foreach_target.h (kept in their own include block).
#include "hwy/contrib/math/math-inl.h"
#include "kernels/cpu/fast_exp-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace layers {
namespace HWY_NAMESPACE {
namespace {

namespace hn = hwy::HWY_NAMESPACE;
namespace fastexp = ::qkv::HWY_NAMESPACE::fastexp;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

using DD = hn::ScalableTag<double>;
using VD = hn::Vec<DD>;
using DFHalf = hn::Rebind<float, DD>;  // as many floats as DD has doubles

// The GELUs are evaluated in float64 lanes and rounded once at the end: their f32 forms lose
// up to ~4 ulp (GELU erf) and ~1e-5 relative (GELU tanh, where the rounding of u is amplified
// by exp in the negative tail). Linear's fused GELU post-op is oneDNN's own; this path is for
// standalone use and is the one the tests hold to ~1e-7.

// GELU(x) = 0.5 x erfc(-x / sqrt 2). Written with erfc (not 1 + erf) so the negative tail,
// where 1 + erf(z) cancels, keeps full relative accuracy. erfc(z), z >= 0, is Numerical
// Recipes' Chebyshev fit, fractional error <= 1.05e-7 for all z >= 0 (measured in float64
// against math.erfc over [0, 12]):
//   erfc(z) = t exp(-z^2 + c(t)),  t = 1 / (1 + z / 2),  c = -1.26551223 + t (1.00002368 + ...)
// and erfc(-z) = 2 - erfc(z).
// OnePlusErf: erfc(-x / sqrt 2) = 1 + erf(x / sqrt 2) for x in [-30, 30] (the caller clamps), in
// f64 lanes (GELU); OnePlusErfF32 below in f32 lanes (GELU's derivative, and GELU rounded to
// bf16 next). The fit's exponent c(t), Horner in t, is theirs alike.
template <class D>
HWY_INLINE hn::Vec<D> ErfcFitExponent(D d, hn::Vec<D> t) {
  using T = hn::TFromD<D>;
  auto c = hn::Set(d, static_cast<T>(0.17087277));
  for (const double coefficient : {-0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806,
                                   0.09678418, 0.37409196, 1.00002368, -1.26551223}) {
    c = hn::MulAdd(c, t, hn::Set(d, static_cast<T>(coefficient)));
  }
  return c;
}

HWY_INLINE VD OnePlusErf(DD dd, VD xc) {
  const VD z = hn::Mul(hn::Abs(xc), hn::Set(dd, 0.70710678118654752440));
  const VD t = hn::Div(hn::Set(dd, 1.0), hn::MulAdd(z, hn::Set(dd, 0.5), hn::Set(dd, 1.0)));
  const VD erfc_abs = hn::Mul(t, hn::Exp(dd, hn::NegMulAdd(z, z, ErfcFitExponent(dd, t))));
  return hn::IfThenElse(hn::Lt(xc, hn::Zero(dd)), erfc_abs, hn::Sub(hn::Set(dd, 2.0), erfc_abs));
}

// 1 / d for d in [1, 6] (1 + z / 2 of the erfc fit, 1 + e of the tanh form): the estimate (14 bits
// on AVX-512, 12 on AVX2, exact on the scalar target) and one Newton step, r (2 - d r): within
// about an ulp.
HWY_INLINE VF ReciprocalNewton(DF df, VF d) {
  const VF estimate = hn::ApproximateReciprocal(d);
  return hn::Mul(estimate, hn::NegMulAdd(d, estimate, hn::Set(df, 2.0f)));
}

// The same in f32 lanes for |xc| <= 13, without a division or Highway's exp: t by
// ReciprocalNewton and exp(-z^2 + c) by fastexp::ExpNonPositive (1.8e-7 relative). The
// argument is >= -85.8 at |xc| = 13 (above its cut at -87.34) and at most ~3e-8 where the fit's
// c(1) rounds above 0 (so clamped to 0: exp there is 1 to f32). About 1.5 times fewer vector
// operations than a division and hwy::Exp, and no divider: the bf16 activations and GELU's
// derivative in training.
HWY_INLINE VF OnePlusErfF32(DF df, VF xc) {
  const VF z = hn::Mul(hn::Abs(xc), hn::Set(df, 0.70710678118654752440f));
  const VF t = ReciprocalNewton(df, hn::MulAdd(z, hn::Set(df, 0.5f), hn::Set(df, 1.0f)));
  const VF arg = hn::Min(hn::NegMulAdd(z, z, ErfcFitExponent(df, t)), hn::Zero(df));
  const VF erfc_abs = hn::Mul(t, fastexp::ExpNonPositive(df, arg));  // erfc(|x| / sqrt 2)
  return hn::IfThenElse(hn::Lt(xc, hn::Zero(df)), erfc_abs, hn::Sub(hn::Set(df, 2.0f), erfc_abs));
}

HWY_INLINE VD ClampTo30(DD dd, VD x) {
  return hn::Min(hn::Max(x, hn::Set(dd, -30.0)), hn::Set(dd, 30.0));
}

HWY_INLINE VD GeluErf(DD dd, VD x) {
  // Past |x| = 30 the factor is 0 or 2 to double precision; clamping keeps Exp in range.
  const VD factor = OnePlusErf(dd, ClampTo30(dd, x));
  const VD y = hn::Mul(hn::Mul(hn::Set(dd, 0.5), x), factor);
  // Below -30 the true value is 0 in float: x * 0 (so -inf gives NaN, as the float64 formula
  // 0.5 x (1 + erf(x / sqrt 2)) does).
  return hn::IfThenElse(hn::Lt(x, hn::Set(dd, -30.0)), hn::Mul(x, hn::Zero(dd)), y);
}

// GELU, tanh form: 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3).
// The sigmoid form has no 1 + tanh cancellation; with e = exp(-2|u|) <= 1 it never overflows:
// sigmoid(2u) = 1 / (1 + e) for u >= 0 and e / (1 + e) for u < 0.
HWY_INLINE VD GeluTanh(DD dd, VD x) {
  const VD x2 = hn::Mul(x, x);
  const VD u = hn::Mul(hn::MulAdd(hn::Mul(x2, hn::Set(dd, 0.044715)), x, x),
                       hn::Set(dd, 0.79788456080286535588));
  // Clamp keeps Exp in its valid range (exp(-1400) is 0 anyway).
  const VD e = hn::Exp(dd, hn::Max(hn::Mul(hn::Abs(u), hn::Set(dd, -2.0)), hn::Set(dd, -700.0)));
  const VD numerator = hn::IfThenElse(hn::Lt(u, hn::Zero(dd)), e, hn::Set(dd, 1.0));
  return hn::Div(hn::Mul(x, numerator), hn::Add(hn::Set(dd, 1.0), e));
}

// The GELUs' derivatives, in f32 lanes (a gradient does not need GELU's own 2e-7: these are
// within ~1e-6 of the float64 formulas, LayerBackward.ActivationsMatchFiniteDifferences; in
// float64 lanes, as the forward, they took 6% of a bf16 training step).
//
// GELU'(x) = 0.5 (1 + erf(x / sqrt 2)) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi), with
// 1 + erf(x / sqrt 2) = erfc(-x / sqrt 2) by GeluErf's fit, on x clamped to [-10, 10] (past
// it the derivative is 0 or 1 in f32; so -inf and +inf give 0 and 1).
HWY_INLINE VF GeluErfDerivative(DF df, VF x) {
  const VF xc = hn::Min(hn::Max(x, hn::Set(df, -10.0f)), hn::Set(df, 10.0f));
  const VF one_plus_erf = OnePlusErfF32(df, xc);
  const VF phi = hn::Mul(fastexp::ExpNonPositive(df, hn::Mul(hn::Mul(xc, xc), hn::Set(df, -0.5f))),
                         hn::Set(df, 0.39894228040143267794f));
  return hn::MulAdd(xc, phi, hn::Mul(hn::Set(df, 0.5f), one_plus_erf));
}

// GELU tanh's derivative: with s = sigmoid(2u) (= 0.5 (1 + tanh u); e = exp(-2|u|)),
// d/dx [x s] = s + x 2 s (1 - s) u', s (1 - s) = e / (1 + e)^2,
// u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2); x clamped to [-10, 10] as above.
HWY_INLINE VF GeluTanhDerivative(DF df, VF x) {
  const VF xc = hn::Min(hn::Max(x, hn::Set(df, -10.0f)), hn::Set(df, 10.0f));
  const VF x2 = hn::Mul(xc, xc);
  const VF u = hn::Mul(hn::MulAdd(hn::Mul(x2, hn::Set(df, 0.044715f)), xc, xc),
                       hn::Set(df, 0.79788456080286535588f));
  const VF e = fastexp::ExpNonPositive(df, hn::Mul(hn::Abs(u), hn::Set(df, -2.0f)));
  const VF inv = ReciprocalNewton(df, hn::Add(hn::Set(df, 1.0f), e));
  const VF s = hn::IfThenElse(hn::Lt(u, hn::Zero(df)), hn::Mul(e, inv), inv);
  const VF ss2 = hn::Mul(hn::Mul(hn::Add(e, e), inv), inv);  // 2 s (1 - s)
  const VF du = hn::Mul(hn::MulAdd(x2, hn::Set(df, 3.0f * 0.044715f), hn::Set(df, 1.0f)),
                        hn::Set(df, 0.79788456080286535588f));
  return hn::MulAdd(hn::Mul(xc, ss2), du, s);
}

// GELU in f32 lanes (for activations rounded to bf16 next: within ~1e-6 relative, far inside
// bf16's 2^-9, down to results of 1e-30): 0.5 x (1 + erf(x / sqrt 2)) with GeluErf's erfc fit
// on x clamped to [-13, 13] (exp's range), and x * 0 below -13 (|GELU| < 1e-37 there); the tanh
// form as GeluTanh.
HWY_INLINE VF GeluErfF32(DF df, VF x) {
  const VF xc = hn::Min(hn::Max(x, hn::Set(df, -13.0f)), hn::Set(df, 13.0f));
  const VF factor = OnePlusErfF32(df, xc);
  const VF y = hn::Mul(hn::Mul(hn::Set(df, 0.5f), x), factor);
  return hn::IfThenElse(hn::Lt(x, hn::Set(df, -13.0f)), hn::Mul(x, hn::Zero(df)), y);
}

HWY_INLINE VF GeluTanhF32(DF df, VF x) {
  const VF u = hn::Mul(hn::MulAdd(hn::Mul(hn::Mul(x, x), hn::Set(df, 0.044715f)), x, x),
                       hn::Set(df, 0.79788456080286535588f));
  const VF e = fastexp::ExpNonPositive(df, hn::Mul(hn::Abs(u), hn::Set(df, -2.0f)));
  const VF numerator = hn::IfThenElse(hn::Lt(u, hn::Zero(df)), e, hn::Set(df, 1.0f));
  return hn::Mul(hn::Mul(x, numerator), ReciprocalNewton(df, hn::Add(hn::Set(df, 1.0f), e)));
}

// Loads/stores of the first `count` lanes (count <= Lanes); masked lanes are never touched,
// loads give 0 there. Highway 1.0.3 has no LoadN/StoreN.
template <class D>
HWY_INLINE hn::Vec<D> LoadFirst(D d, const float* HWY_RESTRICT p, size_t count) {
  return count == hn::Lanes(d) ? hn::LoadU(d, p) : hn::MaskedLoad(hn::FirstN(d, count), d, p);
}
template <class D>
HWY_INLINE void StoreFirst(hn::Vec<D> v, D d, float* HWY_RESTRICT p, size_t count) {
  if (count == hn::Lanes(d)) {
    hn::StoreU(v, d, p);
  } else {
    hn::BlendedStore(v, hn::FirstN(d, count), d, p);
  }
}

// y[i] = op(x[i]) in f32 lanes (y may be x).
template <class Op>
HWY_INLINE void Map(const float* x, float* y, std::int64_t n, Op op) {
  const DF df;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
  for (std::int64_t i = 0; i < n; i += lanes) {
    const size_t count = static_cast<size_t>(std::min(lanes, n - i));
    StoreFirst(op(df, LoadFirst(df, x + i, count)), df, y + i, count);
  }
}

// v rounded to f32, infinities kept. (Highway 1.0.3's HWY_SCALAR DemoteTo clamps them to
// +-FLT_MAX, its guard against converting out-of-range values; the x86 targets' conversion
// keeps them. The scalar target runs on CPUs without AVX2: test_layers_basic.cc forces it.)
HWY_INLINE hn::Vec<DFHalf> DemoteKeepingInf(DFHalf dh, VD v) {
#if HWY_TARGET == HWY_SCALAR
  return hn::Set(dh, static_cast<float>(hn::GetLane(v)));
#else
  return hn::DemoteTo(dh, v);
#endif
}

// x[i] = op(x[i]) evaluated in f64 lanes, rounded once to f32.
template <class Op>
HWY_INLINE void MapF64(const float* x, float* y, std::int64_t n, Op op) {
  const DD dd;
  const DFHalf dh;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(dd));
  for (std::int64_t i = 0; i < n; i += lanes) {
    const size_t count = static_cast<size_t>(std::min(lanes, n - i));
    const VD v = op(dd, hn::PromoteTo(dd, LoadFirst(dh, x + i, count)));
    StoreFirst(DemoteKeepingInf(dh, v), dh, y + i, count);
  }
}

}  // namespace

void ActivationKernel(Activation act, const float* x, float* y, std::int64_t n) {
  switch (act) {
    case Activation::kNone:
      if (x != y) std::copy(x, x + n, y);
      return;
    case Activation::kRelu:
      return Map(x, y, n, [](DF df, VF v) { return hn::Max(v, hn::Zero(df)); });
    case Activation::kGeluErf:
      return MapF64(x, y, n, [](DD dd, VD v) { return GeluErf(dd, v); });
    case Activation::kGeluTanh:
      return MapF64(x, y, n, [](DD dd, VD v) { return GeluTanh(dd, v); });
  }
}

void ActivationBackwardKernel(Activation act, const float* x, const float* dy, float* dx,
                              std::int64_t n) {
  // dx = dy * derivative(x), the derivative chosen here, once.
  const auto map = [&](auto derivative) {
    const DF df;
    const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
    for (std::int64_t i = 0; i < n; i += lanes) {
      const size_t count = static_cast<size_t>(std::min(lanes, n - i));
      const VF d = derivative(df, LoadFirst(df, x + i, count));
      StoreFirst(hn::Mul(LoadFirst(df, dy + i, count), d), df, dx + i, count);
    }
  };
  switch (act) {
    case Activation::kNone:
      std::copy(dy, dy + n, dx);
      return;
    case Activation::kRelu:
      return map([](DF df, VF v) {
        return hn::IfThenElseZero(hn::Gt(v, hn::Zero(df)), hn::Set(df, 1.0f));
      });
    case Activation::kGeluErf:
      return map([](DF df, VF v) { return GeluErfDerivative(df, v); });
    case Activation::kGeluTanh:
      return map([](DF df, VF v) { return GeluTanhDerivative(df, v); });
  }
}

// Independent sums per row pass (LayerNorm's forward and backward), and their total in one
// fixed order.
constexpr int kChains = 4;
template <class V>
HWY_INLINE V AddChains(const V (&chains)[kChains]) {
  return hn::Add(hn::Add(chains[0], chains[1]), hn::Add(chains[2], chains[3]));
}
// f(chain, i) for the whole vectors i of [0, full), vector k in chain k % kChains (unrolled by
// kChains, so the chains' adds are independent in the instruction stream). Returns full.
template <class F>
HWY_INLINE std::int64_t ForEachVectorChained(std::int64_t full, std::int64_t lanes, F f) {
  std::int64_t i = 0;
  for (; i + kChains * lanes <= full; i += kChains * lanes) {
    for (int c = 0; c < kChains; ++c) f(c, i + c * lanes);
  }
  for (int c = 0; i < full; i += lanes, ++c) f(c, i);
  return i;
}

void LayerNormKernel(const float* x, const float* residual, std::int64_t rows,
                     std::int64_t features, const float* gamma, const float* beta, float eps,
                     float* y) {
  const DF df;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
  const std::int64_t full = features - features % lanes;
  const size_t rest = static_cast<size_t>(features - full);
  // v = x + residual, loaded fresh in every pass: y may alias x or residual, and is written
  // only in the last pass, at the position just read.
  auto load = [&](const float* xr, const float* rr, std::int64_t i, size_t count) {
    const VF v = LoadFirst(df, xr + i, count);
    return rr ? hn::Add(v, LoadFirst(df, rr + i, count)) : v;
  };
  for (std::int64_t row = 0; row < rows; ++row) {
    const float* xr = x + row * features;
    const float* rr = residual ? residual + row * features : nullptr;
    float* yr = y + row * features;
    // Two passes (mean, then deviations d = v - mean): no E[v^2] - E[v]^2 cancellation. The
    // mean's own rounding (a sum of `features` values in as many lanes as the target has: one
    // on HWY_SCALAR) is corrected with the deviations' sum, which the second pass adds up
    // anyway (the corrected two-pass algorithm, Chan, Golub and LeVeque 1983): mean' = mean +
    // sum(d) / n and sum((v - mean')^2) = sum(d^2) - sum(d)^2 / n. Without it, rows of offset
    // 100 and spread 1 lost 3e-4 on the scalar target. LoadFirst zero-fills the tail lanes,
    // which then add 0 to the sum; the deviation pass masks them out.
    // Both sums run in kChains chains, vector i of the row in chain i % kChains (one chain
    // waited an add's latency per vector: 165 ns a row of 384 in L2, one thread, Intel AMX
    // Xeon), added up in a fixed order.
    const float n = static_cast<float>(features);
    VF sum[kChains];
    for (VF& s : sum) s = hn::Zero(df);
    ForEachVectorChained(full, lanes, [&](int c, std::int64_t i) {
      sum[c] = hn::Add(sum[c], load(xr, rr, i, lanes));
    });
    if (rest) sum[kChains - 1] = hn::Add(sum[kChains - 1], load(xr, rr, full, rest));
    const float mean = hn::GetLane(hn::SumOfLanes(df, AddChains(sum))) / n;
    const VF vmean0 = hn::Set(df, mean);
    VF dsum[kChains], sq[kChains];
    for (int c = 0; c < kChains; ++c) dsum[c] = sq[c] = hn::Zero(df);
    const auto deviation = [&](int c, const VF d) {
      dsum[c] = hn::Add(dsum[c], d);
      sq[c] = hn::MulAdd(d, d, sq[c]);
    };
    ForEachVectorChained(full, lanes, [&](int c, std::int64_t i) {
      deviation(c, hn::Sub(load(xr, rr, i, lanes), vmean0));
    });
    if (rest) {
      deviation(kChains - 1, hn::IfThenElseZero(hn::FirstN(df, rest),
                                                hn::Sub(load(xr, rr, full, rest), vmean0)));
    }
    const float d_total = hn::GetLane(hn::SumOfLanes(df, AddChains(dsum)));
    const float var = std::max(
        0.0f, (hn::GetLane(hn::SumOfLanes(df, AddChains(sq))) - d_total * d_total / n) / n);
    const VF vmean = hn::Set(df, mean + d_total / n);
    const VF inv_std = hn::Set(df, 1.0f / std::sqrt(var + eps));
    for (std::int64_t i = 0; i < features; i += lanes) {
      const size_t count = static_cast<size_t>(std::min<std::int64_t>(lanes, features - i));
      const VF norm = hn::Mul(hn::Sub(load(xr, rr, i, count), vmean), inv_std);
      const VF out =
          hn::MulAdd(norm, LoadFirst(df, gamma + i, count), LoadFirst(df, beta + i, count));
      StoreFirst(out, df, yr + i, count);
    }
  }
}

// bf16 of x rounded to nearest even, as f32_to_bf16_bits does it lane for lane (NaN keeps its
// sign and becomes quiet), in the low 16 bits of u32 lanes.
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> Bf16Bits(DF df, VF v) {
  const hn::RebindToUnsigned<DF> du;
  const auto bits = hn::BitCast(du, v);
  const auto high = hn::ShiftRight<16>(bits);
  const auto rounded =
      hn::ShiftRight<16>(hn::Add(hn::Add(bits, hn::Set(du, 0x7fffu)), hn::And(high, hn::Set(du, 1u))));
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), hn::Or(high, hn::Set(du, 0x40u)),
                        rounded);
}

// bits = bf16(op(x)) lane for lane, op evaluated in f32 lanes (the tail through a full vector).
template <class Op>
HWY_INLINE void MapToBf16(const float* x, std::uint16_t* bits, std::int64_t n, Op op) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<std::uint16_t, DF> d16;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto b = Bf16Bits(df, op(df, hn::LoadU(df, x + i)));
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, b)), d16, bits + i);
  }
  if (i < n) {
    HWY_ALIGN float in[HWY_MAX_BYTES / sizeof(float)] = {}, out[HWY_MAX_BYTES / sizeof(float)];
    std::copy(x + i, x + n, in);
    hn::Store(op(df, hn::Load(df, in)), df, out);
    for (std::int64_t k = 0; i + k < n; ++k) bits[i + k] = f32_to_bf16_bits(out[k]);
  }
}

void RoundToBf16Kernel(const float* x, std::int64_t n, std::uint16_t* bits, float* values) {
  if (bits != nullptr) return MapToBf16(x, bits, n, [](DF, VF v) { return v; });
  const DF df;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto b = Bf16Bits(df, hn::LoadU(df, x + i));
    hn::StoreU(hn::BitCast(df, hn::ShiftLeft<16>(b)), df, values + i);
  }
  for (; i < n; ++i) values[i] = round_to_bf16(x[i]);
}

void ActivationToBf16Kernel(Activation act, const float* x, std::uint16_t* bits, std::int64_t n) {
  // The activation chosen here, once.
  const auto map = [&](auto op) { MapToBf16(x, bits, n, op); };
  switch (act) {
    case Activation::kNone:
      return map([](DF, VF v) { return v; });
    case Activation::kRelu:
      return map([](DF df, VF v) { return hn::Max(v, hn::Zero(df)); });
    case Activation::kGeluErf:
      return map([](DF df, VF v) { return GeluErfF32(df, v); });
    case Activation::kGeluTanh:
      return map([](DF df, VF v) { return GeluTanhF32(df, v); });
  }
}

// z = x + residual (residual nullable) at [at, at + count), widened to f64 (0 past count).
HWY_INLINE VD LoadZ(const float* x, const float* residual, std::int64_t at, size_t count) {
  const DD dd;
  const DFHalf dh;
  const VD v = hn::PromoteTo(dd, LoadFirst(dh, x + at, count));
  return residual ? hn::Add(v, hn::PromoteTo(dd, LoadFirst(dh, residual + at, count))) : v;
}

// Sum of a row's f64 lanes: z = x (+ residual) widened, then f(z) per lane, added in lanes, in
// kChains chains (vector i in chain i % kChains).
template <class F>
HWY_INLINE double RowSumF64(const float* x, const float* residual, std::int64_t n, F f) {
  const DD dd;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(dd));
  const size_t whole = static_cast<size_t>(lanes);
  VD acc[kChains];
  for (VD& a : acc) a = hn::Zero(dd);
  const std::int64_t i = ForEachVectorChained(n - n % lanes, lanes, [&](int c, std::int64_t at) {
    acc[c] = hn::Add(acc[c], f(dd, LoadZ(x, residual, at, whole), at, whole));
  });
  if (i < n) {  // the partial vector, its lanes past n zeroed
    const size_t count = static_cast<size_t>(n - i);
    const VD v = LoadZ(x, residual, i, count);
    acc[kChains - 1] =
        hn::Add(acc[kChains - 1], hn::IfThenElseZero(hn::FirstN(dd, count), f(dd, v, i, count)));
  }
  return hn::GetLane(hn::SumOfLanes(dd, AddChains(acc)));
}

void LayerNormBackwardRowsKernel(const float* x, const float* residual, const float* dy,
                                 std::int64_t rows, std::int64_t features, const float* gamma,
                                 double eps, double* mean, double* rstd, float* dz) {
  const DD dd;
  const DFHalf dh;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(dd));
  const double inv_f = 1.0 / static_cast<double>(features);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * features;
    const float* rr = residual ? residual + r * features : nullptr;
    const float* dyr = dy + r * features;
    const auto identity = [](DD, VD v, std::int64_t, size_t) { return v; };
    const double m = RowSumF64(xr, rr, features, identity) * inv_f;
    const VD vm = hn::Set(dd, m);
    const double var = RowSumF64(xr, rr, features, [&](DD, VD v, std::int64_t, size_t) {
      const VD d = hn::Sub(v, vm);
      return hn::Mul(d, d);
    });
    const double s = 1.0 / std::sqrt(var * inv_f + eps);
    mean[r] = m;
    rstd[r] = s;
    if (dz == nullptr) continue;
    const VD vs = hn::Set(dd, s);
    // g = dy gamma; mean_g, mean_gz = the means of g and g zhat (zhat = (z - mean) rstd).
    auto g_at = [&](std::int64_t i, size_t count) {
      return hn::Mul(hn::PromoteTo(dd, LoadFirst(dh, dyr + i, count)),
                     hn::PromoteTo(dd, LoadFirst(dh, gamma + i, count)));
    };
    const double mean_g = RowSumF64(dyr, nullptr, features,
                                    [&](DD, VD, std::int64_t i, size_t c) { return g_at(i, c); }) *
                          inv_f;
    const double mean_gz = RowSumF64(xr, rr, features,
                                     [&](DD, VD v, std::int64_t i, size_t c) {
                                       return hn::Mul(g_at(i, c), hn::Mul(hn::Sub(v, vm), vs));
                                     }) *
                           inv_f;
    const VD vmg = hn::Set(dd, mean_g), vmgz = hn::Set(dd, mean_gz);
    float* dzr = dz + r * features;
    for (std::int64_t i = 0; i < features; i += lanes) {
      const size_t count = static_cast<size_t>(std::min(lanes, features - i));
      const VD zhat = hn::Mul(hn::Sub(LoadZ(xr, rr, i, count), vm), vs);
      const VD d = hn::Mul(vs, hn::NegMulAdd(zhat, vmgz, hn::Sub(g_at(i, count), vmg)));
      StoreFirst(DemoteKeepingInf(dh, d), dh, dzr + i, count);  // (dz may be dy: read above)
    }
  }
}

void LayerNormParamGradsKernel(const float* x, const float* residual, const float* dy,
                               std::int64_t rows, std::int64_t features, const double* mean,
                               const double* rstd, std::int64_t begin, std::int64_t end,
                               float* dgamma, float* dbeta) {
  const DD dd;
  const DFHalf dh;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(dd));
  const auto add_to_params = [&](std::int64_t j, VD g, VD b, size_t count) {
    HWY_ALIGN double gl[HWY_MAX_BYTES / sizeof(double)], bl[HWY_MAX_BYTES / sizeof(double)];
    hn::Store(g, dd, gl);
    hn::Store(b, dd, bl);
    for (size_t c = 0; c < count; ++c) {
      if (dgamma != nullptr) dgamma[j + c] += static_cast<float>(gl[c]);
      if (dbeta != nullptr) dbeta[j + c] += static_cast<float>(bl[c]);
    }
  };
  // kVecs vectors of columns walk the rows together, so each row's lines are read once (one
  // vector at a time read each line twice, the second time from L3 at 2048 rows of 512; 37%
  // of a LayerNorm backward, 2.1 us a row on one thread). Each column still sums its rows in
  // order: the same bits.
  constexpr std::int64_t kVecs = 4;
  std::int64_t j = begin;
  for (; j + kVecs * lanes <= end; j += kVecs * lanes) {
    VD g[kVecs], b[kVecs];
    for (std::int64_t v = 0; v < kVecs; ++v) g[v] = b[v] = hn::Zero(dd);
    for (std::int64_t r = 0; r < rows; ++r) {
      const VD m = hn::Set(dd, mean[r]), s = hn::Set(dd, rstd[r]);
      for (std::int64_t v = 0; v < kVecs; ++v) {
        const std::int64_t at = r * features + j + v * lanes;
        const VD d = hn::PromoteTo(dd, hn::LoadU(dh, dy + at));
        const VD zhat = hn::Mul(hn::Sub(LoadZ(x, residual, at, static_cast<size_t>(lanes)), m), s);
        g[v] = hn::MulAdd(d, zhat, g[v]);
        b[v] = hn::Add(b[v], d);
      }
    }
    for (std::int64_t v = 0; v < kVecs; ++v) {
      add_to_params(j + v * lanes, g[v], b[v], static_cast<size_t>(lanes));
    }
  }
  for (; j < end; j += lanes) {
    const size_t count = static_cast<size_t>(std::min(lanes, end - j));
    VD g = hn::Zero(dd), b = hn::Zero(dd);
    for (std::int64_t r = 0; r < rows; ++r) {  // (rows in order: each column's sum)
      const std::int64_t at = r * features + j;
      const VD d = hn::PromoteTo(dd, LoadFirst(dh, dy + at, count));
      const VD zhat = hn::Mul(hn::Sub(LoadZ(x, residual, at, count), hn::Set(dd, mean[r])),
                              hn::Set(dd, rstd[r]));
      g = hn::MulAdd(d, zhat, g);
      b = hn::Add(b, d);
    }
    add_to_params(j, g, b, count);
  }
}

// AdamW::step's update, element by element (layer_kernels.h); the tail in masked lanes.
void AdamWKernel(const AdamWParams& a, const AdamWStep& s, float* HWY_RESTRICT p,
                 const float* HWY_RESTRICT g, float* HWY_RESTRICT m, float* HWY_RESTRICT v,
                 std::int64_t n) {
  const DF df;
  const VF decay = hn::Set(df, s.decay), beta1 = hn::Set(df, a.beta1), beta2 = hn::Set(df, a.beta2),
           rest1 = hn::Set(df, 1.0f - a.beta1), rest2 = hn::Set(df, 1.0f - a.beta2),
           step_size = hn::Set(df, s.step_size), root_c2 = hn::Set(df, s.root_c2),
           eps = hn::Set(df, a.eps);
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
  for (std::int64_t i = 0; i < n; i += lanes) {
    const auto count = static_cast<size_t>(std::min(lanes, n - i));
    const VF gi = LoadFirst(df, g + i, count);
    const VF mi = hn::MulAdd(rest1, gi, hn::Mul(beta1, LoadFirst(df, m + i, count)));
    const VF vi = hn::MulAdd(hn::Mul(rest2, gi), gi, hn::Mul(beta2, LoadFirst(df, v + i, count)));
    const VF denominator = hn::Add(hn::Div(hn::Sqrt(vi), root_c2), eps);
    const VF pi = hn::Mul(LoadFirst(df, p + i, count), decay);
    StoreFirst(hn::Sub(pi, hn::Div(hn::Mul(step_size, mi), denominator)), df, p + i, count);
    StoreFirst(mi, df, m + i, count);
    StoreFirst(vi, df, v + i, count);
  }
}

void ColumnSumsKernel(const float* x, std::int64_t rows, std::int64_t cols, std::int64_t begin,
                      std::int64_t end, float* sums) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> dh;  // (as many f32 lanes as dd has f64 lanes)
  constexpr std::int64_t kVecs = 4;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(dd));
  std::int64_t j = begin;
  for (; j + kVecs * lanes <= end; j += kVecs * lanes) {
    hn::Vec<decltype(dd)> acc[kVecs];
    for (auto& a : acc) a = hn::Zero(dd);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t v = 0; v < kVecs; ++v) {
        acc[v] = hn::Add(acc[v], hn::PromoteTo(dd, hn::LoadU(dh, x + r * cols + j + v * lanes)));
      }
    }
    HWY_ALIGN double lane[kVecs * HWY_MAX_BYTES / sizeof(double)];
    for (std::int64_t v = 0; v < kVecs; ++v) hn::Store(acc[v], dd, lane + v * lanes);
    for (std::int64_t c = 0; c < kVecs * lanes; ++c) sums[j + c] += static_cast<float>(lane[c]);
  }
  for (; j < end; ++j) {
    double sum = 0.0;
    for (std::int64_t r = 0; r < rows; ++r) sum += x[r * cols + j];
    sums[j] += static_cast<float>(sum);
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace layers
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::layers {

HWY_EXPORT(ActivationKernel);
HWY_EXPORT(ActivationBackwardKernel);
HWY_EXPORT(ActivationToBf16Kernel);
HWY_EXPORT(LayerNormKernel);
HWY_EXPORT(RoundToBf16Kernel);
HWY_EXPORT(ColumnSumsKernel);
HWY_EXPORT(AdamWKernel);
HWY_EXPORT(LayerNormBackwardRowsKernel);
HWY_EXPORT(LayerNormParamGradsKernel);
HWY_EXPORT(TargetName);

void activation_kernel(Activation act, const float* x, float* y, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(ActivationKernel)(act, x, y, n);
}

void activation_backward_kernel(Activation act, const float* x, const float* dy, float* dx,
                                std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(ActivationBackwardKernel)(act, x, dy, dx, n);
}

void activation_to_bf16_kernel(Activation act, const float* x, std::uint16_t* bits,
                               std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(ActivationToBf16Kernel)(act, x, bits, n);
}

void layer_norm_kernel(const float* x, const float* residual, std::int64_t rows,
                       std::int64_t features, const float* gamma, const float* beta, float eps,
                       float* y) {
  HWY_DYNAMIC_DISPATCH(LayerNormKernel)(x, residual, rows, features, gamma, beta, eps, y);
}

void round_to_bf16_kernel(const float* x, std::int64_t n, std::uint16_t* bits) {
  HWY_DYNAMIC_DISPATCH(RoundToBf16Kernel)(x, n, bits, nullptr);
}

void round_to_bf16_kernel(const float* x, std::int64_t n, float* values) {
  HWY_DYNAMIC_DISPATCH(RoundToBf16Kernel)(x, n, nullptr, values);
}

void column_sums_kernel(const float* x, std::int64_t rows, std::int64_t cols, std::int64_t begin,
                        std::int64_t end, float* sums) {
  HWY_DYNAMIC_DISPATCH(ColumnSumsKernel)(x, rows, cols, begin, end, sums);
}

void adamw_kernel(const AdamWParams& a, const AdamWStep& s, float* p, const float* g, float* m,
                  float* v, std::int64_t n) {
  HWY_DYNAMIC_DISPATCH(AdamWKernel)(a, s, p, g, m, v, n);
}

void layer_norm_backward_rows_kernel(const float* x, const float* residual, const float* dy,
                                     std::int64_t rows, std::int64_t features, const float* gamma,
                                     double eps, double* mean, double* rstd, float* dz) {
  HWY_DYNAMIC_DISPATCH(LayerNormBackwardRowsKernel)
  (x, residual, dy, rows, features, gamma, eps, mean, rstd, dz);
}

void layer_norm_param_grads_kernel(const float* x, const float* residual, const float* dy,
                                   std::int64_t rows, std::int64_t features, const double* mean,
                                   const double* rstd, std::int64_t begin, std::int64_t end,
                                   float* dgamma, float* dbeta) {
  HWY_DYNAMIC_DISPATCH(LayerNormParamGradsKernel)
  (x, residual, dy, rows, features, mean, rstd, begin, end, dgamma, dbeta);
}

const char* layer_kernels_target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace qkv::layers
#endif  // HWY_ONCE
