// Which blocks a ring step needs (qkv/ring_attention.h), from positions alone: every rank
// computes the same answers for every rank, so senders and receivers agree without messages.
#pragma once

#include <cstdint>
#include <vector>

#include "qkv/attention.h"
#include "qkv/ring_attention.h"

namespace qkv::distributed {

class RingSchedule {
 public:
  RingSchedule(const RingParams& params, int ranks);

  int ranks() const { return ranks_; }
  const std::vector<RingSegment>& q_segments(int rank) const { return q_[rank]; }
  const std::vector<RingSegment>& kv_segments(int rank) const { return kv_[rank]; }
  std::int64_t q_rows(int rank) const;
  std::int64_t kv_rows(int rank) const;

  // Whether some query of `q` may attend some key of `k` (causal, window, key lengths).
  bool interact(const RingSegment& q, const RingSegment& k) const;
  // Whether rank `rank` needs the K/V shard of rank `source`.
  bool needs(int rank, int source) const { return needs_[rank * ranks_ + source]; }
  // Whether the shard of `source`, held at ring step `step` by rank (source + step) % P, must
  // go on to the next rank: some rank that would hold it at a later step needs it.
  bool forward(int source, int step) const;

 private:
  int ranks_;
  std::vector<std::vector<RingSegment>> q_, kv_;
  std::int64_t diagonal_ = 0, left_ = -1, right_ = -1, key_limit_ = 0;
  std::vector<char> needs_;  // [rank][source]
};

}  // namespace qkv::distributed
