// qkv demo: the main job. The seed article's scenario (8 heads, embed 512 -> head_dim 64,
// self-attention) run through standard, chunked and flash attention at growing sequence lengths,
// filling in the performance-comparison table the article leaves empty, measured on this machine
// in this run.
//
//   q, k, v, out: [B=1, L, H=8, D=64] f32 (BSHD), Lq = Lk = L
//
// "standard" is the reference kernel: like the article's scaled_dot_product_attention it
// materialises the L x L score matrix (the article's version holds B*H*L*L floats at once; ours
// one per (batch, head) being computed). "chunked" is the article's MemoryEfficientAttention
// (query chunks), "flash" the tiled online softmax. Each is checked against float64 attention
// computed here, with plain double loops, on a sample of query rows.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "qkv/attention.h"
#include "qkv/tensor.h"
#include "tools/cli.h"
#include "tools/fma_probe.h"
#include "tools/memory_probe.h"
#include "tools/random_fill.h"

namespace qkv::cli {
namespace {

constexpr std::int64_t kBatch = 1;
constexpr std::int64_t kNumHeads = 8;
constexpr std::int64_t kEmbed = 512;
constexpr std::int64_t kHeadDim = kEmbed / kNumHeads;  // 64
constexpr std::int64_t kSampleRows = 32;               // float64-checked rows when L > 256

constexpr const char* kDemoUsage =
    "usage: qkv demo [--max-len N | --lengths L1,L2,...] [--threads N] [--budget-mib M]\n"
    "                [--causal]\n"
    "\n"
    "The seed article's scenario: B=1, 8 heads, embed 512 -> head_dim 64, self-attention\n"
    "(Lq = Lk = L), f32 random inputs. Runs standard (the reference kernel, which materialises\n"
    "the L x L score matrix), chunked (query-chunked 'memory-efficient') and flash attention at\n"
    "growing L and prints one table: time, GFLOP/s, fraction of this machine's FMA peak\n"
    "(measured first, in the same process), peak extra memory and max error against float64.\n"
    "\n"
    "options:\n"
    "  --max-len N      lengths 256, 1024, 4096, ... (x4) up to N (default 16384)\n"
    "  --lengths a,b,c  these lengths instead (each >= 1)\n"
    "  --threads N      threads for the kernels and the peak probe (default 0 = OpenMP's default)\n"
    "  --budget-mib M   standard attention runs only where its score matrix, B*H*L*L*4 bytes as\n"
    "                   the article's implementation holds it, fits in M MiB (default 1024)\n"
    "  --causal         causal self-attention (GFLOP/s then count only the allowed pairs)\n"
    "  --help           this text\n"
    "\n"
    "See docs/cli-bench-demo.md for what each column means and how it is measured.\n";

struct DemoOptions {
  std::vector<std::int64_t> lengths;
  int threads = 0;
  double budget_mib = 1024.0;
  bool causal = false;
};

DemoOptions parse_options(std::vector<std::string> argv, bool* help) {
  DemoOptions options;
  std::int64_t max_len = 16384;
  bool lengths_given = false, max_len_given = false;
  Args args(std::move(argv));
  while (!args.done()) {
    const std::string arg = args.next();
    if (arg == "--help" || arg == "-h") {
      *help = true;
    } else if (arg == "--causal") {
      options.causal = true;
    } else if (arg == "--max-len") {
      max_len = parse_int(arg, args.value(arg));
      if (max_len < 1) throw UsageError("--max-len: expected >= 1, got " + std::to_string(max_len));
      max_len_given = true;
    } else if (arg == "--lengths") {
      options.lengths = parse_int_list(arg, args.value(arg));
      for (std::int64_t length : options.lengths) {
        if (length < 1 || length > (std::int64_t{1} << 24)) {
          throw UsageError("--lengths: each length must be in [1, 16777216], got " +
                           std::to_string(length));
        }
      }
      lengths_given = true;
    } else if (arg == "--threads") {
      const std::int64_t threads = parse_int(arg, args.value(arg));
      if (threads < 0 || threads > 4096) {
        throw UsageError("--threads: expected 0 (default) to 4096, got " + std::to_string(threads));
      }
      options.threads = static_cast<int>(threads);
    } else if (arg == "--budget-mib") {
      const std::string text = args.value(arg);
      options.budget_mib = parse_double(arg, text);
      if (!(options.budget_mib >= 0.0) || !std::isfinite(options.budget_mib)) {
        throw UsageError("--budget-mib: expected a number >= 0, got '" + text + "'");
      }
    } else {
      throw UsageError("unknown option '" + arg + "' for demo (try 'qkv demo --help')");
    }
  }
  if (lengths_given && max_len_given) {
    throw UsageError("--lengths and --max-len: give one or the other");
  }
  if (!lengths_given) {
    for (std::int64_t length = 256; length <= max_len; length *= 4)
      options.lengths.push_back(length);
    if (options.lengths.empty()) options.lengths.push_back(max_len);
  }
  return options;
}

// The float64 oracle of this demo, independent of the library: exact softmax attention of the
// sampled query rows, every head. expected: [rows, H, D].
std::vector<double> exact_rows(const std::vector<float>& q, const std::vector<float>& k,
                               const std::vector<float>& v, std::int64_t seq,
                               const std::vector<std::int64_t>& rows, bool causal) {
  // q, k, v: [1, L, H, D] contiguous
  const double scale = 1.0 / std::sqrt(static_cast<double>(kHeadDim));
  std::vector<double> expected(rows.size() * kNumHeads * kHeadDim, 0.0);
  std::vector<double> scores(seq);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const std::int64_t i = rows[r];
    const std::int64_t num_keys = causal ? i + 1 : seq;  // Lq == Lk: both alignments agree
    for (std::int64_t h = 0; h < kNumHeads; ++h) {
      const float* q_row = &q[(i * kNumHeads + h) * kHeadDim];
      double max_score = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j < num_keys; ++j) {
        const float* k_row = &k[(j * kNumHeads + h) * kHeadDim];
        double dot = 0.0;
        for (std::int64_t d = 0; d < kHeadDim; ++d) dot += double{q_row[d]} * double{k_row[d]};
        scores[j] = dot * scale;
        max_score = std::max(max_score, scores[j]);
      }
      double sum = 0.0;
      for (std::int64_t j = 0; j < num_keys; ++j) {
        scores[j] = std::exp(scores[j] - max_score);
        sum += scores[j];
      }
      double* out_row = &expected[(r * kNumHeads + h) * kHeadDim];
      for (std::int64_t j = 0; j < num_keys; ++j) {
        const float* v_row = &v[(j * kNumHeads + h) * kHeadDim];
        const double p = scores[j] / sum;
        for (std::int64_t d = 0; d < kHeadDim; ++d) out_row[d] += p * double{v_row[d]};
      }
    }
  }
  return expected;
}

// Max |out - expected| over the sampled rows; NaN if any sampled output is not finite.
double max_abs_error(const std::vector<float>& out, const std::vector<double>& expected,
                     const std::vector<std::int64_t>& rows) {
  double error = 0.0;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (std::int64_t h = 0; h < kNumHeads; ++h) {
      for (std::int64_t d = 0; d < kHeadDim; ++d) {
        const float got = out[(rows[r] * kNumHeads + h) * kHeadDim + d];
        if (!std::isfinite(got)) return std::numeric_limits<double>::quiet_NaN();
        error =
            std::max(error, std::abs(double{got} - expected[(r * kNumHeads + h) * kHeadDim + d]));
      }
    }
  }
  return error;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct Method {
  const char* label;
  Kernel kernel;
};
constexpr Method kMethods[] = {
    {"standard", Kernel::kReference}, {"chunked", Kernel::kChunked}, {"flash", Kernel::kFlash}};

struct MethodResult {
  int runs = 0;
  double seconds = 0.0;       // median
  tools::MemoryUsage memory;  // the largest over the runs
  double error = 0.0;
};

// Runs one method: a first run, then two more when the first took under a second (median of 3).
MethodResult run_method(Kernel kernel, const TensorView& q, const TensorView& k,
                        const TensorView& v, std::vector<float>& out, const DemoOptions& options,
                        int threads, std::int64_t length, const char* label) {
  std::fill(out.begin(), out.end(), 0.0f);  // a stale result must not pass the check
  AttentionOutputs outputs;
  outputs.out = TensorView::contiguous(out.data(), DType::kF32, q.sizes);
  AttentionParams params;
  params.causal = options.causal;
  params.kernel = kernel;
  params.num_threads = threads;

  MethodResult result;
  std::vector<double> times;
  for (int run = 0; run < 3; ++run) {
    std::fprintf(stderr, "qkv demo: L=%lld %s run %d...\n", static_cast<long long>(length), label,
                 run + 1);
    double seconds = 0.0;
    const tools::MemoryUsage memory = tools::measure_peak_memory([&] {
      const auto start = std::chrono::steady_clock::now();
      attention(q, k, v, outputs, params);
      seconds = seconds_since(start);
    });
    times.push_back(seconds);
    if (run == 0 || memory.peak_extra_bytes() > result.memory.peak_extra_bytes()) {
      result.memory = memory;
    }
    if (times[0] >= 1.0) break;
  }
  std::sort(times.begin(), times.end());
  result.runs = static_cast<int>(times.size());
  result.seconds = times[times.size() / 2];
  return result;
}

// "512.0 MiB", "8.0 GiB": the unit that keeps the number readable.
std::string size_text(double bytes) {
  char text[32];
  if (bytes >= 1024.0 * 1024.0 * 1024.0) {
    std::snprintf(text, sizeof(text), "%.1f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  } else if (bytes >= 1024.0 * 1024.0) {
    std::snprintf(text, sizeof(text), "%.1f MiB", bytes / (1024.0 * 1024.0));
  } else {
    std::snprintf(text, sizeof(text), "%.1f KiB", bytes / 1024.0);
  }
  return text;
}

std::string mib_text(std::int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return text;
}

void print_header(const DemoOptions& options, int threads, const tools::FmaPeak& peak) {
  std::printf(
      "qkv demo: the seed article's scenario, measured here (its performance table, filled in)\n"
      "  B=1, 8 heads, embed 512 -> head_dim 64, self-attention Lq = Lk = L, f32, %s\n"
      "  %d thread%s; fp32 FMA peak measured in this run: %.1f GFLOP/s (Highway %s)\n"
      "  memory: %s\n\n",
      options.causal ? "causal" : "no mask", threads, threads == 1 ? "" : "s", peak.gflops,
      peak.hwy_target.c_str(),
      tools::process_peak_available()
          ? "peak RSS during the call above RSS before it (VmHWM), and kernel scratch"
          : "kernel scratch only (/proc/self/clear_refs not writable)");
  std::printf("%7s  %-9s  %4s  %11s  %9s  %7s  %10s  %11s  %12s\n", "L", "method", "runs",
              "median ms", "GFLOP/s", "% peak", "extra MiB", "scratch MiB", "max abs err");
  std::fflush(stdout);
}

}  // namespace

int run_demo(std::vector<std::string> args) {
  bool help = false;
  const DemoOptions options = parse_options(std::move(args), &help);
  if (help) {
    std::fputs(kDemoUsage, stdout);
    return 0;
  }
  const int threads = resolve_num_threads(options.threads);
  std::fprintf(stderr, "qkv demo: measuring the fp32 FMA peak on %d thread%s...\n", threads,
               threads == 1 ? "" : "s");
  const tools::FmaPeak peak = tools::measure_fma_peak(threads);
  print_header(options, threads, peak);

  const auto demo_start = std::chrono::steady_clock::now();
  bool any_over_tolerance = false;
  for (std::size_t length_index = 0; length_index < options.lengths.size(); ++length_index) {
    const std::int64_t length = options.lengths[length_index];
    // q, k, v, out: [1, L, 8, 64]
    const std::array<std::int64_t, 4> sizes = {kBatch, length, kNumHeads, kHeadDim};
    const std::size_t count = static_cast<std::size_t>(kBatch * length * kNumHeads * kHeadDim);
    std::vector<float> q(count), k(count), v(count), out(count);
    tools::fill_normal(q, 1000 + length);
    tools::fill_normal(k, 2000 + length);
    tools::fill_normal(v, 3000 + length);
    const TensorView q_view = TensorView::contiguous(q.data(), DType::kF32, sizes);
    const TensorView k_view = TensorView::contiguous(k.data(), DType::kF32, sizes);
    const TensorView v_view = TensorView::contiguous(v.data(), DType::kF32, sizes);

    // Rows checked in float64: all when L is small, else 32 spread over [0, L), ends included.
    std::vector<std::int64_t> rows;
    if (length <= 256) {
      for (std::int64_t i = 0; i < length; ++i) rows.push_back(i);
    } else {
      for (std::int64_t r = 0; r < kSampleRows; ++r) {
        rows.push_back(r * (length - 1) / (kSampleRows - 1));
      }
    }
    std::fprintf(stderr, "qkv demo: L=%lld float64 check of %zu rows...\n",
                 static_cast<long long>(length), rows.size());
    const std::vector<double> expected = exact_rows(q, k, v, length, rows, options.causal);
    double max_expected = 0.0;
    for (double value : expected) max_expected = std::max(max_expected, std::abs(value));
    const double tolerance = 2e-5 * std::max(1.0, max_expected);

    AttentionParams pair_params;
    pair_params.causal = options.causal;
    const double flops = attention_flops(
        kBatch, kNumHeads, allowed_pairs(length, length, pair_params), kHeadDim, kHeadDim);
    for (const Method& method : kMethods) {
      if (method.kernel == Kernel::kReference) {
        // What the article's standard implementation materialises: all B*H score matrices.
        const double score_bytes =
            4.0 * kBatch * kNumHeads * static_cast<double>(length) * static_cast<double>(length);
        if (score_bytes > options.budget_mib * 1024.0 * 1024.0) {
          std::printf("%7lld  %-9s  skipped: score matrix would need %s > budget %s\n",
                      static_cast<long long>(length), method.label, size_text(score_bytes).c_str(),
                      size_text(options.budget_mib * 1024.0 * 1024.0).c_str());
          std::fflush(stdout);
          continue;
        }
      }
      MethodResult result = run_method(method.kernel, q_view, k_view, v_view, out, options, threads,
                                       length, method.label);
      result.error = max_abs_error(out, expected, rows);
      const bool over = !(result.error <= tolerance);
      any_over_tolerance = any_over_tolerance || over;
      const double gflops = flops / result.seconds / 1e9;
      std::printf(
          "%7lld  %-9s  %4d  %11.3f  %9.2f  %6.1f%%  %10s  %11s  %11.2e%s\n",
          static_cast<long long>(length), method.label, result.runs, result.seconds * 1e3, gflops,
          100.0 * gflops / peak.gflops,
          result.memory.has_process_peak ? mib_text(result.memory.process_peak_extra).c_str()
                                         : "n/a",
          mib_text(result.memory.scratch_peak_extra).c_str(), result.error, over ? " !" : "");
      std::fflush(stdout);
    }
    if (length_index + 1 < options.lengths.size()) std::printf("\n");
  }

  std::printf(
      "\nColumns: median ms is the median wall time of one attention call (runs: 3 when a call\n"
      "takes under a second, else 1). GFLOP/s = 4*B*H*Lq*Lk*D / time; %% peak divides it by the\n"
      "fp32 FMA peak measured at the start of this run on the same %d thread%s.%s\n"
      "extra MiB is the peak resident memory during the call above the memory before it (inputs\n"
      "and output were already allocated); scratch MiB is the most the kernel held in its own\n"
      "buffers. max abs err compares the sampled output rows (all rows up to L=256, else 32\n"
      "spread over L, every head) with float64 attention computed independently by this\n"
      "command%s.\n"
      "standard = the reference kernel: it materialises each head's L x L scores like the\n"
      "article's code, but it is a scalar oracle with f64 accumulation, not a BLAS-speed\n"
      "implementation, so its memory is representative and its time is not (it dominates the run\n"
      "time). chunked = query chunks against all keys (an L x query-block score panel per\n"
      "thread); flash = tiled online softmax over query and key tiles (a few tiles per thread).\n"
      "All figures come from this run on this machine (%.1f s in total); on a shared machine they\n"
      "drift from run to run, fractions of peak less than times.\n",
      threads, threads == 1 ? "" : "s",
      options.causal ? "\nWith --causal, Lq*Lk counts only the pairs causal allows (L*(L+1)/2)."
                     : "",
      any_over_tolerance ? ";\n'!' marks an error above 2e-5 * max(1, max|expected|)" : "",
      seconds_since(demo_start));
  return 0;
}

}  // namespace qkv::cli
