// qkv::ring_attention (qkv/ring_attention.h): K/V blocks around a ring of MPI ranks, partial
// attention at global positions, log-sum-exp merges.
//
// Every shard travels as C blocks of rows (RingSchedule). The ring runs C rounds of P - 1
// positions; at position k of round c, rank r receives block c of the shard of rank r - 1 - k
// from r - 1 and sends on to r + 1 what it received at the position before (at k = 0: block c
// of its own shard). So every block moves one hop per position and is passed on as soon as it
// has arrived: each link carries one block per position and a rank holds three blocks (the one
// arriving, the one computed and passed on, its own one leaving), never a whole shard of
// another rank. While they travel it computes its queries against the block that arrived at
// the position before (and at k = 0 against its own block c), in pieces of query rows with an
// MPI_Testall between pieces (Open MPI moves a large message only inside MPI calls), then
// waits. Which blocks are computed and which travel comes from RingSchedule: positions alone,
// so both ends of every transfer agree without messages.
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
  static constexpr int kFields = 21;
  static constexpr const char* kNames[kFields] = {
      "batch", "num_heads_q", "num_heads_kv", "head_dim", "head_dim_v", "dtype", "seq_q",
      "seq_kv", "layout", "causal", "align", "window_left", "window_right", "softcap (bits)",
      "scale (bits, -1 = default)", "kernel", "key_lengths entries", "key_lengths (hash)",
      "block_rows", "query rows", "key rows"};
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
             params.block_rows, q.sizes[1],
             k.sizes[1]};
  return s;
}

// Checks this rank's arguments (what can be checked alone), gathers every rank's signature and
// compares them; throws the same qkv::Error on every rank if anything is off.
void agree(MPI_Comm comm, int rank, int ranks, const TensorView& q, const TensorView& k,
           const TensorView& v, const AttentionOutputs& outputs, const RingParams& params) {
  Signature mine = signature_of(q, k, v, params);
  try {
    const AttentionParams& a = params.attention;
    if (params.block_rows < 0) {
      throw Error("block_rows = " + std::to_string(params.block_rows) +
                  " must be >= 0 (0: blocks of about 8 MiB)");
    }
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

// Packs k then v of one block contiguously: the message that travels ([B, rows, Hkv, D] then
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

  const std::int64_t batch = q.sizes[0], heads_q = q.sizes[2], heads_kv = k.sizes[2];
  const std::int64_t dim = k.sizes[3], dim_v = v.sizes[3];
  const int element = dtype_size(k.dtype);
  const RingSchedule schedule(params, ranks, batch * heads_kv * (dim + dim_v) * element);
  const int blocks = schedule.blocks();
  auto block_bytes = [&](int source, int block) {
    const auto [first, last] = schedule.block_rows(source, block);
    return static_cast<std::size_t>(batch * (last - first) * heads_kv * (dim + dim_v) * element);
  };
  std::size_t max_bytes = 0;
  for (int r = 0; r < ranks; ++r) {
    for (int c = 0; c < blocks; ++c) max_bytes = std::max(max_bytes, block_bytes(r, c));
  }
  if (max_bytes > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    throw Error("ring_attention: a K/V block of " + std::to_string(max_bytes) +
                " bytes is over MPI's int count (2 GiB); use a smaller block_rows or more ranks");
  }
  stats.block_bytes = static_cast<std::int64_t>(max_bytes);
  const bool transfer = mode != RingMode::kComputeOnly, compute = mode != RingMode::kTransferOnly;
  // Two slots take turns receiving and being computed (and passed on); the third sends this
  // rank's own block.
  std::array<AlignedBuffer, 2> slots = {AlignedBuffer(max_bytes), AlignedBuffer(max_bytes)};
  AlignedBuffer own(max_bytes);
  // Compute-only mode never receives: its slots stand in for the blocks with zeros (the same
  // sizes, the same skipped blocks).
  if (!transfer) {
    for (AlignedBuffer& slot : slots) std::memset(slot.as<char>(), 0, max_bytes);
  }

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

  std::array<MPI_Request, 2> requests = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  const auto poll = [&] {
    int done = 0;
    check_mpi(MPI_Testall(2, requests.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
  };
  const std::vector<RingSegment>& q_segments = schedule.q_segments(rank);
  // Merges this rank's queries against block `block` of `source`'s shard, whose rows are the
  // rows of `k_rows` / `v_rows` ([B, block rows, Hkv, D or Dv]).
  const auto attend = [&](int source, int block, const TensorView& k_rows, const TensorView& v_rows) {
    const std::vector<RingSegment> keys = schedule.block_keys(source, block);
    const double compute_start = MPI_Wtime();
    std::int64_t q_row = 0;
    for (const RingSegment& qs : q_segments) {
      std::int64_t k_row = 0;
      for (const RingSegment& ks : keys) {
        if (!compute || !schedule.interact(qs, ks)) {
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
          attention_block(narrow(q, 1, q_row + r0, n), narrow(k_rows, 1, k_row, ks.length),
                          narrow(v_rows, 1, k_row, ks.length), {.out = po, .lse = pl},
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
  };
  // Views of a block as it travels: k then v, contiguous.
  const auto packed = [&](char* base, int source, int block, TensorView& k_rows, TensorView& v_rows) {
    const auto [first, last] = schedule.block_rows(source, block);
    k_rows = TensorView::contiguous(base, k.dtype, {batch, last - first, heads_kv, dim});
    v_rows = TensorView::contiguous(base + batch * (last - first) * heads_kv * dim * element,
                                    k.dtype, {batch, last - first, heads_kv, dim_v});
  };

  const int to = (rank + 1) % ranks, from = (rank + ranks - 1) % ranks;
  // The block that arrived at the position before, in slots[1 - slot]: its source, or -1.
  int held = -1, held_block = 0, slot = 0;
  auto attend_held = [&] {
    if (held < 0) return;
    TensorView k_rows, v_rows;
    packed(slots[1 - slot].as<char>(), held, held_block, k_rows, v_rows);
    attend(held, held_block, k_rows, v_rows);
  };
  const int positions = std::max(ranks - 1, 1);  // per round; one rank: no transfers at all
  for (int block = 0; block < blocks; ++block) {
    for (int hop = 0; hop < positions; ++hop) {
      // Arriving: block `block` of rank r - 1 - hop, if rank r - 1 passes it on.
      const int incoming = ((rank - 1 - hop) % ranks + ranks) % ranks;
      const bool arrives = ranks > 1 && schedule.sends(incoming, block, hop);
      if (transfer && arrives) {
        check_mpi(MPI_Irecv(slots[slot].as<char>(), static_cast<int>(block_bytes(incoming, block)),
                            MPI_BYTE, from, 0, comm, &requests[0]),
                  "MPI_Irecv");
      }
      // Leaving: this rank's own block at hop 0, else the block that arrived before.
      const int outgoing = hop == 0 ? rank : held;
      if (ranks > 1 && outgoing >= 0) {
        if (schedule.sends(outgoing, block, hop)) {
          char* source = hop == 0 ? own.as<char>() : slots[1 - slot].as<char>();
          if (hop == 0) {
            const auto [first, last] = schedule.block_rows(rank, block);
            pack_shard(narrow(k, 1, first, last - first), narrow(v, 1, first, last - first), source);
          }
          if (transfer) {
            check_mpi(MPI_Isend(source, static_cast<int>(block_bytes(outgoing, block)), MPI_BYTE,
                                to, 0, comm, &requests[1]),
                      "MPI_Isend");
            stats.bytes_sent += static_cast<std::int64_t>(block_bytes(outgoing, block));
          }
        } else {
          ++stats.sends_skipped;
        }
      }
      // Computing: the block that arrived before, and this rank's own block at hop 0.
      attend_held();
      if (hop == 0) {
        const auto [first, last] = schedule.block_rows(rank, block);
        attend(rank, block, narrow(k, 1, first, last - first), narrow(v, 1, first, last - first));
      }
      const double wait_start = MPI_Wtime();
      check_mpi(MPI_Waitall(2, requests.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
      stats.wait_seconds += MPI_Wtime() - wait_start;
      if (!arrives && ranks > 1) {  // a block no rank from here on needs: all of it skipped
        stats.blocks_skipped += static_cast<std::int64_t>(
            q_segments.size() * schedule.block_keys(incoming, block).size());
      }
      held = arrives ? incoming : -1;
      held_block = block;
      slot = 1 - slot;
    }
  }
  attend_held();  // the last block to arrive
  stats.seconds = MPI_Wtime() - started;
  return stats;
}

}  // namespace distributed
}  // namespace qkv
