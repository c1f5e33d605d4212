// Element-wise activations used by the layers: GELU (exact erf form and the tanh
// approximation) and ReLU. Linear fuses the same functions into its GEMM as oneDNN post-ops;
// apply_activation is the standalone, vectorised form (Highway, runtime dispatch).
#pragma once

#include <cstdint>

namespace qkv {

enum class Activation : std::uint8_t {
  kNone,      // identity
  kGeluErf,   // 0.5 x (1 + erf(x / sqrt 2)): BERT's "gelu", torch's default GELU
  kGeluTanh,  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): "gelu_new", approximate="tanh"
  kRelu,      // max(x, 0)
};

// "none", "gelu", "gelu_tanh", "relu".
const char* activation_name(Activation act);

// x: [n], in place. Relative error against a float64 evaluation is ~1e-7 (a few ulp) wherever
// the result is a normal float (docs/layers.md gives the measured figures).
void apply_activation(Activation act, float* x, std::int64_t n);
// The same out of place: y = act(x), x and y: [n] (y may be x; otherwise they must not
// overlap). Training keeps x (the pre-activation) for activation_backward this way.
void apply_activation(Activation act, const float* x, float* y, std::int64_t n);

// The backward of apply_activation, for training: dx = dy * act'(x), where x is the
// activation's INPUT (the pre-activation the forward overwrote; keep a copy). x, dy, dx: [n];
// dx may alias dy. GELU's derivatives: erf form Phi(x) + x phi(x); tanh form
// 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), t = tanh(sqrt(2/pi)
// (x + 0.044715 x^3)); ReLU 1 for x > 0, else 0 (as torch).
void activation_backward(Activation act, const float* x, const float* dy, float* dx,
                         std::int64_t n);

}  // namespace qkv
