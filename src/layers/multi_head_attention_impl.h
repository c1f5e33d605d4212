// MultiHeadAttention's state, shared by its inference (multi_head_attention.cc) and training
// (multi_head_attention_train.cc) halves.
#pragma once

#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/view_copy.h"
#include "layers/scratch.h"
#include "qkv/error.h"
#include "qkv/layers/linear.h"
#include "qkv/layers/multi_head_attention.h"

namespace qkv {
namespace layers {

// A projection's output rows [B * L, row_stride], stored as dtype (f32, or bf16 bits where the
// projections hand the core bf16), and BSHD views of its column ranges.
struct ProjectedRows {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  std::int64_t batch = 0, seq = 0, row_stride = 0;

  // Columns [col, col + heads * head_dim) viewed [B, L, heads, head_dim].
  TensorView heads(std::int64_t col, std::int64_t heads, std::int64_t head_dim) const {
    TensorView view;
    view.data = const_cast<char*>(static_cast<const char*>(data) + col * dtype_size(dtype));
    view.dtype = dtype;
    view.sizes = {batch, seq, heads, head_dim};
    view.strides = {seq * row_stride, row_stride, head_dim, 1};
    return view;
  }
};

// A contiguous copy of the f32 view `src` in `dtype` (bf16 or f16; nearest, ties to even), in
// `buffer`: the q of a cached step whose cache holds that dtype.
inline TensorView half_copy(const TensorView& src, DType dtype, AlignedBuffer& buffer) {
  const std::int64_t count = src.sizes[0] * src.sizes[1] * src.sizes[2] * src.sizes[3];
  void* dst = scratch_halves(buffer, count);
  const TensorView copy = TensorView::contiguous(dst, dtype, src.sizes);
  copy_view(src, dtype, dst, copy.strides);
  return copy;
}

// The attention core's params for `options` (its masks, bias, threads and dropout), with
// `key_lengths` (the options' own, or a tape's copy).
inline AttentionParams core_params(const MhaOptions& options,
                                   std::span<const std::int64_t> key_lengths) {
  return {.causal = options.causal,
          .align = options.align,
          .window_left = options.window_left,
          .window_right = options.window_right,
          .key_lengths = key_lengths,
          .mask = options.mask,
          .bias = options.bias,
          .num_threads = options.num_threads,
          .dropout_p = options.dropout_p,
          .seed = options.dropout_seed,
          .offset = options.dropout_offset};
}

}  // namespace layers

struct MultiHeadAttention::Impl {
  std::int64_t embed_dim = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, kdim = 0, vdim = 0;
  std::int64_t kv_width = 0;  // Hkv * head_dim
  DType matmul_dtype = DType::kF32;  // of every projection

  QkvPacking packing = QkvPacking::kSeparate;  // of the weights given (parameters() keeps it)
  // Canonical weights (torch [out, in] layout); biases are empty or full.
  std::vector<float> q_w, q_b, k_w, k_b, v_w, v_b, out_w, out_b;
  std::optional<Linear> qkv_proj;                // self-attention: [E + 2 kv_width, E]
  std::optional<Linear> q_proj, k_proj, v_proj;  // cross-attention, built on first use
  std::optional<Linear> out_proj;                // [E, E]

  // Scratch (grow-only, a set per concurrent call): projections, attention output,
  // averaged-weights staging.
  std::shared_ptr<layers::ScratchPool> scratch = layers::make_scratch_pool();
  std::once_flag cross_built;  // the cross projections are built by the first forward_cross

  // Validates `weights` for this layer's dimensions and fills the canonical weights.
  void canonicalize(const MultiHeadAttentionWeights& weights);
  // The row of qkv_weight that holds canonical row r of part `part` (0 = q, 1 = k, 2 = v) in
  // the fused packings.
  // Part (0 = q, 1 = k, 2 = v) of canonical row c of [Wq; Wk; Wv], and c's row within it.
  std::pair<int, std::int64_t> canonical_part(std::int64_t c) const {
    if (c < embed_dim) return {0, c};
    if (c < embed_dim + kv_width) return {1, c - embed_dim};
    return {2, c - embed_dim - kv_width};
  }
  std::int64_t packed_row(int part, std::int64_t r) const {
    if (packing == QkvPacking::kFusedPerHead) return (r / head_dim) * 3 * head_dim + part * head_dim + r % head_dim;
    return part == 0 ? r : embed_dim + (part - 1) * kv_width + r;  // [Wq; Wk; Wv]
  }
  // Self-attention's one projection [E + 2 kv_width, E] and its bias ([Wq; Wk; Wv]; a missing
  // bias part is zeros; no bias when none has one).
  std::pair<std::vector<float>, std::vector<float>> fused_qkv() const;

  void ensure_cross() {
    std::call_once(cross_built, [this] { build_cross(); });
  }
  void build_cross() {
    q_proj.emplace(LinearParams{.weight = q_w,
                                .bias = q_b,
                                .in_features = embed_dim,
                                .out_features = embed_dim,
                                .dtype = matmul_dtype});
    k_proj.emplace(LinearParams{.weight = k_w,
                                .bias = k_b,
                                .in_features = kdim,
                                .out_features = kv_width,
                                .dtype = matmul_dtype});
    v_proj.emplace(LinearParams{.weight = v_w,
                                .bias = v_b,
                                .in_features = vdim,
                                .out_features = kv_width,
                                .dtype = matmul_dtype});
  }

  // Runs the core on q [B, Lq, H, hd], k/v [B, Lk, Hkv, hd] into ctx [B, Lq, E], then the
  // output projection into out [B, Lq, E].
  void attend_and_project(const TensorView& q, const TensorView& k, const TensorView& v,
                          std::int64_t batch, std::int64_t seq_q, std::int64_t seq_kv, float* out,
                          const MhaOptions& options) {
    const layers::ScratchPool::Lease scratch(*this->scratch);
    const AttentionParams params = layers::core_params(options, options.key_lengths);

    // A bf16 core hands the output projection bf16 (the kernel's rounding of its f32 result,
    // the bits a bf16 Linear would round it to itself).
    const bool half_ctx = q.dtype == DType::kBF16 && matmul_dtype == DType::kBF16;
    const std::int64_t rows = batch * seq_q;
    void* ctx = half_ctx
                    ? static_cast<void*>(layers::scratch_halves(scratch->ctx, rows * embed_dim))
                    : static_cast<void*>(layers::scratch_floats(scratch->ctx, rows * embed_dim));
    AttentionOutputs outputs;
    outputs.out = TensorView::contiguous(ctx, half_ctx ? DType::kBF16 : DType::kF32,
                                         {batch, seq_q, num_heads, head_dim});
    const std::array<std::int64_t, 4> probs_shape = {batch, num_heads, seq_q, seq_kv};
    if (options.attn_weights != nullptr) {
      // Per head: written straight into the caller's array. Averaged: staged, then reduced.
      float* probs = options.average_weights
                         ? layers::scratch_floats(scratch->probs, batch * num_heads * seq_q * seq_kv)
                         : options.attn_weights;
      outputs.probs = TensorView::contiguous(probs, DType::kF32, probs_shape);
    }
    attention(q, k, v, outputs, params);
    if (options.attn_weights != nullptr && options.average_weights) {
      // attn_weights[b, i, j] = mean over heads of probs[b, h, i, j]; heads summed in order.
      const float* probs = scratch->probs.as<float>();
      const std::int64_t plane = seq_q * seq_kv;
      const float inv_heads = 1.0f / static_cast<float>(num_heads);
      for (std::int64_t b = 0; b < batch; ++b) {
        float* dst = options.attn_weights + b * plane;
        std::fill(dst, dst + plane, 0.0f);
        for (std::int64_t h = 0; h < num_heads; ++h) {
          const float* src = probs + (b * num_heads + h) * plane;
          for (std::int64_t i = 0; i < plane; ++i) dst[i] += src[i];
        }
        for (std::int64_t i = 0; i < plane; ++i) dst[i] *= inv_heads;
      }
    }
    if (half_ctx) {
      out_proj->forward_from_bf16(static_cast<const std::uint16_t*>(ctx), rows, out);
    } else {
      out_proj->forward(static_cast<const float*>(ctx), rows, out);
    }
  }

  // The dtype the projections hand the attention core q, k and v in: bf16 where they run in
  // bf16 (the core's products then run in bf16 too: AMX tiles or vdpbf16ps where the CPU has
  // them; softmax and accumulation f32), else f32.
  DType core_dtype() const { return matmul_dtype == DType::kBF16 ? DType::kBF16 : DType::kF32; }

  // proj(x) for B * L rows into `buffer`, stored as dtype (kF32, or kBF16 for a bf16 Linear:
  // the f32 result rounded to nearest even).
  static layers::ProjectedRows project(const Linear& proj, const float* x, std::int64_t batch,
                                       std::int64_t seq, AlignedBuffer& buffer, DType dtype) {
    const std::int64_t rows = batch * seq, width = proj.out_features();
    layers::ProjectedRows out{.dtype = dtype, .batch = batch, .seq = seq, .row_stride = width};
    if (dtype == DType::kBF16) {
      std::uint16_t* bits = layers::scratch_halves(buffer, rows * width);
      proj.forward_to_bf16(x, rows, bits);
      out.data = bits;
    } else {
      float* values = layers::scratch_floats(buffer, rows * width);
      proj.forward(x, rows, values);
      out.data = values;
    }
    return out;
  }

  void check_call(const char* where, const void* a, const void* b, std::int64_t batch,
                  std::int64_t seq) const {
    if (batch < 0 || seq < 0) {
      throw Error(std::string("MultiHeadAttention::") + where + ": batch = " + std::to_string(batch) +
                  " and seq = " + std::to_string(seq) + " must be >= 0");
    }
    if (batch * seq > 0 && (a == nullptr || b == nullptr)) {
      throw Error(std::string("MultiHeadAttention::") + where + ": null input or output");
    }
  }

  void check_self(const char* where) const {
    if (!qkv_proj) {
      throw Error(std::string("MultiHeadAttention::") + where +
                  ": self-attention needs kdim == vdim == embed_dim, got kdim = " + std::to_string(kdim) +
                  ", vdim = " + std::to_string(vdim) + ", embed_dim = " + std::to_string(embed_dim));
    }
  }
};

}  // namespace qkv
