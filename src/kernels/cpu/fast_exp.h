// Array entry points of qkv's vectorised exp (kernels/cpu/fast_exp-inl.h), for its tests and
// its speed comparison with Highway's hwy::Exp. Kernels call fastexp::ExpNonPositive and
// fastexp::Pow2 directly.
#pragma once

#include <cstdint>

namespace qkv {

// y[i] = exp(x[i]) for x[i] <= 0 (-inf gives +0; x < -87.3365 gives +0, never a denormal).
//   x: [n]   y: [n]   (y may alias x; any alignment; n >= 0)
void exp_nonpositive_cpu(const float* x, float* y, std::int64_t n);

// y[i] = 2^x[i] for x[i] <= 16 (fastexp::Pow2, the online softmax's; -inf and x < -126 give +0,
// never a denormal), and the same with its degree-4 polynomial (fastexp::Pow2Coarse: 2.9e-6,
// for probabilities rounded to bf16 afterwards).
//   x: [n]   y: [n]   (y may alias x; any alignment; n >= 0)
void pow2_cpu(const float* x, float* y, std::int64_t n);
void pow2_coarse_cpu(const float* x, float* y, std::int64_t n);

// The same through hwy::Exp (hwy/contrib/math), the exp this replaces.
//   x: [n]   y: [n]
void exp_hwy_cpu(const float* x, float* y, std::int64_t n);

// The Highway target the two dispatch to now, e.g. "AVX3", "AVX2", "SCALAR".
const char* fast_exp_cpu_target_name();

}  // namespace qkv
