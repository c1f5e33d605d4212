#include "qkv/layers/activation.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/parallel.h"
#include "layers/layer_kernels.h"
#include "qkv/error.h"

namespace qkv {

const char* activation_name(Activation act) {
  switch (act) {
    case Activation::kNone:
      return "none";
    case Activation::kGeluErf:
      return "gelu";
    case Activation::kGeluTanh:
      return "gelu_tanh";
    case Activation::kRelu:
      return "relu";
  }
  return "?";
}

void apply_activation(Activation act, float* x, std::int64_t n) {
  if (n < 0) throw Error("apply_activation: n = " + std::to_string(n) + " is negative");
  if (n == 0 || act == Activation::kNone) return;
  if (x == nullptr) throw Error("apply_activation: x is null with n = " + std::to_string(n));
  // Chunks large enough to amortise a task; each element's result is independent of the
  // chunking, so thread count never changes the output.
  constexpr std::int64_t kChunk = 1 << 14;
  const std::int64_t num_chunks = (n + kChunk - 1) / kChunk;
  parallel_for(num_chunks, resolve_num_threads(0), [&](std::int64_t chunk, int) {
    const std::int64_t begin = chunk * kChunk;
    layers::activation_kernel(act, x + begin, std::min(kChunk, n - begin));
  });
}

namespace {

// act'(x), in double (a few ulp in float after rounding).
double derivative(Activation act, double x) {
  constexpr double kSqrt2OverPi = 0.7978845608028654, kInvSqrt2 = 0.7071067811865476;
  constexpr double kInvSqrt2Pi = 0.3989422804014327, kCubic = 0.044715;
  switch (act) {
    case Activation::kNone:
      return 1.0;
    case Activation::kGeluErf:
      return 0.5 * (1.0 + std::erf(x * kInvSqrt2)) + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
    case Activation::kGeluTanh: {
      const double t = std::tanh(kSqrt2OverPi * (x + kCubic * x * x * x));
      return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kCubic * x * x);
    }
    case Activation::kRelu:
      return x > 0.0 ? 1.0 : 0.0;
  }
  return 1.0;
}

}  // namespace

void activation_backward(Activation act, const float* x, const float* dy, float* dx,
                         std::int64_t n) {
  if (n < 0) throw Error("activation_backward: n = " + std::to_string(n) + " is negative");
  if (n == 0) return;
  if (x == nullptr || dy == nullptr || dx == nullptr) {
    throw Error("activation_backward: x, dy and dx must not be null with n = " + std::to_string(n));
  }
  constexpr std::int64_t kChunk = 1 << 14;
  parallel_for((n + kChunk - 1) / kChunk, resolve_num_threads(0), [&](std::int64_t chunk, int) {
    const std::int64_t end = std::min(n, (chunk + 1) * kChunk);
    for (std::int64_t i = chunk * kChunk; i < end; ++i) {
      dx[i] = static_cast<float>(dy[i] * derivative(act, x[i]));
    }
  });
}

}  // namespace qkv
