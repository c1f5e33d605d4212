// The boundary every attention op shares (attention(), attention_block(),
// attention_backward()): validate q, k, v, the outputs and the params, throwing qkv::Error that
// names the argument and shapes, then lower them into one AttentionKernelParams.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/kernel_params.h"
#include "ops/sparse_layout.h"
#include "qkv/attention.h"
#include "qkv/block_attention.h"

namespace qkv::ops {

// The lowered call and the memory its pointers point into, owned for the kernel call (filled
// in place: the params point into the members).
struct PreparedAttention {
  AttentionKernelParams params{};
  Kernel kernel = Kernel::kAuto;            // resolved: never kAuto
  ResolvedSparsity sparsity;                // what params.sparse points to
  std::vector<std::int64_t> block_lengths;  // a block's key lengths (params.key_lengths)

  PreparedAttention() = default;
  PreparedAttention(const PreparedAttention&) = delete;
  PreparedAttention& operator=(const PreparedAttention&) = delete;
};

// `block` (nullable) places q and k in longer sequences (attention_block).
// `out_in_input_dtype`: out may be bf16/f16 like the inputs (attention() only; the kernels
// round into params.out16); else it is f32 (f64 for f64 inputs).
void prepare_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                       const AttentionOutputs& outputs, const AttentionParams& params,
                       const BlockPositions* block, PreparedAttention& prepared,
                       bool out_in_input_dtype = false);

// kAuto: flash, unless probabilities are requested (then chunked; with dropout the
// reference, as the chunked kernel has none).
Kernel resolve_kernel(Kernel requested, bool wants_probs, bool dropout);

}  // namespace qkv::ops
