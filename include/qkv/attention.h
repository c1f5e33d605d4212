// qkv::attention: scaled dot-product attention with every mask real models use.
//
//   q:     [B, Lq, Hq, D]      k: [B, Lk, Hkv, D]      v: [B, Lk, Hkv, Dv]
//   out:   [B, Lq, Hq, Dv]     lse: [B, Hq, Lq, 1]     probs: [B, Hq, Lq, Lk]
//   mask:  bool/u8, broadcastable to [B, Hq, Lq, Lk], TRUE MEANS "MAY ATTEND"
//          (the opposite of torch.nn.MultiheadAttention's key_padding_mask)
//   bias:  f32, broadcastable to [B, Hq, Lq, Lk], -inf allowed
//
// Logical order is BSHD; pass BHSD data as a view with permuted strides (no copy). Hq must be a
// multiple of Hkv: query head h reads kv head h / (Hq / Hkv) (GQA / MQA). "Broadcastable" means
// every size of mask/bias is 1 or the full size of that dimension.
//
// For query row i and key column j of one (batch, head), every kernel computes
//   s = (q_i . k_j) * scale;  if softcap > 0: s = softcap * tanh(s / softcap);  s += bias
//   s = -inf where the pair is not allowed (causal, window, key_lengths, mask)
//   out_i = sum_j softmax_j(s) v_j;   lse_i = log(sum_j exp(s_ij))
// A row with no allowed key gets out_i = 0 and lse_i = -inf, never NaN. Keys at or past
// key_lengths[b] are never read, so they may hold any bits (NaN included). See docs/semantics.md.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "qkv/sparse.h"
#include "qkv/tensor.h"

namespace qkv {

// Which diagonal causal and window masks are anchored to, when Lq != Lk.
enum class Align : std::uint8_t {
  kBottomRight,  // i' = i + (Lk - Lq): the last query sees the last key (KV-cache decoding;
                 // FlashAttention's convention). The default.
  kTopLeft,      // i' = i (PyTorch's is_causal).
};

enum class Kernel : std::uint8_t {
  kAuto,       // flash, unless probabilities are requested (then chunked; with dropout, reference)
  kReference,  // scalar oracle; materialises each (batch, head) score matrix; f64 accumulation
  kChunked,    // query-chunked "memory-efficient" form: O(chunk_size x Lk) scratch per thread
  kFlash,      // tiled online softmax: O(tile) scratch; skips tiles that masks make empty
};

struct AttentionParams {
  std::optional<float> scale = {};  // default 1 / sqrt(D); must be finite and > 0
  float softcap = 0.0f;        // 0 = off; else s = softcap * tanh(s / softcap)
  bool causal = false;
  Align align = Align::kBottomRight;
  // Sliding window: i' - window_left <= j <= i' + window_right; -1 = unbounded on that side.
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  // Per-batch number of valid keys (padding); empty = all Lk keys. Each in [0, Lk].
  std::span<const std::int64_t> key_lengths = {};
  TensorView mask = {};  // optional; see above
  TensorView bias = {};  // optional; see above
  Kernel kernel = Kernel::kAuto;
  int num_threads = 0;            // 0 = OpenMP's default; results never depend on it
  std::int64_t chunk_size = 128;  // query rows per chunk (chunked kernel only)
  // Block-sparse attention (Longformer, BigBird, a block layout): ANDed with every mask above;
  // key tiles it leaves out are skipped. See qkv/sparse.h and docs/sparse.md.
  std::optional<Sparsity> sparsity = std::nullopt;
  // Dropout on the probabilities (training): out_i = sum_j P_ij keep_ij / (1 - dropout_p) v_j,
  // keep_ij a hash of (seed, offset, b, h, i, j) (kernels/dropout_mask.h: the same mask in
  // every kernel, in the backward, and on any thread count; a new offset gives a new mask).
  // lse and probs are those of P itself. dropout_p in [0, 1); 0 = off (costs nothing). Not
  // available from Kernel::kChunked or attention_block.
  float dropout_p = 0.0f;
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
};

struct AttentionOutputs {
  TensorView out = {};    // required, [B, Lq, Hq, Dv]: f32, or bf16/f16 like q, k and v (the f32
                          // result rounded to nearest even; attention() only)
  TensorView lse = {};    // optional, f32, [B, Hq, Lq, 1]; natural log; -inf for fully masked rows
  TensorView probs = {};  // optional, f32, [B, Hq, Lq, Lk]; not available from Kernel::kFlash
};

// Validates everything and throws qkv::Error naming the bad argument and shapes; then runs one
// kernel once. Inputs are only read; outputs are written only after validation succeeded.
void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const AttentionOutputs& outputs, const AttentionParams& params);

// The kernel `params.kernel` resolves to for these outputs ("reference", "chunked", "flash").
const char* resolved_kernel_name(const AttentionParams& params, const AttentionOutputs& outputs);

// The instructions the tile products of attention(q, k, v, outputs, params) run on, on this CPU
// now: "f32-fma", "bf16-widened-fma" / "f16-widened-fma" (converted to f32 exactly, then FMA),
// "bf16-vdpbf16ps" (AVX512-BF16 pairs), "bf16-amx", "f16-amx-split" (AMX tiles; the flash
// kernel only), or "reference-f64". It depends on the shapes too (a bf16 multi-head decode step
// in BSHD widens where the pairs are preferred). Throws qkv::Error where attention() would.
// docs/kernels.md, "Product paths".
const char* resolved_product_path(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const AttentionOutputs& outputs, const AttentionParams& params);

// FLOPs of the forward pass over `pairs` (query, key) pairs per (batch, head):
// 2 * B * Hq * pairs * (D + Dv), which is DESIGN.md's 4 * B * Hq * Lq * Lk * D for all pairs
// and D == Dv.
double attention_flops(std::int64_t batch, std::int64_t num_heads_q, double pairs,
                       std::int64_t head_dim, std::int64_t head_dim_v);

// Number of (query, key) pairs per (batch, head) that causal/window allow (key lengths and
// masks not counted): the "effective" pair count for reporting effective GFLOP/s.
double allowed_pairs(std::int64_t seq_q, std::int64_t seq_kv, const AttentionParams& params);

}  // namespace qkv
