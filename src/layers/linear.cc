// Linear on oneDNN's matmul primitive.
//
// oneDNN computes dst[M, N] = src[M, K] x weights[K, N] (+ bias[1, N], then post-ops). A
// torch-layout weight W[N, K] (row-major) is exactly weights[K, N] with strides {1, K}, so the
// plain view needs no transpose; it is reordered once into the layout the primitive asks for
// (weights format_tag::any lets oneDNN pick a blocked layout its JIT kernels stream well).
//
// Primitives depend on M (= rows) and the src row stride, so one is created per (rows,
// x_stride) on first use and cached. The weight layout a primitive asks for may in principle
// differ with M; each distinct layout gets one reordered copy (reordered from the first copy),
// so the common case keeps exactly one copy of W.
//
// One Linear may be shared by threads. The cache and the weight copies sit behind a mutex and
// entries are shared_ptrs, so a thread keeps using its entry while another one fills or
// restarts the cache. oneDNN primitives may not be executed from two threads at once with the
// library's own scratchpad (Debian's oneDNN shares one per process), so the primitives use
// scratchpad_mode::user and each calling thread passes a scratchpad of its own.
#include "qkv/layers/linear.h"

#include <algorithm>
#include <dnnl.hpp>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/float16.h"
#include "core/parallel.h"
#include "layers/chunks.h"
#include "layers/layer_kernels.h"
#include "qkv/error.h"

namespace qkv {
namespace {

using dnnl::memory;
using Dims = memory::dims;

// One CPU engine for the process; oneDNN engines are thread-safe and cheap to share.
const dnnl::engine& cpu_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// M used to ask oneDNN for its preferred weight layout at construction: a typical batch of
// tokens (e.g. 32 sentences x 128 tokens gives M = 4096; decoding gives M = 1).
constexpr std::int64_t kRepresentativeRows = 256;

// Primitives kept per Linear; past this many distinct (rows, stride) keys the cache restarts
// (a server seeing every possible batch size must not grow without bound).
constexpr std::size_t kMaxCachedPrimitives = 64;

}  // namespace

struct Linear::Impl {
  std::int64_t in_features = 0;
  std::int64_t out_features = 0;
  Activation activation = Activation::kNone;
  DType dtype = DType::kF32;  // of the products
  // What oneDNN reads for W and src: f32, or for bf16 products bf16 where this oneDNN has a bf16
  // matmul for the CPU (Debian's 2.6 needs AVX-512), else f32 holding the bf16-rounded values:
  // their products are exact in f32 and accumulate in f32, as oneDNN's bf16 kernels do.
  memory::data_type storage = memory::data_type::f32;
  std::vector<float> bias;  // [out_features] or empty
  memory::desc bias_md;     // [1, N] or zero desc
  dnnl::primitive_attr attr, linear_attr;  // with the activation post-op; without it
  // Reordered weight copies, one per layout some primitive asked for. [0] always exists.
  std::vector<memory> weights;

  struct Entry {
    dnnl::matmul matmul;
    memory::desc src_md, dst_md, scratchpad_md;
    memory weights;  // the copy of W in the layout this primitive asked for (a shared handle)
  };
  std::mutex mutex;  // guards `weights` (after construction) and `cache`
  // Keyed by (rows, x_stride, with the activation, bf16 dst).
  std::map<std::tuple<std::int64_t, std::int64_t, bool, bool>, std::shared_ptr<const Entry>> cache;

  // bf16_dst: y as bf16 (only where storage is bf16; oneDNN rounds to nearest even).
  dnnl::matmul::primitive_desc make_pd(std::int64_t rows, std::int64_t x_stride,
                                       bool fused = true, bool bf16_dst = false) const {
    // bf16: x is rounded into a contiguous copy first (run), so the src is dense.
    const memory::desc src_md = dtype == DType::kBF16
                                    ? memory::desc(Dims{rows, in_features}, storage,
                                                   memory::format_tag::ab)
                                    : memory::desc(Dims{rows, in_features}, memory::data_type::f32,
                                                   Dims{x_stride, 1});
    const memory::desc weights_md(Dims{in_features, out_features}, weight_type(),
                                  memory::format_tag::any);
    const memory::desc dst_md(Dims{rows, out_features},
                              bf16_dst ? memory::data_type::bf16 : memory::data_type::f32,
                              memory::format_tag::ab);
    const dnnl::matmul::desc desc(src_md, weights_md, bias_md, dst_md);
    return dnnl::matmul::primitive_desc(desc, fused ? attr : linear_attr, cpu_engine());
  }

  memory::data_type weight_type() const { return storage; }

  // bf16 products on f32 storage: the operands' values rounded to bf16.
  bool rounds_in_f32() const {
    return dtype == DType::kBF16 && storage == memory::data_type::f32;
  }

  // A copy of W in layout `md`, reordering one if none matches. Called with `mutex` held.
  memory weights_in_layout(const memory::desc& md) {
    for (const memory& w : weights) {
      if (w.get_desc() == md) return w;
    }
    memory dst(md, cpu_engine());
    dnnl::stream stream(cpu_engine());
    dnnl::reorder(weights[0], dst).execute(stream, weights[0], dst);
    stream.wait();
    weights.push_back(dst);
    return dst;
  }

  // W [out, in] row-major, reordered out of weights[0] on first use (training only). Called
  // with `mutex` held.
  std::vector<float> plain;
  const std::vector<float>& plain_weight() {
    if (plain.empty()) {
      plain.resize(static_cast<std::size_t>(in_features * out_features));
      memory dst(plain_md(), cpu_engine(), plain.data());
      dnnl::stream stream(cpu_engine());
      dnnl::reorder(weights[0], dst).execute(stream, weights[0], dst);
      stream.wait();
    }
    return plain;
  }
  // W[N, K] row-major (f32) as oneDNN's weights[K, N]: strides {1, K}.
  memory::desc plain_md() const {
    return memory::desc(Dims{in_features, out_features}, memory::data_type::f32,
                        Dims{1, in_features});
  }

  std::shared_ptr<const Entry> entry(std::int64_t rows, std::int64_t x_stride, bool fused,
                                     bool bf16_dst) {
    const auto key = std::make_tuple(rows, x_stride, fused, bf16_dst);
    const std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    if (cache.size() >= kMaxCachedPrimitives) cache.clear();  // users keep their shared_ptrs
    const auto pd = make_pd(rows, x_stride, fused, bf16_dst);
    auto e = std::make_shared<const Entry>(Entry{dnnl::matmul(pd), pd.src_desc(), pd.dst_desc(),
                                                 pd.scratchpad_desc(),
                                                 weights_in_layout(pd.weights_desc())});
    return cache.emplace(key, std::move(e)).first->second;
  }
};

namespace {

// Runs a matmul primitive with a scratchpad of this thread's own (scratchpad_mode::user).
void execute(const dnnl::matmul::primitive_desc& pd, std::unordered_map<int, memory> args) {
  thread_local AlignedBuffer scratchpad;
  const memory::desc scratchpad_md = pd.scratchpad_desc();
  const std::size_t pad_bytes = scratchpad_md.get_size();
  if (pad_bytes > 0) {
    if (scratchpad.bytes() < pad_bytes) scratchpad = AlignedBuffer(pad_bytes);
    args.emplace(DNNL_ARG_SCRATCHPAD, memory(scratchpad_md, cpu_engine(), scratchpad.as<float>()));
  }
  dnnl::stream stream(cpu_engine());
  dnnl::matmul(pd).execute(stream, args);
  stream.wait();
}

std::string linear_shape(std::int64_t out_features, std::int64_t in_features) {
  return "[out_features = " + std::to_string(out_features) +
         ", in_features = " + std::to_string(in_features) + "]";
}

// The bf16 values of w, as f32 (the weights of a bf16 Linear on f32 storage).
std::vector<float> bf16_values(std::span<const float> w) {
  std::vector<float> out(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) out[i] = round_to_bf16(w[i]);
  return out;
}

// f32 rows (src_stride apart, `width` each) rounded to bf16 (nearest even) into dst ([rows,
// width] contiguous), as bf16 bits (T = std::uint16_t) or as their f32 values (T = float), the
// rows over the threads in blocks.
template <typename T>
void round_rows(const float* src, std::int64_t src_stride, std::int64_t rows, std::int64_t width,
                T* dst) {
  parallel_for_blocks(rows, width, resolve_num_threads(0), [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      layers::round_to_bf16_kernel(src + r * src_stride, width, dst + r * width);
    }
  });
}

// x's bf16 values as f32 into dst ([rows, in] contiguous; bf16 products on f32 storage): bf16
// bits ([rows, in] contiguous) widened, exactly, or f32 rows (x_stride apart) rounded.
void bf16_values_of_rows(const void* x, bool x_bf16, std::int64_t rows, std::int64_t in,
                         std::int64_t x_stride, float* dst) {
  if (!x_bf16) return round_rows(static_cast<const float*>(x), x_stride, rows, in, dst);
  const auto* xb = static_cast<const std::uint16_t*>(x);
  parallel_for_blocks(rows, in, resolve_num_threads(0), [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t i = r0 * in; i < r1 * in; ++i) dst[i] = bf16_bits_to_f32(xb[i]);
  });
}

dnnl::post_ops activation_post_ops(Activation act) {
  dnnl::post_ops ops;
  switch (act) {
    case Activation::kNone:
      break;
    case Activation::kGeluErf:
      ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_gelu_erf, 0.0f, 0.0f);
      break;
    case Activation::kGeluTanh:
      ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_gelu_tanh, 0.0f, 0.0f);
      break;
    case Activation::kRelu:
      ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
      break;
  }
  return ops;
}

}  // namespace

Linear::Linear(const LinearParams& params) : impl_(std::make_unique<Impl>()) {
  const std::int64_t in = params.in_features;
  const std::int64_t out = params.out_features;
  if (in <= 0 || out <= 0) {
    throw Error("Linear: in_features and out_features must be > 0, got weight shape " +
                linear_shape(out, in));
  }
  if (static_cast<std::int64_t>(params.weight.size()) != in * out) {
    throw Error("Linear: weight has " + std::to_string(params.weight.size()) +
                " elements, expected " + std::to_string(in * out) + " for weight shape " +
                linear_shape(out, in));
  }
  if (params.dtype != DType::kF32 && params.dtype != DType::kBF16) {
    throw Error(std::string("Linear: dtype ") + dtype_name(params.dtype) +
                " is not a product type (f32 or bf16)");
  }
  if (!params.bias.empty() && static_cast<std::int64_t>(params.bias.size()) != out) {
    throw Error("Linear: bias has " + std::to_string(params.bias.size()) +
                " elements, expected out_features = " + std::to_string(out));
  }
  Impl& m = *impl_;
  m.in_features = in;
  m.out_features = out;
  m.activation = params.activation;
  m.dtype = params.dtype;
  if (!params.bias.empty()) {
    m.bias.assign(params.bias.begin(), params.bias.end());
    m.bias_md = memory::desc(Dims{1, out}, memory::data_type::f32, memory::format_tag::ab);
  }
  m.attr.set_post_ops(activation_post_ops(params.activation));
  m.attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  m.linear_attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  try {
    m.storage = m.dtype == DType::kBF16 ? memory::data_type::bf16 : memory::data_type::f32;
    dnnl::matmul::primitive_desc pd;
    try {
      pd = m.make_pd(kRepresentativeRows, in);
    } catch (const dnnl::error& e) {
      if (e.status != dnnl_unimplemented || m.dtype != DType::kBF16) throw;
      m.storage = memory::data_type::f32;  // no bf16 matmul here: rounded values in f32
      pd = m.make_pd(kRepresentativeRows, in);
    }
    const std::vector<float> rounded =
        m.rounds_in_f32() ? bf16_values(params.weight) : std::vector<float>{};
    const std::span<const float> weight =
        m.rounds_in_f32() ? std::span<const float>(rounded) : params.weight;
    // W[N, K] row-major is weights[K, N] with strides {1, K}.
    const memory::desc plain_md(Dims{in, out}, memory::data_type::f32, Dims{1, in});
    const memory plain(plain_md, cpu_engine(), const_cast<float*>(weight.data()));
    memory reordered(pd.weights_desc(), cpu_engine());
    dnnl::stream stream(cpu_engine());
    dnnl::reorder(plain, reordered).execute(stream, const_cast<memory&>(plain), reordered);
    stream.wait();
    m.weights.push_back(reordered);
  } catch (const dnnl::error& e) {
    throw Error(std::string("Linear: oneDNN failed to set up weight shape ") +
                linear_shape(out, in) + ": " + e.what());
  }
}

Linear::~Linear() = default;
Linear::Linear(Linear&&) noexcept = default;
Linear& Linear::operator=(Linear&&) noexcept = default;

std::int64_t Linear::in_features() const { return impl_->in_features; }
std::int64_t Linear::out_features() const { return impl_->out_features; }
Activation Linear::activation() const { return impl_->activation; }
DType Linear::dtype() const { return impl_->dtype; }

void Linear::forward(const float* x, std::int64_t rows, float* y, std::int64_t x_stride) const {
  run(x, false, rows, y, false, x_stride, /*fused=*/true, "forward");
}

void Linear::forward_linear(const float* x, std::int64_t rows, float* y,
                            std::int64_t x_stride) const {
  run(x, false, rows, y, false, x_stride, /*fused=*/false, "forward_linear");
}

void Linear::forward_to_bf16(const float* x, std::int64_t rows, std::uint16_t* y,
                             std::int64_t x_stride) const {
  run(x, false, rows, y, true, x_stride, /*fused=*/true, "forward_to_bf16");
}

void Linear::forward_from_bf16(const std::uint16_t* x, std::int64_t rows, float* y) const {
  run(x, true, rows, y, false, 0, /*fused=*/true, "forward_from_bf16");
}

void Linear::run(const void* x, bool x_bf16, std::int64_t rows, void* y, bool y_bf16,
                 std::int64_t x_stride, bool fused, const char* what) const {
  // x: [rows, in_features] (row stride x_stride)  ->  y: [rows, out_features]
  Impl& m = *impl_;
  const std::string where = std::string("Linear::") + what;
  if ((x_bf16 || y_bf16) && m.dtype != DType::kBF16) {
    throw Error(where + ": needs a bf16 Linear, this one has dtype " + dtype_name(m.dtype));
  }
  if (x_stride == 0) x_stride = m.in_features;
  if (rows < 0) throw Error(where + ": rows = " + std::to_string(rows) + " is negative");
  if (x_stride < m.in_features) {
    throw Error(where + ": x_stride = " + std::to_string(x_stride) +
                " is smaller than in_features = " + std::to_string(m.in_features));
  }
  if (rows == 0) return;
  if (x == nullptr || y == nullptr) throw Error(where + ": x and y must not be null");
  try {
    // A bf16 y comes from oneDNN's own store where it has bf16 matmuls; on f32 storage, from
    // the f32 result rounded here.
    const bool dst_bf16 = y_bf16 && !m.rounds_in_f32();
    const std::shared_ptr<const Impl::Entry> e = m.entry(rows, x_stride, fused, dst_bf16);
    // bf16: x rounded into this thread's buffer (grow-only; concurrent calls never share one),
    // as bf16 bits or (rounds_in_f32) as the f32 values of those bits; bf16 bits given are
    // used as they are (or widened, exactly, for f32 storage).
    thread_local std::vector<std::uint16_t> x_bf16_buffer;
    thread_local std::vector<float> x_rounded;
    thread_local std::vector<float> y_f32;
    void* src_data = const_cast<void*>(x);
    const std::int64_t in = m.in_features;
    const float* xf = static_cast<const float*>(x);
    if (m.rounds_in_f32()) {
      if (x_rounded.size() < static_cast<std::size_t>(rows * in)) x_rounded.resize(rows * in);
      bf16_values_of_rows(x, x_bf16, rows, in, x_stride, x_rounded.data());
      src_data = x_rounded.data();
    } else if (m.dtype == DType::kBF16 && !x_bf16) {
      if (x_bf16_buffer.size() < static_cast<std::size_t>(rows * in)) {
        x_bf16_buffer.resize(rows * in);
      }
      round_rows(xf, x_stride, rows, in, x_bf16_buffer.data());
      src_data = x_bf16_buffer.data();
    }
    const std::int64_t out = m.out_features;
    const bool rounds_y = y_bf16 && !dst_bf16;
    if (rounds_y && y_f32.size() < static_cast<std::size_t>(rows * out)) y_f32.resize(rows * out);
    void* dst_data = rounds_y ? y_f32.data() : y;
    memory src(e->src_md, cpu_engine(), src_data);
    memory dst(e->dst_md, cpu_engine(), dst_data);
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, e->weights}, {DNNL_ARG_DST, dst}};
    if (!m.bias.empty()) {
      args.emplace(DNNL_ARG_BIAS, memory(m.bias_md, cpu_engine(), m.bias.data()));
    }
    // This thread's scratchpad (grow-only): concurrent calls never share one.
    thread_local AlignedBuffer scratchpad;
    const std::size_t pad_bytes = e->scratchpad_md.get_size();
    if (pad_bytes > 0) {
      if (scratchpad.bytes() < pad_bytes) scratchpad = AlignedBuffer(pad_bytes);
      args.emplace(DNNL_ARG_SCRATCHPAD,
                   memory(e->scratchpad_md, cpu_engine(), scratchpad.as<float>()));
    }
    dnnl::stream stream(cpu_engine());
    e->matmul.execute(stream, args);
    stream.wait();
    if (rounds_y) {
      // y_f32's data taken here: the workers' own thread_local y_f32 is not this thread's.
      round_rows(y_f32.data(), out, rows, out, static_cast<std::uint16_t*>(y));
    }
  } catch (const dnnl::error& e) {
    throw Error(where + ": oneDNN failed for x shape [" + std::to_string(rows) +
                ", " + std::to_string(m.in_features) + "], weight shape " +
                linear_shape(m.out_features, m.in_features) + ": " + e.what());
  }
}

void Linear::backward(const float* x, std::int64_t rows, const float* dy, float* dx,
                      float* dweight, float* dbias, std::int64_t x_stride) const {
  run_backward(x, false, rows, dy, dx, dweight, dbias, x_stride, "backward");
}

void Linear::backward_from_bf16(const std::uint16_t* x, std::int64_t rows, const float* dy,
                                float* dx, float* dweight, float* dbias) const {
  run_backward(x, true, rows, dy, dx, dweight, dbias, 0, "backward_from_bf16");
}

void Linear::run_backward(const void* x_data, bool x_bf16, std::int64_t rows, const float* dy,
                          float* dx, float* dweight, float* dbias, std::int64_t x_stride,
                          const char* what) const {
  // x: [rows, in] (row stride x_stride), dy: [rows, out] -> dx: [rows, in], dW: [out, in]
  Impl& m = *impl_;
  const std::string where = std::string("Linear::") + what;
  const std::int64_t in = m.in_features, out = m.out_features;
  if (x_bf16 && m.dtype != DType::kBF16) {
    throw Error(where + ": needs a bf16 Linear, this one has dtype " + dtype_name(m.dtype));
  }
  if (x_stride == 0) x_stride = in;
  if (rows < 0) throw Error(where + ": rows = " + std::to_string(rows) + " is negative");
  if (x_stride < in) {
    throw Error(where + ": x_stride = " + std::to_string(x_stride) +
                " is smaller than in_features = " + std::to_string(in));
  }
  if (rows == 0) return;
  if (x_data == nullptr || dy == nullptr || dweight == nullptr) {
    throw Error(where + ": x, dy and dweight must not be null");
  }
  if (dbias != nullptr && m.bias.empty()) {
    throw Error(where + ": dbias given, but the layer has no bias");
  }
  const auto* x = static_cast<const float*>(x_data);
  const auto* x_bits = static_cast<const std::uint16_t*>(x_data);
  try {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    // The operands as the products take them: f32 as given, or for a bf16 Linear rounded to
    // bf16 (nearest even, as its forward rounds x and W), as bf16 bits or, on f32 storage, as
    // the f32 values of those bits. dy is rounded here into this thread's buffer; W and x go
    // through `operand` below.
    const bool bf16 = m.dtype == DType::kBF16;
    const memory::data_type type = bf16 ? m.storage : memory::data_type::f32;
    const bool bits = type == memory::data_type::bf16;
    thread_local std::vector<std::uint16_t> dy_bits;
    thread_local std::vector<float> dy_values, x_values;
    const void* dy_op = dy;
    if (bf16) {
      const auto n = static_cast<std::size_t>(rows * out);
      if (bits && dy_bits.size() < n) dy_bits.resize(n);
      if (!bits && dy_values.size() < n) dy_values.resize(n);
      // dy's rows rounded into bits or values, the kind chosen once.
      if (bits) {
        round_rows(dy, out, rows, out, dy_bits.data());
        dy_op = dy_bits.data();
      } else {
        round_rows(dy, out, rows, out, dy_values.data());
        dy_op = dy_values.data();
      }
    }
    const float* plain = nullptr;
    if (dx != nullptr) {
      const std::lock_guard<std::mutex> lock(m.mutex);
      plain = m.plain_weight().data();
    }
    // Each product takes its B operand (W for dx, x for dW) in the layout its primitive asks
    // for (format any: a blocked layout; plain B ran at about half the speed, 107-171 against
    // 302-333 GFLOP/s in f32 at 1024 x 768 x 3072 here), reordered into this thread's buffer
    // from f32 (oneDNN rounding to bf16, nearest even, where the storage is bf16) or from the
    // bf16 bits given.
    thread_local AlignedBuffer w_buffer, x_buffer;
    auto operand = [&](const memory::desc& want, const memory::desc& have, const void* data,
                       AlignedBuffer& buffer) {
      memory src(have, cpu_engine(), const_cast<void*>(data));
      if (want == have) return src;
      if (buffer.bytes() < want.get_size()) buffer = AlignedBuffer(want.get_size());
      memory dst(want, cpu_engine(), buffer.as<float>());
      dnnl::stream stream(cpu_engine());
      dnnl::reorder(src, dst).execute(stream, src, dst);
      stream.wait();
      return dst;
    };
    if (dx != nullptr) {  // dx[rows, in] = dy[rows, out] W[out, in]
      const memory::desc dy_md(Dims{rows, out}, type, memory::format_tag::ab);
      const memory::desc w_md(Dims{out, in}, type, memory::format_tag::any);
      const memory::desc dx_md(Dims{rows, in}, memory::data_type::f32, memory::format_tag::ab);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(dy_md, w_md, dx_md), attr,
                                            cpu_engine());
      // (plain: W in f32, or for f32 storage of a bf16 Linear its rounded values already)
      const memory::desc plain_md(Dims{out, in}, memory::data_type::f32, memory::format_tag::ab);
      execute(pd, {{DNNL_ARG_SRC, memory(dy_md, cpu_engine(), const_cast<void*>(dy_op))},
                   {DNNL_ARG_WEIGHTS, operand(pd.weights_desc(), plain_md, plain, w_buffer)},
                   {DNNL_ARG_DST, memory(dx_md, cpu_engine(), dx)}});
    }
    {  // dW[out, in] += dy^T[out, rows] x[rows, in]
      dnnl::post_ops sum;
      sum.append_sum(1.0f);
      dnnl::primitive_attr accumulate = attr;
      accumulate.set_post_ops(sum);
      const memory::desc dyt_md(Dims{out, rows}, type, Dims{1, out});
      const memory::desc x_md(Dims{rows, in}, type, memory::format_tag::any);
      const memory::desc dw_md(Dims{out, in}, memory::data_type::f32, memory::format_tag::ab);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(dyt_md, x_md, dw_md), accumulate,
                                            cpu_engine());
      // x: the bf16 bits given (bits storage); f32 as given (an f32 Linear, or bits storage:
      // oneDNN's reorder rounds it); or on f32 storage x's bf16 values, rounded or widened
      // into this thread's buffer.
      memory::desc given_md(Dims{rows, in}, memory::data_type::f32, Dims{x_stride, 1});
      const void* given = x;
      if (x_bf16 && bits) {
        given_md = memory::desc(Dims{rows, in}, type, memory::format_tag::ab);
        given = x_bits;
      } else if (bf16 && !bits) {
        if (x_values.size() < static_cast<std::size_t>(rows * in)) x_values.resize(rows * in);
        bf16_values_of_rows(x_data, x_bf16, rows, in, x_stride, x_values.data());
        given_md = memory::desc(Dims{rows, in}, type, memory::format_tag::ab);
        given = x_values.data();
      }
      execute(pd, {{DNNL_ARG_SRC, memory(dyt_md, cpu_engine(), const_cast<void*>(dy_op))},
                   {DNNL_ARG_WEIGHTS, operand(pd.weights_desc(), given_md, given, x_buffer)},
                   {DNNL_ARG_DST, memory(dw_md, cpu_engine(), dweight)}});
    }
  } catch (const dnnl::error& e) {
    throw Error(where + ": oneDNN failed for x shape [" + std::to_string(rows) + ", " +
                std::to_string(in) + "], weight shape " + linear_shape(out, in) + ": " + e.what());
  }
  if (dbias != nullptr) {  // column sums, rows in order, 64 columns per task
    constexpr std::int64_t kColumns = 64;
    parallel_for((out + kColumns - 1) / kColumns, resolve_num_threads(0),
                 [&](std::int64_t task, int) {
                   layers::column_sums_kernel(dy, rows, out, task * kColumns,
                                              std::min(out, (task + 1) * kColumns), dbias);
                 });
  }
}

std::vector<float> Linear::weight() const {
  const std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->plain_weight();
}

std::vector<float> Linear::bias() const { return impl_->bias; }

void Linear::set_weights(std::span<const float> weight, std::span<const float> bias) {
  Impl& m = *impl_;
  if (static_cast<std::int64_t>(weight.size()) != m.in_features * m.out_features) {
    throw Error("Linear::set_weights: weight has " + std::to_string(weight.size()) +
                " elements, expected " + std::to_string(m.in_features * m.out_features) +
                " for weight shape " + linear_shape(m.out_features, m.in_features));
  }
  if (bias.size() != m.bias.size()) {
    throw Error("Linear::set_weights: bias has " + std::to_string(bias.size()) +
                " elements, the layer's has " + std::to_string(m.bias.size()));
  }
  const std::vector<float> rounded =
      m.rounds_in_f32() ? bf16_values(weight) : std::vector<float>{};
  if (m.rounds_in_f32()) weight = rounded;
  const std::lock_guard<std::mutex> lock(m.mutex);
  try {
    // Every copy in place: cached primitives keep pointing at the right memory.
    const memory plain(m.plain_md(), cpu_engine(), const_cast<float*>(weight.data()));
    dnnl::stream stream(cpu_engine());
    for (memory& w : m.weights) {
      dnnl::reorder(plain, w).execute(stream, const_cast<memory&>(plain), w);
    }
    stream.wait();
  } catch (const dnnl::error& e) {
    throw Error(std::string("Linear::set_weights: oneDNN failed for weight shape ") +
                linear_shape(m.out_features, m.in_features) + ": " + e.what());
  }
  if (!m.plain.empty()) {
    layers::copy_floats(weight.data(), m.plain.data(), static_cast<std::int64_t>(m.plain.size()));
  }
  std::copy(bias.begin(), bias.end(), m.bias.begin());
}

}  // namespace qkv
