// The ring layouts: which positions each rank holds (qkv/ring_attention.h), and copies between a
// whole sequence and a rank's shard.
#include <cstring>
#include <string>

#include "qkv/error.h"
#include "qkv/ring_attention.h"

namespace qkv {
namespace {

// Piece `index` of [0, seq) cut into `pieces`: the first seq % pieces one longer.
RingSegment piece(std::int64_t seq, std::int64_t pieces, std::int64_t index) {
  const std::int64_t base = seq / pieces, extra = seq % pieces;
  return {index * base + std::min(index, extra), base + (index < extra ? 1 : 0)};
}

// Rows of dim 1: shard rows [row, row + n) <-> full rows [start, start + n), element by element
// (any strides, any dtype of the same size on both sides).
void copy_rows(const TensorView& from, std::int64_t from_row, const TensorView& to,
               std::int64_t to_row, std::int64_t n) {
  const int size = dtype_size(from.dtype);
  const auto* src = static_cast<const char*>(from.data);
  auto* dst = static_cast<char*>(to.data);
  for (std::int64_t b = 0; b < from.sizes[0]; ++b)
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t h = 0; h < from.sizes[2]; ++h)
        for (std::int64_t d = 0; d < from.sizes[3]; ++d) {
          std::memcpy(dst + to.offset(b, to_row + i, h, d) * size,
                      src + from.offset(b, from_row + i, h, d) * size, size);
        }
}

void check_pair(const char* what, const TensorView& full, const TensorView& shard,
                std::int64_t rows) {
  if (full.dtype != shard.dtype || full.sizes[0] != shard.sizes[0] ||
      full.sizes[2] != shard.sizes[2] || full.sizes[3] != shard.sizes[3] ||
      shard.sizes[1] != rows || full.data == nullptr || shard.data == nullptr) {
    throw Error(std::string(what) + ": full " + shape_string(full.sizes) + " " +
                dtype_name(full.dtype) + " and shard " + shape_string(shard.sizes) + " " +
                dtype_name(shard.dtype) + " do not match (the shard holds " +
                std::to_string(rows) + " rows)");
  }
}

}  // namespace

std::vector<RingSegment> ring_shard(RingLayout layout, std::int64_t seq, int rank, int ranks) {
  const std::int64_t per_rank = layout == RingLayout::kZigzag ? 2 : 1;
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    throw Error("ring: rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                " ranks is out of range");
  }
  if (seq < per_rank * ranks) {
    throw Error("ring: " + std::to_string(ranks) + " ranks cannot share a sequence of " +
                std::to_string(seq) + " (each rank needs at least " + std::to_string(per_rank) +
                (per_rank == 1 ? " row" : " rows, one per zigzag chunk") + ")");
  }
  if (layout == RingLayout::kContiguous) return {piece(seq, ranks, rank)};
  return {piece(seq, 2 * ranks, rank), piece(seq, 2 * ranks, 2 * ranks - 1 - rank)};
}

namespace {

// Calls copy(full_row, shard_row, rows) for each segment of this rank, after checking the pair.
template <typename Copy>
void for_each_segment(const char* what, const TensorView& full, const TensorView& shard,
                      RingLayout layout, int rank, int ranks, Copy copy) {
  const auto segments = ring_shard(layout, full.sizes[1], rank, ranks);
  std::int64_t rows = 0;
  for (const RingSegment& s : segments) rows += s.length;
  check_pair(what, full, shard, rows);
  std::int64_t row = 0;
  for (const RingSegment& s : segments) {
    copy(s.start, row, s.length);
    row += s.length;
  }
}

}  // namespace

void copy_to_shard(const TensorView& full, const TensorView& shard, RingLayout layout, int rank,
                   int ranks) {
  for_each_segment("copy_to_shard", full, shard, layout, rank, ranks,
                   [&](std::int64_t full_row, std::int64_t shard_row, std::int64_t n) {
                     copy_rows(full, full_row, shard, shard_row, n);
                   });
}

void copy_from_shard(const TensorView& shard, const TensorView& full, RingLayout layout,
                     int rank, int ranks) {
  for_each_segment("copy_from_shard", full, shard, layout, rank, ranks,
                   [&](std::int64_t full_row, std::int64_t shard_row, std::int64_t n) {
                     copy_rows(shard, shard_row, full, full_row, n);
                   });
}

}  // namespace qkv
