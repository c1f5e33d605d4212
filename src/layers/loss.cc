#include "qkv/layers/loss.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "qkv/error.h"

namespace qkv {

double cross_entropy(const float* logits, std::int64_t rows, std::int64_t classes,
                     const std::int32_t* targets, float* dlogits, std::int32_t ignore_index) {
  if (rows < 0 || classes <= 0) {
    throw Error("cross_entropy: rows = " + std::to_string(rows) + " and classes = " +
                std::to_string(classes) + " (need rows >= 0, classes > 0)");
  }
  if (rows > 0 && (logits == nullptr || targets == nullptr)) {
    throw Error("cross_entropy: logits and targets must not be null");
  }
  std::int64_t count = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int32_t t = targets[r];
    if (t == ignore_index) continue;
    if (t < 0 || t >= classes) {
      throw Error("cross_entropy: targets[" + std::to_string(r) + "] = " + std::to_string(t) +
                  " is outside [0, " + std::to_string(classes) + ") and is not ignore_index = " +
                  std::to_string(ignore_index));
    }
    ++count;
  }
  double total = 0;
  std::vector<double> p(static_cast<std::size_t>(classes));
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * classes;
    float* grad = dlogits ? dlogits + r * classes : nullptr;
    if (targets[r] == ignore_index) {
      if (grad) std::fill(grad, grad + classes, 0.0f);
      continue;
    }
    double max = -INFINITY;
    for (std::int64_t c = 0; c < classes; ++c) {
      if (!std::isfinite(row[c])) {
        throw Error("cross_entropy: logits[" + std::to_string(r) + ", " + std::to_string(c) +
                    "] = " + std::to_string(row[c]) + " is not finite");
      }
      max = std::max(max, static_cast<double>(row[c]));
    }
    double sum = 0;
    for (std::int64_t c = 0; c < classes; ++c) sum += p[c] = std::exp(row[c] - max);
    total += std::log(sum) - (row[targets[r]] - max);
    if (grad) {
      for (std::int64_t c = 0; c < classes; ++c) {
        grad[c] = static_cast<float>((p[c] / sum - (c == targets[r] ? 1.0 : 0.0)) / count);
      }
    }
  }
  return count == 0 ? 0.0 : total / static_cast<double>(count);
}

}  // namespace qkv
