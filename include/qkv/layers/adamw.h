// AdamW (Loshchilov and Hutter, 2019; torch.optim.AdamW's update, decoupled weight decay):
//   p -= lr * weight_decay * p
//   m = beta1 m + (1 - beta1) g        v = beta2 v + (1 - beta2) g^2
//   p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
// over a fixed list of parameter tensors (the moments are kept per tensor, in the list's order).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace qkv {

struct AdamWParams {
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

class AdamW {
 public:
  // Throws qkv::Error for lr < 0, betas outside [0, 1), eps <= 0 or weight_decay < 0.
  explicit AdamW(const AdamWParams& params);

  // One step: params[i] -= ... from grads[i] (the same sizes; the same list, in the same
  // order, at every step: the first step sizes the moments). Moments in f32, the bias
  // corrections in double. Throws qkv::Error, before changing anything, when the lists or a
  // tensor's size differ from the first step's.
  void step(std::span<std::vector<float>* const> params,
            std::span<std::vector<float>* const> grads);

  std::int64_t steps() const { return steps_; }
  const AdamWParams& params() const { return params_; }
  void set_lr(float lr) { params_.lr = lr; }

 private:
  AdamWParams params_;
  std::int64_t steps_ = 0;
  std::vector<std::vector<float>> m_, v_;
};

}  // namespace qkv
