// LinearKernelParams: the one struct the linear-attention kernels take. ops/linear_attention.cc
// fills it from validated input, so kernels trust it: sizes are positive, pointers are non-null
// where required, key_lengths are in [0, Lk].
#pragma once

#include <cstdint>

namespace qkv {

struct LinearKernelParams {
  // Sizes. num_features is M: nb_features for FAVOR+, head_dim for elu+1.
  std::int64_t batch, seq_q, seq_kv, num_heads_q, num_heads_kv, head_dim, head_dim_v;
  std::int64_t num_features;

  // Operands (f32) and their strides in elements, in logical order.
  //   q: [B, Lq, Hq, D]   k: [B, Lk, Hkv, D]   v: [B, Lk, Hkv, Dv]   out: [B, Lq, Hq, Dv]
  const float* q;
  const float* k;
  const float* v;
  float* out;
  std::int64_t q_stride[4], k_stride[4], v_stride[4], out_stride[4];

  // Feature map: favor = false is elu(x) + 1 (projection unused); favor = true is FAVOR+ with
  // projection [M][D] row-major and x' = x * feature_scale (feature_scale = sqrt(scale)).
  bool favor;
  const float* projection;
  float feature_scale;

  // Allowed keys of query row i in batch b: j < key_lengths[b], and when causal also
  // j <= i + diagonal_offset (Lk - Lq bottom-right, 0 top-left).
  bool causal;
  std::int64_t diagonal_offset;
  const std::int64_t* key_lengths;  // nullable; [B]

  int num_threads;          // resolved, >= 1
  std::int64_t chunk_size;  // >= 1: query rows (and key rows) per chunk
};

}  // namespace qkv
