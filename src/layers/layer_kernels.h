// Vectorised element-wise and row kernels behind the layers (Highway, runtime dispatch;
// implemented in layer_kernels.cc). Single-threaded: callers split work with parallel_for.
// Inputs are assumed valid (the public layer classes validate).
#pragma once

#include <cstdint>

#include "qkv/layers/activation.h"

namespace qkv::layers {

// x: [n] in place.
void activation_kernel(Activation act, float* x, std::int64_t n);

// For each of `rows` rows: v = x + residual (residual nullable), y = (v - mean) / sqrt(var +
// eps) * gamma + beta. x, residual, y: [rows, features] contiguous; y may alias x or residual.
void layer_norm_kernel(const float* x, const float* residual, std::int64_t rows,
                       std::int64_t features, const float* gamma, const float* beta, float eps,
                       float* y);

// Name of the Highway target the kernels dispatch to on this CPU ("AVX3", "AVX2", ...).
const char* layer_kernels_target_name();

}  // namespace qkv::layers
