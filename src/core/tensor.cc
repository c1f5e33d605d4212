#include "qkv/tensor.h"

#include "qkv/error.h"

namespace qkv {

int dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 2;
    case DType::kBool:
      return 1;
    case DType::kU8:
      return 1;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kF64:
      return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kBool:
      return "bool";
    case DType::kU8:
      return "u8";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kF64:
      return "f64";
  }
  return "?";
}

TensorView TensorView::contiguous(void* data, DType dtype, std::array<std::int64_t, 4> sizes) {
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.sizes = sizes;
  std::int64_t stride = 1;
  for (int d = 3; d >= 0; --d) {
    view.strides[d] = stride;
    stride *= sizes[d];
  }
  return view;
}

TensorView TensorView::permuted(std::array<int, 4> order) const {
  TensorView view = *this;
  bool seen[4] = {false, false, false, false};
  for (int d = 0; d < 4; ++d) {
    if (order[d] < 0 || order[d] > 3 || seen[order[d]]) {
      throw Error("TensorView::permuted: order must be a permutation of 0, 1, 2, 3");
    }
    seen[order[d]] = true;
    view.sizes[d] = sizes[order[d]];
    view.strides[d] = strides[order[d]];
  }
  return view;
}

std::string shape_string(const std::array<std::int64_t, 4>& sizes) {
  std::string text = "(";
  for (int d = 0; d < 4; ++d) {
    if (d > 0) text += ", ";
    text += std::to_string(sizes[d]);
  }
  return text + ")";
}

}  // namespace qkv
