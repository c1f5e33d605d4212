// qkv._qkv's training pieces, numpy in and out. The public, documented signatures are
// python/qkv/__init__.py's (docs/python.md, "Training an encoder layer"):
//
//   EncoderLayer(weights, ...)            qkv::EncoderLayer; weights: {name: array} by
//                                         EncoderLayerParams's field names, "attention." before
//                                         the attention's ("attention.q_weight", "ff1_weight")
//     forward(x, causal, key_lengths)     x: [B, L, E] float32, copied (never modified) -> y
//     forward_train(x, ...)               -> (y, tape)
//     backward(tape, dy)                  dy: [B, L, E] -> (dx [B, L, E], {name: gradient})
//     parameters() / set_parameters(d)    {name: array}: copies, the names the layer was given
//   EncoderLayerTape                      opaque: what backward needs, tied to its layer
//   cross_entropy(logits, targets, ii)    logits: [rows, classes] f32, targets: [rows] int
//   AdamW(...).step(params, grads)        {name: f32 array}; params updated in place
//
// Every array is validated here and named in the message (weights['ff1_weight'], dy, ...)
// with both shapes: TypeError for dtypes, ValueError for shapes, names and options; qkv::Error
// from the library becomes ValueError. Arrays are copied in and out (the layer owns its
// weights, a tape its activations), so any strides are fine and nothing the caller holds is
// written, except AdamW's params. The GIL is released while the library computes, and mutexes
// are only ever taken with the GIL released (so a thread waiting for one never holds the GIL
// that the holder needs back).
#include "python/layers.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "python/arrays.h"
#include "python/options.h"
#include "qkv/error.h"
#include "qkv/layers/adamw.h"
#include "qkv/layers/encoder_layer.h"
#include "qkv/layers/loss.h"

namespace qkv::python {
namespace {

using namespace nb::literals;
using Shape = std::vector<std::int64_t>;
using NumpyF32 = nb::ndarray<nb::numpy, float>;

std::string shape_text(const Shape& shape) {
  std::string text = "(";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    text += (d ? ", " : "") + std::to_string(shape[d]);
  }
  return text + (shape.size() == 1 ? ",)" : ")");
}

// An imported array's shape at its own rank (input_view pads its view to 4 dims).
template <typename Array>
Shape shape_of(const Held<Array>& held) {
  const auto rank = static_cast<std::ptrdiff_t>(held.array.ndim());
  return Shape(held.view.sizes.end() - rank, held.view.sizes.end());
}

// The view's elements in C order (any strides, broadcast ones too).
std::vector<float> gather(const TensorView& v) {
  const auto* data = static_cast<const float*>(v.data);
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(v.numel()));
  for (std::int64_t i0 = 0; i0 < v.sizes[0]; ++i0)
    for (std::int64_t i1 = 0; i1 < v.sizes[1]; ++i1)
      for (std::int64_t i2 = 0; i2 < v.sizes[2]; ++i2)
        for (std::int64_t i3 = 0; i3 < v.sizes[3]; ++i3)
          out.push_back(data[v.offset(i0, i1, i2, i3)]);
  return out;
}

// Writes `values` (C order) into the view's elements.
void scatter(const std::vector<float>& values, const TensorView& v) {
  auto* data = static_cast<float*>(v.data);
  std::size_t n = 0;
  for (std::int64_t i0 = 0; i0 < v.sizes[0]; ++i0)
    for (std::int64_t i1 = 0; i1 < v.sizes[1]; ++i1)
      for (std::int64_t i2 = 0; i2 < v.sizes[2]; ++i2)
        for (std::int64_t i3 = 0; i3 < v.sizes[3]; ++i3)
          data[v.offset(i0, i1, i2, i3)] = values[n++];
}

// A float32 array of exactly `rank` dims: its shape and a C-order copy of its values.
struct Floats {
  Shape shape;
  std::vector<float> values;
};

Floats import_floats(const std::string& name, nb::handle object, int rank, const char* shape) {
  const Held<InArray> held =
      input_view(name.c_str(), object, {rank, rank, shape, {DType::kF32}, "float32"});
  return {shape_of(held), gather(held.view)};
}

// A new numpy float32 array owning `values`.
NumpyF32 numpy_of(std::vector<float> values, const Shape& shape) {
  auto* owned = new std::vector<float>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  std::array<std::size_t, 4> dims{};
  for (std::size_t d = 0; d < shape.size(); ++d) dims[d] = static_cast<std::size_t>(shape[d]);
  return NumpyF32(owned->data(), shape.size(), dims.data(), owner);
}

// {name: object} of a dict argument with str keys (TypeError otherwise), in the dict's order.
std::vector<std::pair<std::string, nb::object>> named_arrays(const char* argument,
                                                             nb::handle dict) {
  if (!nb::isinstance<nb::dict>(dict)) {
    throw nb::type_error((std::string(argument) +
                          ": expected a dict of name -> float32 array, got " +
                          nb::type_name(dict.type()).c_str())
                             .c_str());
  }
  std::vector<std::pair<std::string, nb::object>> items;
  for (auto [key, value] : nb::borrow<nb::dict>(dict)) {
    if (!nb::isinstance<nb::str>(key)) {
      throw nb::type_error(
          (std::string(argument) + ": keys must be str, got " + nb::type_name(key.type()).c_str())
              .c_str());
    }
    items.emplace_back(nb::cast<std::string>(key), nb::borrow(value));
  }
  return items;
}

// ---------------------------------------------------------------------------------------------
// EncoderLayer's parameters by name.

// The sizes parameter shapes are made of.
enum class Dim : std::uint8_t { kNone, kEmbed, kDff, kKv, kQkv };
struct Dims {
  std::int64_t embed = 0, d_ff = 0, kv = 0;  // kv = num_kv_heads * head_dim

  std::int64_t of(Dim d) const {
    switch (d) {
      case Dim::kEmbed:
        return embed;
      case Dim::kDff:
        return d_ff;
      case Dim::kKv:
        return kv;
      case Dim::kQkv:
        return embed + 2 * kv;
      case Dim::kNone:
        break;
    }
    return 0;
  }
};

const char* dim_words(Dim d) {
  switch (d) {
    case Dim::kEmbed:
      return "embed_dim";
    case Dim::kDff:
      return "d_ff";
    case Dim::kKv:
      return "num_kv_heads * head_dim";
    case Dim::kQkv:
      return "embed_dim + 2 * num_kv_heads * head_dim";
    case Dim::kNone:
      break;
  }
  return "";
}

enum class Packings : std::uint8_t { kAll, kSeparate, kFused };

// One parameter: its Python name, where it lives in EncoderLayerParams (one of the two member
// pointers is set), its shape [rows] or [rows, cols], whether it may be left out (the biases),
// and the packings that have it.
struct Field {
  const char* name;
  std::vector<float> MultiHeadAttentionParams::*attention;
  std::vector<float> EncoderLayerParams::*layer;
  Dim rows, cols;
  bool optional;
  Packings packings;

  std::vector<float>& of(EncoderLayerParams& p) const {
    return attention ? p.attention.*attention : p.*layer;
  }
  int rank() const { return cols == Dim::kNone ? 1 : 2; }
  Shape shape(const Dims& d) const {
    return cols == Dim::kNone ? Shape{d.of(rows)} : Shape{d.of(rows), d.of(cols)};
  }
  std::string shape_words() const {
    return cols == Dim::kNone ? std::string("(") + dim_words(rows) + ",)"
                              : std::string("(") + dim_words(rows) + ", " + dim_words(cols) + ")";
  }
  bool in(QkvPacking packing) const {
    return packings == Packings::kAll ||
           (packings == Packings::kSeparate) == (packing == QkvPacking::kSeparate);
  }
};

// In EncoderLayerParams::tensors()'s order: name, field (of M = MultiHeadAttentionParams or
// L = EncoderLayerParams), rows, cols, optional, packings.
using M = MultiHeadAttentionParams;
using L = EncoderLayerParams;
using enum Dim;
using enum Packings;
// clang-format off
constexpr Field kFields[] = {
    {"attention.qkv_weight", &M::qkv_weight, nullptr,         kQkv,   kEmbed, false, kFused},
    {"attention.qkv_bias",   &M::qkv_bias,   nullptr,         kQkv,   kNone,  true,  kFused},
    {"attention.q_weight",   &M::q_weight,   nullptr,         kEmbed, kEmbed, false, kSeparate},
    {"attention.q_bias",     &M::q_bias,     nullptr,         kEmbed, kNone,  true,  kSeparate},
    {"attention.k_weight",   &M::k_weight,   nullptr,         kKv,    kEmbed, false, kSeparate},
    {"attention.k_bias",     &M::k_bias,     nullptr,         kKv,    kNone,  true,  kSeparate},
    {"attention.v_weight",   &M::v_weight,   nullptr,         kKv,    kEmbed, false, kSeparate},
    {"attention.v_bias",     &M::v_bias,     nullptr,         kKv,    kNone,  true,  kSeparate},
    {"attention.out_weight", &M::out_weight, nullptr,         kEmbed, kEmbed, false, kAll},
    {"attention.out_bias",   &M::out_bias,   nullptr,         kEmbed, kNone,  true,  kAll},
    {"norm1_gamma",          nullptr,        &L::norm1_gamma, kEmbed, kNone,  false, kAll},
    {"norm1_beta",           nullptr,        &L::norm1_beta,  kEmbed, kNone,  false, kAll},
    {"ff1_weight",           nullptr,        &L::ff1_weight,  kDff,   kEmbed, false, kAll},
    {"ff1_bias",             nullptr,        &L::ff1_bias,    kDff,   kNone,  true,  kAll},
    {"ff2_weight",           nullptr,        &L::ff2_weight,  kEmbed, kDff,   false, kAll},
    {"ff2_bias",             nullptr,        &L::ff2_bias,    kEmbed, kNone,  true,  kAll},
    {"norm2_gamma",          nullptr,        &L::norm2_gamma, kEmbed, kNone,  false, kAll},
    {"norm2_beta",           nullptr,        &L::norm2_beta,  kEmbed, kNone,  false, kAll},
};
// clang-format on

const Field* find_field(const std::string& name, QkvPacking packing) {
  for (const Field& f : kFields) {
    if (name == f.name && f.in(packing)) return &f;
  }
  return nullptr;
}

const char* packing_name(QkvPacking packing) {
  switch (packing) {
    case QkvPacking::kSeparate:
      return "separate";
    case QkvPacking::kFusedBlocks:
      return "fused_blocks";
    case QkvPacking::kFusedPerHead:
      return "fused_per_head";
  }
  return "";
}

// What forward_train kept, for backward on the layer that made it (layer_id) with the
// parameters it had then (version).
struct PyEncoderTape {
  EncoderLayerTape tape;
  std::uint64_t layer_id = 0, version = 0;

  std::string repr() const {
    return "qkv.EncoderLayerTape(batch=" + std::to_string(tape.batch) +
           ", seq=" + std::to_string(tape.seq) + ", step=" + std::to_string(tape.step) + ")";
  }
};

std::atomic<std::uint64_t> next_layer_id{1};

class PyEncoderLayer {
 public:
  PyEncoderLayer(nb::handle weights, std::int64_t num_heads, std::int64_t num_kv_heads,
                 const std::string& activation, bool norm_first, float eps, float dropout,
                 std::uint64_t seed, const std::string& qkv_packing,
                 const std::string& matmul_dtype)
      : id_(next_layer_id++) {
    const DType products = parse_choice<DType>("matmul_dtype", matmul_dtype,
                                               {{"f32", DType::kF32}, {"bf16", DType::kBF16}});
    packing_ = parse_choice<QkvPacking>("qkv_packing", qkv_packing,
                                        {{"separate", QkvPacking::kSeparate},
                                         {"fused_blocks", QkvPacking::kFusedBlocks},
                                         {"fused_per_head", QkvPacking::kFusedPerHead}});
    const Activation act = parse_choice<Activation>("activation", activation,
                                                    {{"gelu", Activation::kGeluErf},
                                                     {"gelu_tanh", Activation::kGeluTanh},
                                                     {"relu", Activation::kRelu}});
    const auto given = checked_names("weights", weights, /*at_construction=*/true);
    // embed_dim and d_ff from two of the arrays; every shape is then checked against them.
    auto array = [&](const char* name) {
      for (const auto& [n, object] : given) {
        if (n == name) return object;
      }
      return nb::object();
    };
    dims_.embed =
        import_floats("weights['norm1_gamma']", array("norm1_gamma"), 1, "1: (embed_dim,)")
            .shape[0];
    dims_.d_ff =
        import_floats("weights['ff1_weight']", array("ff1_weight"), 2, "2: (d_ff, embed_dim)")
            .shape[0];
    const std::int64_t E = dims_.embed, H = num_heads, Hkv = num_kv_heads ? num_kv_heads : H;
    if (H <= 0 || E % H != 0) {
      throw nb::value_error(("num_heads: " + std::to_string(H) +
                             " must be positive and divide embed_dim = " + std::to_string(E) +
                             " (weights['norm1_gamma'] has shape (" + std::to_string(E) + ",))")
                                .c_str());
    }
    if (Hkv <= 0 || H % Hkv != 0) {
      throw nb::value_error(("num_kv_heads: " + std::to_string(num_kv_heads) +
                             " must be positive and divide num_heads = " + std::to_string(H) +
                             " (0: num_heads)")
                                .c_str());
    }
    dims_.kv = Hkv * (E / H);
    EncoderLayerParams params = read_params("weights", given);
    const EncoderLayerConfig config{.embed_dim = E,
                                    .num_heads = H,
                                    .num_kv_heads = num_kv_heads,
                                    .d_ff = dims_.d_ff,
                                    .activation = act,
                                    .norm_first = norm_first,
                                    .eps = eps,
                                    .dropout = dropout,
                                    .matmul_dtype = products};
    without_gil([&] {
      layer_.emplace(config, params.weights());
      layer_->set_training(true, seed);
    });
  }

  PyEncoderLayer(const PyEncoderLayer&) = delete;
  PyEncoderLayer& operator=(const PyEncoderLayer&) = delete;

  const EncoderLayerConfig& config() const { return layer_->config(); }
  std::string packing() const { return packing_name(packing_); }

  NumpyF32 forward(nb::handle x, bool causal, nb::handle key_lengths) const {
    Floats y = import_rows("x", x);
    const std::vector<std::int64_t> lengths = key_lengths_of(key_lengths);
    const MhaOptions options{.causal = causal, .key_lengths = lengths};
    without_gil([&] {
      // Inference calls may run at once; in training mode a call advances the dropout step.
      std::shared_lock shared(mutex_);
      if (!layer_->training())
        return layer_->forward(y.values.data(), y.shape[0], y.shape[1], options);
      shared.unlock();
      const std::unique_lock unique(mutex_);
      layer_->forward(y.values.data(), y.shape[0], y.shape[1], options);
    });
    return numpy_of(std::move(y.values), y.shape);
  }

  nb::tuple forward_train(nb::handle x, bool causal, nb::handle key_lengths) {
    Floats y = import_rows("x", x);
    const std::vector<std::int64_t> lengths = key_lengths_of(key_lengths);
    const MhaOptions options{.causal = causal, .key_lengths = lengths};
    PyEncoderTape tape;
    tape.layer_id = id_;
    without_gil([&] {
      const std::unique_lock lock(mutex_);
      layer_->forward_train(y.values.data(), y.shape[0], y.shape[1], options, tape.tape);
      tape.version = version_;
    });
    return nb::make_tuple(numpy_of(std::move(y.values), y.shape), std::move(tape));
  }

  nb::tuple backward(nb::handle tape_object, nb::handle dy) const {
    if (!nb::isinstance<PyEncoderTape>(tape_object)) {
      throw nb::type_error((std::string("tape: expected the EncoderLayerTape that forward_train "
                                        "returned, got ") +
                            nb::type_name(tape_object.type()).c_str())
                               .c_str());
    }
    const PyEncoderTape& tape = nb::cast<const PyEncoderTape&>(tape_object);
    if (tape.layer_id != id_) {
      throw nb::value_error("tape: made by another EncoderLayer's forward_train");
    }
    Floats dx = import_floats("dy", dy, 3, "3: (B, L, embed_dim)");
    const Shape expected = {tape.tape.batch, tape.tape.seq, dims_.embed};
    if (dx.shape != expected) {
      throw nb::value_error(("dy: shape " + shape_text(dx.shape) +
                             " does not match the tape's output: shape " + shape_text(expected))
                                .c_str());
    }
    EncoderLayerParams grads;
    const bool stale = without_gil([&] {
      const std::unique_lock lock(mutex_);
      if (tape.version != version_) return true;
      grads = layer_->zero_grads();
      layer_->backward(tape.tape, dx.values.data(), grads);
      return false;
    });
    if (stale) {
      throw nb::value_error(
          "tape: the layer's parameters were set (set_parameters) after the forward_train "
          "that made it; run forward_train again");
    }
    return nb::make_tuple(numpy_of(std::move(dx.values), dx.shape), dict_of(grads));
  }

  nb::dict parameters() const {
    EncoderLayerParams params = without_gil([&] {
      const std::shared_lock lock(mutex_);
      return layer_->parameters();
    });
    return dict_of(params);
  }

  void set_parameters(nb::handle params) {
    const EncoderLayerParams p =
        read_params("params", checked_names("params", params, /*at_construction=*/false));
    without_gil([&] {
      const std::unique_lock lock(mutex_);
      layer_->set_parameters(p);
      ++version_;
    });
  }

  void set_training(bool training, std::uint64_t seed) {
    without_gil([&] {
      const std::unique_lock lock(mutex_);
      layer_->set_training(training, seed);
    });
  }

  bool training() const {
    return without_gil([&] {
      const std::shared_lock lock(mutex_);
      return layer_->training();
    });
  }

 private:
  // x or dy: [B, L, embed_dim] float32, copied.
  Floats import_rows(const char* name, nb::handle object) const {
    Floats rows = import_floats(name, object, 3, "3: (B, L, embed_dim)");
    if (rows.shape[2] != dims_.embed) {
      throw nb::value_error(
          (std::string(name) + ": shape " + shape_text(rows.shape) +
           " does not match the layer's embed_dim = " + std::to_string(dims_.embed) +
           ": expected (" + std::to_string(rows.shape[0]) + ", " + std::to_string(rows.shape[1]) +
           ", " + std::to_string(dims_.embed) + ")")
              .c_str());
    }
    return rows;
  }

  // The entries of a weights / params dict, every name checked: a known name of this
  // packing, and every required one there. At construction the biases may be left out (a
  // layer without that bias); afterwards the names must be those the layer was built with.
  std::vector<std::pair<std::string, nb::object>> checked_names(const char* argument,
                                                                nb::handle dict,
                                                                bool at_construction) {
    auto items = named_arrays(argument, dict);
    std::string known;
    for (const Field& f : kFields) {
      if (f.in(packing_)) known += std::string(known.empty() ? "" : ", ") + f.name;
    }
    for (const auto& [name, object] : items) {
      const Field* field = find_field(name, packing_);
      const bool ours = at_construction
                            ? field != nullptr
                            : std::find(fields_.begin(), fields_.end(), field) != fields_.end();
      if (!ours) {
        throw nb::value_error(
            (std::string(argument) + ": unknown name '" + name + "'; " +
             (at_construction ? "with qkv_packing='" + std::string(packing_name(packing_)) +
                                    "' the names are " + known
                              : "this layer's parameters are " + names()))
                .c_str());
      }
    }
    std::vector<const Field*> present;
    for (const Field& f : kFields) {
      if (!f.in(packing_)) continue;
      const bool given = std::any_of(items.begin(), items.end(),
                                     [&](const auto& item) { return item.first == f.name; });
      const bool needed = at_construction
                              ? !f.optional
                              : std::find(fields_.begin(), fields_.end(), &f) != fields_.end();
      if (!given && needed) {
        throw nb::value_error((std::string(argument) + ": missing '" + f.name + "' (shape " +
                               f.shape_words() + ")" +
                               (f.optional ? "; this layer was built with it" : ""))
                                  .c_str());
      }
      if (given) present.push_back(&f);
    }
    if (at_construction) fields_ = present;
    return items;
  }

  std::string names() const {
    std::string text;
    for (const Field* f : fields_) text += std::string(text.empty() ? "" : ", ") + f->name;
    return text;
  }

  // The arrays of a checked dict as EncoderLayerParams, each shape checked.
  EncoderLayerParams read_params(
      const char* argument, const std::vector<std::pair<std::string, nb::object>>& items) const {
    EncoderLayerParams p;
    p.attention.packing = packing_;
    for (const auto& [name, object] : items) {
      const Field& f = *find_field(name, packing_);
      const std::string where = std::string(argument) + "['" + name + "']";
      const std::string rank_words = std::to_string(f.rank()) + ": " + f.shape_words();
      Floats values = import_floats(where, object, f.rank(), rank_words.c_str());
      const Shape expected = f.shape(dims_);
      if (values.shape != expected) {
        throw nb::value_error((where + ": shape " + shape_text(values.shape) + ", expected " +
                               shape_text(expected) + " = " + f.shape_words() +
                               " with embed_dim = " + std::to_string(dims_.embed) +
                               ", d_ff = " + std::to_string(dims_.d_ff) +
                               ", num_kv_heads * head_dim = " + std::to_string(dims_.kv))
                                  .c_str());
      }
      f.of(p) = std::move(values.values);
    }
    return p;
  }

  nb::dict dict_of(EncoderLayerParams& p) const {
    nb::dict d;
    for (const Field* f : fields_)
      d[f->name] = nb::cast(numpy_of(std::move(f->of(p)), f->shape(dims_)));
    return d;
  }

  std::optional<EncoderLayer> layer_;
  QkvPacking packing_ = QkvPacking::kSeparate;
  Dims dims_;
  std::vector<const Field*> fields_;  // the parameters this layer has, in kFields's order
  const std::uint64_t id_;
  std::uint64_t version_ = 0;  // set_parameters calls
  mutable std::shared_mutex mutex_;
};

// ---------------------------------------------------------------------------------------------

nb::tuple cross_entropy_binding(nb::handle logits, nb::handle targets, std::int64_t ignore_index) {
  // logits: [rows, classes] float32   targets: [rows] int32 or int64  ->  (loss, dlogits)
  Floats l = import_floats("logits", logits, 2, "2: (rows, classes)");
  const Held<InArray> t = input_view(
      "targets", targets, {1, 1, "1: (rows,)", {DType::kI32, DType::kI64}, "int32 or int64"});
  const Shape t_shape = shape_of(t);
  if (t_shape[0] != l.shape[0]) {
    throw nb::value_error(("targets: shape " + shape_text(t_shape) +
                           " does not match logits: shape " + shape_text(l.shape) +
                           " (rows differ: " + std::to_string(t_shape[0]) + " vs " +
                           std::to_string(l.shape[0]) + ")")
                              .c_str());
  }
  constexpr std::int64_t kMin = std::numeric_limits<std::int32_t>::min();
  constexpr std::int64_t kMax = std::numeric_limits<std::int32_t>::max();
  if (ignore_index < kMin || ignore_index > kMax) {
    throw nb::value_error(
        ("ignore_index: " + std::to_string(ignore_index) + " is outside int32").c_str());
  }
  std::vector<std::int32_t> target(static_cast<std::size_t>(t_shape[0]));
  for (std::size_t r = 0; r < target.size(); ++r) {
    const std::int64_t offset = static_cast<std::int64_t>(r) * t.view.strides[3];
    const std::int64_t value = t.view.dtype == DType::kI32
                                   ? static_cast<const std::int32_t*>(t.view.data)[offset]
                                   : static_cast<const std::int64_t*>(t.view.data)[offset];
    if (value < kMin || value > kMax) {  // the library's message, for a value int32 cannot hold
      throw nb::value_error(("cross_entropy: targets[" + std::to_string(r) +
                             "] = " + std::to_string(value) + " is outside [0, " +
                             std::to_string(l.shape[1]) +
                             ") and is not ignore_index = " + std::to_string(ignore_index))
                                .c_str());
    }
    target[r] = static_cast<std::int32_t>(value);
  }
  std::vector<float> dlogits(l.values.size());
  const double loss = without_gil([&] {
    return cross_entropy(l.values.data(), l.shape[0], l.shape[1], target.data(), dlogits.data(),
                         static_cast<std::int32_t>(ignore_index));
  });
  return nb::make_tuple(loss, numpy_of(std::move(dlogits), l.shape));
}

// AdamW over dicts of arrays: the names sorted, the same names and shapes at every step.
class PyAdamW {
 public:
  PyAdamW(float lr, float beta1, float beta2, float eps, float weight_decay)
      : adamw_(make(
            {.lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay})) {
  }

  std::int64_t steps() const { return adamw_.steps(); }
  float lr() const { return adamw_.params().lr; }
  void set_lr(float lr) {
    if (!(lr >= 0.0f))
      throw nb::value_error(("lr: " + std::to_string(lr) + " must be >= 0").c_str());
    without_gil([&] {
      const std::lock_guard lock(mutex_);
      adamw_.set_lr(lr);
    });
  }
  float beta1() const { return adamw_.params().beta1; }
  float beta2() const { return adamw_.params().beta2; }
  float eps() const { return adamw_.params().eps; }
  float weight_decay() const { return adamw_.params().weight_decay; }

  void step(nb::handle params, nb::handle grads) {
    std::unique_lock lock(mutex_, std::defer_lock);
    {
      nb::gil_scoped_release release;
      lock.lock();
    }
    auto p_items = named_arrays("params", params), g_items = named_arrays("grads", grads);
    auto by_name = [](const auto& a, const auto& b) { return a.first < b.first; };
    std::sort(p_items.begin(), p_items.end(), by_name);
    std::sort(g_items.begin(), g_items.end(), by_name);
    std::vector<std::string> names;
    for (const auto& item : p_items) names.push_back(item.first);
    for (const auto& [name, object] : g_items) {
      if (!std::binary_search(names.begin(), names.end(), name)) {
        throw nb::value_error(("grads: '" + name + "' is not in params").c_str());
      }
    }
    for (const std::string& name : names) {
      if (!std::any_of(g_items.begin(), g_items.end(),
                       [&](const auto& g) { return g.first == name; })) {
        throw nb::value_error(("grads: missing '" + name + "' (params has it)").c_str());
      }
    }
    if (adamw_.steps() > 0 && names != names_) {
      throw nb::value_error(("params: names " + joined(names) + " differ from the first step's " +
                             joined(names_) + " (the moments are kept per name)")
                                .c_str());
    }
    // Every array imported and checked before anything changes.
    const Expect any_f32{0, 4, "at most 4", {DType::kF32}, "float32"};
    std::vector<Held<OutArray>> p_held;
    std::vector<std::vector<float>> p_values, g_values;
    std::vector<Shape> shapes;
    for (std::size_t i = 0; i < names.size(); ++i) {
      const std::string p_name = "params['" + names[i] + "']", g_name = "grads['" + names[i] + "']";
      p_held.push_back(output_view(p_name.c_str(), p_items[i].second, any_f32));
      const Held<InArray> g = input_view(g_name.c_str(), g_items[i].second, any_f32);
      const Shape p_shape = shape_of(p_held.back()), g_shape = shape_of(g);
      if (g_shape != p_shape) {
        throw nb::value_error((g_name + ": shape " + shape_text(g_shape) + " does not match " +
                               p_name + ": shape " + shape_text(p_shape))
                                  .c_str());
      }
      if (adamw_.steps() > 0 && p_shape != shapes_[i]) {
        throw nb::value_error((p_name + ": shape " + shape_text(p_shape) +
                               " differs from the first step's " + shape_text(shapes_[i]))
                                  .c_str());
      }
      shapes.push_back(p_shape);
      p_values.push_back(gather(p_held.back().view));
      g_values.push_back(gather(g.view));
    }
    without_gil([&] {
      std::vector<std::vector<float>*> p_ptrs, g_ptrs;
      for (std::size_t i = 0; i < names.size(); ++i) {
        p_ptrs.push_back(&p_values[i]);
        g_ptrs.push_back(&g_values[i]);
      }
      adamw_.step(p_ptrs, g_ptrs);
      for (std::size_t i = 0; i < names.size(); ++i) scatter(p_values[i], p_held[i].view);
    });
    if (names_.empty()) {
      names_ = std::move(names);
      shapes_ = std::move(shapes);
    }
  }

 private:
  static AdamW make(const AdamWParams& params) {
    try {
      return AdamW(params);
    } catch (const Error& error) {
      throw nb::value_error(error.what());
    }
  }
  static std::string joined(const std::vector<std::string>& names) {
    std::string text = "[";
    for (const std::string& n : names) text += (text.size() > 1 ? ", '" : "'") + n + "'";
    return text + "]";
  }

  AdamW adamw_;
  std::vector<std::string> names_;  // the first step's, sorted
  std::vector<Shape> shapes_;
  std::mutex mutex_;
};

}  // namespace

void define_layers(nb::module_& m) {
  nb::class_<PyEncoderTape>(m, "EncoderLayerTape",
                            "What EncoderLayer.forward_train keeps for backward (opaque).")
      .def_prop_ro("batch", [](const PyEncoderTape& t) { return t.tape.batch; })
      .def_prop_ro("seq", [](const PyEncoderTape& t) { return t.tape.seq; })
      .def_prop_ro("step", [](const PyEncoderTape& t) { return t.tape.step; })
      .def("__repr__", &PyEncoderTape::repr);

  nb::class_<PyEncoderLayer>(m, "EncoderLayer")
      .def(nb::init<nb::handle, std::int64_t, std::int64_t, const std::string&, bool, float, float,
                    std::uint64_t, const std::string&, const std::string&>(),
           "weights"_a, "num_heads"_a, "num_kv_heads"_a, "activation"_a, "norm_first"_a, "eps"_a,
           "dropout"_a, "seed"_a, "qkv_packing"_a, "matmul_dtype"_a)
      .def_prop_ro("embed_dim", [](const PyEncoderLayer& l) { return l.config().embed_dim; })
      .def_prop_ro("num_heads", [](const PyEncoderLayer& l) { return l.config().num_heads; })
      .def_prop_ro("num_kv_heads",
                   [](const PyEncoderLayer& l) {
                     const EncoderLayerConfig& c = l.config();
                     return c.num_kv_heads ? c.num_kv_heads : c.num_heads;
                   })
      .def_prop_ro("d_ff", [](const PyEncoderLayer& l) { return l.config().d_ff; })
      .def_prop_ro("norm_first", [](const PyEncoderLayer& l) { return l.config().norm_first; })
      .def_prop_ro("activation",
                   [](const PyEncoderLayer& l) {
                     return std::string(activation_name(l.config().activation));
                   })
      .def_prop_ro("eps", [](const PyEncoderLayer& l) { return l.config().eps; })
      .def_prop_ro("dropout", [](const PyEncoderLayer& l) { return l.config().dropout; })
      .def_prop_ro("matmul_dtype",
                   [](const PyEncoderLayer& l) {
                     return std::string(l.config().matmul_dtype == DType::kBF16 ? "bf16" : "f32");
                   })
      .def_prop_ro("qkv_packing", &PyEncoderLayer::packing)
      .def_prop_ro("training", &PyEncoderLayer::training)
      .def("set_training", &PyEncoderLayer::set_training, "training"_a, "seed"_a)
      .def("forward", &PyEncoderLayer::forward, "x"_a.none(), "causal"_a, "key_lengths"_a.none())
      .def("forward_train", &PyEncoderLayer::forward_train, "x"_a.none(), "causal"_a,
           "key_lengths"_a.none())
      .def("backward", &PyEncoderLayer::backward, "tape"_a.none(), "dy"_a.none())
      .def("parameters", &PyEncoderLayer::parameters)
      .def("set_parameters", &PyEncoderLayer::set_parameters, "params"_a.none());

  m.def("cross_entropy", &cross_entropy_binding, "logits"_a.none(), "targets"_a.none(),
        "ignore_index"_a);

  nb::class_<PyAdamW>(m, "AdamW")
      .def(nb::init<float, float, float, float, float>(), "lr"_a, "beta1"_a, "beta2"_a, "eps"_a,
           "weight_decay"_a)
      .def_prop_ro("steps", &PyAdamW::steps)
      .def_prop_rw("lr", &PyAdamW::lr, &PyAdamW::set_lr)
      .def_prop_ro("beta1", &PyAdamW::beta1)
      .def_prop_ro("beta2", &PyAdamW::beta2)
      .def_prop_ro("eps", &PyAdamW::eps)
      .def_prop_ro("weight_decay", &PyAdamW::weight_decay)
      .def("step", &PyAdamW::step, "params"_a.none(), "grads"_a.none());
}

}  // namespace qkv::python
