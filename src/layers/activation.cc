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

void apply_activation(Activation act, float* x, std::int64_t n) { apply_activation(act, x, x, n); }

void apply_activation(Activation act, const float* x, float* y, std::int64_t n) {
  if (n < 0) throw Error("apply_activation: n = " + std::to_string(n) + " is negative");
  if (n == 0 || (act == Activation::kNone && x == y)) return;
  if (x == nullptr || y == nullptr) {
    throw Error("apply_activation: x or y is null with n = " + std::to_string(n));
  }
  // Chunks large enough to amortise a task; each element's result is independent of the
  // chunking, so thread count never changes the output.
  constexpr std::int64_t kChunk = 1 << 14;
  const std::int64_t num_chunks = (n + kChunk - 1) / kChunk;
  parallel_for(num_chunks, resolve_num_threads(0), [&](std::int64_t chunk, int) {
    const std::int64_t begin = chunk * kChunk;
    layers::activation_kernel(act, x + begin, y + begin, std::min(kChunk, n - begin));
  });
}

void activation_backward(Activation act, const float* x, const float* dy, float* dx,
                         std::int64_t n) {
  if (n < 0) throw Error("activation_backward: n = " + std::to_string(n) + " is negative");
  if (n == 0) return;
  if (x == nullptr || dy == nullptr || dx == nullptr) {
    throw Error("activation_backward: x, dy and dx must not be null with n = " + std::to_string(n));
  }
  constexpr std::int64_t kChunk = 1 << 14;
  parallel_for((n + kChunk - 1) / kChunk, resolve_num_threads(0), [&](std::int64_t chunk, int) {
    const std::int64_t begin = chunk * kChunk;
    layers::activation_backward_kernel(act, x + begin, dy + begin, dx + begin,
                                       std::min(kChunk, n - begin));
  });
}

}  // namespace qkv
