// Non-owning strided 4-D tensor views.
//
// A view is a data pointer, a dtype, 4 sizes and 4 strides counted in elements (int64). Any
// layout is a choice of strides: attention operands are logically (batch, seq, heads, head_dim)
// ("BSHD"), and a BHSD array (PyTorch SDPA's order) is the same view with permuted strides, so
// accepting it needs no copy. A stride of 0 broadcasts that dimension.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace qkv {

// Element types. f32, bf16 and f16 are attention's operand types (accumulation is f32); f64
// runs on the reference kernel only (gradient checks: docs/training.md). kBool / kU8 are mask
// types, kI32 / kI64 index types.
enum class DType : std::uint8_t { kF32, kBF16, kF16, kBool, kU8, kI32, kI64, kF64 };

// Bytes per element of `dtype`.
int dtype_size(DType dtype);
// "f32", "bf16", "f16", "bool", "u8", "i32", "i64", "f64".
const char* dtype_name(DType dtype);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  std::array<std::int64_t, 4> sizes = {0, 0, 0, 0};
  std::array<std::int64_t, 4> strides = {0, 0, 0, 0};

  // A view over contiguous row-major (C order) memory of the given sizes.
  static TensorView contiguous(void* data, DType dtype, std::array<std::int64_t, 4> sizes);

  bool empty() const { return data == nullptr; }
  std::int64_t numel() const { return sizes[0] * sizes[1] * sizes[2] * sizes[3]; }
  // Offset in elements of element (i0, i1, i2, i3).
  std::int64_t offset(std::int64_t i0, std::int64_t i1, std::int64_t i2, std::int64_t i3) const {
    return i0 * strides[0] + i1 * strides[1] + i2 * strides[2] + i3 * strides[3];
  }
  // The same memory with dims reordered: result dim d is this view's dim order[d].
  TensorView permuted(std::array<int, 4> order) const;
};

// "(2, 128, 8, 64)".
std::string shape_string(const std::array<std::int64_t, 4>& sizes);

}  // namespace qkv
