// qkv::attention_backward: the gradients of qkv::attention (qkv/attention.h) with respect to
// q, k, v and the bias, for every mask and option the forward takes.
//
//   q, k, v, params:  as given to the forward
//   out, lse:         the forward's outputs for them (f32; [B, Lq, Hq, Dv] and [B, Hq, Lq, 1])
//   dout:             dL/d(out), f32, [B, Lq, Hq, Dv]
//   dq: [B, Lq, Hq, D]  dk: [B, Lk, Hkv, D]  dv: [B, Lk, Hkv, Dv]   f32, written (not added to)
//   dbias:            optional, f32, the shape of params.bias: dL/d(bias) summed over the
//                     dimensions the bias broadcasts over
//
// With P the forward's probabilities and s its scores (qkv/attention.h):
//   dv_j = sum_i P_ij dout_i        dP_ij = dout_i . v_j        D_i = dout_i . out_i
//   dS_ij = P_ij (dP_ij - D_i)      dbias_ij = dS_ij
//   dU_ij = dS_ij (1 - (s_ij / softcap)^2) with softcap, else dS_ij   (before the bias)
//   dq_i = scale sum_j dU_ij k_j    dk_j = scale sum_i dU_ij q_i
// summed over the query heads that share a kv head (GQA / MQA). Pairs the masks leave out and
// rows with no allowed key get zero gradients, never NaN; keys at or past key_lengths[b] are
// never read and get dk = dv = 0. Deterministic: the same bits on any thread count.
//
// Kernels (params.kernel): kFlash, FlashAttention-2's scheme on tiles (probabilities
// recomputed from lse, O(tile) scratch per thread; dbias in a pass of its own over the bias's
// cells); kReference, the f64 oracle, row by row (O(Lk (D + Dv)) scratch per thread, scalar
// speed); kAuto: flash. kChunked is refused. docs/training.md.
#pragma once

#include "qkv/attention.h"
#include "qkv/block_attention.h"
#include "qkv/tensor.h"

namespace qkv {

struct AttentionGrads {
  TensorView dq = {};     // required
  TensorView dk = {};     // required
  TensorView dv = {};     // required
  TensorView dbias = {};  // optional; needs params.bias
};

// Validates everything (the forward's checks on q, k, v, out, lse and params, then dout and
// every gradient's shape, dtype and strides; no gradient may overlap an input or another
// gradient, though dq, dk and dv may be column ranges of one [dq | dk | dv] row buffer:
// docs/limits.md) and throws qkv::Error naming the argument and shapes; the gradients are
// written only after validation passed.
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const TensorView& dout,
                        const AttentionGrads& grads, const AttentionParams& params);

// The instructions the backward kernel's products run on for inputs of `dtype` on this CPU:
// "f32-fma"; "bf16-amx" (AMX tiles, where the CPU has AMX-BF16; dout, the probabilities and ds
// are rounded to bf16 for the tile products, f32 accumulation; docs/training.md), else
// "bf16-widened-fma"; "f16-widened-fma" (converted to f32 exactly); or "reference-f64".
const char* backward_product_path(const AttentionParams& params, DType dtype);

// attention_backward of a block (qkv/block_attention.h): q and k at `positions` in longer
// sequences, params what attention_block takes. out, lse and dout are the block's query rows of
// the WHOLE attention's (lse over every key of the whole sequence, not only this block's), so
// dq, dk and dv are this block pair's share of the whole's gradients: the whole's dq is the sum
// over key blocks, its dk and dv the sums over query blocks (ring attention's backward,
// qkv/ring_attention.h). The flash kernel only (kernel auto or flash: the reference recomputes
// the softmax over the block alone). Validates and throws like attention_backward.
void attention_block_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const TensorView& lse,
                              const TensorView& dout, const AttentionGrads& grads,
                              const AttentionParams& params, const BlockPositions& positions);

}  // namespace qkv
