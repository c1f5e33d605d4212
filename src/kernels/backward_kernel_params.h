// AttentionBackwardKernelParams: what every attention backward kernel takes: the forward's
// params (its out and lse are read, never written) and the gradients. ops/attention_backward.cc
// fills it from validated input.
#pragma once

#include <cstdint>

#include "kernels/kernel_params.h"

namespace qkv {

struct AttentionBackwardKernelParams {
  AttentionKernelParams forward;  // q, k, v, masks, scale, softcap; out and lse as inputs

  const float* dout;  // [B, Lq, Hq, Dv]
  std::int64_t dout_stride[4];
  float* dq;  // [B, Lq, Hq, D]
  float* dk;  // [B, Lk, Hkv, D]
  float* dv;  // [B, Lk, Hkv, Dv]
  std::int64_t dq_stride[4], dk_stride[4], dv_stride[4];
  // forward.dtype f64 (the reference kernel only): dout, dq, dk and dv are these instead (the
  // float ones are null), same strides. dbias stays f32, as the bias.
  const double* dout_f64 = nullptr;
  double* dq_f64 = nullptr;
  double* dk_f64 = nullptr;
  double* dv_f64 = nullptr;
  // Nullable. The bias's shape: dbias_sizes[d] is 1 where the bias broadcasts (stride 0 in
  // dbias_stride, seen as [B, Hq, Lq, Lk]) or the full size.
  float* dbias;
  std::int64_t dbias_sizes[4], dbias_stride[4];
};

}  // namespace qkv
