// qkv attention: scaled dot-product attention on .npy files (DESIGN.md section 4); and qkv
// attention-backward: its gradients (qkv/attention_backward.h) on the same files plus --dout.
//
//   --q Q.npy    [B, Lq, Hq, D]      --k K.npy [B, Lk, Hkv, D]     --v V.npy [B, Lk, Hkv, Dv]
//   --out O.npy  [B, Lq, Hq, Dv]     (with --layout bhsd each of these four is [B, H, L, D])
//   --lse        [B, Hq, Lq]         --weights [B, Hq, Lq, Lk]     --key-lengths [B]
//   --mask, --bias: rank <= 4, broadcastable (numpy rules, right-aligned) to [B, Hq, Lq, Lk]
//
// The command only reads files, checks what the library cannot know (file dtypes and ranks,
// layouts, option syntax) and builds views; qkv::attention validates the attention semantics.
// Outputs are written after the computation succeeded, all or none (io::NpyWriteSet).
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "core/float16.h"
#include "io/npy.h"
#include "qkv/attention.h"
#include "qkv/attention_backward.h"
#include "qkv/error.h"
#include "tools/cli.h"
#include "tools/cli_linear.h"
#include "tools/cli_ring.h"
#include "tools/cli_sparse.h"

namespace qkv::cli {
namespace {

constexpr const char* kUsage =
    R"(usage: qkv attention --q Q.npy --k K.npy --v V.npy --out O.npy [options]

Scaled dot-product attention on .npy files. For query row i and key column j:
  s = (q_i . k_j) * scale; if softcap > 0: s = softcap * tanh(s / softcap); s += bias
  s = -inf where the pair is not allowed (causal, window, key lengths, mask)
  out_i = sum_j softmax_j(s) v_j;  lse_i = log(sum_j exp(s_ij))
A row with no allowed key gets out = 0 and lse = -inf. Full docs: docs/cli-attention.md.

inputs and outputs (float32, C order):
  --q Q.npy            queries (B, Lq, Hq, D)
  --k K.npy            keys    (B, Lk, Hkv, D); Hq must be a multiple of Hkv (GQA/MQA)
  --v V.npy            values  (B, Lk, Hkv, Dv)
  --out O.npy          writes the output (B, Lq, Hq, Dv)
  --layout bshd|bhsd   order of the four arrays above: bshd (default) as shown, or bhsd =
                       (B, H, L, D), PyTorch's scaled_dot_product_attention order
  --lse LSE.npy        also writes the log-sum-exp of the scores (B, Hq, Lq), natural log
  --weights W.npy      also writes the attention probabilities (B, Hq, Lq, Lk)
                       (not available from --kernel flash)

scores:
  --scale S            score scale, finite and > 0 (default 1/sqrt(D))
  --softcap C          s = C * tanh(s / C) when C > 0 (default 0 = off)
  --bias A.npy         float32 additive bias, broadcastable to (B, Hq, Lq, Lk); -inf allowed

masks (a pair is allowed only if every given mask allows it):
  --causal             key j only up to query i' (see --align)
  --window L,R         keys i'-L <= j <= i'+R; -1 = unbounded on that side
  --align A            diagonal of --causal/--window when Lq != Lk:
                       bottom-right (default; i' = i + Lk - Lq, KV-cache decoding) or
                       top-left (i' = i, PyTorch's is_causal)
  --key-lengths KL.npy int32/int64 (B,): keys j >= KL[b] are padding (never read)
  --mask M.npy         bool/uint8, broadcastable to (B, Hq, Lq, Lk); TRUE MEANS "MAY ATTEND"
                       (the opposite of torch.nn.MultiheadAttention's key_padding_mask)

dropout (training; docs/training.md):
  --dropout P          drop each probability with chance P in [0, 1) before it weights v (kept
                       ones times 1/(1-P)); --lse and --weights stay those of the softmax
  --seed S, --offset N the mask's key (integers >= 0, default 0): the same (S, N) gives the same
                       mask in every kernel, in attention-backward and on any thread count

execution:
  --kernel K           auto (default: flash, or chunked when --weights is given),
                       reference, chunked or flash
  --dtype T            f32 (default), bf16 or f16: q, k, v are converted to T (round to
                       nearest even) and the kernels read them in T, accumulating in float32
  --threads N          worker threads; 0 = all cores (default). Results do not depend on N.
  --help               this text

Mask and bias arrays broadcast like numpy: missing leading dims count as size 1, and every dim
must be 1 or the full size. Errors print one line 'qkv: error: ...' and exit with status 2;
no output file is written unless the whole command succeeded.
)";

constexpr const char* kBackwardUsage =
    R"(usage: qkv attention-backward --q Q.npy --k K.npy --v V.npy --dout DO.npy
                              --dq DQ.npy --dk DK.npy --dv DV.npy [options]

The gradients of qkv attention (docs/training.md): runs the forward on the inputs, then the
backward for dL/d(out) = --dout, and writes dL/dq, dL/dk, dL/dv (and dL/d(bias)). Takes every
option of qkv attention that defines the forward (scores, masks, --layout, --dtype, --threads)
except --weights, --linear and --ring.

  --dout DO.npy        dL/d(out), float32, the shape of out: (B, Lq, Hq, Dv)
  --dq DQ.npy          writes dL/dq (B, Lq, Hq, D)
  --dk DK.npy          writes dL/dk (B, Lk, Hkv, D): summed over the query heads of a kv head
  --dv DV.npy          writes dL/dv (B, Lk, Hkv, Dv)
  --dbias DB.npy       writes dL/d(bias), the shape of the --bias file (summed over the
                       dimensions it broadcasts over); needs --bias
  --out O.npy          also writes the forward's out; --lse LSE.npy its log-sum-exp
  --kernel K           the forward's kernel (auto, reference, chunked, flash); the backward
                       runs flash (auto, flash) or the float64 oracle (reference)
(--layout bhsd orders --dout, --dq, --dk and --dv as (B, H, L, D) too.)
)";

struct Options {
  std::string q_path, k_path, v_path, out_path;
  std::string lse_path, weights_path, key_lengths_path, mask_path, bias_path;
  Layout layout = Layout::kBSHD;
  std::optional<float> scale;
  float softcap = 0.0f;
  bool causal = false;
  Align align = Align::kBottomRight;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  Kernel kernel = Kernel::kAuto;
  DType dtype = DType::kF32;
  int num_threads = 0;
  float dropout_p = 0.0f;                       // --dropout
  std::uint64_t seed = 0, offset = 0;           // --seed, --offset
  std::optional<LinearAttentionParams> linear;  // --linear SPEC (cli_linear.h)
  std::string favor_features_path;              // --favor-features-out
  bool ring = false;                            // --ring (cli_ring.h)
  RingCliOptions ring_options;                  // --ring-layout, --ring-block
  SparseCliOptions sparse;  // --sparse, --sparse-layout, --sparse-block (cli_sparse.h)
  // qkv attention-backward
  bool backward = false;
  std::string dout_path, dq_path, dk_path, dv_path, dbias_path;
};

// A double option that must also be representable as a float.
float parse_float(const std::string& option, const std::string& text) {
  const double value = parse_double(option, text);
  if (std::isfinite(value) && std::fabs(value) > std::numeric_limits<float>::max()) {
    throw UsageError(option + ": " + text + " is out of float32 range");
  }
  return static_cast<float>(value);
}

Options parse_options(std::vector<std::string> argv, bool backward) {
  Options o;
  o.backward = backward;
  const char* command = backward ? "attention-backward" : "attention";
  Args args(std::move(argv));
  std::set<std::string> seen;
  // The path after option `name`; a following option is a missing value, not a file name.
  const auto path_value = [&](const std::string& name) {
    std::string value = args.value(name);
    if (value.rfind("--", 0) == 0) throw UsageError(name + ": missing value (got " + value + ")");
    if (value.empty()) throw UsageError(name + ": empty file name");
    return value;
  };
  while (!args.done()) {
    const std::string name = args.next();
    if (name.rfind("--", 0) == 0 && !seen.insert(name).second) {
      throw UsageError(name + ": given more than once");
    }
    if (name == "--q") {
      o.q_path = path_value(name);
    } else if (name == "--k") {
      o.k_path = path_value(name);
    } else if (name == "--v") {
      o.v_path = path_value(name);
    } else if (name == "--out") {
      o.out_path = path_value(name);
    } else if (backward && (name == "--dout" || name == "--dq" || name == "--dk" ||
                            name == "--dv" || name == "--dbias")) {
      std::string* const paths[] = {&o.dout_path, &o.dq_path, &o.dk_path, &o.dv_path,
                                    &o.dbias_path};
      const char* const names[] = {"--dout", "--dq", "--dk", "--dv", "--dbias"};
      for (int i = 0; i < 5; ++i) {
        if (name == names[i]) *paths[i] = path_value(name);
      }
    } else if (name == "--lse") {
      o.lse_path = path_value(name);
    } else if (name == "--weights") {
      o.weights_path = path_value(name);
    } else if (name == "--key-lengths") {
      o.key_lengths_path = path_value(name);
    } else if (name == "--mask") {
      o.mask_path = path_value(name);
    } else if (name == "--bias") {
      o.bias_path = path_value(name);
    } else if (name == "--layout") {
      o.layout = parse_layout(args.value(name));
    } else if (name == "--scale") {
      o.scale = parse_float(name, args.value(name));
    } else if (name == "--softcap") {
      o.softcap = parse_float(name, args.value(name));
    } else if (name == "--causal") {
      o.causal = true;
    } else if (name == "--align") {
      const std::string value = args.value(name);
      if (value == "bottom-right") {
        o.align = Align::kBottomRight;
      } else if (value == "top-left") {
        o.align = Align::kTopLeft;
      } else {
        throw UsageError("--align: expected bottom-right or top-left, got '" + value + "'");
      }
    } else if (name == "--window") {
      const std::string value = args.value(name);
      const std::vector<std::int64_t> sides = parse_int_list(name, value);
      if (sides.size() != 2) {
        throw UsageError("--window: expected L,R (two integers, -1 = unbounded), got '" + value +
                         "'");
      }
      o.window_left = sides[0];
      o.window_right = sides[1];
    } else if (name == "--dropout") {
      o.dropout_p = parse_float(name, args.value(name));
    } else if (name == "--seed" || name == "--offset") {
      const std::int64_t value = parse_int(name, args.value(name));
      if (value < 0) throw UsageError(name + ": expected an integer >= 0, got " + std::to_string(value));
      (name == "--seed" ? o.seed : o.offset) = static_cast<std::uint64_t>(value);
    } else if (name == "--ring") {
#if QKV_WITH_MPI
      o.ring = true;
#else
      throw UsageError("--ring: this qkv was built without MPI (install libopenmpi-dev and "
                       "openmpi-bin, then rebuild; docs/distributed.md)");
#endif
    } else if (name == "--ring-layout") {
      o.ring_options.layout = parse_ring_layout(args.value(name));
    } else if (name == "--ring-block") {
      o.ring_options.block_rows = parse_ring_block(args.value(name));
    } else if (name == "--kernel") {
      const std::string value = args.value(name);
      if (value == "auto") {
        o.kernel = Kernel::kAuto;
      } else if (value == "reference") {
        o.kernel = Kernel::kReference;
      } else if (value == "chunked") {
        o.kernel = Kernel::kChunked;
      } else if (value == "flash") {
        o.kernel = Kernel::kFlash;
      } else {
        throw UsageError("--kernel: expected auto, reference, chunked or flash, got '" + value +
                         "'");
      }
    } else if (name == "--dtype") {
      const std::string value = args.value(name);
      if (value == "f32") {
        o.dtype = DType::kF32;
      } else if (value == "bf16") {
        o.dtype = DType::kBF16;
      } else if (value == "f16") {
        o.dtype = DType::kF16;
      } else {
        throw UsageError("--dtype: expected f32, bf16 or f16, got '" + value + "'");
      }
    } else if (name == "--linear") {
      o.linear = parse_linear_spec(name, args.value(name));
    } else if (name == "--favor-features-out") {
      o.favor_features_path = path_value(name);
    } else if (name == "--threads") {
      const std::int64_t threads = parse_int(name, args.value(name));
      if (threads < 0 || threads > 4096) {
        throw UsageError("--threads: expected 0 (all cores) to 4096, got " +
                         std::to_string(threads));
      }
      o.num_threads = static_cast<int>(threads);
    } else if (parse_sparse_option(name, args, o.sparse)) {
      // consumed: --sparse, --sparse-layout, --sparse-block
    } else {
      throw UsageError("unknown option '" + name + "' for 'qkv " + command + "' (try 'qkv " +
                       command + " --help')");
    }
  }
  std::vector<std::pair<const char*, const std::string*>> required = {
      {"--q", &o.q_path}, {"--k", &o.k_path}, {"--v", &o.v_path}};
  if (backward) {
    required.insert(required.end(), {{"--dout", &o.dout_path}, {"--dq", &o.dq_path},
                                     {"--dk", &o.dk_path}, {"--dv", &o.dv_path}});
  } else {
    required.push_back({"--out", &o.out_path});
  }
  for (const auto& [name, path] : required) {
    if (path->empty()) {
      throw UsageError(std::string("missing required option ") + name +
                       (backward ? " (usage: qkv attention-backward --q Q.npy --k K.npy --v V.npy "
                                   "--dout DO.npy --dq DQ.npy --dk DK.npy --dv DV.npy ...)"
                                 : " (usage: qkv attention --q Q.npy --k K.npy --v V.npy --out "
                                   "O.npy ...)"));
    }
  }
  if (backward) {
    const char* unsupported = !o.weights_path.empty() ? "--weights"
                              : o.linear              ? "--linear"
                              : o.ring                ? "--ring"
                                                      : nullptr;
    if (unsupported != nullptr) {
      throw UsageError(std::string(unsupported) + ": not available for attention-backward");
    }
    if (!o.dbias_path.empty() && o.bias_path.empty()) throw UsageError("--dbias: needs --bias");
  }
  if (!o.favor_features_path.empty() &&
      (!o.linear || o.linear->feature_map != FeatureMap::kFavorPositive)) {
    throw UsageError("--favor-features-out: needs --linear favor[:...]");
  }
  check_sparse_options(o.sparse);
  if (o.linear && (seen.count("--dropout") || seen.count("--seed") || seen.count("--offset"))) {
    throw UsageError(std::string(seen.count("--dropout") ? "--dropout" : "--seed/--offset") +
                     ": cannot be combined with --linear (dropout is on softmax attention)");
  }
  if (o.sparse.given() && o.linear) {
    throw UsageError(sparse_option_text(o.sparse) + ": cannot be combined with --linear");
  }
  if (o.ring) {
    const char* unsupported = !o.mask_path.empty()    ? "--mask"
                              : !o.bias_path.empty()  ? "--bias"
                              : o.sparse.given()      ? "--sparse"
                              : o.linear              ? "--linear"
                              : !o.weights_path.empty() ? "--weights"
                              : seen.count("--dropout") ? "--dropout"
                                                      : nullptr;
    if (unsupported != nullptr) {
      throw UsageError(std::string(unsupported) +
                       ": cannot be combined with --ring (the ring takes masks defined by "
                       "positions: --causal, --window, --key-lengths)");
    }
  } else if (seen.count("--ring-layout") || seen.count("--ring-block")) {
    throw UsageError(std::string(seen.count("--ring-layout") ? "--ring-layout" : "--ring-block") +
                     ": only applies to --ring");
  }
  if (!o.weights_path.empty() && o.kernel == Kernel::kFlash) {
    throw UsageError(
        "--weights: not available from --kernel flash (it never materialises "
        "probabilities); use --kernel auto, reference or chunked");
  }
  return o;
}

// Output files must differ from each other (or one would silently replace the other), and their
// directories must exist: checked before any work is done.
void check_output_paths(const Options& o) {
  const std::pair<const char*, const std::string*> outputs[] = {
      {"--out", &o.out_path},
      {"--lse", &o.lse_path},
      {"--weights", &o.weights_path},
      {"--favor-features-out", &o.favor_features_path},
      {"--dq", &o.dq_path},
      {"--dk", &o.dk_path},
      {"--dv", &o.dv_path},
      {"--dbias", &o.dbias_path}};
  std::vector<std::pair<std::string, std::filesystem::path>> seen;
  for (const auto& [name, path] : outputs) {
    if (path->empty()) continue;
    const std::string at = std::string(name) + " " + *path;
    std::error_code error;
    std::filesystem::path absolute = std::filesystem::absolute(*path, error);
    const std::filesystem::path canonical = std::filesystem::weakly_canonical(absolute, error);
    if (!error) absolute = canonical;  // else compare the lexically normal form
    absolute = absolute.lexically_normal();
    std::filesystem::path parent = std::filesystem::path(*path).parent_path();
    if (parent.empty()) parent = ".";
    if (!std::filesystem::is_directory(parent, error)) {
      throw Error(at + ": directory '" + parent.string() + "' does not exist");
    }
    if (std::filesystem::is_directory(*path, error)) throw Error(at + ": is a directory");
    if (std::filesystem::exists(*path, error) && !std::filesystem::is_regular_file(*path, error)) {
      throw Error(at + ": exists and is not a regular file");
    }
    for (const auto& [other_name, other] : seen) {
      if (other == absolute) throw UsageError(at + ": same file as " + other_name);
    }
    seen.emplace_back(at, absolute);
  }
}

std::string where(const char* option, const std::string& path) {
  return std::string(option) + " " + path;
}

void require_dtype(const io::NpyArray& array, const char* option, const std::string& path,
                   std::initializer_list<DType> allowed, const char* expected) {
  for (const DType dtype : allowed) {
    if (array.dtype == dtype) return;
  }
  throw Error(where(option, path) + ": dtype " + io::npy_type_name(array.dtype) +
              " is not supported; expected " + expected);
}

// q, k, v: float32, rank 4, as a logical [B, L, H, D] view (no copy for bhsd either).
TensorView load_operand(io::NpyArray& array, const char* option, const std::string& path,
                        Layout layout, const char* bshd_shape, const char* bhsd_shape) {
  array = io::read_npy(path, option);
  require_dtype(array, option, path, {DType::kF32}, "float32");
  if (array.shape.size() != 4) {
    throw Error(where(option, path) + ": shape " + io::npy_shape_string(array.shape) +
                " is not 4-D; expected " + (layout == Layout::kBSHD ? bshd_shape : bhsd_shape) +
                (layout == Layout::kBSHD ? " (--layout bshd)" : " (--layout bhsd)"));
  }
  const TensorView view = TensorView::contiguous(
      array.data(), DType::kF32, {array.shape[0], array.shape[1], array.shape[2], array.shape[3]});
  // bhsd file dims (B, H, L, D) -> logical (B, L, H, D): logical dim d is file dim order[d].
  return layout == Layout::kBSHD ? view : view.permuted({0, 2, 1, 3});
}

// `view` of `array` with its elements converted to `dtype` storage (bf16/f16, round to nearest
// even) in `bits`; the same view for f32.
TensorView to_storage(const io::NpyArray& array, TensorView view, DType dtype,
                      std::vector<std::uint16_t>& bits) {
  if (dtype == DType::kF32) return view;
  bits = to_half_bits(dtype, {array.as<float>(), static_cast<std::size_t>(array.numel())});
  view.data = bits.data();
  view.dtype = dtype;
  return view;
}

// mask / bias: rank <= 4, right-aligned numpy broadcasting to `full` = (B, Hq, Lq, Lk). The view
// keeps the file's sizes (1 or full) padded with leading 1s; qkv::attention broadcasts the 1s.
TensorView broadcast_view(const io::NpyArray& array, const char* option, const std::string& path,
                          const std::array<std::int64_t, 4>& full, const std::string& sources) {
  std::array<std::int64_t, 4> sizes = {1, 1, 1, 1};
  const std::size_t rank = array.shape.size();  // <= 4, checked by the reader
  for (std::size_t d = 0; d < rank; ++d) sizes[4 - rank + d] = array.shape[d];
  for (int d = 0; d < 4; ++d) {
    if (sizes[d] != 1 && sizes[d] != full[d]) {
      throw Error(where(option, path) + ": shape " + io::npy_shape_string(array.shape) +
                  " is not broadcastable to (B, Hq, Lq, Lk) = " + shape_string(full) + " (" +
                  sources + "): each dim, aligned from the right, must be 1 or the full size");
    }
  }
  return TensorView::contiguous(array.data(), array.dtype, sizes);
}

// qkv::attention names its parameters (q, key_lengths, probs, ...); rewrite each "name:" that
// starts the message or a phrase into the option the user typed ("--key-lengths kl.npy:").
std::string cli_message(const std::string& message, const Options& o) {
  const std::pair<std::string, std::string> names[] = {
      {"q:", where("--q", o.q_path) + ":"},
      {"k:", where("--k", o.k_path) + ":"},
      {"v:", where("--v", o.v_path) + ":"},
      {"out:", where("--out", o.out_path) + ":"},
      {"lse:", where("--lse", o.lse_path) + ":"},
      {"probs:", where("--weights", o.weights_path) + ":"},
      {"key_lengths:", where("--key-lengths", o.key_lengths_path) + ":"},
      {"mask:", where("--mask", o.mask_path) + ":"},
      {"bias:", where("--bias", o.bias_path) + ":"},
      {"scale:", "--scale:"},
      {"softcap:", "--softcap:"},
      {"window:", "--window:"},
      {"num_threads:", "--threads:"},
      {"sparsity:", sparse_option_text(o.sparse) + ":"},
      {"dout:", where("--dout", o.dout_path) + ":"},
      {"dq:", where("--dq", o.dq_path) + ":"},
      {"dk:", where("--dk", o.dk_path) + ":"},
      {"dv:", where("--dv", o.dv_path) + ":"},
      {"dbias:", where("--dbias", o.dbias_path) + ":"},
      {"kernel:", "--kernel:"},
      {"dropout_p:", "--dropout:"}};
  std::string text;
  std::size_t pos = 0;
  while (pos < message.size()) {
    const bool phrase_start = pos == 0 || message[pos - 1] == ' ' || message[pos - 1] == '(';
    bool replaced = false;
    for (const auto& [name, option] : names) {
      if (phrase_start && message.compare(pos, name.size(), name) == 0) {
        text += option;
        pos += name.size();
        replaced = true;
        break;
      }
    }
    if (!replaced) text += message[pos++];
  }
  if (o.layout == Layout::kBHSD && text.find("shape") != std::string::npos) {
    text += o.backward ? " (with --layout bhsd, shapes of --q, --k, --v, --out, --dout, --dq, --dk "
                         "and --dv are shown here in logical (B, L, H, D) order)"
                       : " (with --layout bhsd, shapes of --q, --k, --v and --out are shown here "
                         "in logical (B, L, H, D) order)";
  }
  return text;
}

// A float32 output array in the file order of --layout for logical [B, L, H, D] `sizes`, and
// its logical view.
TensorView make_output(io::NpyArray& array, const std::array<std::int64_t, 4>& sizes,
                       Layout layout, const std::string& what) {
  const bool bshd = layout == Layout::kBSHD;
  array = io::make_npy_array(DType::kF32,
                             bshd ? std::vector<std::int64_t>{sizes[0], sizes[1], sizes[2], sizes[3]}
                                  : std::vector<std::int64_t>{sizes[0], sizes[2], sizes[1], sizes[3]},
                             what);
  const TensorView view = TensorView::contiguous(
      array.data(), DType::kF32, {array.shape[0], array.shape[1], array.shape[2], array.shape[3]});
  return bshd ? view : view.permuted({0, 2, 1, 3});
}

int run(std::vector<std::string> args, bool backward) {
  for (const std::string& arg : args) {
    if ((arg == "--help" || arg == "-h") && backward) {
      std::fputs(kBackwardUsage, stdout);
      std::fputs("\nThe forward's options, as for qkv attention:\n\n", stdout);
      std::fputs(kUsage, stdout);
      std::fputs("\n", stdout);
      std::fputs(kSparseHelp, stdout);
      return 0;
    }
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::fputs("\n", stdout);
      std::fputs(kLinearUsage, stdout);
      std::fputs("\n", stdout);
      std::fputs(kSparseHelp, stdout);
      std::fputs("\n", stdout);
      std::fputs(kRingUsage, stdout);
      return 0;
    }
  }
  const Options o = parse_options(std::move(args), backward);
  check_output_paths(o);

  // Inputs, as logical views. q: [B, Lq, Hq, D]  k: [B, Lk, Hkv, D]  v: [B, Lk, Hkv, Dv]
  io::NpyArray q_array, k_array, v_array;
  std::vector<std::uint16_t> q_bits, k_bits, v_bits;  // --dtype bf16|f16 storage
  const TensorView q = to_storage(
      q_array, load_operand(q_array, "--q", o.q_path, o.layout, "(B, Lq, Hq, D)", "(B, Hq, Lq, D)"),
      o.dtype, q_bits);
  const TensorView k = to_storage(
      k_array,
      load_operand(k_array, "--k", o.k_path, o.layout, "(B, Lk, Hkv, D)", "(B, Hkv, Lk, D)"),
      o.dtype, k_bits);
  const TensorView v = to_storage(
      v_array,
      load_operand(v_array, "--v", o.v_path, o.layout, "(B, Lk, Hkv, Dv)", "(B, Hkv, Lk, Dv)"),
      o.dtype, v_bits);
  const std::int64_t batch = q.sizes[0], seq_q = q.sizes[1], num_heads_q = q.sizes[2];
  const std::int64_t seq_kv = k.sizes[1], head_dim_v = v.sizes[3];
  const std::string sources = "from --q shape " + io::npy_shape_string(q_array.shape) +
                              " and --k shape " + io::npy_shape_string(k_array.shape);

  AttentionParams params;
  params.scale = o.scale;
  params.softcap = o.softcap;
  params.causal = o.causal;
  params.align = o.align;
  params.window_left = o.window_left;
  params.window_right = o.window_right;
  params.kernel = o.kernel;
  params.num_threads = o.num_threads;
  params.dropout_p = o.dropout_p;
  params.seed = o.seed;
  params.offset = o.offset;
  io::NpyArray sparse_layout;  // --sparse-layout's file, alive until the call returns
  SparseCliOptions sparse = o.sparse;
  params.sparsity = make_sparsity(sparse, sparse_layout, seq_q, seq_kv, num_heads_q, sources);

  // key_lengths: [B], int32 or int64.
  std::vector<std::int64_t> key_lengths;
  if (!o.key_lengths_path.empty()) {
    const io::NpyArray array = io::read_npy(o.key_lengths_path, "--key-lengths");
    require_dtype(array, "--key-lengths", o.key_lengths_path, {DType::kI32, DType::kI64},
                  "int32 or int64");
    if (array.shape.size() != 1 || array.shape[0] != batch) {
      throw Error(where("--key-lengths", o.key_lengths_path) + ": shape " +
                  io::npy_shape_string(array.shape) + " does not match (B,) = (" +
                  std::to_string(batch) + ",) from --q shape " +
                  io::npy_shape_string(q_array.shape));
    }
    for (std::int64_t b = 0; b < batch; ++b) {
      key_lengths.push_back(array.dtype == DType::kI32 ? array.as<std::int32_t>()[b]
                                                       : array.as<std::int64_t>()[b]);
    }
    params.key_lengths = key_lengths;
  }

  // mask / bias: broadcastable to [B, Hq, Lq, Lk].
  const std::array<std::int64_t, 4> score_shape = {batch, num_heads_q, seq_q, seq_kv};
  io::NpyArray mask_array, bias_array;
  if (!o.mask_path.empty()) {
    mask_array = io::read_npy(o.mask_path, "--mask");
    require_dtype(mask_array, "--mask", o.mask_path, {DType::kBool, DType::kU8}, "bool or uint8");
    params.mask = broadcast_view(mask_array, "--mask", o.mask_path, score_shape, sources);
  }
  if (!o.bias_path.empty()) {
    bias_array = io::read_npy(o.bias_path, "--bias");
    require_dtype(bias_array, "--bias", o.bias_path, {DType::kF32}, "float32");
    params.bias = broadcast_view(bias_array, "--bias", o.bias_path, score_shape, sources);
  }

  // Outputs. out: [B, Lq, Hq, Dv] (file order follows --layout)  lse: [B, Hq, Lq]
  // weights: [B, Hq, Lq, Lk]
  io::NpyArray out_array;
  AttentionOutputs outputs;
  outputs.out = make_output(out_array, {batch, seq_q, num_heads_q, head_dim_v}, o.layout,
                            o.out_path.empty() ? "out" : where("--out", o.out_path));
  io::NpyArray lse_array, weights_array;
  if (!o.lse_path.empty() || backward) {  // the backward needs the forward's lse
    lse_array =
        io::make_npy_array(DType::kF32, {batch, num_heads_q, seq_q},
                           o.lse_path.empty() ? "lse" : where("--lse", o.lse_path));
    outputs.lse =
        TensorView::contiguous(lse_array.data(), DType::kF32, {batch, num_heads_q, seq_q, 1});
  }
  if (!o.weights_path.empty()) {
    weights_array = io::make_npy_array(DType::kF32, {score_shape.begin(), score_shape.end()},
                                       where("--weights", o.weights_path));
    outputs.probs = TensorView::contiguous(weights_array.data(), DType::kF32, score_shape);
  }

#if QKV_WITH_MPI
  if (o.ring) {
    // Every rank computes its shard; only rank 0 holds the whole result and writes the files.
    if (ring_attention_cli(q, k, v, outputs, params, o.ring_options) != 0) return 0;
  } else
#endif
  {
    try {
      if (o.linear) {
        linear_attention(q, k, v, outputs, linear_params_from(*o.linear, params));
      } else {
        attention(q, k, v, outputs, params);
      }
    } catch (const Error& e) {
      throw Error(cli_message(e.what(), o));
    }
  }

  io::NpyWriteSet files;
  io::NpyArray dout_array, dq_array, dk_array, dv_array, dbias_array;
  if (backward) {
    const TensorView dout = load_operand(dout_array, "--dout", o.dout_path, o.layout,
                                         "(B, Lq, Hq, Dv)", "(B, Hq, Lq, Dv)");
    const std::int64_t heads_kv = k.sizes[2], head_dim = q.sizes[3];
    AttentionGrads grads{
        .dq = make_output(dq_array, {batch, seq_q, num_heads_q, head_dim}, o.layout,
                          where("--dq", o.dq_path)),
        .dk = make_output(dk_array, {batch, seq_kv, heads_kv, head_dim}, o.layout,
                          where("--dk", o.dk_path)),
        .dv = make_output(dv_array, {batch, seq_kv, heads_kv, head_dim_v}, o.layout,
                          where("--dv", o.dv_path))};
    if (!o.dbias_path.empty()) {  // the --bias file's shape
      dbias_array = io::make_npy_array(DType::kF32, bias_array.shape, where("--dbias", o.dbias_path));
      grads.dbias = TensorView::contiguous(dbias_array.data(), DType::kF32, params.bias.sizes);
    }
    try {
      attention_backward(q, k, v, outputs.out, outputs.lse, dout, grads, params);
    } catch (const Error& e) {
      throw Error(cli_message(e.what(), o));
    }
    files.stage(o.dq_path, dq_array, "--dq");
    files.stage(o.dk_path, dk_array, "--dk");
    files.stage(o.dv_path, dv_array, "--dv");
    if (!o.dbias_path.empty()) files.stage(o.dbias_path, dbias_array, "--dbias");
  }
  if (!o.out_path.empty()) files.stage(o.out_path, out_array, "--out");
  if (!o.lse_path.empty()) files.stage(o.lse_path, lse_array, "--lse");
  if (!o.weights_path.empty()) files.stage(o.weights_path, weights_array, "--weights");
  if (!o.favor_features_path.empty()) {
    files.stage(o.favor_features_path,
                favor_projection_array(*o.linear, q.sizes[3],
                                       where("--favor-features-out", o.favor_features_path)),
                "--favor-features-out");
  }
  files.commit();
  return 0;
}

}  // namespace

int run_attention(std::vector<std::string> args) { return run(std::move(args), false); }

int run_attention_backward(std::vector<std::string> args) { return run(std::move(args), true); }

}  // namespace qkv::cli
