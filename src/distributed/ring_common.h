// The pieces the ring's forward (ring_attention.cc) and backward (ring_attention_backward.cc)
// share: MPI error checks, the agreement of every rank on shapes and options, row views, and
// the packing of K/V rows into the message that travels.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "distributed/ring_schedule.h"
#include "qkv/attention.h"
#include "qkv/ring_attention.h"
#include "qkv/tensor.h"

namespace qkv::distributed {

// Throws qkv::Error naming `what` unless code is MPI_SUCCESS.
void check_mpi(int code, const char* what);

// dim `dim` of `view` narrowed to [start, start + n).
TensorView narrow(TensorView view, int dim, std::int64_t start, std::int64_t n);

// Checks this rank's arguments (what can be checked alone: shard rows, outputs, a dry run of
// the block call; then `more_checks`, if any), gathers every rank's signature (shapes, dtype,
// options) and compares them; throws the same qkv::Error, "<op>: rank R: ...", on every rank if
// anything is off on any rank.
void agree(MPI_Comm comm, int rank, int ranks, const TensorView& q, const TensorView& k,
           const TensorView& v, const AttentionOutputs& outputs, const RingParams& params,
           const char* op, const std::function<void()>& more_checks = {});

// Packs k then v of one block contiguously: the message that travels ([B, rows, Hkv, D] then
// [B, rows, Hkv, Dv], in the inputs' dtype).
void pack_shard(const TensorView& k, const TensorView& v, char* dst);

// Query rows per compute piece between two MPI_Testall calls (poll): a position's compute is
// cut into about `pieces` pieces (Open MPI pushes a large TCP message along only inside MPI
// calls) of 64 to `max_rows` rows (smaller pieces cost the kernels their tile efficiency).
// The forward takes 16 pieces of at most 256 rows; the backward, 2.5x the work per row and
// more per-call overhead (each call packs its key tiles and writes dk, dv once), 8 of at most
// 1024 (measured: 20% faster than 256-row pieces at L = 16384 on 2 ranks).
std::int64_t piece_rows(std::int64_t q_rows, std::int64_t pieces, std::int64_t max_rows);

// One piece of the work on a block: this rank's query rows [q_row, q_row + rows) (the first at
// position q_start) against the block's key rows [k_row, k_row + keys) (the first at k_start).
struct RingPiece {
  std::int64_t q_row, q_start, rows, k_row, k_start, keys;
};

// Calls piece(RingPiece) for this rank's queries against block `block` of `source`'s shard:
// every (query segment, key segment) pair that the masks leave non-empty, cut into pieces of
// at most `max_rows` query rows; the other pairs (all of them when compute is false) count as
// skipped. The calls' time goes to stats.compute_seconds.
template <typename Piece>
void for_each_piece(const RingSchedule& schedule, int rank, int source, int block,
                    std::int64_t max_rows, bool compute, RingStats& stats, Piece&& piece) {
  const std::vector<RingSegment> keys = schedule.block_keys(source, block);
  const double start = MPI_Wtime();
  std::int64_t q_row = 0;
  for (const RingSegment& qs : schedule.q_segments(rank)) {
    std::int64_t k_row = 0;
    for (const RingSegment& ks : keys) {
      if (!compute || !schedule.interact(qs, ks)) {
        ++stats.blocks_skipped;
      } else {
        ++stats.blocks_computed;
        for (std::int64_t r0 = 0; r0 < qs.length; r0 += max_rows) {
          piece(RingPiece{.q_row = q_row + r0, .q_start = qs.start + r0,
                          .rows = std::min(max_rows, qs.length - r0), .k_row = k_row,
                          .k_start = ks.start, .keys = ks.length});
        }
      }
      k_row += ks.length;
    }
    q_row += qs.length;
  }
  stats.compute_seconds += MPI_Wtime() - start;
}

// MPI_Testall on `count` requests: lets Open MPI move the messages along.
void poll(int count, MPI_Request* requests);

// Every element of an f32 view <- value.
void fill(const TensorView& view, float value);

// A duplicate of a communicator, freed on scope exit: the ring's messages never meet the
// caller's.
class RingComm {
 public:
  explicit RingComm(MPI_Comm comm) { check_mpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup"); }
  ~RingComm() { MPI_Comm_free(&comm_); }
  RingComm(const RingComm&) = delete;
  RingComm& operator=(const RingComm&) = delete;
  MPI_Comm get() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

}  // namespace qkv::distributed
