// qkv bench: GFLOP/s of the attention kernels as a fraction of this machine's fp32 FMA peak,
// measured in the same process on the same threads (DESIGN.md sections 4 and 6).
//
//   q: [B, Lq, Hq, D]   k, v: [B, Lk, Hkv, D]   out: [B, Lq, Hq, D]   (f32, contiguous BSHD)
//
// Per case: one warm-up call, one call for the memory probe, then R timed repeats (each repeat
// runs enough calls to last >= 10 ms), median seconds per call. GFLOP/s counts every (query, key) pair
// (4 * B * Hq * Lq * Lk * D); effective GFLOP/s counts only the pairs causal allows.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "core/float16.h"
#include "core/huge_pages.h"
#include "core/parallel.h"
#include "kernels/cpu/kv_head_major.h"
#include "kernels/product_path.h"
#include "qkv/attention.h"
#include "qkv/attention_backward.h"
#include "qkv/tensor.h"
#include "tools/cli.h"
#include "tools/cli_linear.h"
#include "tools/cli_sparse.h"
#include "tools/fma_probe.h"
#include "tools/memory_probe.h"
#include "tools/random_fill.h"

namespace qkv::cli {
namespace {

constexpr const char* kBenchUsage =
    "usage: qkv bench [--json] [--shape B,Hq,Hkv,Lq,Lk,D] [--causal] [--kernel K] [--dtype T]\n"
    "                 [--products P] [--threads N] [--repeats R] [--backward]\n"
    "\n"
    "Times qkv::attention on random inputs (fixed seed) and reports GFLOP/s as a fraction of this\n"
    "machine's peak for the dtype's instructions, measured first in the same process on the same\n"
    "threads: the fp32 FMA peak, or for bf16 on a CPU with AVX512-BF16 the vdpbf16ps peak.\n"
    "\n"
    "options:\n"
    "  --json           one JSON object per line on stdout instead of a table; progress and the\n"
    "                   probe summary go to stderr\n"
    "  --shape B,Hq,Hkv,Lq,Lk,D\n"
    "                   one shape: batch, num_heads_q, num_heads_kv, seq_q, seq_kv, head_dim\n"
    "                   (Hq a multiple of Hkv). Without it, a default set is swept: Hq=Hkv=8\n"
    "                   at L=1024 and 4096 with D=64 and D=128, GQA 32:8 and a decode step\n"
    "                   (Lq=1), each with and without --causal\n"
    "  --causal         causal mask (bottom-right aligned). With the default sweep: only the\n"
    "                   causal cases\n"
    "  --kernel K       auto|reference|chunked|flash, or a comma list (default auto, which\n"
    "                   resolves to flash). 'reference' is the scalar oracle: slow\n"
    "  --dtype T        f32 (default), bf16 or f16: storage of q, k and v (the kernels accumulate\n"
    "                   in f32; bf16 runs on AMX tiles where the CPU has AMX-BF16, on\n"
    "                   vdpbf16ps on AMD CPUs with AVX512-BF16, else widened to f32; f16 on\n"
    "                   AMX tiles as bf16 hi + lo parts where the CPU has AMX-BF16, else\n"
    "                   widened; json: products). The fp32 peak is also printed (json:\n"
    "                   fp32_peak_gflops), and the AMX tile peak where bf16 or f16 has it\n"
    "                   (amx_peak_gflops; %peak of bf16-amx and f16-amx-split rows divides\n"
    "                   by it), with whether the tiles run beside the softmax's vector code\n"
    "                   (amx_softmax_together_over_sum: 1 = they take turns)\n"
    "  --out-dtype O    f32 (default) or input: out stored as --dtype (bf16/f16: the f32 result\n"
    "                   rounded by the kernel, as torch's bf16 SDPA returns; json: out_dtype).\n"
    "                   The forward only (not with --backward or --linear)\n"
    "  --products P     auto (default: the CPU's choice, as above); or the flash kernel's product\n"
    "                   path to pin for --dtype, a comma list of them, or all (every path this\n"
    "                   CPU runs for --dtype, its own choice first), to compare paths on one\n"
    "                   CPU: f32-fma; bf16-widened-fma, bf16-vdpbf16ps (any CPU with\n"
    "                   AVX512-BF16), bf16-amx; f16-widened-fma, f16-amx-split. Several paths\n"
    "                   give a row each per case, on the same inputs, their timed repeats taking\n"
    "                   turns (a change in the machine's load reaches them alike). A path this\n"
    "                   CPU cannot run is an error that lists the ones it can. The flash\n"
    "                   kernel only (not with --linear or --kernel chunked/reference); with\n"
    "                   --backward its backward's paths: bf16-vdpbf16ps, bf16-amx,\n"
    "                   bf16-widened-fma, f32-fma, f16-widened-fma\n"
    "  --threads N      threads for the kernels and the FMA probe (default 0 = OpenMP's default)\n"
    "  --layout bshd|bhsd\n"
    "                   how q, k, v and out (and --backward's arrays) are stored: bshd (default)\n"
    "                   as --shape's order, or bhsd = (B, H, L, D), PyTorch's order and qkv's\n"
    "                   KvCache's, passed as strided views (json: layout). Long bshd K/V\n"
    "                   may be walked from a head-major copy (a line under the row; json:\n"
    "                   kv_head_major_copy; its bytes count in the extra MiB)\n"
    "  --repeats R      timed repeats per case, median reported (default 5; fewer when one call\n"
    "                   takes over 2 s, unless given)\n"
    "  --linear SPEC    time linear attention instead: elu or favor[:features=N][,seed=S]\n"
    "                   (cli_linear.h). GFLOP/s then counts the linear formula\n"
    "                   2*M*(P + Dv + 1)*(B*Hkv*Lk + B*Hq*Lq), P = D for favor, 0 for elu\n"
    "                   (docs/linear-attention.md)\n"
    "  --sparse SPEC, --sparse-layout L.npy --sparse-block BQ,BK\n"
    "                   block-sparse attention, spelled as for qkv attention (docs/sparse.md);\n"
    "                   eff GFLOP/s then counts the pairs the sparsity and causal allow (json:\n"
    "                   \"pairs\", per batch and head)\n"
    "  --backward       time qkv::attention_backward (dq, dk, dv for a random dout; the forward's\n"
    "                   out and lse computed once before) instead; GFLOP/s counts 2.5x the\n"
    "                   forward's FLOPs (FlashAttention's convention: five products to the\n"
    "                   forward's two). --kernel auto|flash|reference (docs/training.md)\n"
    "  --help           this text\n"
    "\n"
    "columns: median ms per call; GFLOP/s = 4*B*Hq*Lq*Lk*D / seconds (all pairs); eff GFLOP/s\n"
    "counts only the pairs the mask allows; %peak = GFLOP/s / measured FMA peak; extra MiB =\n"
    "peak resident memory during a call above the memory before it. Decode shapes (Lq <= 16)\n"
    "add a line: K/V read = 2*B*Hkv*Lk*D*(4 or 2) bytes / seconds, as a fraction of the\n"
    "streaming read bandwidth measured at the start (best of 5 sweeps of 256 MiB, or of twice\n"
    "the last-level cache where that is larger, so that a sweep evicts K and V; json:\n"
    "read_buffer_mib, kv_gbytes_per_second, kv_fraction_of_read_bandwidth, on every shape) and\n"
    "of the median of one sweep after each timed repeat, taken under the same load as the\n"
    "kernel's median (json: read_gbytes_per_second_between_repeats,\n"
    "kv_fraction_of_read_between_repeats; 0 for other shapes) and of the median of a plain read\n"
    "of the K and V arrays themselves after each repeat (json: kv_arrays_read_gbytes_per_second,\n"
    "kv_fraction_of_kv_arrays_read; 0 for other shapes): on a VM, pages allocated at different\n"
    "times can read at different speeds, and this one reads the kernel's own. The operands,\n"
    "out (and --backward's dout, dq, dk, dv) and the probe's buffer are advised onto\n"
    "transparent huge pages (madvise), as numpy's arrays and qkv's KvCache are; the header\n"
    "says \"huge pages\" where the kernel took the advice (json: read_huge_pages). See\n"
    "docs/cli-bench-demo.md.\n";

struct BenchCase {
  std::int64_t batch, num_heads_q, num_heads_kv, seq_q, seq_kv, head_dim;
  bool causal;
};

struct BenchOptions {
  bool json = false;
  std::optional<BenchCase> shape;
  bool causal = false;
  std::vector<Kernel> kernels = {Kernel::kAuto};
  int threads = 0;
  int repeats = 5;
  bool repeats_given = false;
  DType dtype = DType::kF32;
  bool out_in_input_dtype = false;  // --out-dtype input: out stored as --dtype (bf16/f16)
  std::optional<LinearAttentionParams> linear;  // --linear: time linear_attention instead
  SparseCliOptions sparse;                      // --sparse, --sparse-layout, --sparse-block
  bool backward = false;                        // --backward: time attention_backward
  std::vector<ProductPath> products;            // --products: paths to pin in turn (none: auto)
  bool all_products = false;                    // --products all: every path this CPU runs
  Layout layout = Layout::kBSHD;  // --layout: bhsd = arrays stored (B, H, L, D), strided views
};

Kernel parse_kernel(const std::string& name) {
  if (name == "auto") return Kernel::kAuto;
  if (name == "reference") return Kernel::kReference;
  if (name == "chunked") return Kernel::kChunked;
  if (name == "flash") return Kernel::kFlash;
  throw UsageError("--kernel: unknown kernel '" + name +
                   "' (expected auto, reference, chunked or flash)");
}

std::vector<Kernel> parse_kernels(const std::string& text) {
  std::vector<Kernel> kernels;
  for (const std::string& name : split_commas(text)) kernels.push_back(parse_kernel(name));
  return kernels;
}

ProductPath parse_product_path(const std::string& name) {
  std::string names;
  for (ProductPath path : kProductPaths) {
    if (name == product_path_name(path)) return path;
    names += std::string(", ") + product_path_name(path);
  }
  throw UsageError("--products: unknown path '" + name + "' (expected auto, all" + names + ")");
}

// --products: auto (an empty list), all, or a comma list of paths, each named once.
void parse_products(const std::string& text, BenchOptions& options) {
  options.products.clear();
  options.all_products = text == "all";
  if (text == "auto" || options.all_products) return;
  for (const std::string& name : split_commas(text)) {
    if (name == "auto" || name == "all") {
      throw UsageError("--products: " + name + " stands alone, not in a list ('" + text + "')");
    }
    const ProductPath path = parse_product_path(name);
    if (std::find(options.products.begin(), options.products.end(), path) !=
        options.products.end()) {
      throw UsageError(std::string("--products: ") + product_path_name(path) + " listed twice");
    }
    options.products.push_back(path);
  }
}

// --products: pins the flash kernel's path, or its backward's (for the warm-up, memory call and
// each timed repeat of that path's row), or says which paths this CPU runs instead.
void pin_products(ProductPath path, DType dtype, bool backward) {
  if (backward ? pin_backward_product_path(dtype, path) : pin_flash_product_path(dtype, path)) {
    return;
  }
  std::string names;
  for (ProductPath p : backward ? backward_product_paths(dtype) : flash_product_paths(dtype)) {
    names += std::string(names.empty() ? "" : ", ") + product_path_name(p);
  }
  throw UsageError(std::string("--products ") + product_path_name(path) +
                   ": not available on this CPU (" + dtype_name(dtype) +
                   (backward ? "'s backward" : "") + " runs on: " + names + ")");
}

BenchCase parse_shape(const std::string& text) {
  const std::vector<std::int64_t> v = parse_int_list("--shape", text);
  if (v.size() != 6) {
    throw UsageError("--shape: expected 6 sizes B,Hq,Hkv,Lq,Lk,D, got '" + text + "'");
  }
  for (std::int64_t size : v) {
    if (size < 1) throw UsageError("--shape: every size must be >= 1, got '" + text + "'");
  }
  if (v[1] % v[2] != 0) {
    throw UsageError("--shape: Hq (" + std::to_string(v[1]) + ") must be a multiple of Hkv (" +
                     std::to_string(v[2]) + ")");
  }
  // Each of q, k, v, out must fit in memory; also keeps every size product inside int64.
  const double q_elements = static_cast<double>(v[0]) * v[1] * v[3] * v[5];
  const double kv_elements = static_cast<double>(v[0]) * v[2] * v[4] * v[5];
  if (std::max(q_elements, kv_elements) > static_cast<double>(std::int64_t{1} << 32)) {
    throw UsageError("--shape: " + text + " needs more than 16 GiB per tensor");
  }
  return {v[0], v[1], v[2], v[3], v[4], v[5], false};
}

BenchOptions parse_options(std::vector<std::string> argv, bool* help) {
  BenchOptions options;
  Args args(std::move(argv));
  while (!args.done()) {
    const std::string arg = args.next();
    if (arg == "--help" || arg == "-h") {
      *help = true;
    } else if (arg == "--json") {
      options.json = true;
    } else if (arg == "--backward") {
      options.backward = true;
    } else if (arg == "--causal") {
      options.causal = true;
    } else if (arg == "--shape") {
      options.shape = parse_shape(args.value(arg));
    } else if (arg == "--kernel") {
      options.kernels = parse_kernels(args.value(arg));
    } else if (arg == "--dtype") {
      const std::string dtype = args.value(arg);
      if (dtype == "f32") {
        options.dtype = DType::kF32;
      } else if (dtype == "bf16") {
        options.dtype = DType::kBF16;
      } else if (dtype == "f16") {
        options.dtype = DType::kF16;
      } else {
        throw UsageError("--dtype: expected f32, bf16 or f16, got '" + dtype + "'");
      }
    } else if (arg == "--out-dtype") {
      const std::string out = args.value(arg);
      if (out != "f32" && out != "input") {
        throw UsageError("--out-dtype: expected f32 or input, got '" + out + "'");
      }
      options.out_in_input_dtype = out == "input";
    } else if (arg == "--products") {
      parse_products(args.value(arg), options);
    } else if (arg == "--layout") {
      options.layout = parse_layout(args.value(arg));
    } else if (arg == "--threads") {
      const std::int64_t threads = parse_int(arg, args.value(arg));
      if (threads < 0 || threads > 4096) {
        throw UsageError("--threads: expected 0 (default) to 4096, got " + std::to_string(threads));
      }
      options.threads = static_cast<int>(threads);
    } else if (parse_sparse_option(arg, args, options.sparse)) {
      // consumed: --sparse, --sparse-layout, --sparse-block (cli_sparse.h)
    } else if (arg == "--linear") {
      options.linear = parse_linear_spec(arg, args.value(arg));
    } else if (arg == "--repeats") {
      const std::int64_t repeats = parse_int(arg, args.value(arg));
      if (repeats < 1 || repeats > 1000) {
        throw UsageError("--repeats: expected 1 to 1000, got " + std::to_string(repeats));
      }
      options.repeats = static_cast<int>(repeats);
      options.repeats_given = true;
    } else {
      throw UsageError("unknown option '" + arg + "' for bench (try 'qkv bench --help')");
    }
  }
  check_sparse_options(options.sparse);
  if (options.backward && options.linear) throw UsageError("--backward: not available with --linear");
  if (options.out_in_input_dtype && (options.backward || options.linear)) {
    throw UsageError(std::string("--out-dtype input: attention's forward only (") +
                     (options.backward ? "--backward" : "--linear") + " writes f32)");
  }
  if (options.backward) {
    for (Kernel kernel : options.kernels) {
      if (kernel == Kernel::kChunked) {
        throw UsageError("--kernel chunked: the backward has no chunked kernel (auto, flash or reference)");
      }
    }
  }
  if (!options.products.empty() || options.all_products) {
    if (options.linear) {
      throw UsageError("--products: pins the flash kernel's products; not with --linear");
    }
    for (Kernel kernel : options.kernels) {
      if (kernel == Kernel::kChunked || kernel == Kernel::kReference) {
        throw UsageError(std::string("--products: pins the flash kernel's products; --kernel ") +
                         (kernel == Kernel::kChunked ? "chunked" : "reference") +
                         " has its own (use auto or flash)");
      }
    }
    for (ProductPath path : options.products) {
      if (product_path_dtype(path) != options.dtype) {
        throw UsageError(std::string("--products ") + product_path_name(path) + ": a " +
                         dtype_name(product_path_dtype(path)) + " path, but --dtype is " +
                         dtype_name(options.dtype));
      }
    }
  }
  return options;
}

std::vector<BenchCase> default_sweep(bool causal_only) {
  const std::vector<BenchCase> shapes = {
      {1, 8, 8, 1024, 1024, 64, false},    // the seed's scenario: 8 heads, embed 512
      {1, 8, 8, 4096, 4096, 64, false},    //
      {1, 8, 8, 1024, 1024, 128, false},   // head_dim 128 (most LLMs)
      {1, 8, 8, 4096, 4096, 128, false},   //
      {1, 32, 8, 1024, 1024, 128, false},  // GQA 32:8
  };
  std::vector<BenchCase> cases;
  for (const BenchCase& shape : shapes) {
    for (bool causal : {false, true}) {
      if (causal_only && !causal) continue;
      BenchCase c = shape;
      c.causal = causal;
      cases.push_back(c);
    }
  }
  // One decode step against an 8k KV cache (bottom-right causal allows every key: same work).
  if (!causal_only) cases.push_back({1, 32, 8, 1, 8192, 128, false});
  return cases;
}

struct BenchResult {
  std::string kernel;
  std::string products;  // the instructions the products ran on (resolved_product_path)
  bool kv_copy = false;  // the flash walk read a head-major copy of K and V (kv_head_major.h)
  double seconds;  // median per call
  int repeats;
  int calls_per_repeat;
  double gflops, effective_gflops;
  double pairs;               // (query, key) pairs per (batch, head) counted in effective_gflops
  std::string sparse;         // "none", or the sparsity option as given
  tools::MemoryUsage memory;  // the peak of one call of its own, before the timed repeats
  // Decode-like shapes: the streaming read bandwidth swept once after each timed repeat, median
  // (0 otherwise). Quoted with the K/V bandwidth, which is also a median, under the same load.
  double read_between_repeats = 0.0;
  // The same shapes: one plain read of the K and V arrays themselves after each timed repeat
  // (tools::read_buffers), median: the rate their pages allow, whatever the probe's got.
  double kv_read_between_repeats = 0.0;
};

// Decode-like shapes get the K/V bandwidth line in the table.
constexpr std::int64_t kDecodeMaxSeqQ = 16;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One row per product path in `paths`, pinned in turn, on the same inputs (none: one row, the
// CPU's own choice). The rows' timed repeats take turns.
std::vector<BenchResult> run_case(const BenchCase& c, Kernel kernel, const BenchOptions& options,
                                  const std::vector<ProductPath>& paths, int threads) {
  // q: [B, Lq, Hq, D]  k, v: [B, Lk, Hkv, D]  out: [B, Lq, Hq, D]
  const std::array<std::int64_t, 4> q_sizes = {c.batch, c.seq_q, c.num_heads_q, c.head_dim};
  const std::array<std::int64_t, 4> kv_sizes = {c.batch, c.seq_kv, c.num_heads_kv, c.head_dim};
  // A [B, L, H, D] view of an array stored in --layout's order ((B, H, L, D) for bhsd: strided).
  const auto view_of = [&](void* data, DType dtype, const std::array<std::int64_t, 4>& sizes) {
    if (options.layout == Layout::kBSHD) return TensorView::contiguous(data, dtype, sizes);
    return TensorView::contiguous(data, dtype, {sizes[0], sizes[2], sizes[1], sizes[3]})
        .permuted({0, 2, 1, 3});
  };
  // The operands on huge pages where the kernel grants them (core/huge_pages.h), as numpy's
  // arrays and qkv's KvCache are; the read probe's buffer is too, so K/V's fraction of the
  // read bandwidth compares reads from the same kind of pages.
  const auto operand_values = [](std::int64_t count) {
    std::vector<float> values;
    reserve_on_huge_pages(values, static_cast<std::size_t>(count));
    values.resize(static_cast<std::size_t>(count));
    return values;
  };
  std::vector<float> q = operand_values(c.batch * c.seq_q * c.num_heads_q * c.head_dim);
  std::vector<float> k = operand_values(c.batch * c.seq_kv * c.num_heads_kv * c.head_dim);
  std::vector<float> v = operand_values(static_cast<std::int64_t>(k.size()));
  // (zero-filled, as the gradients below: their pages are resident before timing)
  std::vector<float> out = operand_values(static_cast<std::int64_t>(q.size()));
  tools::fill_normal(q, 1);
  tools::fill_normal(k, 2);
  tools::fill_normal(v, 3);
  // --dtype bf16|f16: the same values converted to that storage.
  std::vector<std::uint16_t> q_bits, k_bits, v_bits;
  const auto operand = [&](std::vector<float>& values, std::vector<std::uint16_t>& bits,
                           const std::array<std::int64_t, 4>& sizes) {
    if (options.dtype == DType::kF32) {
      return view_of(values.data(), DType::kF32, sizes);
    }
    bits = to_half_bits(options.dtype, values);  // on huge pages too
    std::vector<float>().swap(values);  // the f32 copy is not needed any more
    return view_of(bits.data(), options.dtype, sizes);
  };
  const TensorView q_view = operand(q, q_bits, q_sizes);
  const TensorView k_view = operand(k, k_bits, kv_sizes);
  const TensorView v_view = operand(v, v_bits, kv_sizes);
  AttentionOutputs outputs;
  outputs.out = view_of(out.data(), DType::kF32, q_sizes);
  // --out-dtype input: out stored as the inputs' bf16/f16 (the kernels round into it).
  std::vector<std::uint16_t> out16;
  if (options.out_in_input_dtype && options.dtype != DType::kF32) {
    std::vector<float>().swap(out);
    out16.assign(q_bits.size(), 0);  // zero-filled: resident before timing
    outputs.out = view_of(out16.data(), options.dtype, q_sizes);
  }
  AttentionParams params;
  params.causal = c.causal;
  params.kernel = kernel;
  params.num_threads = threads;

  BenchResult result;
  result.kernel = resolved_kernel_name(params, outputs);
  io::NpyArray sparse_layout;  // --sparse-layout's file
  SparseCliOptions sparse = options.sparse;
  params.sparsity =
      make_sparsity(sparse, sparse_layout, c.seq_q, c.seq_kv, c.num_heads_q, "from --shape");
  result.sparse = !sparse.given()       ? "none"
                  : sparse.spec.empty() ? "layout:" + sparse.layout_path
                                        : sparse.spec;
  for (char& ch : result.sparse) {
    if (ch == '"' || ch == '\\' || static_cast<unsigned char>(ch) < 0x20) ch = '?';  // JSON-safe
  }
  LinearAttentionParams linear;  // after params is complete: --sparse with --linear is an error
  if (options.linear) {
    linear = linear_params_from(*options.linear, params);
    result.kernel = linear_spec_name(linear);
    result.products = "linear";
  }
  // --backward: the forward once (out, lse), then the backward is what is timed.
  std::vector<float> lse, dout, dq, dk, dv;
  AttentionGrads grads;
  TensorView dout_view;
  if (options.backward) {
    lse.assign(static_cast<std::size_t>(c.batch * c.num_heads_q * c.seq_q), 0.0f);
    outputs.lse = TensorView::contiguous(lse.data(), DType::kF32,
                                         {c.batch, c.num_heads_q, c.seq_q, 1});
    AttentionParams forward = params;
    forward.kernel = Kernel::kAuto;
    attention(q_view, k_view, v_view, outputs, forward);
    dout = operand_values(static_cast<std::int64_t>(out.size()));
    tools::fill_normal(dout, 4);
    dout_view = view_of(dout.data(), DType::kF32, q_sizes);
    dq = operand_values(static_cast<std::int64_t>(out.size()));
    dk = operand_values(c.batch * c.seq_kv * c.num_heads_kv * c.head_dim);
    dv = operand_values(static_cast<std::int64_t>(dk.size()));
    grads = {.dq = view_of(dq.data(), DType::kF32, q_sizes),
             .dk = view_of(dk.data(), DType::kF32, kv_sizes),
             .dv = view_of(dv.data(), DType::kF32, kv_sizes)};
    result.kernel = std::string(kernel == Kernel::kReference ? "reference" : "flash") + "-backward";
    result.products = backward_product_path(params, options.dtype);
  }
  if (!options.linear && !options.backward && paths.empty()) {  // pinned paths: per row, below
    result.products = resolved_product_path(q_view, k_view, v_view, outputs, params);
  }
  auto call = [&] {
    if (options.linear) {
      linear_attention(q_view, k_view, v_view, outputs, linear);
    } else if (options.backward) {
      attention_backward(q_view, k_view, v_view, outputs.out, outputs.lse, dout_view, grads,
                         params);
    } else {
      attention(q_view, k_view, v_view, outputs, params);
    }
  };

  const std::size_t rows = std::max<std::size_t>(1, paths.size());
  const auto pin = [&](std::size_t row) {
    if (!paths.empty()) pin_products(paths[row], options.dtype, options.backward);
  };
  std::vector<BenchResult> results(rows, result);
  double slowest = 0.0;
  for (std::size_t row = 0; row < rows; ++row) {
    pin(row);
    if (!paths.empty()) {
      results[row].products = options.backward
                                  ? backward_product_path(params, options.dtype)
                                  : resolved_product_path(q_view, k_view, v_view, outputs, params);
    }
    const std::int64_t copies = kv_head_major_copies();
    const auto warm_start = std::chrono::steady_clock::now();
    call();
    const double warm_seconds = seconds_since(warm_start);
    results[row].kv_copy = kv_head_major_copies() > copies;
    // Calls shorter than the timer's comfort zone are batched to >= 10 ms per repeat.
    results[row].calls_per_repeat =
        warm_seconds >= 0.01 ? 1
                             : static_cast<int>(std::min(1000.0, std::ceil(0.01 / warm_seconds)));
    slowest = std::max(slowest, warm_seconds);
  }
  int repeats = options.repeats;
  if (!options.repeats_given && slowest > 2.0) {
    repeats = slowest > 10.0 ? 1 : std::min(options.repeats, 3);
  }

  // Memory on a call of its own: the probe hands the freed heap back to the OS first, so that
  // the call's scratch counts afresh; done around every timed repeat, it made each call
  // page-fault its scratch again (~150 faults a call at L = 1024), which a caller's loop
  // does not.
  for (std::size_t row = 0; row < rows; ++row) {
    pin(row);
    results[row].memory = tools::measure_peak_memory(call);
    results[row].repeats = repeats;
  }
  std::vector<std::vector<double>> times(rows), reads(rows), kv_reads(rows);
  std::optional<tools::ReadProbe> read_probe;
  if (c.seq_q <= kDecodeMaxSeqQ) read_probe.emplace(threads);
  const auto bytes_of = [&](const TensorView& view) {
    return static_cast<std::size_t>(view.numel()) * dtype_size(options.dtype);
  };
  const std::vector<tools::ByteRange> kv_ranges = {{k_view.data, bytes_of(k_view)},
                                                   {v_view.data, bytes_of(v_view)}};
  std::uint64_t kv_checksum = 0;
  for (int r = 0; r < repeats; ++r) {
    for (std::size_t row = 0; row < rows; ++row) {
      pin(row);
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < results[row].calls_per_repeat; ++i) call();
      times[row].push_back(seconds_since(start) / results[row].calls_per_repeat);
      if (read_probe) {
        // The probe's sweep (which evicts K and V: the caches hold less than it reads), K and V
        // read plainly from memory, and the sweep again, so that the next call finds them
        // evicted too (none after the last).
        reads[row].push_back(read_probe->sweep());
        kv_reads[row].push_back(tools::read_buffers(kv_ranges, threads, &kv_checksum));
        if (r + 1 < repeats || row + 1 < rows) read_probe->sweep();
      }
    }
  }
  const double all_pairs = static_cast<double>(c.seq_q) * static_cast<double>(c.seq_kv);
  const double flops = attention_flops(c.batch, c.num_heads_q, all_pairs, c.head_dim, c.head_dim);
  const double pairs = sparse_allowed_pairs(c.seq_q, c.seq_kv, c.num_heads_q, params);
  for (BenchResult& r : results) r.pairs = pairs;
  const double effective_flops =
      attention_flops(c.batch, c.num_heads_q, pairs, c.head_dim, c.head_dim);
  const double work = options.backward ? 2.5 : 1.0;  // the backward's five products to two
  for (std::size_t row = 0; row < rows; ++row) {
    BenchResult& r = results[row];
    r.seconds = tools::median(times[row]);
    if (read_probe) {
      r.read_between_repeats = tools::median(reads[row]);
      r.kv_read_between_repeats = tools::median(kv_reads[row]);
    }
    r.gflops = work * flops / r.seconds / 1e9;
    r.effective_gflops = work * effective_flops / r.seconds / 1e9;
    if (options.linear) {
      // Linear attention does the same work whatever the mask: one count (linear_attention.h).
      r.gflops = r.effective_gflops =
          linear_attention_flops(c.batch, c.num_heads_q, c.num_heads_kv, c.seq_q, c.seq_kv,
                                 c.head_dim, c.head_dim, linear) /
          r.seconds / 1e9;
    }
  }
  return results;
}

std::string shape_text(const BenchCase& c) {
  return std::to_string(c.batch) + "," + std::to_string(c.num_heads_q) + "," +
         std::to_string(c.num_heads_kv) + "," + std::to_string(c.seq_q) + "," +
         std::to_string(c.seq_kv) + "," + std::to_string(c.head_dim);
}

// JSON numbers must be finite.
double finite(double value) { return std::isfinite(value) ? value : 0.0; }

// GB/s of K and V read once per call (2 * B * Hkv * Lk * D values of the dtype): what bounds a
// decode step (Lq small), quoted against the streaming read bandwidth measured in the same run.
double kv_gbytes_per_second(const BenchCase& c, const BenchResult& r, DType dtype) {
  const double kv_bytes = 2.0 * static_cast<double>(c.batch * c.num_heads_kv) *
                          static_cast<double>(c.seq_kv) * static_cast<double>(c.head_dim) *
                          dtype_size(dtype);
  return kv_bytes / r.seconds / 1e9;
}
// The machine probes of one run: the fp32 FMA peak, the vdpbf16ps peak (bf16 runs on a CPU with
// AVX512-BF16; else 0), the AMX tile peak (bf16 and f16 runs on a CPU with AMX-BF16; else 0),
// and the streaming read bandwidth. %peak divides by the peak of the instructions the row's
// products ran on (peak_for; f16-amx-split runs 2.5x the tile work of the FLOPs it counts).
struct Probes {
  tools::FmaPeak fp32_peak, pairs_peak, amx_peak;
  tools::AmxOverlap amx_overlap;  // with amx_peak: tiles beside the softmax's vector code
  tools::ReadBandwidth bandwidth;

  const tools::FmaPeak& peak_for(const BenchResult& r) const {
    if (r.products == "bf16-vdpbf16ps" && pairs_peak.gflops > 0.0) return pairs_peak;
    if ((r.products == "bf16-amx" || r.products == "f16-amx-split") && amx_peak.gflops > 0.0) {
      return amx_peak;
    }
    return fp32_peak;
  }
};

void print_json(const BenchCase& c, const BenchResult& r, int threads, DType dtype, DType out_dtype,
                Layout layout, const Probes& probes) {
  const tools::FmaPeak& peak = probes.peak_for(r);
  const tools::ReadBandwidth& bandwidth = probes.bandwidth;
  const double kv_gbs = kv_gbytes_per_second(c, r, dtype);
  std::printf(
      "{\"kernel\": \"%s\", \"dtype\": \"%s\", \"out_dtype\": \"%s\", \"layout\": \"%s\", "
      "\"B\": %lld, \"Hq\": %lld, "
      "\"Hkv\": %lld, "
      "\"Lq\": %lld, \"Lk\": %lld, \"D\": %lld, \"causal\": %s, \"sparse\": \"%s\", "
      "\"pairs\": %.17g, \"threads\": %d, "
      "\"seconds\": %.9g, \"repeats\": %d, \"calls_per_repeat\": %d, \"gflops\": %.6g, "
      "\"effective_gflops\": %.6g, \"peak_gflops\": %.6g, \"fraction_of_peak\": %.6g, "
      "\"effective_fraction_of_peak\": %.6g, \"peak_extra_rss_bytes\": %lld, "
      "\"scratch_peak_bytes\": %lld, \"memory_method\": \"%s\", \"hwy_target\": \"%s\", "
      "\"products\": \"%s\", \"kv_head_major_copy\": %s, "
      "\"read_gbytes_per_second\": %.6g, \"read_buffer_mib\": %.6g, \"read_huge_pages\": %s, "
      "\"kv_gbytes_per_second\": "
      "%.6g, "
      "\"kv_fraction_of_read_bandwidth\": %.6g, \"read_gbytes_per_second_between_repeats\": %.6g, "
      "\"kv_fraction_of_read_between_repeats\": %.6g, "
      "\"kv_arrays_read_gbytes_per_second\": %.6g, \"kv_fraction_of_kv_arrays_read\": %.6g, "
      "\"fp32_peak_gflops\": %.6g, \"amx_peak_gflops\": %.6g, "
      "\"amx_softmax_together_over_sum\": %.6g}\n",
      r.kernel.c_str(), dtype_name(dtype), dtype_name(out_dtype),
      layout == Layout::kBHSD ? "bhsd" : "bshd", static_cast<long long>(c.batch),
      static_cast<long long>(c.num_heads_q), static_cast<long long>(c.num_heads_kv),
      static_cast<long long>(c.seq_q), static_cast<long long>(c.seq_kv),
      static_cast<long long>(c.head_dim), c.causal ? "true" : "false", r.sparse.c_str(),
      finite(r.pairs), threads, finite(r.seconds), r.repeats, r.calls_per_repeat, finite(r.gflops),
      finite(r.effective_gflops), finite(peak.gflops), finite(r.gflops / peak.gflops),
      finite(r.effective_gflops / peak.gflops), static_cast<long long>(r.memory.peak_extra_bytes()),
      static_cast<long long>(r.memory.scratch_peak_extra), r.memory.method, peak.hwy_target.c_str(),
      r.products.c_str(), r.kv_copy ? "true" : "false", finite(bandwidth.gbytes_per_second),
      finite(bandwidth.buffer_mib), bandwidth.huge_pages ? "true" : "false", finite(kv_gbs),
      finite(kv_gbs / bandwidth.gbytes_per_second), finite(r.read_between_repeats),
      finite(r.read_between_repeats > 0.0 ? kv_gbs / r.read_between_repeats : 0.0),
      finite(r.kv_read_between_repeats),
      finite(r.kv_read_between_repeats > 0.0 ? kv_gbs / r.kv_read_between_repeats : 0.0),
      finite(probes.fp32_peak.gflops), finite(probes.amx_peak.gflops),
      finite(probes.amx_overlap.together_over_sum()));
  std::fflush(stdout);
}

void print_table_header(int threads, DType dtype, const Probes& probes) {
  std::printf(
      "qkv bench: %s, %d thread%s; measured in this process: fp32 FMA peak %.1f GFLOP/s "
      "(Highway %s, %d lanes), read bandwidth %.1f GB/s (%.0f MiB swept%s)\n",
      dtype_name(dtype), threads, threads == 1 ? "" : "s", probes.fp32_peak.gflops,
      probes.fp32_peak.hwy_target.c_str(), probes.fp32_peak.lanes,
      probes.bandwidth.gbytes_per_second, probes.bandwidth.buffer_mib,
      probes.bandwidth.huge_pages ? ", huge pages" : "");
  if (probes.pairs_peak.gflops > 0.0) {
    std::printf(
        "vdpbf16ps peak %.1f GFLOP/s (%.2fx the fp32 peak): %%peak of bf16-vdpbf16ps rows divides "
        "by it, of the others by the fp32 peak\n",
        probes.pairs_peak.gflops, probes.pairs_peak.gflops / probes.fp32_peak.gflops);
  }
  if (probes.amx_peak.gflops > 0.0) {
    std::printf(
        "AMX tile peak %.1f GFLOP/s (%.2fx the fp32 peak): %%peak of bf16-amx and f16-amx-split "
        "rows divides by it\n",
        probes.amx_peak.gflops, probes.amx_peak.gflops / probes.fp32_peak.gflops);
  }
  if (probes.amx_overlap.together_seconds > 0.0) {
    std::printf(
        "AMX tiles beside the softmax (1 thread): together %.2fx the sum of the two alone, %.2fx "
        "the longer (1.00x the sum: they take turns; docs/kernels.md, \"The ceiling\")\n",
        probes.amx_overlap.together_over_sum(), probes.amx_overlap.together_over_longer());
  }
  std::printf("memory: %s\n\n",
              tools::process_peak_available()
                  ? "extra MiB = peak RSS during a call (VmHWM) minus RSS before it"
                  : "extra MiB = kernel scratch peak only (/proc/self/clear_refs not writable)");
  std::printf("%-9s  %-16s  %-24s  %-6s  %3s  %10s  %8s  %8s  %8s  %6s  %6s  %9s\n", "kernel",
              "products", "shape B,Hq,Hkv,Lq,Lk,D", "causal", "thr", "median ms", "GFLOP/s", "eff GF/s",
              "peak GF/s", "%peak", "eff %", "extra MiB");
  std::fflush(stdout);
}

void print_table_row(const BenchCase& c, const BenchResult& r, int threads, DType dtype,
                     const Probes& probes) {
  const tools::FmaPeak& peak = probes.peak_for(r);
  std::printf("%-9s  %-16s  %-24s  %-6s  %3d  %10.3f  %8.2f  %8.2f  %8.1f  %5.1f%%  %5.1f%%  %9.1f\n",
              r.kernel.c_str(), r.products.c_str(), shape_text(c).c_str(), c.causal ? "yes" : "no", threads,
              r.seconds * 1e3, r.gflops, r.effective_gflops, peak.gflops,
              100.0 * r.gflops / peak.gflops, 100.0 * r.effective_gflops / peak.gflops,
              static_cast<double>(r.memory.peak_extra_bytes()) / (1024.0 * 1024.0));
  if (r.kv_copy) {
    std::printf(
        "%-9s  K/V walked from a head-major copy (their size, in extra MiB; docs/kernels.md, \"A "
        "head-major copy of K and V\")\n",
        "");
  }
  if (c.seq_q <= kDecodeMaxSeqQ) {
    const double kv_gbs = kv_gbytes_per_second(c, r, dtype);
    std::printf(
        "%-9s  K/V read %.1f GB/s = %.1f%% of the read bandwidth; %.1f%% of %.1f GB/s, the median "
        "read between the repeats; %.1f%% of %.1f GB/s, a plain read of the K/V arrays\n",
        "", kv_gbs, 100.0 * kv_gbs / probes.bandwidth.gbytes_per_second,
        100.0 * kv_gbs / r.read_between_repeats, r.read_between_repeats,
        100.0 * kv_gbs / r.kv_read_between_repeats, r.kv_read_between_repeats);
  }
  std::fflush(stdout);
}

}  // namespace

int run_bench(std::vector<std::string> args) {
  bool help = false;
  const BenchOptions options = parse_options(std::move(args), &help);
  if (help) {
    std::fputs(kBenchUsage, stdout);
    return 0;
  }
  std::vector<BenchCase> cases;
  if (options.shape) {
    BenchCase c = *options.shape;
    c.causal = options.causal;
    cases.push_back(c);
  } else {
    cases = default_sweep(options.causal);
  }
  const int threads = resolve_num_threads(options.threads);
  // --products: each path must run here (a usage error names those that do); the probes then
  // run with nothing pinned, so every peak a row may be measured against is there.
  const std::vector<ProductPath> paths = !options.all_products ? options.products
                                         : options.backward ? backward_product_paths(options.dtype)
                                                            : flash_product_paths(options.dtype);
  for (ProductPath path : paths) pin_products(path, options.dtype, options.backward);
  unpin_flash_product_path();

  std::fprintf(stderr,
               "qkv bench: measuring the fp32 FMA peak and read bandwidth on %d thread%s...\n",
               threads, threads == 1 ? "" : "s");
  Probes probes;
  probes.fp32_peak = tools::measure_fma_peak(threads);
  if (options.dtype == DType::kBF16 && !options.linear) {
    probes.pairs_peak = tools::measure_bf16_peak(threads);  // 0 without AVX512-BF16
  }
  if (options.dtype != DType::kF32 && !options.linear) {
    probes.amx_peak = tools::measure_amx_peak(threads);  // 0 without AMX-BF16
    probes.amx_overlap = tools::measure_amx_overlap();   // 0 without AMX-BF16
  }
  probes.bandwidth = tools::measure_read_bandwidth(threads);
  if (options.json) {
    std::fprintf(stderr,
                 "qkv bench: fp32 peak %.1f GFLOP/s (%s), vdpbf16ps peak %.1f, AMX peak %.1f "
                 "(beside the softmax: together %.2fx the sum), read %.1f GB/s\n",
                 probes.fp32_peak.gflops, probes.fp32_peak.hwy_target.c_str(),
                 probes.pairs_peak.gflops, probes.amx_peak.gflops,
                 probes.amx_overlap.together_over_sum(), probes.bandwidth.gbytes_per_second);
  } else {
    print_table_header(threads, options.dtype, probes);
  }

  const std::size_t total = cases.size() * options.kernels.size();
  std::size_t index = 0;
  for (const BenchCase& c : cases) {
    for (Kernel kernel : options.kernels) {
      ++index;
      std::fprintf(stderr, "qkv bench: [%zu/%zu] %s (%s)%s%s ...\n", index, total,
                   options.linear                 ? linear_spec_name(*options.linear).c_str()
                   : kernel == Kernel::kAuto      ? "auto"
                   : kernel == Kernel::kReference ? "reference"
                   : kernel == Kernel::kChunked   ? "chunked"
                                                  : "flash",
                   shape_text(c).c_str(), c.causal ? " causal" : "",
                   options.layout == Layout::kBHSD ? " bhsd" : "");
      for (const BenchResult& result : run_case(c, kernel, options, paths, threads)) {
        if (options.json) {
          print_json(c, result, threads, options.dtype,
                     options.out_in_input_dtype ? options.dtype : DType::kF32, options.layout,
                     probes);
        } else {
          print_table_row(c, result, threads, options.dtype, probes);
        }
      }
    }
  }
  return 0;
}

}  // namespace qkv::cli
