// Entry points of the attention kernels. Each computes DESIGN.md section 3 exactly (up to f32
// rounding) for a validated AttentionKernelParams; none of them throws on valid input except
// std::bad_alloc.
#pragma once

#include "kernels/backward_kernel_params.h"
#include "kernels/kernel_params.h"
#include "kernels/linear_kernel_params.h"

namespace qkv {

// kernels/reference/: scalar oracle, f64 accumulation; materialises each (b, h) score matrix.
void attention_reference(const AttentionKernelParams& params);

// kernels/reference/: the backward oracle, f64, row by row (qkv/attention_backward.h).
void attention_backward_reference(const AttentionBackwardKernelParams& params);

// kernels/cpu/: Highway SIMD with runtime dispatch.
void attention_chunked_cpu(const AttentionKernelParams& params);  // may write probs
void attention_flash_cpu(const AttentionKernelParams& params);    // never writes probs
// The flash backward (kernels/cpu/flash_backward.cc): no dbias.
void attention_backward_flash_cpu(const AttentionBackwardKernelParams& params);

// The Highway target the CPU kernels dispatch to now, e.g. "AVX3", "AVX2", "SCALAR".
const char* attention_cpu_target_name();

// Linear attention (docs/linear-attention.md): the f64 quadratic-form oracle and the chunk-wise
// prefix-sum Highway kernel (kernels/cpu/linear_attention.cc) with its dispatch target.
void linear_attention_reference(const LinearKernelParams& params);
void linear_attention_cpu(const LinearKernelParams& params);
const char* linear_attention_cpu_target_name();

}  // namespace qkv
