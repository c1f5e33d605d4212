// The pieces the ring's forward and backward share (distributed/ring_common.h).
#include "distributed/ring_common.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "ops/validate.h"
#include "qkv/block_attention.h"
#include "qkv/error.h"

namespace qkv::distributed {
namespace {

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

}  // namespace

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

// Checks this rank's arguments (what can be checked alone), gathers every rank's signature and
// compares them; throws the same qkv::Error on every rank if anything is off.
void agree(MPI_Comm comm, int rank, int ranks, const TensorView& q, const TensorView& k,
           const TensorView& v, const AttentionOutputs& outputs, const RingParams& params,
           const char* op, const std::function<void()>& more_checks) {
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
    if (more_checks) more_checks();
  } catch (const Error& e) {
    std::strncpy(mine.error.data(), e.what(), mine.error.size() - 1);
  }
  std::vector<Signature> all(static_cast<std::size_t>(ranks));
  check_mpi(MPI_Allgather(&mine, sizeof(Signature), MPI_BYTE, all.data(), sizeof(Signature),
                          MPI_BYTE, comm),
            "MPI_Allgather");
  for (int r = 0; r < ranks; ++r) {
    if (all[r].error[0] != '\0') {
      throw Error(std::string(op) + ": rank " + std::to_string(r) + ": " + all[r].error.data());
    }
  }
  for (int r = 1; r < ranks; ++r) {
    for (int f = 0; f < Signature::kFields - 2; ++f) {  // the last two are per rank
      if (all[r].field[f] != all[0].field[f]) {
        throw Error(std::string(op) + ": rank " + std::to_string(r) + " has " + Signature::kNames[f] +
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

std::int64_t piece_rows(std::int64_t q_rows, std::int64_t pieces, std::int64_t max_rows) {
  constexpr std::int64_t kMinPieceRows = 64;
  return std::min(q_rows, std::clamp(q_rows / pieces, kMinPieceRows, max_rows));
}

void poll(int count, MPI_Request* requests) {
  int done = 0;
  check_mpi(MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
}

void fill(const TensorView& view, float value) {
  auto* data = static_cast<float*>(view.data);
  for (std::int64_t a = 0; a < view.sizes[0]; ++a)
    for (std::int64_t b = 0; b < view.sizes[1]; ++b)
      for (std::int64_t c = 0; c < view.sizes[2]; ++c)
        for (std::int64_t d = 0; d < view.sizes[3]; ++d) data[view.offset(a, b, c, d)] = value;
}

}  // namespace qkv::distributed
