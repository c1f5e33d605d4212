// Which K/V blocks a ring position needs (qkv/ring_attention.h), from positions alone: every
// rank computes the same answers for every rank, so senders and receivers agree without
// messages.
//
// Every shard travels as `blocks()` blocks of rows. Block c of source s's shard holds its rows
// [c n / C, (c + 1) n / C) (n = the shard's rows, C = blocks()): the same C on every rank, so
// the ring's positions line up although shards may differ in length.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "qkv/attention.h"
#include "qkv/ring_attention.h"

namespace qkv::distributed {

// Messages above this many bytes are split into blocks when RingParams::block_rows is 0.
inline constexpr std::int64_t kDefaultBlockBytes = std::int64_t{8} << 20;

class RingSchedule {
 public:
  // row_bytes: one K/V row of one shard as it travels (B x Hkv x (D + Dv) x element bytes).
  RingSchedule(const RingParams& params, int ranks, std::int64_t row_bytes);

  int ranks() const { return ranks_; }
  int blocks() const { return blocks_; }
  const std::vector<RingSegment>& q_segments(int rank) const { return q_[rank]; }
  std::int64_t q_rows(int rank) const;
  std::int64_t kv_rows(int rank) const;

  // Rows [first, second) of `source`'s shard in block `block`.
  std::pair<std::int64_t, std::int64_t> block_rows(int source, int block) const;
  // The key positions of those rows, in row order (one or two runs).
  std::vector<RingSegment> block_keys(int source, int block) const;

  // Whether some query of `q` may attend some key of `k` (causal, window, key lengths).
  bool interact(const RingSegment& q, const RingSegment& k) const;
  // Whether rank `rank` needs block `block` of `source`'s shard.
  bool needs(int rank, int source, int block) const;
  // Whether the rank `distance` steps along the ring from `source` (0: the source itself) must
  // pass block `block` of its shard on: a rank further along needs it.
  bool sends(int source, int block, int distance) const;
  // The furthest distance along the ring that block `block` of `source`'s shard travels to
  // (0: it never leaves its source).
  int reach(int source, int block) const;

 private:
  int ranks_, blocks_ = 1;
  std::vector<std::vector<RingSegment>> q_, kv_;
  std::int64_t diagonal_ = 0, left_ = -1, right_ = -1, key_limit_ = 0;
};

}  // namespace qkv::distributed
