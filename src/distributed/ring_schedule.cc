#include "distributed/ring_schedule.h"

#include <algorithm>
#include <string>

#include "core/int_math.h"
#include "ops/validate.h"
#include "qkv/error.h"

namespace qkv::distributed {

RingSchedule::RingSchedule(const RingParams& params, int ranks, std::int64_t row_bytes)
    : ranks_(ranks) {
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
  std::int64_t longest = 0;
  for (int r = 0; r < ranks; ++r) longest = std::max(longest, kv_rows(r));
  const std::int64_t rows = params.block_rows > 0
                                ? params.block_rows
                                : std::max<std::int64_t>(1, kDefaultBlockBytes / row_bytes);
  const std::int64_t blocks = ceil_div(longest, std::min(rows, longest));
  if (blocks > (std::int64_t{1} << 30)) {
    throw Error("ring_attention: block_rows = " + std::to_string(rows) + " cuts shards of " +
                std::to_string(longest) + " rows into more than 2^30 blocks");
  }
  blocks_ = static_cast<int>(blocks);
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

std::pair<std::int64_t, std::int64_t> RingSchedule::block_rows(int source, int block) const {
  const std::int64_t n = kv_rows(source);
  const auto row = [&](int b) {  // n * b can pass int64 for absurd n: 128-bit products
    return static_cast<std::int64_t>(static_cast<__int128>(n) * b / blocks_);
  };
  return {row(block), row(block + 1)};
}

std::vector<RingSegment> RingSchedule::block_keys(int source, int block) const {
  const auto [first, last] = block_rows(source, block);
  std::vector<RingSegment> keys;
  std::int64_t row = 0;  // the shard row where segment s begins
  for (const RingSegment& s : kv_[source]) {
    const std::int64_t lo = std::max(first, row), hi = std::min(last, row + s.length);
    if (lo < hi) keys.push_back({.start = s.start + (lo - row), .length = hi - lo});
    row += s.length;
  }
  return keys;
}

bool RingSchedule::interact(const RingSegment& q, const RingSegment& k) const {
  // Query i may attend [i + d - left, i + d + right]; over i in [q.start, q.end) these
  // windows slide by one, so their union is one interval.
  const std::int64_t lo = left_ < 0 ? 0 : q.start + diagonal_ - left_;
  const std::int64_t hi = right_ < 0 ? key_limit_ - 1 : q.start + q.length - 1 + diagonal_ + right_;
  return std::max(lo, k.start) <= std::min({hi, k.start + k.length - 1, key_limit_ - 1});
}

bool RingSchedule::needs(int rank, int source, int block) const {
  const std::vector<RingSegment> keys = block_keys(source, block);
  for (const RingSegment& q : q_[rank]) {
    for (const RingSegment& k : keys) {
      if (interact(q, k)) return true;
    }
  }
  return false;
}

bool RingSchedule::sends(int source, int block, int distance) const {
  for (int later = distance + 1; later < ranks_; ++later) {
    if (needs((source + later) % ranks_, source, block)) return true;
  }
  return false;
}

int RingSchedule::reach(int source, int block) const {
  for (int distance = ranks_ - 1; distance > 0; --distance) {
    if (sends(source, block, distance - 1)) return distance;
  }
  return 0;
}

}  // namespace qkv::distributed
