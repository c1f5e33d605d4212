// qkv::ring_attention (qkv/ring_attention.h): K/V shards around a ring of MPI ranks, partial
// attention at global positions, log-sum-exp merges.
//
// Step s of P: rank r holds the K/V shard of rank (r - s) mod P in `current`. It posts the
// receive of the next shard (from r - 1) into `next` and the send of `current` (to r + 1), then
// computes with `current` while they travel, in pieces of query rows with an MPI_Testall between
// pieces (Open MPI moves a large message only inside MPI calls), then waits and swaps. Which
// steps compute and which shards travel comes from RingSchedule: positions alone, so both ends
// of every transfer agree without messages.
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "distributed/ring_modes.h"
#include "distributed/ring_schedule.h"
#include "ops/validate.h"
#include "qkv/block_attention.h"
#include "qkv/error.h"
#include "qkv/ring_attention.h"

namespace qkv {
namespace {

using distributed::RingSchedule;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Query rows per compute piece between two MPI_Testall calls: a step's compute is cut into at
// least ~16 pieces (Open MPI pushes a large TCP message along only inside MPI calls), of 64 to
// 256 rows (smaller pieces would cost the kernels their tile efficiency).
constexpr std::int64_t kMinPieceRows = 64, kMaxPieceRows = 256, kPiecesPerStep = 16;

void check_mpi(int code, const char* what) {
  if (code != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(code, text, &length);
    throw Error(std::string("ring_attention: ") + what + " failed: " + std::string(text, length));
  }
}

// dim `dim` of `view` narrowed to [start, start + n).
TensorView narrow(TensorView view, int dim, std::int64_t start, std::int64_t n) {
  view.data = static_cast<char*>(view.data) + start * view.strides[dim] * dtype_size(view.dtype);
  view.sizes[dim] = n;
  return view;
}

// What every rank must agree on, and what each rank holds, as int64s for one MPI_Allgather.
// An error found on one rank travels in `error` so that every rank throws it.
struct Signature {
  static constexpr int kFields = 20;
  static constexpr const char* kNames[kFields] = {
      "batch", "num_heads_q", "num_heads_kv", "head_dim", "head_dim_v", "dtype", "seq_q",
      "seq_kv", "layout", "causal", "align", "window_left", "window_right", "softcap (bits)",
      "scale (bits, -1 = default)", "kernel", "key_lengths entries", "key_lengths (hash)",
      "query rows", "key rows"};
  std::array<std::int64_t, kFields> field{};
  std::array<char, 512> error{};
};

std::int64_t float_bits(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return bits;
}

Signature signature_of(const TensorView& q, const TensorView& k, const TensorView& v,
                       const RingParams& params) {
  const AttentionParams& a = params.attention;
  std::uint64_t hash = 1469598103934665603ull;  // FNV-1a over the key lengths
  for (const std::int64_t length : a.key_lengths) hash = (hash ^ std::uint64_t(length)) * 1099511628211ull;
  Signature s;
  s.field = {q.sizes[0],       q.sizes[2],
             k.sizes[2],       q.sizes[3],
             v.sizes[3],       static_cast<std::int64_t>(q.dtype),
             params.seq_q,     params.seq_kv,
             static_cast<std::int64_t>(params.layout), a.causal,
             static_cast<std::int64_t>(a.align), a.window_left,
             a.window_right,   float_bits(a.softcap),
             a.scale ? float_bits(*a.scale) : -1, static_cast<std::int64_t>(a.kernel),
             static_cast<std::int64_t>(a.key_lengths.size()), static_cast<std::int64_t>(hash >> 1),
             q.sizes[1],       k.sizes[1]};
  return s;
}

// Checks this rank's arguments (what can be checked alone), gathers every rank's signature and
// compares them; throws the same qkv::Error on every rank if anything is off.
void agree(MPI_Comm comm, int rank, int ranks, const TensorView& q, const TensorView& k,
           const TensorView& v, const AttentionOutputs& outputs, const RingParams& params) {
  Signature mine = signature_of(q, k, v, params);
  try {
    const AttentionParams& a = params.attention;
    if (params.layout == RingLayout::kZigzag && params.seq_q != params.seq_kv) {
      throw Error("layout: zigzag needs seq_q == seq_kv (self-attention), got " +
                  std::to_string(params.seq_q) + " and " + std::to_string(params.seq_kv));
    }
    const auto q_rows = ring_shard(params.layout, params.seq_q, rank, ranks);
    const auto kv_rows = ring_shard(params.layout, params.seq_kv, rank, ranks);
    std::int64_t q_expected = 0, kv_expected = 0;
    for (const RingSegment& s : q_rows) q_expected += s.length;
    for (const RingSegment& s : kv_rows) kv_expected += s.length;
    if (q.sizes[1] != q_expected || k.sizes[1] != kv_expected) {
      throw Error("rank " + std::to_string(rank) + " holds " + std::to_string(q.sizes[1]) +
                  " query rows and " + std::to_string(k.sizes[1]) + " key rows; its shards of seq_q = " +
                  std::to_string(params.seq_q) + " and seq_kv = " + std::to_string(params.seq_kv) +
                  " over " + std::to_string(ranks) + " ranks have " + std::to_string(q_expected) +
                  " and " + std::to_string(kv_expected) + " (q: shape " + shape_string(q.sizes) +
                  ", k: shape " + shape_string(k.sizes) + ")");
    }
    // The block call checks shapes, dtypes, options and outputs: a dry run on the first
    // segment pair, writing nothing (its output is a scratch copy of one row).
    if (!a.mask.empty() || !a.bias.empty() || a.sparsity) {
      throw Error(std::string(!a.mask.empty() ? "mask" : !a.bias.empty() ? "bias" : "sparsity") +
                  ": not available for ring attention (positions-defined masks only)");
    }
    if (outputs.out.empty()) throw Error("out: required");
    if (!outputs.probs.empty()) throw Error("probs: not available for ring attention");
    ops::require_dtype("out", outputs.out, DType::kF32, "expected f32");
    ops::require_shape("out", outputs.out, {q.sizes[0], q.sizes[1], q.sizes[2], v.sizes[3]},
                       "(B, this rank's query rows, Hq, Dv)");
    ops::require_writable_strides("out", outputs.out);
    if (!outputs.lse.empty()) {
      ops::require_dtype("lse", outputs.lse, DType::kF32, "expected f32");
      ops::require_shape("lse", outputs.lse, {q.sizes[0], q.sizes[2], q.sizes[1], 1},
                         "(B, Hq, this rank's query rows, 1)");
      ops::require_writable_strides("lse", outputs.lse);
    }
    const ops::NamedView written[] = {{"out", &outputs.out}, {"lse", &outputs.lse}};
    const ops::NamedView read[] = {{"q", &q}, {"k", &k}, {"v", &v}};
    ops::require_no_overlap(written, read);
    std::vector<float> out_row(static_cast<std::size_t>(q.sizes[0] * q.sizes[2] * v.sizes[3]));
    std::vector<float> lse_row(static_cast<std::size_t>(q.sizes[0] * q.sizes[2]));
    AttentionOutputs dry{
        .out = TensorView::contiguous(out_row.data(), DType::kF32, {q.sizes[0], 1, q.sizes[2], v.sizes[3]}),
        .lse = TensorView::contiguous(lse_row.data(), DType::kF32, {q.sizes[0], q.sizes[2], 1, 1})};
    attention_block(narrow(q, 1, 0, 1), narrow(k, 1, 0, 1), narrow(v, 1, 0, 1), dry, a,
                    {.q_offset = q_rows[0].start, .k_offset = kv_rows[0].start,
                     .seq_q = params.seq_q, .seq_kv = params.seq_kv});
  } catch (const Error& e) {
    std::strncpy(mine.error.data(), e.what(), mine.error.size() - 1);
  }
  std::vector<Signature> all(static_cast<std::size_t>(ranks));
  check_mpi(MPI_Allgather(&mine, sizeof(Signature), MPI_BYTE, all.data(), sizeof(Signature),
                          MPI_BYTE, comm),
            "MPI_Allgather");
  for (int r = 0; r < ranks; ++r) {
    if (all[r].error[0] != '\0') {
      throw Error("ring_attention: rank " + std::to_string(r) + ": " + all[r].error.data());
    }
  }
  for (int r = 1; r < ranks; ++r) {
    for (int f = 0; f < Signature::kFields - 2; ++f) {  // the last two are per rank
      if (all[r].field[f] != all[0].field[f]) {
        throw Error("ring_attention: rank " + std::to_string(r) + " has " + Signature::kNames[f] +
                    " = " + std::to_string(all[r].field[f]) + " but rank 0 has " +
                    std::to_string(all[0].field[f]) + " (every rank must pass the same shapes, "
                    "dtype and options)");
      }
    }
  }
}

// Packs k then v of one shard contiguously: the message that travels ([B, rows, Hkv, D] then
// [B, rows, Hkv, Dv], in the inputs' dtype).
void pack_shard(const TensorView& k, const TensorView& v, char* dst) {
  const int size = dtype_size(k.dtype);
  for (const TensorView* t : {&k, &v}) {
    const auto* src = static_cast<const char*>(t->data);
    for (std::int64_t b = 0; b < t->sizes[0]; ++b)
      for (std::int64_t i = 0; i < t->sizes[1]; ++i)
        for (std::int64_t h = 0; h < t->sizes[2]; ++h) {
          if (t->strides[3] == 1) {
            std::memcpy(dst, src + t->offset(b, i, h, 0) * size, t->sizes[3] * size);
            dst += t->sizes[3] * size;
          } else {
            for (std::int64_t d = 0; d < t->sizes[3]; ++d, dst += size) {
              std::memcpy(dst, src + t->offset(b, i, h, d) * size, size);
            }
          }
        }
  }
}

}  // namespace

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
  // A communicator of our own: the ring's messages never meet the caller's.
  MPI_Comm ring_comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(comm, &ring_comm), "MPI_Comm_dup");
  struct Free {
    MPI_Comm* c;
    ~Free() { MPI_Comm_free(c); }
  } free_comm{&ring_comm};
  comm = ring_comm;
  agree(comm, rank, ranks, q, k, v, outputs, params);

  const RingSchedule schedule(params, ranks);
  const std::int64_t batch = q.sizes[0], heads_q = q.sizes[2], heads_kv = k.sizes[2];
  const std::int64_t dim = k.sizes[3], dim_v = v.sizes[3];
  const int element = dtype_size(k.dtype);
  auto shard_bytes = [&](int r) {
    return static_cast<std::size_t>(batch * schedule.kv_rows(r) * heads_kv * (dim + dim_v) * element);
  };
  std::size_t max_bytes = 0;
  for (int r = 0; r < ranks; ++r) max_bytes = std::max(max_bytes, shard_bytes(r));
  if (max_bytes > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    throw Error("ring_attention: a K/V shard of " + std::to_string(max_bytes) +
                " bytes is over MPI's int count (2 GiB); use more ranks");
  }
  AlignedBuffer current(max_bytes), next(max_bytes);
  const bool transfer = mode != RingMode::kComputeOnly, compute = mode != RingMode::kTransferOnly;
  // Compute-only mode reads up to max_bytes of its own shard's buffer (a longer shard's rows).
  if (!transfer) std::memset(current.as<char>(), 0, max_bytes);
  pack_shard(k, v, current.as<char>());

  // Accumulators: out = 0, lse = -inf (nothing seen yet). lse is the caller's or ours.
  const TensorView& out = outputs.out;
  AlignedBuffer own_lse;
  TensorView lse = outputs.lse;
  if (lse.empty()) {
    own_lse = AlignedBuffer(sizeof(float) * batch * heads_q * q.sizes[1]);
    lse = TensorView::contiguous(own_lse.as<float>(), DType::kF32, {batch, heads_q, q.sizes[1], 1});
  }
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < q.sizes[1]; ++i)
      for (std::int64_t h = 0; h < heads_q; ++h) {
        for (std::int64_t d = 0; d < dim_v; ++d) static_cast<float*>(out.data)[out.offset(b, i, h, d)] = 0.0f;
        static_cast<float*>(lse.data)[lse.offset(b, h, i, 0)] = kNegInf;
      }
  const std::int64_t piece_rows = std::min(
      q.sizes[1], std::clamp(q.sizes[1] / kPiecesPerStep, kMinPieceRows, kMaxPieceRows));
  AlignedBuffer part_out(sizeof(float) * batch * piece_rows * heads_q * dim_v);
  AlignedBuffer part_lse(sizeof(float) * batch * heads_q * piece_rows);

  const int to = (rank + 1) % ranks, from = (rank + ranks - 1) % ranks;
  for (int step = 0; step < ranks; ++step) {
    const int source = (rank - step + ranks) % ranks;
    const int incoming = (from - step + ranks) % ranks;  // what `from` holds at this step
    std::array<MPI_Request, 2> requests = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    if (transfer && step + 1 < ranks) {
      if (schedule.forward(incoming, step)) {
        check_mpi(MPI_Irecv(next.as<char>(), static_cast<int>(shard_bytes(incoming)), MPI_BYTE,
                            from, step, comm, &requests[0]),
                  "MPI_Irecv");
      }
      if (schedule.forward(source, step)) {
        check_mpi(MPI_Isend(current.as<char>(), static_cast<int>(shard_bytes(source)), MPI_BYTE,
                            to, step, comm, &requests[1]),
                  "MPI_Isend");
        stats.bytes_sent += static_cast<std::int64_t>(shard_bytes(source));
      } else {
        ++stats.sends_skipped;
      }
    }
    const auto poll = [&] {
      int done = 0;
      check_mpi(MPI_Testall(2, requests.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    };

    // The source's shard as views over `current`.
    const std::int64_t rows = schedule.kv_rows(source);
    char* base = current.as<char>();
    const TensorView k_shard = TensorView::contiguous(base, k.dtype, {batch, rows, heads_kv, dim});
    const TensorView v_shard = TensorView::contiguous(
        base + batch * rows * heads_kv * dim * element, k.dtype, {batch, rows, heads_kv, dim_v});
    const double compute_start = MPI_Wtime();
    std::int64_t q_row = 0;
    for (const RingSegment& qs : compute ? schedule.q_segments(rank) : std::vector<RingSegment>{}) {
      std::int64_t k_row = 0;
      for (const RingSegment& ks : schedule.kv_segments(source)) {
        if (!schedule.interact(qs, ks)) {
          ++stats.blocks_skipped;
          k_row += ks.length;
          continue;
        }
        ++stats.blocks_computed;
        for (std::int64_t r0 = 0; r0 < qs.length; r0 += piece_rows) {
          const std::int64_t n = std::min(piece_rows, qs.length - r0);
          const TensorView po = TensorView::contiguous(part_out.as<float>(), DType::kF32,
                                                       {batch, n, heads_q, dim_v});
          const TensorView pl =
              TensorView::contiguous(part_lse.as<float>(), DType::kF32, {batch, heads_q, n, 1});
          attention_block(narrow(q, 1, q_row + r0, n), narrow(k_shard, 1, k_row, ks.length),
                          narrow(v_shard, 1, k_row, ks.length), {.out = po, .lse = pl},
                          params.attention,
                          {.q_offset = qs.start + r0, .k_offset = ks.start,
                           .seq_q = params.seq_q, .seq_kv = params.seq_kv});
          merge_attention(narrow(out, 1, q_row + r0, n), narrow(lse, 2, q_row + r0, n), po, pl,
                          params.attention.num_threads);
          poll();
        }
        k_row += ks.length;
      }
      q_row += qs.length;
    }
    stats.compute_seconds += MPI_Wtime() - compute_start;
    const double wait_start = MPI_Wtime();
    check_mpi(MPI_Waitall(2, requests.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
    stats.wait_seconds += MPI_Wtime() - wait_start;
    if (transfer) std::swap(current, next);
  }
  stats.seconds = MPI_Wtime() - started;
  return stats;
}

}  // namespace distributed
}  // namespace qkv
