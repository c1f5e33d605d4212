// Linear: y = act(x W^T + b) on a cached oneDNN matmul primitive.
//
//   x: [rows, in_features] (row stride x_stride)   W: [out_features, in_features] (torch layout)
//   b: [out_features] or none                       y: [rows, out_features], contiguous
//
// The constructor copies W once into the layout oneDNN's matmul prefers (so the caller's
// weight memory, e.g. an mmap'ed checkpoint, may be released afterwards). One primitive is
// created per (rows, x_stride) seen and cached; bias and activation are fused as post-ops.
// forward() may be called on one object from several threads at once (the primitive cache is
// guarded; each thread passes oneDNN a scratchpad of its own).
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "qkv/layers/activation.h"

namespace qkv {

struct LinearParams {
  std::span<const float> weight = {};  // [out_features, in_features], row-major
  std::span<const float> bias = {};    // [out_features] or empty
  std::int64_t in_features = 0;
  std::int64_t out_features = 0;
  Activation activation = Activation::kNone;  // fused as a oneDNN post-op
};

class Linear {
 public:
  // Validates sizes (qkv::Error naming them); copies + reorders W once.
  explicit Linear(const LinearParams& params);
  ~Linear();
  Linear(Linear&&) noexcept;
  Linear& operator=(Linear&&) noexcept;

  std::int64_t in_features() const;
  std::int64_t out_features() const;
  Activation activation() const;

  // x: [rows, in_features] with row stride x_stride (>= in_features; 0 = in_features)
  // y: [rows, out_features] contiguous; must not overlap x. rows == 0 does nothing.
  void forward(const float* x, std::int64_t rows, float* y, std::int64_t x_stride = 0) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace qkv
