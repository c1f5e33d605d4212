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
//
// dtype kBF16: W is stored as bf16 and x is rounded to bf16 (nearest even) before
// each product; oneDNN accumulates in f32 and adds the f32 bias, and y stays f32. oneDNN runs
// it on AMX where the CPU has it, else on AVX512-BF16 or AVX-512 by conversion; on a CPU for
// which oneDNN has no bf16 matmul (Debian's 2.6 without AVX-512, e.g. AVX2 only), W and x are
// rounded to bf16 values held in f32 and multiplied in f32 (products of bf16 values are exact
// in f32, accumulation f32: the same result up to summation order, at f32 speed). backward()
// of a bf16 Linear (mixed-precision training: the caller keeps the f32 weights and hands each
// step's to set_weights) rounds dy, W and x to bf16 the same way for its two products.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "qkv/layers/activation.h"
#include "qkv/tensor.h"

namespace qkv {

struct LinearParams {
  std::span<const float> weight = {};  // [out_features, in_features], row-major
  std::span<const float> bias = {};    // [out_features] or empty
  std::int64_t in_features = 0;
  std::int64_t out_features = 0;
  Activation activation = Activation::kNone;  // fused as a oneDNN post-op
  DType dtype = DType::kF32;  // of the products: kF32, or kBF16 (see above)
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
  DType dtype() const;

  // x: [rows, in_features] with row stride x_stride (>= in_features; 0 = in_features)
  // y: [rows, out_features] contiguous; must not overlap x. rows == 0 does nothing.
  void forward(const float* x, std::int64_t rows, float* y, std::int64_t x_stride = 0) const;

  // bf16 Linear (dtype kBF16) only, for a chain of two (a feed-forward's hidden activations):
  // forward_to_bf16 writes y as bf16 bits, the f32 result of forward() rounded to nearest even
  // (by oneDNN on its store, where it has bf16 matmuls); forward_from_bf16 reads x as bf16 bits,
  // the rounding forward() would apply itself, so
  //   a.forward_to_bf16(x, rows, h);  b.forward_from_bf16(h, rows, y);
  // gives the bits of a.forward(x, rows, h32); b.forward(h32, rows, y) while moving half the
  // hidden bytes and skipping b's pass over them. x (forward_from_bf16) and y (forward_to_bf16):
  // [rows, features] contiguous. Other dtypes: qkv::Error.
  void forward_to_bf16(const float* x, std::int64_t rows, std::uint16_t* y,
                       std::int64_t x_stride = 0) const;
  void forward_from_bf16(const std::uint16_t* x, std::int64_t rows, float* y) const;

  // y = x W^T + b without the fused activation (training keeps this pre-activation for
  // activation_backward, then applies apply_activation itself). Same arguments as forward().
  void forward_linear(const float* x, std::int64_t rows, float* y, std::int64_t x_stride = 0) const;

  // The backward of the linear part, for training: with a fused activation, dy is the gradient
  // of forward_linear's output (activation_backward gives it). x as given to forward (row
  // stride x_stride), dy = dL/dy: [rows, out_features] contiguous. On oneDNN matmuls:
  //   dx = dy W        [rows, in_features], contiguous; written (nullable: not computed)
  //   dweight += dy^T x [out_features, in_features], row-major (torch's layout)
  //   dbias += the sum of dy's rows   [out_features]; nullable
  // Parameter gradients accumulate, as torch's .grad does. dbias sums rows in row order (the
  // same bits on any thread count); dx and dweight are oneDNN's (its sgemm may split the sum
  // differently for another thread count). None of the outputs may overlap x or dy.
  // dtype kBF16: dy, W and x enter both products rounded to bf16 (nearest even), the sums and
  // dx, dweight stay f32 (on AMX where the CPU has it); dbias sums dy as given.
  void backward(const float* x, std::int64_t rows, const float* dy, float* dx, float* dweight,
                float* dbias, std::int64_t x_stride = 0) const;
  // A bf16 Linear's backward with x given as bf16 bits ([rows, in_features] contiguous), the
  // rounding backward() would apply itself: the bits of backward() on their f32 values, one
  // pass fewer (mixed-precision training hands the FFN's hidden activations over this way, as
  // forward_from_bf16 in the forward). Other dtypes: qkv::Error.
  void backward_from_bf16(const std::uint16_t* x, std::int64_t rows, const float* dy, float* dx,
                          float* dweight, float* dbias) const;

  // W as [out_features, in_features] row-major (copied out of oneDNN's layout), and b (empty
  // when there is none).
  std::vector<float> weight() const;
  std::vector<float> bias() const;
  // Replaces W and b (sizes as at construction; bias only if the layer has one): an
  // optimizer's step. Not while forward or backward run on this object.
  void set_weights(std::span<const float> weight, std::span<const float> bias = {});

 private:
  // x: f32 (x_bf16 false) or bf16 bits; y: f32 (y_bf16 false) or bf16 bits.
  void run(const void* x, bool x_bf16, std::int64_t rows, void* y, bool y_bf16,
           std::int64_t x_stride, bool fused, const char* what) const;
  void run_backward(const void* x, bool x_bf16, std::int64_t rows, const float* dy, float* dx,
                    float* dweight, float* dbias, std::int64_t x_stride, const char* what) const;

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace qkv
