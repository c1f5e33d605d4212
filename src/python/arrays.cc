#include "python/arrays.h"

#include <algorithm>

namespace qkv::python {
namespace {

using Code = nb::dlpack::dtype_code;

bool is(const nb::dlpack::dtype& dtype, Code code, int bits) {
  return dtype.code == static_cast<std::uint8_t>(code) && dtype.bits == bits && dtype.lanes == 1;
}

std::string python_type_name(nb::handle object) { return nb::type_name(object.type()).c_str(); }

std::string shape_text(const auto& array) {
  std::string text = "(";
  for (std::size_t d = 0; d < array.ndim(); ++d) {
    text += (d ? ", " : "") + std::to_string(array.shape(d));
  }
  return text + (array.ndim() == 1 ? ",)" : ")");
}

template <typename Array>
Array import_array(const char* name, nb::handle object) {
  Array array;
  if (!nb::try_cast(object, array, /*convert=*/false)) {
    if constexpr (!Array::ReadOnly) {
      InArray readable;
      if (nb::try_cast(object, readable, /*convert=*/false)) {
        throw nb::value_error((std::string(name) + ": the array is read-only").c_str());
      }
    }
    throw nb::type_error((std::string(name) +
                          ": expected an array (numpy, torch or jax: DLPack "
                          "or the buffer protocol), got " +
                          python_type_name(object))
                             .c_str());
  }
  if (array.device_type() != nb::device::cpu::value) {
    throw nb::value_error((std::string(name) + ": the array is on a device of DLPack type " +
                           std::to_string(array.device_type()) +
                           ", not the CPU; qkv computes on the CPU (move it there first)")
                              .c_str());
  }
  return array;
}

template <typename Array>
Held<Array> view_of(const char* name, nb::handle object, const Expect& expect, bool bf16_bits) {
  Held<Array> held{import_array<Array>(name, object), {}};
  const Array& array = held.array;
  const int rank = static_cast<int>(array.ndim());
  if (rank < expect.min_rank || rank > expect.max_rank) {
    throw nb::value_error((std::string(name) + ": shape " + shape_text(array) + " has " +
                           std::to_string(rank) + " dims; expected " + expect.shape)
                              .c_str());
  }
  const std::optional<DType> dtype = dtype_of(array.dtype(), bf16_bits);
  if (!dtype ||
      std::find(expect.dtypes.begin(), expect.dtypes.end(), *dtype) == expect.dtypes.end()) {
    throw nb::type_error((std::string(name) + ": dtype " + dtype_text(array.dtype()) +
                          " is not supported; expected " + expect.dtype_names)
                             .c_str());
  }
  TensorView& view = held.view;
  view.data = const_cast<void*>(static_cast<const void*>(array.data()));
  view.dtype = *dtype;
  const int pad = 4 - rank;
  for (int d = 0; d < 4; ++d) {
    view.sizes[d] = d < pad ? 1 : static_cast<std::int64_t>(array.shape(d - pad));
    view.strides[d] = d < pad ? 0 : array.stride(d - pad);
  }
  return held;
}

}  // namespace

std::optional<DType> dtype_of(const nb::dlpack::dtype& dtype, bool bf16_bits) {
  if (is(dtype, Code::Float, 32)) return DType::kF32;
  if (is(dtype, Code::Float, 64)) return DType::kF64;
  if (is(dtype, Code::Bfloat, 16) || (bf16_bits && is(dtype, Code::UInt, 16))) {
    return DType::kBF16;
  }
  if (is(dtype, Code::Float, 16)) return DType::kF16;
  if (is(dtype, Code::Bool, 8)) return DType::kBool;
  if (is(dtype, Code::UInt, 8)) return DType::kU8;
  if (is(dtype, Code::Int, 32)) return DType::kI32;
  if (is(dtype, Code::Int, 64)) return DType::kI64;
  return std::nullopt;
}

std::string dtype_text(const nb::dlpack::dtype& dtype) {
  std::string kind;
  switch (static_cast<Code>(dtype.code)) {
    case Code::Int:
      kind = "int";
      break;
    case Code::UInt:
      kind = "uint";
      break;
    case Code::Float:
      kind = "float";
      break;
    case Code::Bfloat:
      kind = "bfloat";
      break;
    case Code::Complex:
      kind = "complex";
      break;
    case Code::Bool:
      return "bool";
    default:
      kind = "dlpack-code-" + std::to_string(dtype.code) + "-";
      break;
  }
  std::string text = kind + std::to_string(dtype.bits);
  if (dtype.lanes != 1) text += "x" + std::to_string(dtype.lanes);
  return text;
}

Held<InArray> input_view(const char* name, nb::handle object, const Expect& expect,
                         bool bf16_bits) {
  return view_of<InArray>(name, object, expect, bf16_bits);
}

Held<OutArray> output_view(const char* name, nb::handle object, const Expect& expect,
                           bool bf16_bits) {
  return view_of<OutArray>(name, object, expect, bf16_bits);
}

std::uintptr_t data_address(nb::handle object) {
  const InArray array = import_array<InArray>("array", object);
  return reinterpret_cast<std::uintptr_t>(array.data());
}

}  // namespace qkv::python
