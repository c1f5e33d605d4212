#include "qkv/layers/layer_norm.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/parallel.h"
#include "layers/layer_kernels.h"
#include "qkv/error.h"

namespace qkv {

LayerNorm::LayerNorm(std::span<const float> gamma, std::span<const float> beta,
                     std::int64_t features, float eps)
    : features_(features), eps_(eps) {
  if (features <= 0)
    throw Error("LayerNorm: features = " + std::to_string(features) + " must be > 0");
  if (static_cast<std::int64_t>(gamma.size()) != features) {
    throw Error("LayerNorm: gamma has " + std::to_string(gamma.size()) +
                " elements, expected features = " + std::to_string(features));
  }
  if (static_cast<std::int64_t>(beta.size()) != features) {
    throw Error("LayerNorm: beta has " + std::to_string(beta.size()) +
                " elements, expected features = " + std::to_string(features));
  }
  if (!(eps > 0.0f) || !std::isfinite(eps)) {
    throw Error("LayerNorm: eps = " + std::to_string(eps) + " must be finite and > 0");
  }
  gamma_.assign(gamma.begin(), gamma.end());
  beta_.assign(beta.begin(), beta.end());
}

void LayerNorm::forward(const float* x, const float* residual, std::int64_t rows, float* y) const {
  // x, residual, y: [rows, features]
  if (rows < 0) throw Error("LayerNorm::forward: rows = " + std::to_string(rows) + " is negative");
  if (rows == 0) return;
  if (x == nullptr || y == nullptr) throw Error("LayerNorm::forward: x and y must not be null");
  // Rows are independent: blocks of rows per task, so results never depend on thread count.
  const std::int64_t rows_per_task = std::max<std::int64_t>(1, (1 << 14) / features_);
  const std::int64_t num_tasks = (rows + rows_per_task - 1) / rows_per_task;
  parallel_for(num_tasks, resolve_num_threads(0), [&](std::int64_t task, int) {
    const std::int64_t r0 = task * rows_per_task;
    const std::int64_t n = std::min(rows_per_task, rows - r0);
    const std::int64_t off = r0 * features_;
    layers::layer_norm_kernel(x + off, residual ? residual + off : nullptr, n, features_,
                              gamma_.data(), beta_.data(), eps_, y + off);
  });
}

}  // namespace qkv
