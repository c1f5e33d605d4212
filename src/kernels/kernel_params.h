// AttentionKernelParams: the one struct every attention kernel takes (FlashAttention's
// Flash_fwd_params idea). ops/attention.cc fills it from validated input, so kernels trust it:
// sizes are positive, pointers are non-null where required, broadcast dims have stride 0.
#pragma once

#include <cstdint>

#include "core/float16.h"
#include "qkv/tensor.h"

namespace qkv {

// A resolved sparsity (qkv/sparse.h), ANDed with the other masks. BigBird arrives as kBlock.
// Pointers stay valid for the kernel call (ops/sparse_layout.h owns them).
struct SparseKernelParams {
  enum class Kind : std::uint8_t { kNone, kBand, kBlock } kind = Kind::kNone;
  // kBand (Longformer): query position i' = i + diagonal_offset may attend key j when i' or j
  // is global, or |i' - j| <= band and (i' - j) % dilation == 0.
  std::int64_t band = 0, dilation = 1;
  const std::int64_t* global = nullptr;  // sorted, unique positions
  std::int64_t num_global = 0;
  // kBlock: layout[h * layout_stride[0] + (i / block_q) * layout_stride[1] +
  //                (j / block_k) * layout_stride[2]] != 0   (layout_stride[0] = 0: all heads)
  const std::uint8_t* layout = nullptr;
  std::int64_t layout_stride[3] = {0, 0, 0};
  std::int64_t block_q = 1, block_k = 1, num_q_blocks = 0, num_k_blocks = 0;
};

struct AttentionKernelParams {
  // Sizes.
  std::int64_t batch, seq_q, seq_kv, num_heads_q, num_heads_kv, head_dim, head_dim_v;

  // Operands and their strides in elements, in logical order. q, k and v are stored as `dtype`
  // (f32, bf16 or f16; kernels accumulate in f32); out, lse and probs are f32. dtype f64 runs on
  // the reference kernel only: out, lse and probs are then the f64 ones below (these are null).
  //   q: [B, Lq, Hq, D]   k: [B, Lk, Hkv, D]   v: [B, Lk, Hkv, Dv]   out: [B, Lq, Hq, Dv]
  DType dtype;
  const void* q;
  const void* k;
  const void* v;
  float* out;
  std::int64_t q_stride[4], k_stride[4], v_stride[4], out_stride[4];
  float* lse;  // nullable; [B, Hq, Lq]
  std::int64_t lse_stride[3];
  float* probs;  // nullable; [B, Hq, Lq, Lk]
  std::int64_t probs_stride[4];
  // out in the inputs' dtype (bf16 or f16 bits, out_stride): when set, out is null and every
  // kernel rounds its f32 result to nearest even into it (DESIGN.md: outputs f32 or the input
  // dtype). attention() only; lse and probs stay f32.
  std::uint16_t* out16 = nullptr;
  double* out_f64 = nullptr;  // dtype f64: out, lse (nullable) and probs (nullable), same strides
  double* lse_f64 = nullptr;
  double* probs_f64 = nullptr;

  // Scores.
  float scale;    // > 0
  double scale_f64 = 0.0;  // dtype f64: the scale in f64 (1/sqrt(D) unrounded by default)
  float softcap;  // 0 = off

  // Allowed pairs: j in [i' - window_left, i' + window_right] with i' = i + diagonal_offset,
  // -1 = unbounded. causal is folded in: window_right = min(window_right, 0) when causal.
  std::int64_t diagonal_offset;  // Lk - Lq (bottom-right) or 0 (top-left)
  std::int64_t window_left, window_right;
  const std::int64_t* key_lengths;  // nullable; [B], each in [0, Lk]

  // Broadcast [B, Hq, Lq, Lk] operands; stride 0 on broadcast dims.
  const std::uint8_t* mask;  // nullable; nonzero = may attend
  std::int64_t mask_stride[4];
  const float* bias;  // nullable
  std::int64_t bias_stride[4];

  SparseKernelParams sparse;  // kind kNone: dense

  // Dropout (kernels/dropout_mask.h): on when dropout_p > 0; kept probabilities are scaled by
  // dropout_scale = 1 / (1 - dropout_p).
  float dropout_p;
  std::uint32_t dropout_threshold;
  float dropout_scale;
  std::uint64_t dropout_seed, dropout_offset;

  int num_threads;  // resolved, >= 1
  std::int64_t chunk_size;
};

// Element `offset` (in elements) of an f32/bf16/f16 operand, widened to f32 (exact).
inline float load_element(const void* base, DType dtype, std::int64_t offset) {
  if (dtype == DType::kF32) return static_cast<const float*>(base)[offset];
  return half_bits_to_f32(dtype, static_cast<const std::uint16_t*>(base)[offset]);
}

// The same for any of them and f64, as f64 (exact): the reference kernels read through it.
inline double load_element_f64(const void* base, DType dtype, std::int64_t offset) {
  if (dtype == DType::kF64) return static_cast<const double*>(base)[offset];
  return load_element(base, dtype, offset);
}

// `base` advanced by `offset` elements of `dtype`.
inline const void* element_at(const void* base, DType dtype, std::int64_t offset) {
  return static_cast<const char*>(base) + offset * dtype_size(dtype);
}

}  // namespace qkv
