// The one per-pair sparsity predicate (qkv/sparse.h, docs/sparse.md). The reference kernel
// calls it for every pair and qkv::sparse_mask() builds the tests' explicit masks from it; the
// flash and chunked kernels use a tile-level form of the same rule (kernels/cpu/
// sparse_tiles-inl.h) that the tests compare against it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/kernel_params.h"

namespace qkv {

// Whether `position` is one of the sorted global positions.
inline bool sparse_is_global(const SparseKernelParams& s, std::int64_t position) {
  return std::binary_search(s.global, s.global + s.num_global, position);
}

// Whether the sparsity allows query i of head h to attend key j (other masks not included).
inline bool sparse_pair_allowed(const SparseKernelParams& s, std::int64_t diagonal_offset,
                                std::int64_t h, std::int64_t i, std::int64_t j) {
  switch (s.kind) {
    case SparseKernelParams::Kind::kNone:
      return true;
    case SparseKernelParams::Kind::kBand: {
      const std::int64_t position = i + diagonal_offset;
      if (sparse_is_global(s, position) || sparse_is_global(s, j)) return true;
      const std::int64_t distance = position - j;
      return distance >= -s.band && distance <= s.band && distance % s.dilation == 0;
    }
    case SparseKernelParams::Kind::kBlock:
      return s.layout[h * s.layout_stride[0] + i / s.block_q * s.layout_stride[1] +
                      j / s.block_k * s.layout_stride[2]] != 0;
  }
  return true;
}

}  // namespace qkv
