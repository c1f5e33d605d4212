// The K/V blocks' way around the ring (distributed/kv_ring.h).
#include "distributed/kv_ring.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "distributed/ring_common.h"
#include "qkv/error.h"

namespace qkv::distributed {

KvRing::KvRing(MPI_Comm comm, int rank, const RingSchedule& schedule, const TensorView& k,
               const TensorView& v, bool transfer, RingStats& stats)
    : comm_(comm),
      rank_(rank),
      ranks_(schedule.ranks()),
      per_round_(std::max(schedule.ranks() - 1, 1)),  // one rank: no transfers at all
      positions_(schedule.blocks() * per_round_ + 1),
      schedule_(schedule),
      k_(k),
      v_(v),
      transfer_(transfer),
      stats_(stats) {
  for (int r = 0; r < ranks_; ++r) {
    for (int c = 0; c < schedule.blocks(); ++c)
      max_bytes_ = std::max(max_bytes_, block_bytes(r, c));
  }
  if (max_bytes_ > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    throw Error("ring_attention: a K/V block of " + std::to_string(max_bytes_) +
                " bytes is over MPI's int count (2 GiB); use a smaller block_rows or more ranks");
  }
  stats_.block_bytes = static_cast<std::int64_t>(max_bytes_);
  slots_ = {AlignedBuffer(max_bytes_), AlignedBuffer(max_bytes_)};
  own_ = AlignedBuffer(max_bytes_);
  if (!transfer_) {
    for (AlignedBuffer& slot : slots_) std::memset(slot.as<char>(), 0, max_bytes_);
  }
}

std::size_t KvRing::block_bytes(int source, int block) const {
  const auto [first, last] = schedule_.block_rows(source, block);
  return static_cast<std::size_t>(k_.sizes[0] * (last - first) * k_.sizes[2] *
                                  (k_.sizes[3] + v_.sizes[3]) * dtype_size(k_.dtype));
}

KvRing::Block KvRing::view(char* base, int source, int block, int distance) const {
  const auto [first, last] = schedule_.block_rows(source, block);
  const std::int64_t rows = last - first, batch = k_.sizes[0], heads = k_.sizes[2];
  return {
      .source = source,
      .block = block,
      .distance = distance,
      .k = TensorView::contiguous(base, k_.dtype, {batch, rows, heads, k_.sizes[3]}),
      .v = TensorView::contiguous(base + batch * rows * heads * k_.sizes[3] * dtype_size(k_.dtype),
                                  k_.dtype, {batch, rows, heads, v_.sizes[3]})};
}

void KvRing::post(int t) {
  arrives_ = false;
  if (t >= positions_ - 1 || ranks_ == 1) return;  // the last position only computes
  const int block = t / per_round_, hop = t % per_round_;
  const int to = (rank_ + 1) % ranks_, from = (rank_ + ranks_ - 1) % ranks_;
  // Arriving: block `block` of rank r - 1 - hop, if rank r - 1 passes it on.
  incoming_ = ((rank_ - 1 - hop) % ranks_ + ranks_) % ranks_;
  arrives_ = schedule_.sends(incoming_, block, hop);
  if (transfer_ && arrives_) {
    check_mpi(MPI_Irecv(slots_[slot_].as<char>(), static_cast<int>(block_bytes(incoming_, block)),
                        MPI_BYTE, from, 0, comm_, &requests_[0]),
              "MPI_Irecv");
  }
  // Leaving: this rank's own block at hop 0, else the block that arrived before.
  const int outgoing = hop == 0 ? rank_ : held_;
  if (outgoing < 0) return;
  if (!schedule_.sends(outgoing, block, hop)) {
    ++stats_.sends_skipped;
    return;
  }
  char* source = hop == 0 ? own_.as<char>() : slots_[1 - slot_].as<char>();
  if (hop == 0) {
    const auto [first, last] = schedule_.block_rows(rank_, block);
    pack_shard(narrow(k_, 1, first, last - first), narrow(v_, 1, first, last - first), source);
  }
  if (transfer_) {
    check_mpi(MPI_Isend(source, static_cast<int>(block_bytes(outgoing, block)), MPI_BYTE, to, 0,
                        comm_, &requests_[1]),
              "MPI_Isend");
    stats_.bytes_sent += static_cast<std::int64_t>(block_bytes(outgoing, block));
  }
}

std::vector<KvRing::Block> KvRing::blocks(int t) const {
  std::vector<Block> blocks;
  if (held_ >= 0) {
    blocks.push_back(
        view(slots_[1 - slot_].as<char>(), held_, held_block_, (rank_ - held_ + ranks_) % ranks_));
  }
  if (t < positions_ - 1 && t % per_round_ == 0) {
    const int block = t / per_round_;
    const auto [first, last] = schedule_.block_rows(rank_, block);
    blocks.push_back({.source = rank_,
                      .block = block,
                      .distance = 0,
                      .k = narrow(k_, 1, first, last - first),
                      .v = narrow(v_, 1, first, last - first)});
  }
  return blocks;
}

void KvRing::finish(int t) {
  if (t >= positions_ - 1) {
    held_ = -1;
    return;
  }
  const int block = t / per_round_;
  if (!arrives_ && ranks_ > 1) {  // a block no rank from here on needs: all of it skipped
    stats_.blocks_skipped += static_cast<std::int64_t>(
        schedule_.q_segments(rank_).size() * schedule_.block_keys(incoming_, block).size());
  }
  held_ = arrives_ ? incoming_ : -1;
  held_block_ = block;
  slot_ = 1 - slot_;
}

}  // namespace qkv::distributed
