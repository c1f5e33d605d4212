// The ring options of the command line (cli_ring.h): qkv attention --ring and qkv ring-bench.
#include "tools/cli_ring.h"

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/float16.h"
#include "distributed/ring_modes.h"
#include "qkv/error.h"
#include "qkv/ring_attention.h"
#include "tools/cli.h"
#include "tools/memory_probe.h"

namespace qkv::cli {


namespace {

// MPI for the process, started on first use and finished at exit.
void ensure_mpi() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  std::atexit([] {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  });
}

RingLayout layout_of(const std::string& text) {
  return text == "zigzag" ? RingLayout::kZigzag : RingLayout::kContiguous;
}

// rows of `full` (dim 1) in shard order -> a new contiguous shard buffer; returns its view.
TensorView make_shard(const TensorView& full, RingLayout layout, int rank, int ranks,
                      AlignedBuffer& storage) {
  std::int64_t rows = 0;
  for (const RingSegment& s : ring_shard(layout, full.sizes[1], rank, ranks)) rows += s.length;
  storage = AlignedBuffer(static_cast<std::size_t>(full.sizes[0] * rows * full.sizes[2] *
                                                   full.sizes[3] * dtype_size(full.dtype)));
  const TensorView shard = TensorView::contiguous(storage.as<void>(), full.dtype,
                                                  {full.sizes[0], rows, full.sizes[2], full.sizes[3]});
  copy_to_shard(full, shard, layout, rank, ranks);
  return shard;
}

int world(int* ranks) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, ranks);
  return rank;
}

}  // namespace

int ring_attention_cli(const TensorView& q, const TensorView& k, const TensorView& v,
                       const AttentionOutputs& outputs, const AttentionParams& params,
                       const RingCliOptions& options) {
  ensure_mpi();
  int ranks = 1;
  const int rank = world(&ranks);
  const RingLayout layout = layout_of(options.layout);
  const std::int64_t seq_q = q.sizes[1], seq_kv = k.sizes[1];
  // Shards of the inputs (a P-th of each), this rank's rows of the outputs.
  AlignedBuffer q_store, k_store, v_store, out_store, lse_store;
  RingParams ring{.attention = params, .layout = layout, .seq_q = seq_q, .seq_kv = seq_kv,
                  .block_rows = options.block_rows};
  TensorView qs, ks, vs;
  // What fails from here on fails on every rank alike (a sequence too short for the ranks, the
  // ranks' agreement check in ring_attention).
  try {
    qs = make_shard(q, layout, rank, ranks, q_store);
    ks = make_shard(k, layout, rank, ranks, k_store);
    vs = make_shard(v, layout, rank, ranks, v_store);
  } catch (const Error& e) {
    throw RingCollectiveError(e.what());
  }
  const std::int64_t rows = qs.sizes[1], batch = q.sizes[0], heads = q.sizes[2];
  const std::int64_t dim_v = v.sizes[3];
  out_store = AlignedBuffer(sizeof(float) * batch * rows * heads * dim_v);
  lse_store = AlignedBuffer(sizeof(float) * batch * heads * rows);
  const TensorView out = TensorView::contiguous(out_store.as<float>(), DType::kF32,
                                                {batch, rows, heads, dim_v});
  const TensorView lse = TensorView::contiguous(lse_store.as<float>(), DType::kF32,
                                                {batch, heads, rows, 1});
  try {
    ring_attention(MPI_COMM_WORLD, qs, ks, vs, {.out = out, .lse = lse}, ring);
  } catch (const Error& e) {
    throw RingCollectiveError(e.what());
  }

  // Rank 0 gathers every rank's rows (out as [B, rows, Hq, Dv], lse as [B, Hq, rows]).
  // (Exact byte counts: AlignedBuffer rounds its size up.)
  const int out_bytes = static_cast<int>(sizeof(float) * batch * rows * heads * dim_v);
  const int lse_bytes = static_cast<int>(sizeof(float) * batch * heads * rows);
  if (rank != 0) {
    MPI_Send(out.data, out_bytes, MPI_BYTE, 0, 1, MPI_COMM_WORLD);
    MPI_Send(lse.data, lse_bytes, MPI_BYTE, 0, 2, MPI_COMM_WORLD);
    return rank;
  }
  // lse [B, Hq, L, 1] seen as [B, L, Hq, 1] for the shard copies along dim 1.
  auto lse_rows = [](TensorView t) {
    std::swap(t.sizes[1], t.sizes[2]);
    std::swap(t.strides[1], t.strides[2]);
    return t;
  };
  for (int r = 0; r < ranks; ++r) {
    std::int64_t r_rows = 0;
    for (const RingSegment& s : ring_shard(layout, seq_q, r, ranks)) r_rows += s.length;
    std::vector<float> r_out(static_cast<std::size_t>(batch * r_rows * heads * dim_v));
    std::vector<float> r_lse(static_cast<std::size_t>(batch * heads * r_rows));
    if (r == 0) {
      std::copy_n(static_cast<const float*>(out.data), r_out.size(), r_out.begin());
      std::copy_n(static_cast<const float*>(lse.data), r_lse.size(), r_lse.begin());
    } else {
      MPI_Recv(r_out.data(), static_cast<int>(r_out.size() * 4), MPI_BYTE, r, 1, MPI_COMM_WORLD,
               MPI_STATUS_IGNORE);
      MPI_Recv(r_lse.data(), static_cast<int>(r_lse.size() * 4), MPI_BYTE, r, 2, MPI_COMM_WORLD,
               MPI_STATUS_IGNORE);
    }
    copy_from_shard(TensorView::contiguous(r_out.data(), DType::kF32, {batch, r_rows, heads, dim_v}),
                    outputs.out, layout, r, ranks);
    if (!outputs.lse.empty()) {
      copy_from_shard(lse_rows(TensorView::contiguous(r_lse.data(), DType::kF32,
                                                      {batch, heads, r_rows, 1})),
                      lse_rows(outputs.lse), layout, r, ranks);
    }
  }
  return 0;
}

bool mpi_active() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

int ring_exit_on_error(const std::exception& error) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (dynamic_cast<const RingCollectiveError*>(&error) != nullptr) {
    if (rank == 0) std::fprintf(stderr, "qkv: error: %s\n", error.what());
    return 2;
  }
  // Only this rank failed: the others would wait for it forever.
  std::fprintf(stderr, "qkv: error: rank %d: %s\n", rank, error.what());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 2);
  return 2;
}

// ---------------------------------------------------------------------------------------------
// qkv ring-bench

namespace {

constexpr const char* kBenchUsage =
    R"(usage: mpirun -np P qkv ring-bench [--shape B,Hq,Hkv,L,D] [--causal] [--ring-layout L]
                                [--ring-block ROWS] [--dtype f32|bf16] [--threads N]
                                [--repeats R] [--backward] [--json]

Times ring attention over the ranks of MPI_COMM_WORLD (docs/distributed.md). Each rank makes
its shard of random q, k, v (seeded by rank) and runs, R times each (median reported):
  compute   the ring's block attention without the transfers
  transfer  the ring's K/V transfers without the compute
  ring      the ring itself (transfers overlapping the compute)
and prints per rank: the three times, the ring's own compute and wait times, the hidden part
of the communication, (compute + transfer - ring) / transfer, and the peak resident memory of a
ring call above the memory before it (the shards excluded). Times are the ring loop's (the
agreement check and buffer setup, the same in every mode, are left out). Rank 0 then prints the slowest
rank's compute against the mean (load balance). With --backward the same for the ring's
backward (ring_attention_backward: K/V blocks, and each block's dk/dv one position behind),
after one forward for its out and lse, with dout ~ N(0, 1). Default shape 1,8,8,4096,64.

options:
  --shape B,Hq,Hkv,L,D  batch, query heads, kv heads, sequence length (Lq = Lk), head_dim
  --causal              causal (bottom-right; with Lq = Lk the same as top-left)
  --ring-layout L       contiguous (default) or zigzag
  --ring-block ROWS     K/V rows per message (default 0: blocks of about 8 MiB)
  --dtype T             f32 (default) or bf16 storage of q, k, v
  --threads N           OpenMP threads per rank (default 0 = OpenMP's default)
  --repeats R           timed repeats per mode (default 3)
  --backward            time the backward (its transfers carry K/V and the dk/dv sums)
  --json                one JSON object per rank on stdout (rank 0 prints them all)
  --help                this text
)";

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int run_ring_bench(std::vector<std::string> argv) {
  std::vector<std::int64_t> shape = {1, 8, 8, 4096, 64};
  bool causal = false, json = false, backward = false;
  std::string layout_text = "contiguous";
  std::int64_t block_rows = 0;
  DType dtype = DType::kF32;
  int threads = 0;
  std::int64_t repeats = 3;
  Args args(std::move(argv));
  while (!args.done()) {
    const std::string name = args.next();
    if (name == "--help" || name == "-h") {
      std::fputs(kBenchUsage, stdout);
      return 0;
    } else if (name == "--shape") {
      shape = parse_int_list(name, args.value(name));
      if (shape.size() != 5 || *std::min_element(shape.begin(), shape.end()) < 1 ||
          shape[1] % shape[2] != 0) {
        throw UsageError("--shape: expected B,Hq,Hkv,L,D (integers >= 1, Hq a multiple of Hkv)");
      }
    } else if (name == "--causal") {
      causal = true;
    } else if (name == "--ring-layout") {
      layout_text = parse_ring_layout(args.value(name));
    } else if (name == "--ring-block") {
      block_rows = parse_ring_block(args.value(name));
    } else if (name == "--dtype") {
      const std::string value = args.value(name);
      if (value != "f32" && value != "bf16") {
        throw UsageError("--dtype: expected f32 or bf16, got '" + value + "'");
      }
      dtype = value == "f32" ? DType::kF32 : DType::kBF16;
    } else if (name == "--threads") {
      const std::int64_t n = parse_int(name, args.value(name));
      if (n < 0 || n > 4096) throw UsageError("--threads: expected 0 to 4096");
      threads = static_cast<int>(n);
    } else if (name == "--repeats") {
      repeats = parse_int(name, args.value(name));
      if (repeats < 1 || repeats > 1000) throw UsageError("--repeats: expected 1 to 1000");
    } else if (name == "--json") {
      json = true;
    } else if (name == "--backward") {
      backward = true;
    } else {
      throw UsageError("unknown option '" + name + "' for ring-bench (try --help)");
    }
  }
  ensure_mpi();
  int ranks = 1;
  const int rank = world(&ranks);
  const std::int64_t batch = shape[0], heads_q = shape[1], heads_kv = shape[2], seq = shape[3];
  const std::int64_t dim = shape[4];
  const RingLayout layout = layout_of(layout_text);
  std::vector<RingSegment> segments;
  try {
    segments = ring_shard(layout, seq, rank, ranks);
  } catch (const Error& e) {
    throw RingCollectiveError(e.what());
  }
  std::int64_t rows = 0;
  for (const RingSegment& s : segments) rows += s.length;

  // This rank's shards: N(0, 1) values (bf16: rounded and stored as bits).
  std::mt19937_64 rng(1234 + rank);
  std::normal_distribution<float> normal;
  const int element = dtype_size(dtype);
  AlignedBuffer q_store(batch * rows * heads_q * dim * element);
  AlignedBuffer k_store(batch * rows * heads_kv * dim * element);
  AlignedBuffer v_store(batch * rows * heads_kv * dim * element);
  for (AlignedBuffer* b : {&q_store, &k_store, &v_store}) {
    const std::size_t n = b->bytes() / element;
    for (std::size_t i = 0; i < n; ++i) {
      const float x = normal(rng);
      if (dtype == DType::kF32) {
        b->as<float>()[i] = x;
      } else {
        b->as<std::uint16_t>()[i] = f32_to_bf16_bits(x);
      }
    }
  }
  const TensorView q = TensorView::contiguous(q_store.as<void>(), dtype, {batch, rows, heads_q, dim});
  const TensorView k = TensorView::contiguous(k_store.as<void>(), dtype, {batch, rows, heads_kv, dim});
  const TensorView v = TensorView::contiguous(v_store.as<void>(), dtype, {batch, rows, heads_kv, dim});
  std::vector<float> out(batch * rows * heads_q * dim), lse(batch * heads_q * rows);
  const AttentionOutputs outputs{
      .out = TensorView::contiguous(out.data(), DType::kF32, {batch, rows, heads_q, dim}),
      .lse = TensorView::contiguous(lse.data(), DType::kF32, {batch, heads_q, rows, 1})};
  const RingParams params{.attention = {.causal = causal, .num_threads = threads},
                          .layout = layout,
                          .seq_q = seq,
                          .seq_kv = seq,
                          .block_rows = block_rows};
  // The backward's dout ~ N(0, 1) and its gradients.
  std::vector<float> dout, dq, dk, dv;
  if (backward) {
    dout.resize(out.size());
    for (float& x : dout) x = normal(rng);
    dq.resize(batch * rows * heads_q * dim);
    dk.resize(batch * rows * heads_kv * dim);
    dv.resize(dk.size());
  }
  const AttentionGrads grads{
      .dq = TensorView::contiguous(dq.data(), DType::kF32, {batch, rows, heads_q, dim}),
      .dk = TensorView::contiguous(dk.data(), DType::kF32, {batch, rows, heads_kv, dim}),
      .dv = TensorView::contiguous(dv.data(), DType::kF32, {batch, rows, heads_kv, dim})};
  using distributed::RingMode;
  auto run = [&](RingMode mode) {
    MPI_Barrier(MPI_COMM_WORLD);  // every mode starts with the ranks together
    try {
      if (backward) {
        return distributed::ring_attention_backward_mode(
            MPI_COMM_WORLD, q, k, v, outputs.out, outputs.lse,
            TensorView::contiguous(dout.data(), DType::kF32, {batch, rows, heads_q, dim}), grads,
            params, mode);
      }
      return distributed::ring_attention_mode(MPI_COMM_WORLD, q, k, v, outputs, params, mode);
    } catch (const Error& e) {
      throw RingCollectiveError(e.what());
    }
  };
  if (backward) {  // the forward's out and lse
    try {
      ring_attention(MPI_COMM_WORLD, q, k, v, outputs, params);
    } catch (const Error& e) {
      throw RingCollectiveError(e.what());
    }
  }
  run(RingMode::kFull);  // warm-up: scratch, primitives, connections
  std::vector<double> compute, transfer, ring, ring_compute, ring_wait;
  RingStats last;
  // The loop's time only (compute + wait): the agreement check and setup are the same in every
  // mode. compute: the compute-only pass's compute; transfer: the transfer-only pass's waits.
  for (std::int64_t r = 0; r < repeats; ++r) {
    compute.push_back(run(RingMode::kComputeOnly).compute_seconds);
    transfer.push_back(run(RingMode::kTransferOnly).wait_seconds);
    last = run(RingMode::kFull);
    ring.push_back(last.compute_seconds + last.wait_seconds);
    ring_compute.push_back(last.compute_seconds);
    ring_wait.push_back(last.wait_seconds);
  }
  const tools::MemoryUsage memory = tools::measure_peak_memory([&] { run(RingMode::kFull); });

  // Per rank: compute, transfer, ring, ring compute, ring wait, peak extra MiB, blocks computed,
  // bytes sent.
  std::array<double, 8> mine = {median(compute), median(transfer), median(ring),
                                median(ring_compute), median(ring_wait),
                                memory.peak_extra_bytes() / 1048576.0,
                                static_cast<double>(last.blocks_computed),
                                static_cast<double>(last.bytes_sent)};
  std::vector<double> all(8 * ranks);
  MPI_Gather(mine.data(), 8, MPI_DOUBLE, all.data(), 8, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (rank != 0) return 0;
  if (!json) {
    std::printf("ring attention%s, %d ranks, shape B=%lld Hq=%lld Hkv=%lld L=%lld D=%lld%s, %s, %s, "
                "K/V blocks of %.2f MiB\n",
                backward ? " backward" : "", ranks, (long long)batch, (long long)heads_q, (long long)heads_kv, (long long)seq,
                (long long)dim, causal ? " causal" : "", layout_text.c_str(), dtype_name(dtype),
                last.block_bytes / 1048576.0);
    std::printf("%5s %10s %10s %10s %10s %10s %8s %9s %7s %10s\n", "rank", "compute s",
                "transfer s", "ring s", "ring cmp s", "wait s", "hidden", "peak MiB", "blocks",
                "sent MiB");
  }
  double sum_compute = 0, max_compute = 0;
  for (int r = 0; r < ranks; ++r) {
    const double* x = &all[8 * r];
    const double hidden = x[1] > 0 ? (x[0] + x[1] - x[2]) / x[1] : 1.0;
    sum_compute += x[0];
    max_compute = std::max(max_compute, x[0]);
    if (json) {
      std::printf("{\"pass\": \"%s\", \"rank\": %d, \"ranks\": %d, \"B\": %lld, \"Hq\": %lld, \"Hkv\": %lld, "
                  "\"L\": %lld, \"D\": %lld, \"causal\": %s, \"layout\": \"%s\", \"dtype\": \"%s\", "
                  "\"compute_seconds\": %.6g, \"transfer_seconds\": %.6g, \"ring_seconds\": %.6g, "
                  "\"ring_compute_seconds\": %.6g, \"ring_wait_seconds\": %.6g, "
                  "\"hidden_fraction\": %.4f, \"peak_extra_mib\": %.2f, \"blocks_computed\": %.0f, "
                  "\"bytes_sent\": %.0f, \"block_bytes\": %lld}\n",
                  backward ? "backward" : "forward", r, ranks, (long long)batch, (long long)heads_q, (long long)heads_kv,
                  (long long)seq, (long long)dim, causal ? "true" : "false", layout_text.c_str(),
                  dtype_name(dtype), x[0], x[1], x[2], x[3], x[4], hidden, x[5], x[6], x[7],
                  (long long)last.block_bytes);
    } else {
      std::printf("%5d %10.4f %10.4f %10.4f %10.4f %10.4f %7.0f%% %9.1f %7.0f %10.1f\n", r, x[0],
                  x[1], x[2], x[3], x[4], 100 * hidden, x[5], x[6], x[7] / 1048576.0);
    }
  }
  if (!json) {
    std::printf("load balance: slowest rank's compute / mean = %.3f\n",
                max_compute / (sum_compute / ranks));
  }
  return 0;
}

}  // namespace qkv::cli
