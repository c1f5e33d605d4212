// qkv demo: the main job. The seed articles' scenario (8 heads, embed 512 -> head_dim 64,
// self-attention) run through every attention method qkv has, at growing sequence lengths: the
// performance-comparison table the first article leaves empty and the long-context trade-off
// the second one describes, measured on this machine in this run.
//
//   q, k, v, out: [B=1, L, H=8, D=64] f32 (BSHD), Lq = Lk = L
//
// Exact methods: "standard" is the article's scaled_dot_product_attention, which returns the
// attention weights and so holds all B*H L x L probability matrices (here: attention() asked for
// probs, which the chunked kernel writes), "chunked" the article's MemoryEfficientAttention
// (query chunks), "flash" the tiled online softmax. Long-context methods: Longformer and BigBird
// (block-sparse, exact over the pairs they keep) and the Linear Transformer (elu+1) and Performer
// (FAVOR+) approximations. Every method is compared with float64 softmax attention computed here,
// with plain double loops, on sampled query rows: the error of an exact method is rounding, that of
// a sparse or linear one is what it gives up for reach. "flash-bf16" is the articles' mixed
// precision: the flash kernel on q, k and v stored as bf16 (f32 accumulation and softmax), on the
// instructions this CPU has for it (AMX tiles, vdpbf16ps, or widened to f32), checked against the
// same float64 attention of the f32 inputs, so its error is what mixed precision costs.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/float16.h"
#include "core/parallel.h"
#include "kernels/product_path.h"
#include "qkv/attention.h"
#include "qkv/linear_attention.h"
#include "qkv/sparse.h"
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
    "                [--max-seconds S] [--causal]\n"
    "\n"
    "The seed articles' scenario: B=1, 8 heads, embed 512 -> head_dim 64, self-attention\n"
    "(Lq = Lk = L), f32 random inputs, through every method at growing L:\n"
    "  standard    also returns the attention weights: all B*H L x L matrices, as the\n"
    "              article's scaled_dot_product_attention does\n"
    "  chunked     query-chunked 'memory-efficient' attention (exact)\n"
    "  flash       tiled online softmax, O(L) memory (exact)\n"
    "  flash-bf16  the same on q, k, v stored as bf16 (mixed precision: f32 accumulation and\n"
    "              softmax; AMX tiles where the CPU has them)\n"
    "  longformer  sliding window w=512 plus global token 0 (block-sparse, exact on its pairs)\n"
    "  bigbird     block 64, 3-block window, 2 global blocks, 3 random blocks, seed 1\n"
    "  linear      Linear Transformer, feature map elu(x)+1\n"
    "  performer   Performer FAVOR+, 256 positive orthogonal random features, seed 1\n"
    "One table: time, GFLOP/s, fraction of this machine's peak for the row's instructions (the\n"
    "FMA peak, or for flash-bf16 the peak of its bf16 products; measured first, in the same\n"
    "process), peak extra memory, and the error against float64 softmax attention of the f32\n"
    "inputs.\n"
    "\n"
    "options:\n"
    "  --max-len N      lengths 1024, 4096, ... (x4) up to N <= 2^24 (default 65536)\n"
    "  --lengths a,b,c  these lengths instead (each >= 1)\n"
    "  --threads N      threads for the kernels and the peak probe (default 0 = OpenMP's default)\n"
    "  --budget-mib M   standard attention runs only where its score matrix, B*H*L*L*4 bytes as\n"
    "                   the article's implementation holds it, fits in M MiB (default 1024)\n"
    "  --max-seconds S  skip a method at a length where its time, extrapolated from the previous\n"
    "                   length (L^2 for exact methods, L for the others), exceeds S seconds\n"
    "                   (default 120)\n"
    "  --causal         causal self-attention (GFLOP/s then count only the allowed pairs)\n"
    "  --help           this text\n"
    "\n"
    "See docs/cli-bench-demo.md for what each column means and how it is measured.\n";

struct DemoOptions {
  std::vector<std::int64_t> lengths;
  int threads = 0;
  double budget_mib = 1024.0;
  double max_seconds = 120.0;
  bool causal = false;
};

double parse_non_negative(const std::string& option, const std::string& text) {
  const double value = parse_double(option, text);
  if (!(value >= 0.0) || !std::isfinite(value)) {
    throw UsageError(option + ": expected a number >= 0, got '" + text + "'");
  }
  return value;
}

DemoOptions parse_options(std::vector<std::string> argv, bool* help) {
  DemoOptions options;
  // Sequence lengths the demo accepts: 16M tokens is 32 GiB of q, k and v at H=8, D=64, far
  // past this machine; the cap keeps "length *= 4" below from ever overflowing.
  constexpr std::int64_t kMaxLength = std::int64_t{1} << 24;
  std::int64_t max_len = 65536;
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
      if (max_len < 1 || max_len > kMaxLength) {
        throw UsageError("--max-len: expected 1 to " + std::to_string(kMaxLength) + ", got " +
                         std::to_string(max_len));
      }
      max_len_given = true;
    } else if (arg == "--lengths") {
      options.lengths = parse_int_list(arg, args.value(arg));
      for (std::int64_t length : options.lengths) {
        if (length < 1 || length > kMaxLength) {
          throw UsageError("--lengths: each length must be in [1, " + std::to_string(kMaxLength) +
                           "], got " + std::to_string(length));
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
      options.budget_mib = parse_non_negative(arg, args.value(arg));
    } else if (arg == "--max-seconds") {
      options.max_seconds = parse_non_negative(arg, args.value(arg));
    } else {
      throw UsageError("unknown option '" + arg + "' for demo (try 'qkv demo --help')");
    }
  }
  if (lengths_given && max_len_given) {
    throw UsageError("--lengths and --max-len: give one or the other");
  }
  if (!lengths_given) {
    for (std::int64_t length = 1024; length <= max_len; length *= 4)
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

struct Errors {
  double max_abs = 0.0;   // NaN if any sampled output is not finite
  double mean_abs = 0.0;
  double relative = 0.0;  // |out - expected|_2 / |expected|_2 over the sampled rows
};

Errors errors_of(const std::vector<float>& out, const std::vector<double>& expected,
                 const std::vector<std::int64_t>& rows) {
  Errors e;
  double sum_abs = 0.0, sum_sq = 0.0, norm_sq = 0.0;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (std::int64_t hd = 0; hd < kNumHeads * kHeadDim; ++hd) {
      const float got = out[rows[r] * kNumHeads * kHeadDim + hd];
      const double want = expected[r * kNumHeads * kHeadDim + hd];
      if (!std::isfinite(got)) {
        e.max_abs = e.mean_abs = e.relative = std::numeric_limits<double>::quiet_NaN();
        return e;
      }
      const double diff = std::abs(double{got} - want);
      e.max_abs = std::max(e.max_abs, diff);
      sum_abs += diff;
      sum_sq += diff * diff;
      norm_sq += want * want;
    }
  }
  e.mean_abs = sum_abs / static_cast<double>(expected.size());
  e.relative = norm_sq > 0 ? std::sqrt(sum_sq / norm_sq) : 0.0;
  return e;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One row of the table: how to call the library, and whether its cost grows as L^2.
struct Method {
  const char* label;
  bool exact;      // softmax attention over all pairs (errors are rounding only)
  bool quadratic;  // time ~ L^2 (for the --max-seconds estimate)
  bool weights = false;  // also return the [B, H, L, L] probabilities (standard attention)
  Kernel kernel = Kernel::kAuto;
  DType dtype = DType::kF32;  // storage of q, k and v (bf16: the inputs rounded, out f32)
  std::optional<Sparsity> sparsity = {};
  std::optional<LinearAttentionParams> linear = {};
};

constexpr std::int64_t kLongformerGlobal[] = {0};

std::vector<Method> methods() {
  std::vector<Method> list;
  list.push_back({.label = "standard", .exact = true, .quadratic = true, .weights = true});
  list.push_back({.label = "chunked", .exact = true, .quadratic = true,
                  .kernel = Kernel::kChunked});
  list.push_back({.label = "flash", .exact = true, .quadratic = true, .kernel = Kernel::kFlash});
  list.push_back({.label = "flash-bf16",
                  .exact = true,
                  .quadratic = true,
                  .kernel = Kernel::kFlash,
                  .dtype = DType::kBF16});
  list.push_back({.label = "longformer", .exact = false, .quadratic = false,
                  .kernel = Kernel::kFlash,
                  .sparsity = LongformerSparsity{.window = 512, .global = kLongformerGlobal}});
  list.push_back({.label = "bigbird", .exact = false, .quadratic = false, .kernel = Kernel::kFlash,
                  .sparsity = BigBirdSparsity{.block = 64, .num_random_blocks = 3,
                                              .num_global_blocks = 2, .seed = 1}});
  list.push_back({.label = "linear", .exact = false, .quadratic = false,
                  .linear = LinearAttentionParams{.feature_map = FeatureMap::kEluPlusOne}});
  list.push_back({.label = "performer", .exact = false, .quadratic = false,
                  .linear = LinearAttentionParams{.feature_map = FeatureMap::kFavorPositive,
                                                  .nb_features = 256, .seed = 1}});
  return list;
}

struct MethodResult {
  int runs = 0;
  double seconds = 0.0;       // median
  tools::MemoryUsage memory;  // the largest over the runs
};

// Runs one method: a first run, then two more when the first took under a second (median of 3).
MethodResult run_method(const Method& method, const TensorView& q, const TensorView& k,
                        const TensorView& v, std::vector<float>& out, const DemoOptions& options,
                        int threads, std::int64_t length) {
  std::fill(out.begin(), out.end(), 0.0f);  // a stale result must not pass the check
  AttentionOutputs outputs;
  outputs.out = TensorView::contiguous(out.data(), DType::kF32, q.sizes);
  const std::array<std::int64_t, 4> probs_sizes = {q.sizes[0], q.sizes[2], q.sizes[1], k.sizes[1]};
  AttentionParams params;
  params.causal = options.causal;
  params.kernel = method.kernel;
  params.num_threads = threads;
  params.sparsity = method.sparsity;
  std::optional<LinearAttentionParams> linear = method.linear;
  if (linear) {
    linear->causal = options.causal;
    linear->num_threads = threads;
  }

  MethodResult result;
  std::vector<double> times;
  for (int run = 0; run < 3; ++run) {
    std::fprintf(stderr, "qkv demo: L=%lld %s run %d...\n", static_cast<long long>(length),
                 method.label, run + 1);
    double seconds = 0.0;
    const tools::MemoryUsage memory = tools::measure_peak_memory([&] {
      const auto start = std::chrono::steady_clock::now();
      // Standard attention's weights are allocated inside the measured call: they are its memory.
      std::vector<float> probs(method.weights ? static_cast<std::size_t>(probs_sizes[0] *
                                                                         probs_sizes[1] *
                                                                         probs_sizes[2] *
                                                                         probs_sizes[3])
                                              : 0);
      if (method.weights) {
        outputs.probs = TensorView::contiguous(probs.data(), DType::kF32, probs_sizes);
      }
      if (linear) {
        linear_attention(q, k, v, outputs, *linear);
      } else {
        attention(q, k, v, outputs, params);
      }
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

// FLOPs one call of `method` performs at length L: the pairs it computes for softmax methods
// (all, causal-allowed or sparse-allowed), the linear formula for the feature-map methods.
double method_flops(const Method& method, std::int64_t length, bool causal) {
  if (method.linear) {
    LinearAttentionParams params = *method.linear;
    params.causal = causal;
    return linear_attention_flops(kBatch, kNumHeads, kNumHeads, length, length, kHeadDim,
                                  kHeadDim, params);
  }
  AttentionParams params;
  params.causal = causal;
  params.sparsity = method.sparsity;
  return attention_flops(kBatch, kNumHeads,
                         sparse_allowed_pairs(length, length, kNumHeads, params), kHeadDim,
                         kHeadDim);
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

// The peak flash-bf16's % peak divides by: that of the instructions its products run on.
struct Bf16Peak {
  ProductPath path;
  tools::FmaPeak peak;
  const char* probe;
};

Bf16Peak measure_bf16_products_peak(int threads, const tools::FmaPeak& fma) {
  const ProductPath path = attention_flash_product_path(DType::kBF16);
  if (path == ProductPath::kBf16Amx) {
    return {path, tools::measure_amx_peak(threads), "AMX tile probe"};
  }
  if (path == ProductPath::kBf16Pairs) {
    return {path, tools::measure_bf16_peak(threads), "vdpbf16ps probe"};
  }
  return {path, fma, "fp32 FMA peak: bf16 is widened to f32"};
}

void print_header(const DemoOptions& options, int threads, const tools::FmaPeak& peak,
                  const Bf16Peak& bf16) {
  std::printf(
      "qkv demo: the seed articles' scenario, measured here (their performance table, filled "
      "in)\n"
      "  B=1, 8 heads, embed 512 -> head_dim 64, self-attention Lq = Lk = L, f32, %s\n"
      "  %d thread%s; fp32 FMA peak measured in this run: %.1f GFLOP/s (Highway %s)\n"
      "  flash-bf16 runs its products on %s: %% peak of %.1f GFLOP/s (%s)\n"
      "  memory: %s\n\n",
      options.causal ? "causal" : "no mask", threads, threads == 1 ? "" : "s", peak.gflops,
      peak.hwy_target.c_str(), product_path_name(bf16.path), bf16.peak.gflops, bf16.probe,
      tools::process_peak_available() ? "peak RSS during the call above RSS before it (VmHWM)"
                                      : "kernel scratch only (/proc/self/clear_refs not writable)");
  std::printf("%7s  %-10s  %4s  %11s  %9s  %7s  %9s  %10s  %10s  %9s\n", "L", "method", "runs",
              "median ms", "GFLOP/s", "% peak", "extra MiB", "max err", "mean err", "rel err");
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
  const Bf16Peak bf16_peak = measure_bf16_products_peak(threads, peak);
  print_header(options, threads, peak, bf16_peak);

  const std::vector<Method> all = methods();
  // Per method: the last length it ran at and its time there (for the --max-seconds estimate).
  std::vector<std::optional<std::pair<std::int64_t, double>>> last(all.size());
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
    // flash-bf16's inputs: the same values rounded to bf16 (to nearest even).
    std::vector<std::uint16_t> q16 = to_half_bits(DType::kBF16, q);
    std::vector<std::uint16_t> k16 = to_half_bits(DType::kBF16, k);
    std::vector<std::uint16_t> v16 = to_half_bits(DType::kBF16, v);
    const TensorView q16_view = TensorView::contiguous(q16.data(), DType::kBF16, sizes);
    const TensorView k16_view = TensorView::contiguous(k16.data(), DType::kBF16, sizes);
    const TensorView v16_view = TensorView::contiguous(v16.data(), DType::kBF16, sizes);

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
    // bf16's tolerance (DESIGN.md section 5): 4x the error of the exact computation on the
    // inputs rounded to bf16, against the f32 inputs' (what rounding the inputs alone costs).
    const auto widened = [](const std::vector<std::uint16_t>& bits) {
      std::vector<float> values(bits.size());
      for (std::size_t i = 0; i < bits.size(); ++i) values[i] = bf16_bits_to_f32(bits[i]);
      return values;
    };
    const std::vector<double> expected_rounded =
        exact_rows(widened(q16), widened(k16), widened(v16), length, rows, options.causal);
    double rounding_error = 0.0;
    for (std::size_t i = 0; i < expected.size(); ++i) {
      rounding_error = std::max(rounding_error, std::abs(expected_rounded[i] - expected[i]));
    }
    const double bf16_tolerance = tolerance + 4.0 * rounding_error;

    for (std::size_t m = 0; m < all.size(); ++m) {
      const Method& method = all[m];
      const auto skip = [&](const std::string& why) {
        std::printf("%7lld  %-10s  skipped: %s\n", static_cast<long long>(length), method.label,
                    why.c_str());
        std::fflush(stdout);
      };
      if (method.weights) {
        // What the article's standard implementation materialises: all B*H score matrices.
        const double score_bytes =
            4.0 * kBatch * kNumHeads * static_cast<double>(length) * static_cast<double>(length);
        if (score_bytes > options.budget_mib * 1024.0 * 1024.0) {
          skip("score matrix would need " + size_text(score_bytes) + " > budget " +
               size_text(options.budget_mib * 1024.0 * 1024.0) + " (--budget-mib)");
          continue;
        }
      }
      if (last[m]) {
        const double growth = static_cast<double>(length) / static_cast<double>(last[m]->first);
        const double estimate = last[m]->second * (method.quadratic ? growth * growth : growth);
        if (estimate > options.max_seconds) {
          char why[160];
          std::snprintf(why, sizeof(why), "estimated %.0f s from L=%lld > --max-seconds %.0f",
                        estimate, static_cast<long long>(last[m]->first), options.max_seconds);
          skip(why);
          continue;
        }
      }
      const bool bf16 = method.dtype == DType::kBF16;
      const MethodResult result =
          bf16 ? run_method(method, q16_view, k16_view, v16_view, out, options, threads, length)
               : run_method(method, q_view, k_view, v_view, out, options, threads, length);
      last[m] = std::make_pair(length, result.seconds);
      const Errors errors = errors_of(out, expected, rows);
      const bool over = method.exact && !(errors.max_abs <= (bf16 ? bf16_tolerance : tolerance));
      any_over_tolerance = any_over_tolerance || over;
      const double gflops = method_flops(method, length, options.causal) / result.seconds / 1e9;
      const double peak_gflops = bf16 ? bf16_peak.peak.gflops : peak.gflops;
      std::printf("%7lld  %-10s  %4d  %11.3f  %9.2f  %6.1f%%  %9.1f  %10.2e  %10.2e  %9.2e%s\n",
                  static_cast<long long>(length), method.label, result.runs, result.seconds * 1e3,
                  gflops, 100.0 * gflops / peak_gflops,
                  static_cast<double>(result.memory.peak_extra_bytes()) / (1024.0 * 1024.0),
                  errors.max_abs, errors.mean_abs, errors.relative, over ? " !" : "");
      std::fflush(stdout);
    }
    if (length_index + 1 < options.lengths.size()) std::printf("\n");
  }

  std::printf(
      "\nColumns: median ms is the median wall time of one call (runs: 3 when a call takes under\n"
      "a second, else 1). GFLOP/s counts the work each method does: 4*D per (query, key) pair it\n"
      "computes for the softmax methods (all pairs for the exact ones%s; the pairs the sparsity\n"
      "keeps for longformer and bigbird), and the linear formula of docs/linear-attention.md for\n"
      "linear and performer. %% peak divides it by the fp32 FMA peak measured at the start of\n"
      "this run on the same %d thread%s (flash-bf16: by the peak of its products, in the header).\n"
      "extra MiB is the peak resident memory during the call above the memory before it (inputs\n"
      "and output were already allocated). Errors compare the sampled output rows (32 spread\n"
      "over L, every head) with float64 softmax attention of the f32 inputs, computed\n"
      "independently by this command: max and mean absolute error, and rel err =\n"
      "|out - exact|_2 / |exact|_2. For the exact methods it is rounding%s (flash-bf16's\n"
      "includes the inputs' rounding to bf16); for the sparse and linear ones it is the\n"
      "approximation (random inputs spread attention over all keys, the hardest case for them).\n"
      "standard = the article's scaled_dot_product_attention: it returns the attention weights,\n"
      "so all B*H L x L probabilities are held at once (qkv computes them with the chunked\n"
      "kernel and writes them out; the weights are the memory, allocated inside the call).\n"
      "All figures come from this run on this machine (%.1f s in total); on a shared machine they\n"
      "drift from run to run, fractions of peak less than times.\n",
      options.causal ? "; with --causal only the L*(L+1)/2 allowed ones" : "", threads,
      threads == 1 ? "" : "s",
      any_over_tolerance ? " ('!' marks an error above 2e-5 * max(1, max|expected|), for\n"
                           "flash-bf16 plus 4x what rounding the inputs to bf16 alone changes)"
                         : "",
      seconds_since(demo_start));
  return 0;
}

}  // namespace qkv::cli
