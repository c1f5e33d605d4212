// The pieces the ring's forward (ring_attention.cc) and backward (ring_attention_backward.cc)
// share: MPI error checks, the agreement of every rank on shapes and options, row views, and
// the packing of K/V rows into the message that travels.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>

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
