// MultiHeadAttention: projections (oneDNN Linear), qkv::attention for the core, output
// projection. Self-attention, cross-attention and incremental (KV-cached) decoding.
//
//   E = embed_dim, H = num_heads, Hkv = num_kv_heads, head_dim = E / H
//   self:   x: [B, L, E]                                   -> out: [B, L, E]
//   cross:  query: [B, Lq, E], memory: [B, Lk, kdim/vdim]  -> out: [B, Lq, E]
//   cached: x: [B, Lnew, E] + KvCache [B, Lcached, Hkv, head_dim] -> out: [B, Lnew, E]
//
// One object may be shared by threads: its scratch (sized for the largest call seen) is a set
// per concurrent call, and its oneDNN primitive caches are guarded (qkv/layers/linear.h). A
// KvCache belongs to the caller, one per sequence. See docs/layers.md.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "qkv/attention.h"
#include "qkv/layers/kv_cache.h"
#include "qkv/tensor.h"

namespace qkv {

enum class QkvPacking : std::uint8_t {
  kSeparate,      // q/k/v weights separate (BERT checkpoints; the seed's QKVProjection)
  kFusedBlocks,   // one [3E, E] weight: rows [Wq; Wk; Wv] (torch.nn.MultiheadAttention's
                  // in_proj_weight). With GQA: [E + 2 * Hkv * head_dim, E].
  kFusedPerHead,  // one [3E, E] weight whose output reshapes to (B, L, H, 3 * head_dim) and
                  // splits per head into q|k|v (the seed article's layout); needs Hkv == H
};

struct MultiHeadAttentionConfig {
  std::int64_t embed_dim = 0;
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;  // 0 = num_heads (GQA when smaller; must divide num_heads)
  std::int64_t kdim = 0;          // 0 = embed_dim: feature size of the key memory
  std::int64_t vdim = 0;          // 0 = embed_dim: feature size of the value memory
  // The layer's matrix products: kF32, or kBF16 (inference and mixed-precision training). With
  // kBF16 the projections run in bf16 (LinearParams::dtype) and hand the attention core q, k
  // and v as bf16 (their f32 results rounded to nearest even), so its two products run in bf16
  // too (AMX tiles or vdpbf16ps where the CPU has them); its softmax and accumulation stay f32,
  // and its output goes to the output projection as bf16 (the rounding that projection applies
  // to its input anyway). forward_cached keeps an f32 or f16 cache's f32 path. Training with
  // kBF16: forward_train computes what forward() does, and backward runs every product in bf16
  // too (Linear::backward; attention_backward on the bf16 q, k, v), gradients f32.
  DType matmul_dtype = DType::kF32;
};

// Spans are copied at construction. (Every member has a default initializer so designated
// initialisers compile without GCC 12's -Wmissing-field-initializers.) Weights use torch's [out,
// in] layout. Biases may be empty.
//   q_weight: [E, E]   k_weight: [Hkv * head_dim, kdim]   v_weight: [Hkv * head_dim, vdim]
//   qkv_weight: [E + 2 * Hkv * head_dim, E] (fused packings; needs kdim == vdim == E)
struct MultiHeadAttentionWeights {
  QkvPacking packing = QkvPacking::kSeparate;
  std::span<const float> qkv_weight = {}, qkv_bias = {};  // fused packings only
  std::span<const float> q_weight = {}, q_bias = {}, k_weight = {}, k_bias = {}, v_weight = {},
                         v_bias = {};           // kSeparate
  std::span<const float> out_weight, out_bias;  // [E, E], [E]
};

// Per-call options: the masks of the core (see qkv/attention.h; mask TRUE MEANS "MAY ATTEND")
// plus the attention-weights output.
struct MhaOptions {
  bool causal = false;
  Align align = Align::kBottomRight;
  std::int64_t window_left = -1, window_right = -1;
  std::span<const std::int64_t> key_lengths = {};  // [B], valid keys per batch (padding)
  TensorView mask = {}, bias = {};                 // broadcastable to [B, H, Lq, Lk]
  float* attn_weights = nullptr;  // optional: [B, H, Lq, Lk] or, if average_weights, [B, Lq, Lk]
  bool average_weights = false;   // mean over heads (torch's average_attn_weights)
  int num_threads = 0;            // attention core only; 0 = OpenMP's default
  // Dropout on the attention probabilities (training; qkv/attention.h's dropout_p, seed,
  // offset): the same mask in forward_train and backward.
  float dropout_p = 0.0f;
  std::uint64_t dropout_seed = 0, dropout_offset = 0;
};

// A MultiHeadAttention's parameters, or their gradients, as owned vectors in the layout of the
// packing it was built with: that packing's fields (qkv_weight / qkv_bias for the fused ones,
// q/k/v for kSeparate) and out_weight / out_bias, each bias only where the layer has one.
struct MultiHeadAttentionParams {
  QkvPacking packing = QkvPacking::kSeparate;
  std::vector<float> qkv_weight = {}, qkv_bias = {}, q_weight = {}, q_bias = {}, k_weight = {},
                     k_bias = {}, v_weight = {}, v_bias = {}, out_weight = {}, out_bias = {};
  // Spans over the vectors (for a constructor).
  MultiHeadAttentionWeights weights() const;
  // The non-empty vectors, in a fixed order (an optimizer walks them).
  std::vector<std::vector<float>*> tensors();
};

// What forward_train keeps for backward: the projections [B, L, E + 2 Hkv hd], the attention's
// output [B, L, E] and lse [B, H, L], and the options (key lengths copied).
struct MhaTape {
  std::int64_t batch = 0, seq = 0;
  std::vector<float> qkv, ctx, lse;
  // matmul_dtype bf16: the projections as the bf16 bits the core takes (written so by the
  // projection; qkv then stays empty).
  std::vector<std::uint16_t> qkv_bf16;
  MhaOptions options;
  std::vector<std::int64_t> key_lengths;
};

class MultiHeadAttention {
 public:
  MultiHeadAttention(const MultiHeadAttentionConfig& config,
                     const MultiHeadAttentionWeights& weights);
  ~MultiHeadAttention();
  MultiHeadAttention(MultiHeadAttention&&) noexcept;
  MultiHeadAttention& operator=(MultiHeadAttention&&) noexcept;

  std::int64_t embed_dim() const;
  std::int64_t num_heads() const;
  std::int64_t num_kv_heads() const;
  std::int64_t head_dim() const;
  std::int64_t kdim() const;
  std::int64_t vdim() const;

  // Self-attention. x: [B, L, E] -> out: [B, L, E] (out must not overlap x).
  void forward(const float* x, std::int64_t batch, std::int64_t seq, float* out,
               const MhaOptions& options = {}) const;

  // Cross-attention. query: [B, Lq, E], memory: [B, Lk, kdim] gives keys and values
  // (needs kdim == vdim) -> out: [B, Lq, E].
  void forward_cross(const float* query, std::int64_t batch, std::int64_t seq_q,
                     const float* memory, std::int64_t seq_kv, float* out,
                     const MhaOptions& options = {}) const;
  // Cross-attention with separate key memory [B, Lk, kdim] and value memory [B, Lk, vdim].
  void forward_cross(const float* query, std::int64_t batch, std::int64_t seq_q,
                     const float* key_memory, const float* value_memory, std::int64_t seq_kv,
                     float* out, const MhaOptions& options = {}) const;

  // Incremental decoding: project x [B, Lnew, E], append the new k/v to `cache`, attend over
  // everything cached (Lk = cache.size() after the append). options.causal is usually set
  // (bottom-right alignment makes new token i see cached tokens 0 .. Lk - Lnew + i); then the
  // result equals a full causal forward over the concatenated sequence. Key lengths, mask and
  // bias refer to Lk. The cache must be KvCache(B, Hkv, head_dim, ...). With a bf16 or f16
  // cache, the new k/v are rounded to it and q too (qkv::attention takes one dtype): the core
  // then runs that dtype's products (f32 softmax and accumulation), as on bf16 tensors.
  void forward_cached(const float* x, std::int64_t batch, std::int64_t seq_new, KvCache& cache,
                      float* out, const MhaOptions& options = {}) const;

  // Use `other`'s scratch buffers from now on (both objects must then never run at the same
  // time): layers that run one after another need only one set.
  void share_scratch_with(const MultiHeadAttention& other);

  // A cache shaped for this layer: [batch, max_seq (0 = growing), Hkv, head_dim], stored in
  // `dtype` (kF32, kBF16 or kF16).
  KvCache make_cache(std::int64_t batch, std::int64_t max_seq = 0,
                     DType dtype = DType::kF32) const;

  // Training (self-attention, the cache-free path; multi_head_attention_train.cc).
  // forward_train is forward() keeping in `tape` what backward needs (options.attn_weights,
  // mask and bias must be empty: masks come from causal, window and key lengths).
  void forward_train(const float* x, std::int64_t batch, std::int64_t seq, float* out,
                     const MhaOptions& options, MhaTape& tape) const;
  // Given the forward's x and tape and d_out = dL/d(out) [B, L, E]: writes dx = dL/dx
  // [B, L, E] and ADDS the parameters' gradients to `grads` (laid out as parameters(); start
  // from zero_grads()).
  void backward(const MhaTape& tape, const float* x, const float* d_out, float* dx,
                MultiHeadAttentionParams& grads) const;
  // The current parameters, zeros of their shapes, and an update (an optimizer's step; the
  // same packing and shapes as parameters()).
  MultiHeadAttentionParams parameters() const;
  MultiHeadAttentionParams zero_grads() const;
  void set_parameters(const MultiHeadAttentionParams& params);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace qkv
