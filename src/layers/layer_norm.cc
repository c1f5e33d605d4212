#include "qkv/layers/layer_norm.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

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

void LayerNorm::backward(const float* x, const float* residual, std::int64_t rows,
                         const float* dy, float* dz, float* dgamma, float* dbeta) const {
  // x, residual, dy, dz: [rows, features]
  if (rows < 0) throw Error("LayerNorm::backward: rows = " + std::to_string(rows) + " is negative");
  if (rows == 0) return;
  if (x == nullptr || dy == nullptr || dz == nullptr) {
    throw Error("LayerNorm::backward: x, dy and dz must not be null");
  }
  const std::int64_t f = features_;
  const int threads = resolve_num_threads(0);
  // Per row: mean and rstd of z = x + residual (two passes, as the forward) and dz; dgamma
  // and dbeta each column over rows in order, in tasks of 64 columns (before dz where dz is
  // dy). In f64 lanes (layer_kernels.cc): as scalar double loops they took 8% of a training
  // step's samples at embed 512.
  std::vector<double> mean(static_cast<std::size_t>(rows)), rstd(mean.size());
  const std::int64_t rows_per_task = std::max<std::int64_t>(1, (1 << 14) / f);
  const std::int64_t row_tasks = (rows + rows_per_task - 1) / rows_per_task;
  auto row_pass = [&](bool with_dz) {
    parallel_for(row_tasks, threads, [&](std::int64_t task, int) {
      const std::int64_t r0 = task * rows_per_task, n = std::min(rows_per_task, rows - r0);
      const std::int64_t off = r0 * f;
      layers::layer_norm_backward_rows_kernel(x + off, residual ? residual + off : nullptr,
                                              dy + off, n, f, gamma_.data(), eps_, mean.data() + r0,
                                              rstd.data() + r0, with_dz ? dz + off : nullptr);
    });
  };
  if (dgamma == nullptr && dbeta == nullptr) return row_pass(true);
  // dz first where it does not overwrite dy (the statistics come with it), else after.
  const bool dz_first = dz != dy;
  row_pass(dz_first);
  constexpr std::int64_t kColumns = 64;
  parallel_for((f + kColumns - 1) / kColumns, threads, [&](std::int64_t t, int) {
    layers::layer_norm_param_grads_kernel(x, residual, dy, rows, f, mean.data(), rstd.data(),
                                          t * kColumns, std::min(f, (t + 1) * kColumns), dgamma,
                                          dbeta);
  });
  if (!dz_first) row_pass(true);
}

void LayerNorm::set_affine(std::span<const float> gamma, std::span<const float> beta) {
  if (static_cast<std::int64_t>(gamma.size()) != features_ ||
      static_cast<std::int64_t>(beta.size()) != features_) {
    throw Error("LayerNorm::set_affine: gamma and beta have " + std::to_string(gamma.size()) +
                " and " + std::to_string(beta.size()) + " elements, expected features = " +
                std::to_string(features_));
  }
  gamma_.assign(gamma.begin(), gamma.end());
  beta_.assign(beta.begin(), beta.end());
}

}  // namespace qkv
