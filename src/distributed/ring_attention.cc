// qkv::ring_attention (qkv/ring_attention.h): K/V blocks around a ring of MPI ranks
// (distributed/kv_ring.h has their way), partial attention at global positions, log-sum-exp
// merges. At each position a rank computes its queries against the blocks KvRing hands it, in
// pieces of query rows with an MPI_Testall between pieces (Open MPI moves a large message only
// inside MPI calls), then waits for the position's transfers.
#include "qkv/ring_attention.h"

#include <mpi.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "core/aligned_buffer.h"
#include "distributed/kv_ring.h"
#include "distributed/ring_common.h"
#include "distributed/ring_modes.h"
#include "distributed/ring_schedule.h"
#include "qkv/block_attention.h"

namespace qkv {

RingStats ring_attention(MPI_Comm comm, const TensorView& q, const TensorView& k,
                         const TensorView& v, const AttentionOutputs& outputs,
                         const RingParams& params) {
  return distributed::ring_attention_mode(comm, q, k, v, outputs, params,
                                          distributed::RingMode::kFull);
}

namespace distributed {

RingStats ring_attention_mode(MPI_Comm comm, const TensorView& q, const TensorView& k,
                              const TensorView& v, const AttentionOutputs& outputs,
                              const RingParams& params, RingMode mode) {
  // q: [B, Lq_r, Hq, D]  k: [B, Lk_r, Hkv, D]  v: [B, Lk_r, Hkv, Dv]  out: [B, Lq_r, Hq, Dv]
  RingStats stats;
  const double started = MPI_Wtime();
  int rank = 0, ranks = 1;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &ranks), "MPI_Comm_size");
  const RingComm ring_comm(comm);
  agree(ring_comm.get(), rank, ranks, q, k, v, outputs, params, "ring_attention");

  const std::int64_t batch = q.sizes[0], heads_q = q.sizes[2], heads_kv = k.sizes[2];
  const std::int64_t dim = k.sizes[3], dim_v = v.sizes[3];
  const RingSchedule schedule(params, ranks,
                              batch * heads_kv * (dim + dim_v) * dtype_size(k.dtype));
  const bool compute = mode != RingMode::kTransferOnly;
  KvRing ring(ring_comm.get(), rank, schedule, k, v, mode != RingMode::kComputeOnly, stats);

  // Accumulators: out = 0, lse = -inf (nothing seen yet). lse is the caller's or ours.
  const TensorView& out = outputs.out;
  AlignedBuffer own_lse;
  TensorView lse = outputs.lse;
  if (lse.empty()) {
    own_lse = AlignedBuffer(sizeof(float) * batch * heads_q * q.sizes[1]);
    lse = TensorView::contiguous(own_lse.as<float>(), DType::kF32, {batch, heads_q, q.sizes[1], 1});
  }
  fill(out, 0.0f);
  fill(lse, -std::numeric_limits<float>::infinity());
  const std::int64_t piece = piece_rows(q.sizes[1], /*pieces=*/16, /*max_rows=*/256);
  AlignedBuffer part_out(sizeof(float) * batch * piece * heads_q * dim_v);
  AlignedBuffer part_lse(sizeof(float) * batch * heads_q * piece);

  // Merges this rank's queries against a block, piece by piece.
  const auto attend = [&](const KvRing::Block& block) {
    for_each_piece(schedule, rank, block.source, block.block, piece, compute, stats,
                   [&](const RingPiece& x) {
                     const TensorView po = TensorView::contiguous(
                         part_out.as<float>(), DType::kF32, {batch, x.rows, heads_q, dim_v});
                     const TensorView pl = TensorView::contiguous(
                         part_lse.as<float>(), DType::kF32, {batch, heads_q, x.rows, 1});
                     attention_block(narrow(q, 1, x.q_row, x.rows),
                                     narrow(block.k, 1, x.k_row, x.keys),
                                     narrow(block.v, 1, x.k_row, x.keys), {.out = po, .lse = pl},
                                     params.attention,
                                     {.q_offset = x.q_start,
                                      .k_offset = x.k_start,
                                      .seq_q = params.seq_q,
                                      .seq_kv = params.seq_kv});
                     merge_attention(narrow(out, 1, x.q_row, x.rows),
                                     narrow(lse, 2, x.q_row, x.rows), po, pl,
                                     params.attention.num_threads);
                     poll(2, ring.requests());
                   });
  };

  for (int t = 0; t < ring.positions(); ++t) {
    ring.post(t);
    for (const KvRing::Block& block : ring.blocks(t)) attend(block);
    const double wait_start = MPI_Wtime();
    check_mpi(MPI_Waitall(2, ring.requests(), MPI_STATUSES_IGNORE), "MPI_Waitall");
    stats.wait_seconds += MPI_Wtime() - wait_start;
    ring.finish(t);
  }
  stats.seconds = MPI_Wtime() - started;
  return stats;
}

}  // namespace distributed
}  // namespace qkv
