// Attention of a block of queries against a block of keys, at their positions in longer
// sequences, and the merge of such partial results: the pieces of context parallelism (ring
// attention, qkv/ring_attention.h), where each rank holds a slice of the sequence.
//
//   q: [B, Lq_block, Hq, D]  k: [B, Lk_block, Hkv, D]  v: [B, Lk_block, Hkv, Dv]
//   out: [B, Lq_block, Hq, Dv]  lse: [B, Hq, Lq_block, 1]   (as qkv::attention, f32)
//
// Block row i is query q_offset + i of a query sequence of seq_q; block key j is key
// k_offset + j of a key sequence of seq_kv. causal, align, window and key_lengths mean what they
// mean for the whole sequences (docs/semantics.md), so that attention over the whole equals the
// merge of the blocks' results, in any order. A row with no allowed key in this block gets
// out 0 and lse -inf, which merge_attention treats as "nothing from here".
#pragma once

#include <cstdint>

#include "qkv/attention.h"
#include "qkv/tensor.h"

namespace qkv {

struct BlockPositions {
  std::int64_t q_offset = 0;  // position of the block's first query, >= 0
  std::int64_t k_offset = 0;  // position of the block's first key, >= 0
  std::int64_t seq_q = 0;     // length of the whole query sequence, >= q_offset + Lq_block
  std::int64_t seq_kv = 0;    // length of the whole key sequence, >= k_offset + Lk_block
};

// qkv::attention on a block. params: everything defined by positions (causal, align, window,
// key_lengths over the whole key sequence: each in [0, seq_kv]), scale, softcap, kernel,
// num_threads; mask, bias and sparsity must be empty, and outputs.probs too (a block's
// probabilities are normalised over the block only). Throws qkv::Error like attention().
void attention_block(const TensorView& q, const TensorView& k, const TensorView& v,
                     const AttentionOutputs& outputs, const AttentionParams& params,
                     const BlockPositions& positions);

// (out, lse) <- the attention over the union of the keys behind (out, lse) and behind
// (out_b, lse_b), in place:
//   m = max(lse, lse_b);  w = exp(lse - m), w_b = exp(lse_b - m)
//   out = (w out + w_b out_b) / (w + w_b);  lse = m + log(w + w_b)
// A row that is -inf in both stays out 0, lse -inf (never NaN); -inf on one side takes the
// other side's row unchanged. out, out_b: f32 [B, Lq, Hq, Dv]; lse, lse_b: f32 [B, Hq, Lq, 1];
// out_b and lse_b are only read and may not overlap out or lse.
void merge_attention(const TensorView& out, const TensorView& lse, const TensorView& out_b,
                     const TensorView& lse_b, int num_threads = 0);

}  // namespace qkv
