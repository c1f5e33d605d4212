// qkv::linear_attention: attention in O(N) time and memory through a positive feature map phi,
// replacing softmax(q.k) by phi(q).phi(k) (Linear Transformer, Katharopoulos et al. 2020;
// Performer FAVOR+, Choromanski et al. 2021). It is an approximation of softmax attention, not
// exact: see docs/linear-attention.md for the error it makes and how it is measured.
//
//   q: [B, Lq, Hq, D]      k: [B, Lk, Hkv, D]      v: [B, Lk, Hkv, Dv]      out: [B, Lq, Hq, Dv]
//
// Same operands, strides and GQA rule as qkv::attention (query head h reads kv head
// h / (Hq / Hkv)). For query row i of one (batch, head), with the allowed keys J(i):
//   out_i = sum_{j in J(i)} (phi(q_i) . phi(k_j)) v_j  /  sum_{j in J(i)} phi(q_i) . phi(k_j)
//         = phi(q_i)^T S / phi(q_i)^T z,   S = sum_j phi(k_j) v_j^T [M, Dv],  z = sum_j phi(k_j)
// J(i) = { j < key_lengths[b] }, and with causal also j <= i' (i' = i + Lk - Lq bottom-right,
// i' = i top-left: the same diagonal as qkv::attention). A row whose normaliser is 0 (no
// allowed key, or every feature product underflowed) gets out_i = 0, never NaN.
//
// Feature maps (M = number of features):
//   kEluPlusOne:    phi(x) = elu(x) + 1, M = D. Has no score scale: `scale` must stay unset.
//   kFavorPositive: phi(x)_r = exp(w_r . x' - |x'|^2 / 2 - c) / sqrt(M), x' = x * sqrt(scale),
//                   r < M = nb_features, rows w_r of favor_projection(D, M, seed). Then
//                   E[phi(q) . phi(k)] = exp(scale * q.k) (scale defaults to 1/sqrt(D): x' =
//                   x * D^-1/4). c is a stabiliser that cancels in out_i: per query row for q,
//                   one running maximum per (batch, kv head) for k (docs/linear-attention.md).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "qkv/attention.h"
#include "qkv/tensor.h"

namespace qkv {

enum class FeatureMap : std::uint8_t {
  kEluPlusOne,     // Linear Transformer: elu(x) + 1
  kFavorPositive,  // Performer FAVOR+: positive orthogonal random features
};

enum class LinearKernel : std::uint8_t {
  kAuto,       // kCpu
  kReference,  // scalar oracle: the quadratic form sum_j (phi(q_i).phi(k_j)) v_j in f64
  kCpu,        // chunk-wise prefix sums with Highway SIMD
};

struct LinearAttentionParams {
  FeatureMap feature_map = FeatureMap::kEluPlusOne;
  // FAVOR+ only: number of random features M (>= 1) and the seed of their draw. The features
  // are a function of (seed, D, nb_features) only; pass a new seed to redraw them.
  std::int64_t nb_features = 256;
  std::uint64_t seed = 1;
  // FAVOR+: the softmax temperature the features approximate, exp(scale * q.k); default
  // 1/sqrt(D); finite and > 0. kEluPlusOne: must stay unset (the map has no scale).
  std::optional<float> scale = {};
  bool causal = false;
  Align align = Align::kBottomRight;
  // Per-batch number of valid keys (padding); empty = all Lk keys. Each in [0, Lk]. Keys at or
  // past key_lengths[b] are never read.
  std::span<const std::int64_t> key_lengths = {};

  // Options of qkv::attention that linear attention cannot express: phi(q).phi(k) has no
  // per-pair score to cap, bias or mask, and only prefix (causal) key sets have a running
  // sum. They exist so that code moving from AttentionParams fails loudly: anything but the
  // default throws qkv::Error naming the option.
  float softcap = 0.0f;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  TensorView mask = {};
  TensorView bias = {};

  LinearKernel kernel = LinearKernel::kAuto;
  int num_threads = 0;           // 0 = OpenMP's default; results never depend on it
  std::int64_t chunk_size = 64;  // query rows per chunk of the causal prefix sums (cpu kernel)
};

// Validates everything and throws qkv::Error naming the bad argument and shapes; then runs one
// kernel once. outputs.out is required; outputs.lse and outputs.probs must be empty (linear
// attention has no softmax normaliser). Inputs are only read; out is written only after
// validation succeeded.
void linear_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                      const AttentionOutputs& outputs, const LinearAttentionParams& params);

// The FAVOR+ projection: nb_features rows w_r of dimension head_dim, row-major
// [nb_features][head_dim], a function of (head_dim, nb_features, seed) only. Rows come in
// blocks of head_dim mutually orthogonal directions (Gram-Schmidt of Gaussian blocks, the last
// block truncated), each row rescaled to the norm of an independent Gaussian vector
// (chi(head_dim)-distributed), as in the Performer paper. docs/linear-attention.md gives the
// exact draw. Throws qkv::Error for head_dim < 1 or nb_features outside [1, 65536].
std::vector<float> favor_projection(std::int64_t head_dim, std::int64_t nb_features,
                                    std::uint64_t seed);

// FLOPs of the linear formula for these sizes (what bench reports), counting multiply-adds as
// 2: features (FAVOR projections: 2*M*D per q and k row; elu: none), the key summary
// S, z (2*M*(Dv + 1) per key row per kv head) and the query side phi(q)^T S, phi(q)^T z
// (2*M*(Dv + 1) per query row per query head):
//   2 * M * (P + Dv + 1) * (B * Hkv * Lk + B * Hq * Lq),  P = D for FAVOR+, 0 for elu+1.
// The same count for causal (the chunk-local quadratic part is overhead, not counted).
double linear_attention_flops(std::int64_t batch, std::int64_t num_heads_q,
                              std::int64_t num_heads_kv, std::int64_t seq_q, std::int64_t seq_kv,
                              std::int64_t head_dim, std::int64_t head_dim_v,
                              const LinearAttentionParams& params);

}  // namespace qkv
