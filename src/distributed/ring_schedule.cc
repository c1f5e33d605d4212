#include "distributed/ring_schedule.h"

#include <algorithm>

#include "ops/validate.h"

namespace qkv::distributed {

RingSchedule::RingSchedule(const RingParams& params, int ranks) : ranks_(ranks) {
  for (int r = 0; r < ranks; ++r) {
    q_.push_back(ring_shard(params.layout, params.seq_q, r, ranks));
    kv_.push_back(ring_shard(params.layout, params.seq_kv, r, ranks));
  }
  const AttentionParams& a = params.attention;
  diagonal_ = ops::diagonal_offset(a.align, params.seq_q, params.seq_kv);
  const ops::Window window = ops::effective_window(a, params.seq_q, params.seq_kv, diagonal_);
  left_ = window.left;
  right_ = window.right;
  // Keys at or past every batch entry's length are never attended.
  key_limit_ = params.seq_kv;
  if (!a.key_lengths.empty()) {
    key_limit_ = *std::max_element(a.key_lengths.begin(), a.key_lengths.end());
  }
  needs_.assign(static_cast<std::size_t>(ranks) * ranks, 0);
  for (int r = 0; r < ranks; ++r) {
    for (int s = 0; s < ranks; ++s) {
      for (const RingSegment& q : q_[r]) {
        for (const RingSegment& k : kv_[s]) needs_[r * ranks + s] |= interact(q, k);
      }
    }
  }
}

std::int64_t RingSchedule::q_rows(int rank) const {
  std::int64_t rows = 0;
  for (const RingSegment& s : q_[rank]) rows += s.length;
  return rows;
}

std::int64_t RingSchedule::kv_rows(int rank) const {
  std::int64_t rows = 0;
  for (const RingSegment& s : kv_[rank]) rows += s.length;
  return rows;
}

bool RingSchedule::interact(const RingSegment& q, const RingSegment& k) const {
  // Query i may attend [i + d - left, i + d + right]; over i in [q.start, q.end) these
  // windows slide by one, so their union is one interval.
  const std::int64_t lo = left_ < 0 ? 0 : q.start + diagonal_ - left_;
  const std::int64_t hi = right_ < 0 ? key_limit_ - 1 : q.start + q.length - 1 + diagonal_ + right_;
  return std::max(lo, k.start) <= std::min({hi, k.start + k.length - 1, key_limit_ - 1});
}

bool RingSchedule::forward(int source, int step) const {
  for (int later = step + 1; later < ranks_; ++later) {
    if (needs((source + later) % ranks_, source)) return true;
  }
  return false;
}

}  // namespace qkv::distributed
