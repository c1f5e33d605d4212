// Vectorised element-wise and row kernels behind the layers (Highway, runtime dispatch;
// implemented in layer_kernels.cc). Single-threaded: callers split work with parallel_for.
// Inputs are assumed valid (the public layer classes validate).
#pragma once

#include <cstdint>

#include "qkv/layers/activation.h"
#include "qkv/layers/adamw.h"

namespace qkv::layers {

// y = act(x), x and y: [n] (y may be x).
void activation_kernel(Activation act, const float* x, float* y, std::int64_t n);

// dx = dy * act'(x) element by element (x, dy, dx: [n]; dx may alias dy): GELU's derivatives
// in f32 lanes (erf by GeluErf's fit; within ~1e-6 of the float64 formulas), ReLU's 1 past 0
// and 0 elsewhere (0 at the kink, as torch).
void activation_backward_kernel(Activation act, const float* x, const float* dy, float* dx,
                                std::int64_t n);

// bits = bf16(act(x)) (nearest even), act evaluated in f32 lanes (GELU within ~1e-6 relative
// of the float64 formula: enough for a value rounded to bf16 next; mixed-precision training's
// hidden activations). x: [n], bits: [n].
void activation_to_bf16_kernel(Activation act, const float* x, std::uint16_t* bits, std::int64_t n);

// For each of `rows` rows: v = x + residual (residual nullable), y = (v - mean) / sqrt(var +
// eps) * gamma + beta. x, residual, y: [rows, features] contiguous; y may alias x or residual.
void layer_norm_kernel(const float* x, const float* residual, std::int64_t rows,
                       std::int64_t features, const float* gamma, const float* beta, float eps,
                       float* y);

// x rounded to bf16 (nearest even; NaN stays NaN, quiet), element for element as
// f32_to_bf16_bits / round_to_bf16 (core/float16.h): as bf16 bits, or as the f32 values of
// those bits. x: [n]; bits / values: [n], not aliasing x.
void round_to_bf16_kernel(const float* x, std::int64_t n, std::uint16_t* bits);
void round_to_bf16_kernel(const float* x, std::int64_t n, float* values);

// sums[j] += the sum of x[r][j] over rows r = 0, 1, ..., rows - 1 in that order, in f64, rounded
// once to f32, for columns j in [begin, end). x: [rows, cols] contiguous.
void column_sums_kernel(const float* x, std::int64_t rows, std::int64_t cols, std::int64_t begin,
                        std::int64_t end, float* sums);

// AdamW::step's update of n elements (p, g, m, v: [n], apart), with the step's constants from
// its bias corrections: p = p decay - step_size m' / (sqrt(v') / root_c2 + eps), m' = beta1 m +
// (1 - beta1) g, v' = beta2 v + (1 - beta2) g g (f32 lanes; multiply-adds fused where the target
// has them, so within a few ulp of the formula in plain f32).
struct AdamWStep {
  float decay;      // 1 - lr weight_decay
  float step_size;  // lr / (1 - beta1^t)
  float root_c2;    // sqrt(1 - beta2^t)
};
void adamw_kernel(const AdamWParams& a, const AdamWStep& s, float* p, const float* g, float* m,
                  float* v, std::int64_t n);

// LayerNorm's backward (z = x + residual per row of `features`; residual nullable), in f64
// lanes. Rows kernel: mean[r] and rstd[r] = 1 / sqrt(var + eps) of each row (two passes), and
// unless dz is null dz = rstd (g - mean(g) - zhat mean(g zhat)), g = dy gamma, zhat = (z - mean)
// rstd (dz may be dy). Param-grads kernel: for columns j in [begin, end), dgamma[j] += the sum
// over rows, in row order, of dy zhat and dbeta[j] += that of dy (nullable each).
void layer_norm_backward_rows_kernel(const float* x, const float* residual, const float* dy,
                                     std::int64_t rows, std::int64_t features, const float* gamma,
                                     double eps, double* mean, double* rstd, float* dz);
void layer_norm_param_grads_kernel(const float* x, const float* residual, const float* dy,
                                   std::int64_t rows, std::int64_t features, const double* mean,
                                   const double* rstd, std::int64_t begin, std::int64_t end,
                                   float* dgamma, float* dbeta);

// Name of the Highway target the kernels dispatch to on this CPU ("AVX3", "AVX2", ...).
const char* layer_kernels_target_name();

}  // namespace qkv::layers
