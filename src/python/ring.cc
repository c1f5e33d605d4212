// qkv._qkv's ring attention (qkv/ring_attention.h), built where qkv::distributed is: the
// communicator arrives as its Fortran handle (mpi4py's comm.py2f()), portable across MPI
// implementations, and must be of the MPI that qkv links (mpi4py over Debian's Open MPI is).
// The public, documented signatures are python/qkv/ring.py's.
#include "python/ring.h"

#include <mpi.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "python/arrays.h"
#include "python/options.h"
#include "qkv/error.h"
#include "qkv/ring_attention.h"

namespace qkv::python {
namespace {

using namespace nb::literals;

MPI_Comm communicator(std::int64_t fortran_handle) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    throw nb::value_error(
        "comm: MPI is not initialized (import mpi4py.MPI first) or already "
        "finalized");
  }
  return MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
}

RingLayout ring_layout(const std::string& layout) {
  if (layout == "contiguous") return RingLayout::kContiguous;
  if (layout == "zigzag") return RingLayout::kZigzag;
  throw nb::value_error(
      ("ring_layout: expected 'contiguous' or 'zigzag', got '" + layout + "'").c_str());
}

// The options as RingParams, and the key lengths they view.
struct PyRing {
  RingParams params;
  std::vector<std::int64_t> lengths;
};

void ring_params(nb::handle key_lengths, std::optional<float> scale, float softcap, bool causal,
                 const std::string& align, std::int64_t window_left, std::int64_t window_right,
                 const std::string& kernel, int num_threads, const std::string& layout,
                 std::int64_t seq_q, std::int64_t seq_kv, std::int64_t block_rows, PyRing& out) {
  out.lengths = key_lengths_of(key_lengths);
  out.params = {.attention = {.scale = scale,
                              .softcap = softcap,
                              .causal = causal,
                              .align = parse_align(align),
                              .window_left = window_left,
                              .window_right = window_right,
                              .key_lengths = out.lengths,
                              .kernel = parse_kernel(kernel),
                              .num_threads = num_threads},
                .layout = ring_layout(layout),
                .seq_q = seq_q,
                .seq_kv = seq_kv,
                .block_rows = block_rows};
}

nb::dict stats_dict(const RingStats& s) {
  nb::dict d;
  d["seconds"] = s.seconds;
  d["compute_seconds"] = s.compute_seconds;
  d["wait_seconds"] = s.wait_seconds;
  d["blocks_computed"] = s.blocks_computed;
  d["blocks_skipped"] = s.blocks_skipped;
  d["bytes_sent"] = s.bytes_sent;
  d["sends_skipped"] = s.sends_skipped;
  d["block_bytes"] = s.block_bytes;
  return d;
}

const std::initializer_list<DType> kInputs = {DType::kF32, DType::kBF16, DType::kF16};
const char* const kInputNames = "float32, bfloat16 or float16";

// q, k, v (this rank's shards, BSHD) and a float32 array of the shape `shape` names.
struct Shards {
  Held<InArray> q, k, v;
};

Shards shards(nb::handle q, nb::handle k, nb::handle v, int bf16_bits) {
  return {input_view("q", q, {4, 4, "4: (B, Lq_r, Hq, D)", kInputs, kInputNames}, bf16_bits & 1),
          input_view("k", k, {4, 4, "4: (B, Lk_r, Hkv, D)", kInputs, kInputNames}, bf16_bits & 2),
          input_view("v", v, {4, 4, "4: (B, Lk_r, Hkv, Dv)", kInputs, kInputNames}, bf16_bits & 4)};
}

// lse (B, Hq, Lq_r) as the library takes it, [B, Hq, Lq_r, 1].
TensorView lse_4d(TensorView view) {
  view.sizes = {view.sizes[1], view.sizes[2], view.sizes[3], 1};
  view.strides = {view.strides[1], view.strides[2], view.strides[3], 1};
  return view;
}

nb::dict ring_attention_binding(std::int64_t comm, nb::handle q, nb::handle k, nb::handle v,
                                nb::handle out, nb::handle lse, nb::handle key_lengths,
                                std::optional<float> scale, float softcap, bool causal,
                                const std::string& align, std::int64_t window_left,
                                std::int64_t window_right, const std::string& kernel,
                                int num_threads, const std::string& layout, std::int64_t seq_q,
                                std::int64_t seq_kv, std::int64_t block_rows, int bf16_bits) {
  const MPI_Comm c = communicator(comm);
  const Shards s = shards(q, k, v, bf16_bits);
  const Held<OutArray> out_held =
      output_view("out", out, {4, 4, "4: (B, Lq_r, Hq, Dv)", {DType::kF32}, "float32"});
  const Held<OutArray> lse_held =
      output_view("lse", lse, {3, 3, "3: (B, Hq, Lq_r)", {DType::kF32}, "float32"});
  PyRing ring;
  ring_params(key_lengths, scale, softcap, causal, align, window_left, window_right, kernel,
              num_threads, layout, seq_q, seq_kv, block_rows, ring);
  return stats_dict(without_gil([&] {
    return ring_attention(c, s.q.view, s.k.view, s.v.view,
                          {.out = out_held.view, .lse = lse_4d(lse_held.view)}, ring.params);
  }));
}

nb::dict ring_attention_backward_binding(
    std::int64_t comm, nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
    nb::handle dout, nb::handle dq, nb::handle dk, nb::handle dv, nb::handle key_lengths,
    std::optional<float> scale, float softcap, bool causal, const std::string& align,
    std::int64_t window_left, std::int64_t window_right, const std::string& kernel, int num_threads,
    const std::string& layout, std::int64_t seq_q, std::int64_t seq_kv, std::int64_t block_rows,
    int bf16_bits) {
  const MPI_Comm c = communicator(comm);
  const Shards s = shards(q, k, v, bf16_bits);
  const Held<InArray> out_held =
      input_view("out", out, {4, 4, "4: (B, Lq_r, Hq, Dv)", {DType::kF32}, "float32"});
  const Held<InArray> lse_held =
      input_view("lse", lse, {3, 3, "3: (B, Hq, Lq_r)", {DType::kF32}, "float32"});
  const Held<InArray> dout_held =
      input_view("dout", dout, {4, 4, "4: (B, Lq_r, Hq, Dv)", {DType::kF32}, "float32"});
  const Held<OutArray> dq_held =
      output_view("dq", dq, {4, 4, "4: the shape of q", {DType::kF32}, "float32"});
  const Held<OutArray> dk_held =
      output_view("dk", dk, {4, 4, "4: the shape of k", {DType::kF32}, "float32"});
  const Held<OutArray> dv_held =
      output_view("dv", dv, {4, 4, "4: the shape of v", {DType::kF32}, "float32"});
  PyRing ring;
  ring_params(key_lengths, scale, softcap, causal, align, window_left, window_right, kernel,
              num_threads, layout, seq_q, seq_kv, block_rows, ring);
  return stats_dict(without_gil([&] {
    return ring_attention_backward(
        c, s.q.view, s.k.view, s.v.view, out_held.view, lse_4d(lse_held.view), dout_held.view,
        {.dq = dq_held.view, .dk = dk_held.view, .dv = dv_held.view}, ring.params);
  }));
}

std::vector<std::pair<std::int64_t, std::int64_t>> ring_shard_binding(const std::string& layout,
                                                                      std::int64_t seq, int rank,
                                                                      int ranks) {
  std::vector<std::pair<std::int64_t, std::int64_t>> segments;
  try {
    for (const RingSegment& s : ring_shard(ring_layout(layout), seq, rank, ranks)) {
      segments.emplace_back(s.start, s.length);
    }
  } catch (const Error& error) {
    throw nb::value_error(error.what());
  }
  return segments;
}

}  // namespace

void define_ring(nb::module_& m) {
  m.def("ring_attention", &ring_attention_binding, "comm"_a, "q"_a.none(), "k"_a.none(),
        "v"_a.none(), "out"_a.none(), "lse"_a.none(), "key_lengths"_a.none(), "scale"_a.none(),
        "softcap"_a, "causal"_a, "align"_a, "window_left"_a, "window_right"_a, "kernel"_a,
        "num_threads"_a, "ring_layout"_a, "seq_q"_a, "seq_kv"_a, "block_rows"_a, "bf16_bits"_a);
  m.def("ring_attention_backward", &ring_attention_backward_binding, "comm"_a, "q"_a.none(),
        "k"_a.none(), "v"_a.none(), "out"_a.none(), "lse"_a.none(), "dout"_a.none(), "dq"_a.none(),
        "dk"_a.none(), "dv"_a.none(), "key_lengths"_a.none(), "scale"_a.none(), "softcap"_a,
        "causal"_a, "align"_a, "window_left"_a, "window_right"_a, "kernel"_a, "num_threads"_a,
        "ring_layout"_a, "seq_q"_a, "seq_kv"_a, "block_rows"_a, "bf16_bits"_a);
  m.def("ring_shard", &ring_shard_binding, "ring_layout"_a, "seq"_a, "rank"_a, "ranks"_a);
}

}  // namespace qkv::python
