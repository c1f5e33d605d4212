// One rank's side of the K/V blocks travelling the ring (qkv/ring_attention.h), shared by the
// forward and the backward.
//
// Every shard travels as C blocks (RingSchedule). The ring runs C rounds of P - 1 positions,
// t = c (P - 1) + hop, and one more, t = C (P - 1), that only computes. At position t of round
// c, rank r receives block c of the shard of rank r - 1 - hop from r - 1 and sends on to r + 1
// what it received at the position before (at hop 0: block c of its own shard). So every block
// moves one hop per position and is passed on as soon as it has arrived: each link carries one
// block per position and a rank holds three blocks (the one arriving, the one computed and
// passed on, its own one leaving). At position t a rank computes the block that arrived at
// t - 1 and, at hop 0, its own block c: block c of source s is computed by the rank `distance`
// steps along from s at t = c (P - 1) + distance. Which blocks travel comes from RingSchedule,
// from positions alone, so both ends of every transfer agree without messages. A block that no
// rank further along needs is not sent (a skipped send).
#pragma once

#include <mpi.h>

#include <array>
#include <cstdint>
#include <vector>

#include "core/aligned_buffer.h"
#include "distributed/ring_schedule.h"
#include "qkv/ring_attention.h"
#include "qkv/tensor.h"

namespace qkv::distributed {

class KvRing {
 public:
  // A block to compute at a position: block `block` of `source`'s shard, the rank `distance`
  // steps along the ring from its source (0: this rank's own), as rows k, v
  // ([B, block rows, Hkv, D or Dv], in the inputs' dtype).
  struct Block {
    int source = 0, block = 0, distance = 0;
    TensorView k, v;
  };

  // k, v: this rank's shards. transfer = false (ring-bench's compute-only mode) moves nothing
  // and computes on zeros in place of the other ranks' blocks: the same sizes, the same skips.
  KvRing(MPI_Comm comm, int rank, const RingSchedule& schedule, const TensorView& k,
         const TensorView& v, bool transfer, RingStats& stats);

  int positions() const { return positions_; }
  // The largest block message (its K and V), in bytes.
  std::size_t max_bytes() const { return max_bytes_; }
  std::size_t block_bytes(int source, int block) const;

  // Posts position t's receive and send into requests() (MPI_REQUEST_NULL where none).
  void post(int t);
  MPI_Request* requests() { return requests_.data(); }
  // What this rank computes at position t (after post(t)): the block that arrived at t - 1,
  // then, at hop 0, its own block. At most two.
  std::vector<Block> blocks(int t) const;
  // After the requests completed: what arrived at t is held for t + 1.
  void finish(int t);

 private:
  Block view(char* base, int source, int block, int distance) const;

  MPI_Comm comm_;
  int rank_, ranks_, per_round_, positions_;
  const RingSchedule& schedule_;
  const TensorView k_, v_;
  bool transfer_;
  RingStats& stats_;
  std::size_t max_bytes_ = 0;
  // Two slots take turns receiving and being computed (and passed on); `own_` sends this
  // rank's own block.
  std::array<AlignedBuffer, 2> slots_;
  AlignedBuffer own_;
  std::array<MPI_Request, 2> requests_ = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  int held_ = -1, held_block_ = 0, slot_ = 0, incoming_ = -1;
  bool arrives_ = false;
};

}  // namespace qkv::distributed
