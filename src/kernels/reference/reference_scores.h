// What the reference kernels (forward and backward) share: whether a pair is allowed, checked
// pair by pair with no range arithmetic, and one score in f64. Nothing here is shared with the
// fast kernels (the sparsity predicate is the shared definition in kernels/sparse_pair.h,
// which the tests check on its own).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/kernel_params.h"
#include "kernels/sparse_pair.h"

namespace qkv::reference {

inline bool pair_allowed(const AttentionKernelParams& p, std::int64_t b, std::int64_t h,
                         std::int64_t i, std::int64_t j) {
  const std::int64_t diag = i + p.diagonal_offset;
  if (p.window_left >= 0 && j < diag - p.window_left) return false;
  if (p.window_right >= 0 && j > diag + p.window_right) return false;
  if (p.key_lengths != nullptr && j >= p.key_lengths[b]) return false;
  if (!sparse_pair_allowed(p.sparse, p.diagonal_offset, h, i, j)) return false;
  if (p.mask != nullptr) {
    const std::int64_t at =
        b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2] + j * p.mask_stride[3];
    if (p.mask[at] == 0) return false;
  }
  return true;
}

// The score scale in f64: the unrounded one for f64 inputs, else the kernels' f32 scale.
inline double scale(const AttentionKernelParams& p) {
  return p.dtype == DType::kF64 ? p.scale_f64 : static_cast<double>(p.scale);
}

// The score of an allowed pair, s = softcap(scale q_i . k_j) + bias, in f64; `capped` gets
// tanh(u / softcap) (the softcap's derivative is 1 - capped^2), 0 without softcap.
inline double score(const AttentionKernelParams& p, std::int64_t b, std::int64_t h,
                    std::int64_t i, std::int64_t j, double* capped) {
  const std::int64_t kv_head = h / (p.num_heads_q / p.num_heads_kv);
  const std::int64_t q_row = b * p.q_stride[0] + i * p.q_stride[1] + h * p.q_stride[2];
  const std::int64_t k_row = b * p.k_stride[0] + j * p.k_stride[1] + kv_head * p.k_stride[2];
  double dot = 0.0;
  for (std::int64_t d = 0; d < p.head_dim; ++d) {
    dot += load_element_f64(p.q, p.dtype, q_row + d * p.q_stride[3]) *
           load_element_f64(p.k, p.dtype, k_row + d * p.k_stride[3]);
  }
  double s = dot * scale(p);
  *capped = 0.0;
  if (p.softcap > 0.0f) {
    *capped = std::tanh(s / p.softcap);
    s = p.softcap * *capped;
  }
  if (p.bias != nullptr) {
    s += p.bias[b * p.bias_stride[0] + h * p.bias_stride[1] + i * p.bias_stride[2] +
                j * p.bias_stride[3]];
  }
  return s;
}

}  // namespace qkv::reference
