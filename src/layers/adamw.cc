#include "qkv/layers/adamw.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/parallel.h"
#include "layers/layer_kernels.h"
#include "qkv/error.h"

namespace qkv {

AdamW::AdamW(const AdamWParams& p) : params_(p) {
  if (!(p.lr >= 0.0f) || !(p.beta1 >= 0.0f && p.beta1 < 1.0f) ||
      !(p.beta2 >= 0.0f && p.beta2 < 1.0f) || !(p.eps > 0.0f) || !(p.weight_decay >= 0.0f)) {
    throw Error("AdamW: lr = " + std::to_string(p.lr) + ", betas = (" +
                std::to_string(p.beta1) + ", " + std::to_string(p.beta2) + "), eps = " +
                std::to_string(p.eps) + ", weight_decay = " + std::to_string(p.weight_decay) +
                " (need lr >= 0, betas in [0, 1), eps > 0, weight_decay >= 0)");
  }
}

void AdamW::step(std::span<std::vector<float>* const> params,
                 std::span<std::vector<float>* const> grads) {
  if (params.size() != grads.size()) {
    throw Error("AdamW::step: " + std::to_string(params.size()) + " parameters but " +
                std::to_string(grads.size()) + " gradients");
  }
  if (steps_ > 0 && params.size() != m_.size()) {
    throw Error("AdamW::step: " + std::to_string(params.size()) + " parameters; the first step had " +
                std::to_string(m_.size()));
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::size_t n = params[i]->size();
    if (grads[i]->size() != n || (steps_ > 0 && m_[i].size() != n)) {
      throw Error("AdamW::step: tensor " + std::to_string(i) + " has " + std::to_string(n) +
                  " parameters and " + std::to_string(grads[i]->size()) + " gradients" +
                  (steps_ > 0 ? " (the first step: " + std::to_string(m_[i].size()) + ")" : ""));
    }
  }
  if (steps_ == 0) {
    m_.clear();
    v_.clear();
    for (std::vector<float>* p : params) {
      m_.emplace_back(p->size(), 0.0f);
      v_.emplace_back(p->size(), 0.0f);
    }
  }
  ++steps_;
  const AdamWParams& a = params_;
  const double c1 = 1.0 - std::pow(static_cast<double>(a.beta1), static_cast<double>(steps_));
  const double c2 = 1.0 - std::pow(static_cast<double>(a.beta2), static_cast<double>(steps_));
  const layers::AdamWStep s{.decay = 1.0f - a.lr * a.weight_decay,
                            .step_size = static_cast<float>(a.lr / c1),
                            .root_c2 = static_cast<float>(std::sqrt(c2))};
  // Element by element (each element's update is independent: the same bits on any thread
  // count), in chunks of every tensor spread over the threads.
  constexpr std::int64_t kChunk = 1 << 14;
  std::vector<std::pair<std::size_t, std::int64_t>> chunks;  // (tensor, first element)
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto n = static_cast<std::int64_t>(params[i]->size());
    for (std::int64_t e = 0; e < n; e += kChunk) chunks.emplace_back(i, e);
  }
  parallel_for(static_cast<std::int64_t>(chunks.size()), resolve_num_threads(0),
               [&](std::int64_t c, int) {
                 const auto [i, first] = chunks[static_cast<std::size_t>(c)];
                 const auto n = static_cast<std::int64_t>(params[i]->size());
                 layers::adamw_kernel(a, s, params[i]->data() + first, grads[i]->data() + first,
                                      m_[i].data() + first, v_[i].data() + first,
                                      std::min(kChunk, n - first));
               });
}

}  // namespace qkv
