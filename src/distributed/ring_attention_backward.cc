// qkv::ring_attention_backward (qkv/ring_attention.h): the forward's K/V ring
// (distributed/kv_ring.h), with the gradients of each block's keys following their block.
//
// Block c of source s is computed by the rank `distance` j steps along the ring at position
// t_j = c (P - 1) + j, for j = 0 .. reach (the furthest rank the block travels to). Rank s
// writes its own share of the block's dk and dv (attention_block_backward over its queries)
// into its dk, dv at once. The rank at j = 1 sends its share on at t_1 + 1; the rank at j >= 2
// adds its share to the sum that arrived from the rank before it (sent at t_j: one position
// behind the K/V) and sends that on at t_j + 1: to the next rank, or, from the furthest rank,
// home to s (a direct message; the ring's neighbour when reach = P - 1), which adds it to its
// own share. A rank the K/V only passes through adds nothing and passes the sum on. So a
// block's dk, dv are summed in one fixed order: the same bits on any thread count. dq stays
// with its queries, summed position by position. out and lse are the whole's (the forward's),
// so D_i = dout_i . out_i and the probabilities recomputed from lse make each block pair's
// share exact on its own.
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "distributed/kv_ring.h"
#include "distributed/ring_common.h"
#include "distributed/ring_modes.h"
#include "distributed/ring_schedule.h"
#include "ops/validate.h"
#include "qkv/attention_backward.h"
#include "qkv/error.h"
#include "qkv/ring_attention.h"

namespace qkv {
namespace distributed {
namespace {

// Message tags beside the K/V blocks' (0): a block's gradient sum on its way along the ring,
// and on its way home.
constexpr int kChainTag = 1, kHomeTag = 2;

// dst (f32, any strides) += src (f32, contiguous, dst's sizes).
void accumulate(const TensorView& dst, const float* src) {
  auto* data = static_cast<float*>(dst.data);
  for (std::int64_t b = 0; b < dst.sizes[0]; ++b)
    for (std::int64_t i = 0; i < dst.sizes[1]; ++i)
      for (std::int64_t h = 0; h < dst.sizes[2]; ++h) {
        float* row = data + dst.offset(b, i, h, 0);
        for (std::int64_t d = 0; d < dst.sizes[3]; ++d) row[d * dst.strides[3]] += *src++;
      }
}

// dst (f32, any strides) <- src (f32, contiguous, dst's sizes).
void copy_into(const TensorView& dst, const float* src) {
  fill(dst, 0.0f);
  accumulate(dst, src);
}

// The ring's own checks of the backward's arguments beyond the forward's.
void check_gradients(const TensorView& q, const TensorView& k, const TensorView& v,
                     const TensorView& out, const TensorView& lse, const TensorView& dout,
                     const AttentionGrads& grads, const AttentionParams& params) {
  if (lse.empty()) throw Error("lse: required (the forward's, from ring_attention; f32)");
  if (params.kernel == Kernel::kReference || params.kernel == Kernel::kChunked) {
    throw Error("kernel: the ring's backward runs the flash kernel; use kernel auto or flash");
  }
  if (!grads.dbias.empty()) throw Error("dbias: not available for ring attention (no bias)");
  const std::int64_t batch = q.sizes[0], rows_q = q.sizes[1], heads_q = q.sizes[2];
  const std::int64_t rows_kv = k.sizes[1], heads_kv = k.sizes[2];
  const std::int64_t dim = q.sizes[3], dim_v = v.sizes[3];
  const struct {
    const char* name;
    const TensorView* view;
    std::array<std::int64_t, 4> want;
    const char* text;
  } expected[] = {
      {"dout", &dout, {batch, rows_q, heads_q, dim_v}, "(B, this rank's query rows, Hq, Dv)"},
      {"dq", &grads.dq, {batch, rows_q, heads_q, dim}, "(B, this rank's query rows, Hq, D)"},
      {"dk", &grads.dk, {batch, rows_kv, heads_kv, dim}, "(B, this rank's key rows, Hkv, D)"},
      {"dv", &grads.dv, {batch, rows_kv, heads_kv, dim_v}, "(B, this rank's key rows, Hkv, Dv)"},
  };
  for (const auto& e : expected) {
    if (e.view->empty()) {
      throw Error(std::string(e.name) + ": required (f32, shape " + e.text + " = " +
                  shape_string(e.want) + ")");
    }
    ops::require_data(e.name, *e.view);
    ops::require_dtype(e.name, *e.view, DType::kF32, "expected f32");
    ops::require_shape(e.name, *e.view, e.want, e.text);
    if (e.view != &dout) ops::require_writable_strides(e.name, *e.view);
  }
  const ops::NamedView written[] = {{"dq", &grads.dq}, {"dk", &grads.dk}, {"dv", &grads.dv}};
  const ops::NamedView read[] = {{"q", &q},     {"k", &k},     {"v", &v},
                                 {"out", &out}, {"lse", &lse}, {"dout", &dout}};
  ops::require_no_overlap(written, read);
  ops::require_no_overlap(std::span(written, 1), std::span(written + 1, 2));
  ops::require_no_overlap(std::span(written + 1, 1), std::span(written + 2, 1));
}

}  // namespace

RingStats ring_attention_backward_mode(MPI_Comm comm, const TensorView& q, const TensorView& k,
                                       const TensorView& v, const TensorView& out,
                                       const TensorView& lse, const TensorView& dout,
                                       const AttentionGrads& grads, const RingParams& params,
                                       RingMode mode) {
  // q: [B, Lq_r, Hq, D]  k: [B, Lk_r, Hkv, D]  v: [B, Lk_r, Hkv, Dv]  out, dout: [B, Lq_r, Hq, Dv]
  RingStats stats;
  const double started = MPI_Wtime();
  int rank = 0, ranks = 1;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &ranks), "MPI_Comm_size");
  const RingComm ring_comm(comm);
  agree(ring_comm.get(), rank, ranks, q, k, v, {.out = out, .lse = lse}, params,
        "ring_attention_backward",
        [&] { check_gradients(q, k, v, out, lse, dout, grads, params.attention); });

  const std::int64_t batch = q.sizes[0], heads_q = q.sizes[2], heads_kv = k.sizes[2];
  const std::int64_t dim = k.sizes[3], dim_v = v.sizes[3];
  const RingSchedule schedule(params, ranks,
                              batch * heads_kv * (dim + dim_v) * dtype_size(k.dtype));
  const bool transfer = mode != RingMode::kComputeOnly, compute = mode != RingMode::kTransferOnly;
  KvRing ring(ring_comm.get(), rank, schedule, k, v, transfer, stats);
  const int per_round = std::max(ranks - 1, 1);
  const int to = (rank + 1) % ranks, from = (rank + ranks - 1) % ranks;

  // A block's gradients as they travel: dk [B, rows, Hkv, D] then dv [B, rows, Hkv, Dv], f32.
  const auto grad_floats = [&](int source, int block) {
    const auto [first, last] = schedule.block_rows(source, block);
    return static_cast<std::size_t>(batch * (last - first) * heads_kv * (dim + dim_v));
  };
  std::size_t max_floats = 0;
  for (int r = 0; r < ranks; ++r) {
    for (int c = 0; c < schedule.blocks(); ++c)
      max_floats = std::max(max_floats, grad_floats(r, c));
  }
  if (max_floats * sizeof(float) > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    throw Error("ring_attention_backward: a block's dk and dv are " +
                std::to_string(max_floats * sizeof(float)) +
                " bytes, over MPI's int count (2 GiB); use a smaller block_rows or more ranks");
  }
  const auto grad_views = [&](float* base, int source, int block) {
    const auto [first, last] = schedule.block_rows(source, block);
    const std::int64_t rows = last - first;
    return std::pair{TensorView::contiguous(base, DType::kF32, {batch, rows, heads_kv, dim}),
                     TensorView::contiguous(base + batch * rows * heads_kv * dim, DType::kF32,
                                            {batch, rows, heads_kv, dim_v})};
  };
  // Block `block` of this rank's own dk, dv <- (or +=) a gradient sum.
  const auto store_home = [&](int block, float* sum, bool add) {
    const auto [first, last] = schedule.block_rows(rank, block);
    const auto [dk_sum, dv_sum] = grad_views(sum, rank, block);
    const auto store = add ? accumulate : copy_into;
    store(narrow(grads.dk, 1, first, last - first), static_cast<float*>(dk_sum.data));
    store(narrow(grads.dv, 1, first, last - first), static_cast<float*>(dv_sum.data));
  };
  const std::size_t grad_bytes = max_floats * sizeof(float);
  // parts[t % 2][i]: the sum for the i-th block computed at t, sent on at t + 1.
  std::array<std::array<AlignedBuffer, 2>, 2> parts;
  for (auto& pair : parts)
    for (AlignedBuffer& b : pair) b = AlignedBuffer(grad_bytes);
  AlignedBuffer chain_in(grad_bytes), home_in(grad_bytes);
  std::memset(chain_in.as<char>(), 0, grad_bytes);  // compute-only mode never receives it
  std::memset(home_in.as<char>(), 0, grad_bytes);
  // One piece's dq and one key segment's dk, dv.
  const std::int64_t piece = piece_rows(q.sizes[1], /*pieces=*/8, /*max_rows=*/1024);
  AlignedBuffer piece_dq(sizeof(float) * batch * piece * heads_q * dim), piece_dkv(grad_bytes);
  std::vector<int> own_reach(static_cast<std::size_t>(schedule.blocks()));
  for (int c = 0; c < schedule.blocks(); ++c) own_reach[c] = schedule.reach(rank, c);
  fill(grads.dq, 0.0f);

  std::array<MPI_Request, 4> requests;  // up to two sends, the chain's and home's receives
  requests.fill(MPI_REQUEST_NULL);
  const auto poll_all = [&] {
    poll(2, ring.requests());
    poll(4, requests.data());
  };
  // sum <- this rank's share of the block's dk, dv (0 where its queries never attend it);
  // dq += its share of dq.
  const auto attend = [&](const KvRing::Block& block, float* sum) {
    // (Not a structured binding: clang 14 refuses capturing one in the lambda below.)
    const std::pair<TensorView, TensorView> sums = grad_views(sum, block.source, block.block);
    const TensorView& dk_sum = sums.first;
    const TensorView& dv_sum = sums.second;
    std::memset(sum, 0, grad_floats(block.source, block.block) * sizeof(float));
    for_each_piece(schedule, rank, block.source, block.block, piece, compute, stats,
                   [&](const RingPiece& x) {
                     float* dkv = piece_dkv.as<float>();
                     const TensorView dq_piece = TensorView::contiguous(
                         piece_dq.as<float>(), DType::kF32, {batch, x.rows, heads_q, dim});
                     const TensorView dk_piece = TensorView::contiguous(
                         dkv, DType::kF32, {batch, x.keys, heads_kv, dim});
                     const TensorView dv_piece =
                         TensorView::contiguous(dkv + batch * x.keys * heads_kv * dim,
                                                DType::kF32, {batch, x.keys, heads_kv, dim_v});
                     attention_block_backward(
                         narrow(q, 1, x.q_row, x.rows), narrow(block.k, 1, x.k_row, x.keys),
                         narrow(block.v, 1, x.k_row, x.keys), narrow(out, 1, x.q_row, x.rows),
                         narrow(lse, 2, x.q_row, x.rows), narrow(dout, 1, x.q_row, x.rows),
                         {.dq = dq_piece, .dk = dk_piece, .dv = dv_piece}, params.attention,
                         {.q_offset = x.q_start,
                          .k_offset = x.k_start,
                          .seq_q = params.seq_q,
                          .seq_kv = params.seq_kv});
                     accumulate(narrow(grads.dq, 1, x.q_row, x.rows),
                                static_cast<const float*>(dq_piece.data));
                     accumulate(narrow(dk_sum, 1, x.k_row, x.keys),
                                static_cast<const float*>(dk_piece.data));
                     accumulate(narrow(dv_sum, 1, x.k_row, x.keys),
                                static_cast<const float*>(dv_piece.data));
                     poll_all();
                   });
  };

  struct Computed {
    int source, block, distance, reach;
  };
  std::vector<Computed> previous;  // what was computed at t - 1, its sums in parts[(t - 1) % 2]
  // One position past the K/V ring's: the last blocks' sums go home.
  for (int t = 0; t <= ring.positions(); ++t) {
    ring.post(t);
    // Sends: the sums of the blocks computed at t - 1, on along the ring or home.
    int next_request = 0;
    for (std::size_t i = 0; i < previous.size(); ++i) {
      const Computed& c = previous[i];
      if (c.distance == 0) continue;  // an own share: added into dk, dv already
      const bool home = c.distance == c.reach;
      const int count = static_cast<int>(grad_floats(c.source, c.block));
      if (transfer) {
        check_mpi(
            MPI_Isend(parts[(t - 1) % 2][i].as<float>(), count, MPI_FLOAT, home ? c.source : to,
                      home ? kHomeTag : kChainTag, ring_comm.get(), &requests[next_request++]),
            "MPI_Isend");
        stats.bytes_sent += static_cast<std::int64_t>(count * sizeof(float));
      }
    }
    // Receives: the sum for the block that arrived (from the rank before, sent at t), and the
    // sum coming home for an own block whose way ended at t - 1.
    const std::vector<KvRing::Block> blocks = ring.blocks(t);
    std::vector<Computed> computed;
    for (const KvRing::Block& b : blocks) {
      computed.push_back(
          {b.source, b.block, b.distance,
           b.distance == 0 ? own_reach[b.block] : schedule.reach(b.source, b.block)});
      if (b.distance > 1 && transfer) {
        check_mpi(MPI_Irecv(chain_in.as<float>(), static_cast<int>(grad_floats(b.source, b.block)),
                            MPI_FLOAT, from, kChainTag, ring_comm.get(), &requests[2]),
                  "MPI_Irecv");
      }
    }
    int home_block = -1;
    for (int c = 0; c < schedule.blocks(); ++c) {
      if (own_reach[c] > 0 && c * per_round + own_reach[c] + 1 == t) home_block = c;
    }
    if (home_block >= 0 && transfer) {
      check_mpi(MPI_Irecv(home_in.as<float>(), static_cast<int>(grad_floats(rank, home_block)),
                          MPI_FLOAT, (rank + own_reach[home_block]) % ranks, kHomeTag,
                          ring_comm.get(), &requests[3]),
                "MPI_Irecv");
    }
    for (std::size_t i = 0; i < blocks.size(); ++i) attend(blocks[i], parts[t % 2][i].as<float>());
    const double wait_start = MPI_Wtime();
    check_mpi(MPI_Waitall(2, ring.requests(), MPI_STATUSES_IGNORE), "MPI_Waitall");
    check_mpi(MPI_Waitall(4, requests.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
    stats.wait_seconds += MPI_Wtime() - wait_start;
    for (std::size_t i = 0; i < computed.size(); ++i) {
      const Computed& c = computed[i];
      float* sum = parts[t % 2][i].as<float>();
      if (c.distance > 1) {  // what the ranks before added, then this rank's share
        const float* before = chain_in.as<float>();
        const std::size_t n = grad_floats(c.source, c.block);
        for (std::size_t e = 0; e < n; ++e) sum[e] = before[e] + sum[e];
      } else if (c.distance == 0) {
        store_home(c.block, sum, /*add=*/false);  // this rank's own share first
      }
    }
    if (home_block >= 0) store_home(home_block, home_in.as<float>(), /*add=*/true);
    ring.finish(t);
    previous = std::move(computed);
  }
  stats.seconds = MPI_Wtime() - started;
  return stats;
}

}  // namespace distributed

RingStats ring_attention_backward(MPI_Comm comm, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& out, const TensorView& lse,
                                  const TensorView& dout, const AttentionGrads& grads,
                                  const RingParams& params) {
  return distributed::ring_attention_backward_mode(comm, q, k, v, out, lse, dout, grads, params,
                                                   distributed::RingMode::kFull);
}

}  // namespace qkv
