// Array entry points of qkv's vectorised exp (kernels/cpu/fast_exp-inl.h), for its tests and
// its speed comparison with Highway's hwy::Exp. Kernels call fastexp::ExpNonPositive and
// fastexp::Pow2 directly.
#pragma once

#include <cstdint>

namespace qkv {

// The constants of fast_exp-inl.h (its comments say what each does), here so that code outside
// Highway (the AMX softmax, amx_tiles.cc) computes the same bits.
namespace fastexp {
// Below this the result would be under FLT_MIN (ln(FLT_MIN) = -87.33654): +0 is returned, never
// a denormal. The cut sits 4.5e-5 above ln(FLT_MIN) so that n >= -126 comes with r > 0, p > 1
// and the exponent field stays >= 1 whatever the polynomial's rounding.
constexpr float kMinArg = -87.3365f;
constexpr float kLog2e = 0x1.715476p+0f;   // log2(e) rounded to float
constexpr float kRoundMagic = 0x1.8p+23f;  // 1.5 * 2^23
constexpr float kLn2Hi = 0x1.62e4p-1f;     // ln2 with the low 8 mantissa bits cleared
constexpr float kLn2Lo = 0x1.7f7d1cp-20f;  // float(ln2 - kLn2Hi)
// p(r) = 1 + (r + r^2 * (kC2 + r * (kC3 + ...))): scripts/fit_exp_poly.py --degree 5 --pinned 2
constexpr float kC2 = 0x1.fffdfcp-2f;  // 0.499992311
constexpr float kC3 = 0x1.5557aep-3f;  // 0.166671142
constexpr float kC4 = 0x1.5729f4p-5f;  // 0.041890122
constexpr float kC5 = 0x1.106286p-7f;  // 0.00831252616

constexpr float kMinPow2Arg = -126.0f;  // n >= -126 comes with r >= 0, p >= 1: a normal result
// scripts/fit_exp_poly.py --base2 --degree 5
constexpr float kP1 = 0x1.62e42ap-1f;    // 0.693147004
constexpr float kP2 = 0x1.ebf9bcp-3f;    // 0.240222424
constexpr float kP3 = 0x1.c6b752p-5f;    // 0.0555073358
constexpr float kP4 = 0x1.3cea8cp-7f;    // 0.00967151485
constexpr float kP5 = 0x1.5bba14p-10f;   // 0.00132647273
// Pow2CoarseHalf: 2^(xh - 1/2) = 2^floor(xh) * q(xh - floor(xh)), q(t) = p(t - 1/2) for the
// degree-4 base-2 minimax p (scripts/fit_exp_poly.py --base2 --degree 4; the constants below
// from --base2 --half --degree 4, kHalfP0 moved so that q(1/2) = 1 exactly in float32). Its
// argument is xh = x + kHalfShift: the bf16 softmaxes subtract the shift from their max. Below
// kMinPow2HalfArg (x below kMinPow2Arg): +0; at or above it, floor(xh) = -126 comes with
// t >= 1/2, q >= 1: a normal result.
constexpr float kHalfShift = 0.5f;
constexpr float kMinPow2HalfArg = kMinPow2Arg + kHalfShift;
constexpr float kHalfP0 = 0x1.6a0a2ap-1f;  // 0.707108796
constexpr float kHalfP1 = 0x1.f5c83ap-2f;  // 0.490021616
constexpr float kHalfP2 = 0x1.5db51ep-3f;  // 0.17075561
constexpr float kHalfP3 = 0x1.2cfae8p-5f;  // 0.0367407352
constexpr float kHalfP4 = 0x1.3a02ccp-7f;  // 0.00958285294
}  // namespace fastexp

// y[i] = exp(x[i]) for x[i] <= 0 (-inf gives +0; x < -87.3365 gives +0, never a denormal).
//   x: [n]   y: [n]   (y may alias x; any alignment; n >= 0)
void exp_nonpositive_cpu(const float* x, float* y, std::int64_t n);

// y[i] = 2^x[i] for x[i] <= 16 (fastexp::Pow2, the online softmax's; -inf and x < -126 give +0,
// never a denormal), and the same with its degree-4 polynomial (fastexp::Pow2Coarse: 2.9e-6,
// for probabilities rounded to bf16 afterwards, as Pow2CoarseHalf(x + 1/2)).
//   x: [n]   y: [n]   (y may alias x; any alignment; n >= 0)
void pow2_cpu(const float* x, float* y, std::int64_t n);
void pow2_coarse_cpu(const float* x, float* y, std::int64_t n);
// y[i] = 2^(xh[i] - 1/2) for xh[i] <= 16.5 (fastexp::Pow2CoarseHalf, what the bf16 paths' softmax
// calls on xh = s * c - (m2 - 1/2); +0 below -125.5).
//   xh: [n]   y: [n]   (y may alias xh; any alignment; n >= 0)
void pow2_coarse_half_cpu(const float* xh, float* y, std::int64_t n);

// The same through hwy::Exp (hwy/contrib/math), the exp this replaces.
//   x: [n]   y: [n]
void exp_hwy_cpu(const float* x, float* y, std::int64_t n);

// The Highway target the two dispatch to now, e.g. "AVX3", "AVX2", "SCALAR".
const char* fast_exp_cpu_target_name();

}  // namespace qkv
