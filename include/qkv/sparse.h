// Block-sparse exact attention: which (query, key) pairs a sparsity pattern allows.
//
// A sparsity is one more mask, ANDed with every other one (causal, window, key_lengths, mask;
// bias and softcap apply as usual; a row left with no allowed key gets out 0 and lse -inf).
// It is exact attention over the allowed pairs, not an approximation. The flash kernel skips key
// tiles the pattern leaves out, so the cost follows the allowed pairs, not Lq x Lk.
//
// Positions: query i sits at i' = i + (Lk - Lq) with Align::kBottomRight (the default) or
// i' = i with Align::kTopLeft, as for causal and window; key j sits at j.
//
//   Longformer (window w, dilation d, global positions G):
//     allowed(i, j) = i' in G  or  j in G  or  (|i' - j| <= w  and  (i' - j) % d == 0)
//   BigBird (block b, g global blocks, r random blocks, seed) and a user block layout
//   (layout [1, Hq or 1, ceil(Lq / block_q), ceil(Lk / block_k)], bool/u8):
//     allowed(h, i, j) = layout[h][i / block_q][j / block_k]
//   BigBird's layout has block_q = block_k = b and, per head h and query block qb:
//     qb < g: every key block;  otherwise key blocks kb < g, |qb - kb| <= 1, and r random
//     blocks drawn from the rest (docs/sparse.md gives the exact draw; bigbird_layout() returns
//     the matrix). Block layouts index query blocks by i (top-left), as in the BigBird paper,
//     which is self-attention (Lq = Lk).
// See docs/sparse.md.
#pragma once

#include <cstdint>
#include <span>
#include <variant>
#include <vector>

#include "qkv/tensor.h"

namespace qkv {

// Sliding window plus global tokens (Beltagy et al., 2020).
struct LongformerSparsity {
  std::int64_t window = 256;  // one-sided width w >= 0: |i' - j| <= w
  std::int64_t dilation = 1;  // >= 1: inside the band only keys with (i' - j) % dilation == 0
  // Positions (query i with i' = g, key j = g) that attend every key and that every query
  // attends. Any order; duplicates allowed; each in [0, max(Lk, largest i' + 1)).
  // A view: the caller keeps the positions alive until the call returns.
  std::span<const std::int64_t> global = {};
};

// BigBird's ITC layout (Zaheer et al., 2020): 3-block sliding window, global blocks, random
// blocks. Reproducible: the same seed (and sizes) gives the same layout.
struct BigBirdSparsity {
  std::int64_t block = 64;             // block size b >= 1, for queries and keys
  std::int64_t num_random_blocks = 3;  // r >= 0 per query block (fewer if fewer are left)
  std::int64_t num_global_blocks = 2;  // g >= 0: the first g blocks are global
  std::uint64_t seed = 0;
};

// A user block matrix: query block qb may attend key block kb where layout[0][h][qb][kb] != 0.
struct BlockSparsity {
  TensorView layout;  // bool/u8, [1, 1 or Hq, ceil(Lq / block_q), ceil(Lk / block_k)], any strides
  std::int64_t block_q = 64;  // >= 1
  std::int64_t block_k = 64;  // >= 1
};

using Sparsity = std::variant<LongformerSparsity, BigBirdSparsity, BlockSparsity>;

enum class Align : std::uint8_t;  // qkv/attention.h
struct AttentionParams;           // qkv/attention.h

// The block matrix BigBird resolves to for these sizes: [Hq, ceil(Lq / b), ceil(Lk / b)],
// row-major, 1 = attended. Throws qkv::Error on invalid parameters.
std::vector<std::uint8_t> bigbird_layout(const BigBirdSparsity& sparsity, std::int64_t seq_q,
                                         std::int64_t seq_kv, std::int64_t num_heads_q);

// The pairs `sparsity` alone allows, as a dense [Hq, Lq, Lk] row-major mask (1 = allowed), from
// the same per-pair predicate the reference kernel uses. For tests and inspection: Lq x Lk bytes.
std::vector<std::uint8_t> sparse_mask(const Sparsity& sparsity, std::int64_t seq_q,
                                      std::int64_t seq_kv, std::int64_t num_heads_q, Align align);

// Pairs per (batch, head), averaged over the Hq heads, that params' sparsity AND causal/window
// allow (key lengths and masks not counted): the "effective" pair count of a sparse run.
// Without a sparsity it equals allowed_pairs(seq_q, seq_kv, params).
double sparse_allowed_pairs(std::int64_t seq_q, std::int64_t seq_kv, std::int64_t num_heads_q,
                            const AttentionParams& params);

}  // namespace qkv
