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

 private:
  std::vector<float> gamma_;
  std::vector<float> beta_;
  std::int64_t features_ = 0;
  float eps_ = 0.0f;
};

}  // namespace qkv
