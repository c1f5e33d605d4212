// qkv._qkv: the extension module behind python/qkv/__init__.py. Thin: the Python side picks the
// output framework and allocates outputs; this side imports every array as a view (no copies),
// fills the library's params, releases the GIL and calls the library once.
//
// Function arguments here are positional and internal; the public, documented signatures are
// the Python wrappers' (docs/python.md). qkv::Error becomes ValueError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "core/int_math.h"
#include "kernels/product_path.h"
#include "python/arrays.h"
#include "python/layers.h"
#include "python/options.h"
#if QKV_WITH_MPI
#include "python/ring.h"
#endif
#include "qkv/attention.h"
#include "qkv/attention_backward.h"
#include "qkv/error.h"
#include "qkv/linear_attention.h"
#include "qkv/models/sentence_embedder.h"
#include "qkv/sparse.h"

namespace qkv::python {
namespace {

using namespace nb::literals;

// Which of q, k, v hold bfloat16 as uint16 words (arrays.h, dtype_of).
constexpr int kQBits = 1, kKBits = 2, kVBits = 4, kOutBits = 8;

// q, k, v and out in the caller's layout, as the library's logical BSHD views.
struct Operands {
  Held<InArray> q, k, v;
  Held<OutArray> out;
  bool bhsd = false;
};

Operands operands(nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                  const std::string& layout, int bf16_bits) {
  if (layout != "bshd" && layout != "bhsd") {
    throw nb::value_error(("layout: expected 'bshd' or 'bhsd', got '" + layout + "'").c_str());
  }
  const bool bhsd = layout == "bhsd";
  // (float64: the reference kernel's gradient-check path; the library checks that every
  // output is float64 too.)
  const std::initializer_list<DType> kInputs = {DType::kF32, DType::kBF16, DType::kF16,
                                                DType::kF64};
  const char* const kInputNames = "float32, bfloat16, float16 or float64";
  Operands o{
      input_view("q", q,
                 {4, 4, bhsd ? "4: (B, Hq, Lq, D) for layout 'bhsd'" : "4: (B, Lq, Hq, D)", kInputs,
                  kInputNames},
                 bf16_bits & kQBits),
      input_view("k", k,
                 {4, 4, bhsd ? "4: (B, Hkv, Lk, D) for layout 'bhsd'" : "4: (B, Lk, Hkv, D)",
                  kInputs, kInputNames},
                 bf16_bits & kKBits),
      input_view("v", v,
                 {4, 4, bhsd ? "4: (B, Hkv, Lk, Dv) for layout 'bhsd'" : "4: (B, Lk, Hkv, Dv)",
                  kInputs, kInputNames},
                 bf16_bits & kVBits),
      // (bfloat16 / float16 like q, k and v: attention's out only; the library checks.)
      output_view("out", out,
                  {4,
                   4,
                   bhsd ? "4: (B, Hq, Lq, Dv) for layout 'bhsd'" : "4: (B, Lq, Hq, Dv)",
                   {DType::kF32, DType::kF64, DType::kBF16, DType::kF16},
                   "float32 (float64 for float64 inputs), or bfloat16 / float16 as q, k and v"},
                  bf16_bits & kOutBits),
      bhsd};
  if (bhsd) {
    for (TensorView* view : {&o.q.view, &o.k.view, &o.v.view, &o.out.view}) {
      *view = view->permuted({0, 2, 1, 3});
    }
  }
  return o;
}

// Runs `call` without the GIL; a library error becomes ValueError, with the layout hint the
// CLI gives when shapes are shown in logical order.
template <typename Call>
void call_library(const Operands& o, Call&& call) {
  try {
    nb::gil_scoped_release release;
    call();
  } catch (const Error& error) {
    std::string message = error.what();
    if (o.bhsd && message.find("shape") != std::string::npos) {
      message +=
          " (with layout='bhsd', shapes of q, k, v and out are shown here in logical "
          "(B, L, H, D) order)";
    }
    throw nb::value_error(message.c_str());
  }
}

// A sparsity pattern as Python holds it: the library's description plus the memory its spans
// and views point into (Longformer's global positions, a block layout's array).
class PySparsity {
 public:
  static PySparsity longformer(std::int64_t window, std::int64_t dilation,
                               std::vector<std::int64_t> global) {
    PySparsity s;
    s.longformer_ = {.window = window, .dilation = dilation};
    s.global_ = std::move(global);
    s.kind_ = Kind::kLongformer;
    return s;
  }
  static PySparsity bigbird(std::int64_t block, std::int64_t num_random_blocks,
                            std::int64_t num_global_blocks, std::uint64_t seed) {
    PySparsity s;
    s.bigbird_ = {.block = block,
                  .num_random_blocks = num_random_blocks,
                  .num_global_blocks = num_global_blocks,
                  .seed = seed};
    s.kind_ = Kind::kBigBird;
    return s;
  }
  static PySparsity block_layout(nb::handle layout, std::int64_t block_q, std::int64_t block_k) {
    PySparsity s;
    s.layout_ = input_view("layout", layout,
                           {2,
                            4,
                            "2 to 4: (query blocks, key blocks), (Hq, ...) or (1, Hq, ...)",
                            {DType::kBool, DType::kU8},
                            "bool or uint8"});
    s.block_ = {.layout = s.layout_.view, .block_q = block_q, .block_k = block_k};
    s.kind_ = Kind::kBlock;
    return s;
  }

  // The library's Sparsity, pointing into this object (valid while it lives).
  Sparsity get() const {
    switch (kind_) {
      case Kind::kLongformer: {
        LongformerSparsity s = longformer_;
        s.global = global_;
        return s;
      }
      case Kind::kBigBird:
        return bigbird_;
      case Kind::kBlock:
        return block_;
    }
    return bigbird_;
  }

  std::string repr() const {
    switch (kind_) {
      case Kind::kLongformer: {
        std::string g;
        for (std::size_t i = 0; i < global_.size(); ++i) {
          g += (i ? ", " : "") + std::to_string(global_[i]);
        }
        return "qkv.longformer(window=" + std::to_string(longformer_.window) +
               ", dilation=" + std::to_string(longformer_.dilation) + ", global_=[" + g + "])";
      }
      case Kind::kBigBird:
        return "qkv.bigbird(block=" + std::to_string(bigbird_.block) +
               ", num_random_blocks=" + std::to_string(bigbird_.num_random_blocks) +
               ", num_global_blocks=" + std::to_string(bigbird_.num_global_blocks) +
               ", seed=" + std::to_string(bigbird_.seed) + ")";
      case Kind::kBlock:
        return "qkv.block_layout(layout of shape " + shape_string(block_.layout.sizes) +
               ", block_q=" + std::to_string(block_.block_q) +
               ", block_k=" + std::to_string(block_.block_k) + ")";
    }
    return "";
  }

 private:
  enum class Kind { kLongformer, kBigBird, kBlock };
  Kind kind_ = Kind::kBigBird;
  LongformerSparsity longformer_;
  std::vector<std::int64_t> global_;
  BigBirdSparsity bigbird_;
  BlockSparsity block_;
  Held<InArray> layout_;
};

// A new numpy bool array [d0, d1, d2] owning `mask`.
nb::ndarray<nb::numpy, bool> numpy_bool(std::vector<std::uint8_t> mask, std::int64_t d0,
                                        std::int64_t d1, std::int64_t d2) {
  auto* owned = new std::vector<std::uint8_t>(std::move(mask));
  nb::capsule owner(owned,
                    [](void* p) noexcept { delete static_cast<std::vector<std::uint8_t>*>(p); });
  const std::size_t shape[3] = {static_cast<std::size_t>(d0), static_cast<std::size_t>(d1),
                                static_cast<std::size_t>(d2)};
  return nb::ndarray<nb::numpy, bool>(owned->data(), 3, shape, owner);
}

// The attention options as the library takes them, and the arrays they view (held for the
// call): shared by attention() and attention_backward().
struct PyParams {
  AttentionParams params;
  std::vector<std::int64_t> lengths;
  std::optional<Held<InArray>> mask, bias;
};

void attention_params(nb::handle mask, nb::handle bias, nb::handle key_lengths,
                      const PySparsity* sparsity, std::optional<float> scale, float softcap,
                      bool causal, const std::string& align, std::int64_t window_left,
                      std::int64_t window_right, const std::string& kernel, int num_threads,
                      float dropout_p, std::uint64_t seed, std::uint64_t offset, PyParams& out) {
  // mask, bias: broadcastable to [B, Hq, Lq, Lk] (numpy's rule: missing leading dims are 1)
  out.lengths = key_lengths_of(key_lengths);
  out.params = {.scale = scale,
                .softcap = softcap,
                .causal = causal,
                .align = parse_align(align),
                .window_left = window_left,
                .window_right = window_right,
                .key_lengths = out.lengths,
                .kernel = parse_kernel(kernel),
                .num_threads = num_threads,
                .dropout_p = dropout_p,
                .seed = seed,
                .offset = offset};
  if (!mask.is_none()) {
    out.mask = input_view("mask", mask,
                          {0,
                           4,
                           "at most 4, broadcastable to (B, Hq, Lq, Lk)",
                           {DType::kBool, DType::kU8},
                           "bool or uint8 (true = may attend)"});
    out.params.mask = out.mask->view;
  }
  if (!bias.is_none()) {
    out.bias =
        input_view("bias", bias,
                   {0, 4, "at most 4, broadcastable to (B, Hq, Lq, Lk)", {DType::kF32}, "float32"});
    out.params.bias = out.bias->view;
  }
  if (sparsity) out.params.sparsity = sparsity->get();
}

// Outputs (and the backward's out, lse, dout): float32, or float64 for float64 inputs (the
// library checks which).
const std::initializer_list<DType> kFloatOut = {DType::kF32, DType::kF64};
const char* const kFloatOutNames = "float32 (float64 for float64 inputs)";

// lse as the library takes it: a (B, Hq, Lq) array seen as [B, Hq, Lq, 1].
TensorView lse_view(TensorView view) {
  view.sizes = {view.sizes[1], view.sizes[2], view.sizes[3], 1};  // [1, B, Hq, Lq] ->
  view.strides = {view.strides[1], view.strides[2], view.strides[3], 1};
  return view;
}

void attention_binding(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                       nb::handle weights, nb::handle mask, nb::handle bias, nb::handle key_lengths,
                       const PySparsity* sparsity, std::optional<float> scale, float softcap,
                       bool causal, const std::string& align, std::int64_t window_left,
                       std::int64_t window_right, const std::string& kernel, int num_threads,
                       float dropout_p, std::uint64_t seed, std::uint64_t offset,
                       const std::string& layout, int bf16_bits) {
  // q: [B, Lq, Hq, D]  k: [B, Lk, Hkv, D]  v: [B, Lk, Hkv, Dv]  out: [B, Lq, Hq, Dv]
  // (each [B, H, L, D] with layout "bhsd");  lse: [B, Hq, Lq]  weights: [B, Hq, Lq, Lk]
  const Operands o = operands(q, k, v, out, layout, bf16_bits);
  PyParams py;
  attention_params(mask, bias, key_lengths, sparsity, scale, softcap, causal, align, window_left,
                   window_right, kernel, num_threads, dropout_p, seed, offset, py);
  AttentionOutputs outputs{.out = o.out.view};
  std::optional<Held<OutArray>> lse_held, weights_held;
  if (!lse.is_none()) {
    lse_held = output_view("lse", lse, {3, 3, "3: (B, Hq, Lq)", kFloatOut, kFloatOutNames});
    outputs.lse = lse_view(lse_held->view);
  }
  if (!weights.is_none()) {
    weights_held =
        output_view("weights", weights, {4, 4, "4: (B, Hq, Lq, Lk)", kFloatOut, kFloatOutNames});
    outputs.probs = weights_held->view;
  }
  call_library(o, [&] { attention(o.q.view, o.k.view, o.v.view, outputs, py.params); });
}

// qkv::attention_backward: out (the forward's, f32) travels in the Operands' out slot; dq, dk,
// dv (and dbias) are written. Shapes as for attention_binding; dout like out.
void attention_backward_binding(nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                                nb::handle lse, nb::handle dout, nb::handle dq, nb::handle dk,
                                nb::handle dv, nb::handle dbias, nb::handle mask, nb::handle bias,
                                nb::handle key_lengths, const PySparsity* sparsity,
                                std::optional<float> scale, float softcap, bool causal,
                                const std::string& align, std::int64_t window_left,
                                std::int64_t window_right, const std::string& kernel,
                                int num_threads, float dropout_p, std::uint64_t seed,
                                std::uint64_t offset, const std::string& layout, int bf16_bits) {
  const Operands o = operands(q, k, v, out, layout, bf16_bits);
  PyParams py;
  attention_params(mask, bias, key_lengths, sparsity, scale, softcap, causal, align, window_left,
                   window_right, kernel, num_threads, dropout_p, seed, offset, py);
  const bool bhsd = o.bhsd;
  auto bshd = [&](TensorView view) { return bhsd ? view.permuted({0, 2, 1, 3}) : view; };
  const Held<InArray> lse_held =
      input_view("lse", lse, {3, 3, "3: (B, Hq, Lq)", kFloatOut, kFloatOutNames});
  const Held<InArray> dout_held = input_view(
      "dout", dout, {4, 4, bhsd ? "4: (B, Hq, Lq, Dv) for layout 'bhsd'" : "4: (B, Lq, Hq, Dv)",
                     kFloatOut, kFloatOutNames});
  const Expect f32_4d{4, 4, "4: the shape of q, k or v", kFloatOut, kFloatOutNames};
  Held<OutArray> dq_held = output_view("dq", dq, f32_4d), dk_held = output_view("dk", dk, f32_4d),
                 dv_held = output_view("dv", dv, f32_4d);
  AttentionGrads grads{.dq = bshd(dq_held.view), .dk = bshd(dk_held.view), .dv = bshd(dv_held.view)};
  std::optional<Held<OutArray>> dbias_held;
  if (!dbias.is_none()) {
    dbias_held = output_view("dbias", dbias, {0, 4, "the bias's shape", {DType::kF32}, "float32"});
    grads.dbias = dbias_held->view;
  }
  call_library(o, [&] {
    attention_backward(o.q.view, o.k.view, o.v.view, o.out.view, lse_view(lse_held.view),
                       bshd(dout_held.view), grads, py.params);
  });
}

void linear_attention_binding(nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                              nb::handle key_lengths, const std::string& feature_map,
                              std::int64_t nb_features, std::uint64_t seed,
                              std::optional<float> scale, bool causal, const std::string& align,
                              const std::string& kernel, int num_threads, std::int64_t chunk_size,
                              const std::string& layout, int bf16_bits) {
  const Operands o = operands(q, k, v, out, layout, bf16_bits);
  const std::vector<std::int64_t> lengths = key_lengths_of(key_lengths);
  LinearAttentionParams params{.nb_features = nb_features,
                               .seed = seed,
                               .scale = scale,
                               .causal = causal,
                               .align = parse_align(align),
                               .key_lengths = lengths,
                               .num_threads = num_threads,
                               .chunk_size = chunk_size};
  params.feature_map = parse_choice<FeatureMap>(
      "feature_map", feature_map,
      {{"elu", FeatureMap::kEluPlusOne}, {"favor", FeatureMap::kFavorPositive}});
  params.kernel = parse_choice<LinearKernel>("kernel", kernel,
                                             {{"auto", LinearKernel::kAuto},
                                              {"reference", LinearKernel::kReference},
                                              {"cpu", LinearKernel::kCpu}});
  call_library(
      o, [&] { linear_attention(o.q.view, o.k.view, o.v.view, {.out = o.out.view}, params); });
}

// Seconds of each of `repeats` qkv::attention calls on views made once: the C++ side of the
// Python overhead benchmark (scripts/bench_python.py).
std::vector<double> time_attention(nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                                   int repeats) {
  const Operands o = operands(q, k, v, out, "bshd", 0);
  std::vector<double> seconds(static_cast<std::size_t>(std::max(repeats, 0)));
  call_library(o, [&] {
    for (double& s : seconds) {
      const auto start = std::chrono::steady_clock::now();
      attention(o.q.view, o.k.view, o.v.view, {.out = o.out.view}, {});
      s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  });
  return seconds;
}

// One SentenceEmbedder shared by Python threads: the library's embedder is safe to call from
// several threads at once, and the GIL is released while a call runs.
class PyEmbedder {
 public:
  PyEmbedder(const std::string& model_dir, std::int64_t max_length, std::int64_t batch_size,
             std::optional<bool> normalize, bool bf16)
      : embedder_(load(model_dir, {.max_length = max_length,
                                   .batch_size = batch_size,
                                   .normalize = normalize,
                                   .matmul_dtype = bf16 ? DType::kBF16 : DType::kF32})) {}

  // (std::vector of move-only layers claims to be copyable: say it is not, for nanobind.)
  PyEmbedder(const PyEmbedder&) = delete;
  PyEmbedder& operator=(const PyEmbedder&) = delete;

  std::int64_t dimension() const { return embedder_.dimension(); }
  std::int64_t max_length() const { return embedder_.max_length(); }
  bool normalize() const { return embedder_.normalize(); }

  nb::ndarray<nb::numpy, float> encode(const std::vector<std::string>& texts,
                                       std::int64_t batch_size) {
    const std::int64_t dim = embedder_.dimension();
    auto* rows = new std::vector<float>(texts.size() * static_cast<std::size_t>(dim));
    nb::capsule owner(rows, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
    without_gil([&] { embedder_.embed(texts, rows->data(), {}, batch_size); });
    const std::size_t shape[2] = {texts.size(), static_cast<std::size_t>(dim)};
    return nb::ndarray<nb::numpy, float>(rows->data(), 2, shape, owner);
  }

 private:
  static models::SentenceEmbedder load(const std::string& dir,
                                       const models::EmbedderOptions& options) {
    try {
      return models::SentenceEmbedder::load(dir, options);
    } catch (const Error& error) {
      throw nb::value_error(error.what());
    }
  }

  models::SentenceEmbedder embedder_;
};

}  // namespace

void define_module(nb::module_& m) {
  m.doc() = "qkv's extension module; use the wrappers in the qkv package (docs/python.md).";
  nb::register_exception_translator([](const std::exception_ptr& error, void*) {
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  nb::class_<PySparsity>(m, "Sparsity",
                         "A block-sparsity pattern (qkv.longformer, qkv.bigbird, "
                         "qkv.block_layout); pass it as attention(sparsity=...).")
      .def("__repr__", &PySparsity::repr)
      .def(
          "mask",
          [](const PySparsity& s, std::int64_t seq_q, std::int64_t seq_kv, std::int64_t num_heads_q,
             const std::string& align) {
            return numpy_bool(sparse_mask(s.get(), seq_q, seq_kv, num_heads_q, parse_align(align)),
                              num_heads_q, seq_q, seq_kv);
          },
          "seq_q"_a, "seq_kv"_a, "num_heads_q"_a = 1, "align"_a = "bottom_right",
          "The pairs this pattern alone allows: a bool array (num_heads_q, seq_q, seq_kv).");
  m.def("longformer", &PySparsity::longformer, "window"_a, "dilation"_a, "global_"_a);
  m.def("bigbird", &PySparsity::bigbird, "block"_a, "num_random_blocks"_a, "num_global_blocks"_a,
        "seed"_a);
  m.def("block_layout", &PySparsity::block_layout, "layout"_a, "block_q"_a, "block_k"_a);
  m.def(
      "bigbird_layout",
      [](std::int64_t block, std::int64_t num_random_blocks, std::int64_t num_global_blocks,
         std::uint64_t seed, std::int64_t seq_q, std::int64_t seq_kv, std::int64_t num_heads_q) {
        const BigBirdSparsity s{.block = block,
                                .num_random_blocks = num_random_blocks,
                                .num_global_blocks = num_global_blocks,
                                .seed = seed};
        return numpy_bool(bigbird_layout(s, seq_q, seq_kv, num_heads_q), num_heads_q,
                          ceil_div(seq_q, block), ceil_div(seq_kv, block));
      },
      "block"_a, "num_random_blocks"_a, "num_global_blocks"_a, "seed"_a, "seq_q"_a, "seq_kv"_a,
      "num_heads_q"_a);

  // q, k, v and out accept None too, so that a None there gets qkv's message, not nanobind's.
  m.def("attention", &attention_binding, "q"_a.none(), "k"_a.none(), "v"_a.none(), "out"_a.none(),
        "lse"_a.none(), "weights"_a.none(), "mask"_a.none(), "bias"_a.none(),
        "key_lengths"_a.none(), "sparsity"_a.none(), "scale"_a.none(), "softcap"_a, "causal"_a,
        "align"_a, "window_left"_a, "window_right"_a, "kernel"_a, "num_threads"_a, "dropout_p"_a,
        "seed"_a, "offset"_a, "layout"_a, "bf16_bits"_a);
  m.def("attention_backward", &attention_backward_binding, "q"_a.none(), "k"_a.none(),
        "v"_a.none(), "out"_a.none(), "lse"_a.none(), "dout"_a.none(), "dq"_a.none(),
        "dk"_a.none(), "dv"_a.none(), "dbias"_a.none(), "mask"_a.none(), "bias"_a.none(),
        "key_lengths"_a.none(), "sparsity"_a.none(), "scale"_a.none(), "softcap"_a, "causal"_a,
        "align"_a, "window_left"_a, "window_right"_a, "kernel"_a, "num_threads"_a, "dropout_p"_a,
        "seed"_a, "offset"_a, "layout"_a, "bf16_bits"_a);
  m.def("linear_attention", &linear_attention_binding, "q"_a.none(), "k"_a.none(), "v"_a.none(),
        "out"_a.none(), "key_lengths"_a.none(), "feature_map"_a, "nb_features"_a, "seed"_a,
        "scale"_a.none(), "causal"_a, "align"_a, "kernel"_a, "num_threads"_a, "chunk_size"_a,
        "layout"_a, "bf16_bits"_a);
  m.def(
      "_product_path",
      [](const std::string& dtype) {
        const DType d = dtype == "bf16" ? DType::kBF16 : dtype == "f16" ? DType::kF16 : DType::kF32;
        return std::string(product_path_name(attention_flash_product_path(d)));
      },
      "dtype"_a);
  m.def("_time_attention", &time_attention, "q"_a, "k"_a, "v"_a, "out"_a, "repeats"_a);
  m.def("_data_address", &data_address, "array"_a);

  nb::class_<PyEmbedder>(m, "SentenceEmbedder")
      .def(nb::init<const std::string&, std::int64_t, std::int64_t, std::optional<bool>, bool>(),
           "model_dir"_a, "max_length"_a, "batch_size"_a, "normalize"_a.none(), "bf16"_a)
      .def_prop_ro("dimension", &PyEmbedder::dimension)
      .def_prop_ro("max_length", &PyEmbedder::max_length)
      .def_prop_ro("normalize", &PyEmbedder::normalize)
      .def("encode", &PyEmbedder::encode, "texts"_a, "batch_size"_a);

  define_layers(m);  // EncoderLayer, cross_entropy, AdamW (layers.cc)

#if QKV_WITH_MPI
  define_ring(m);
  m.attr("has_ring") = true;
#else
  m.attr("has_ring") = false;
#endif
}

}  // namespace qkv::python

NB_MODULE(_qkv, m) { qkv::python::define_module(m); }
