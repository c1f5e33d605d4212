// Validation and resolution of a qkv::Sparsity for one attention call (ops/ only).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/kernel_params.h"
#include "qkv/sparse.h"

namespace qkv {

// What the kernels read (params) and the memory it points into, owned for the call.
struct ResolvedSparsity {
  SparseKernelParams params;
  std::vector<std::int64_t> global;  // Longformer: sorted, unique global positions
  std::vector<std::uint8_t> layout;  // BigBird: the materialised block layout [Hq, nqb, nkb]
};

// Validates `sparsity` for these sizes, throwing qkv::Error that names "sparsity" and the sizes
// involved, and fills `resolved` (BigBird becomes a block layout). diagonal_offset is Lk - Lq
// (bottom-right) or 0 (top-left), as in AttentionKernelParams.
void resolve_sparsity(const Sparsity& sparsity, std::int64_t seq_q, std::int64_t seq_kv,
                      std::int64_t num_heads_q, std::int64_t diagonal_offset,
                      ResolvedSparsity& resolved);

}  // namespace qkv
