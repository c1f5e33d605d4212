// LayerNorm with a fused residual add: y = LN(x + residual) * gamma + beta, per row.
//
//   x, residual, y: [rows, features], contiguous; residual may be null; y may alias x or
//   residual (each row is read completely before it is written).
//
// Mean and variance are taken in two passes over the row (no E[x^2] - E[x]^2 cancellation);
// var is the biased (1/features) variance, as torch.nn.LayerNorm.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace qkv {

class LayerNorm {
 public:
  // gamma, beta: [features] (copied); eps > 0.
  LayerNorm(std::span<const float> gamma, std::span<const float> beta, std::int64_t features,
            float eps);

  std::int64_t features() const { return features_; }
  float eps() const { return eps_; }

  void forward(const float* x, const float* residual /*nullable*/, std::int64_t rows,
               float* y) const;

  // The backward of forward(x, residual, rows, y), for training: given the same x and residual
  // and dy = dL/dy [rows, features], writes dz = dL/d(x + residual) (the gradient of x and of
  // the residual alike; may alias dy) and ADDS dL/dgamma and dL/dbeta to dgamma, dbeta
  // ([features]; nullable). With z^ = (z - mean) * rstd, g = dy * gamma:
  //   dz = rstd (g - mean(g) - z^ mean(g z^)),  dgamma = sum over rows of dy z^,  dbeta = sum dy.
  // Row statistics in double; the sums over rows run in row order (the same bits on any
  // thread count).
  void backward(const float* x, const float* residual /*nullable*/, std::int64_t rows,
                const float* dy, float* dz, float* dgamma, float* dbeta) const;

  std::span<const float> gamma() const { return gamma_; }
  std::span<const float> beta() const { return beta_; }
  // Replaces gamma and beta ([features] each): an optimizer's step.
  void set_affine(std::span<const float> gamma, std::span<const float> beta);

 private:
  std::vector<float> gamma_;
  std::vector<float> beta_;
  std::int64_t features_ = 0;
  float eps_ = 0.0f;
};

}  // namespace qkv
