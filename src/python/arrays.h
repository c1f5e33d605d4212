// Python arrays as qkv::TensorView, without copies: anything nanobind imports through DLPack or
// the buffer protocol (numpy, PyTorch CPU tensors, JAX arrays), with its own strides.
//
// Each function names the argument in its errors: TypeError for what is not an array or has a
// dtype qkv does not take, ValueError for devices, ranks and read-only outputs. qkv::Error from
// the library becomes ValueError (module.cc registers the translation).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "qkv/tensor.h"

namespace qkv::python {

namespace nb = nanobind;

using InArray = nb::ndarray<nb::ro>;  // read-only inputs (JAX arrays, read-only numpy)
using OutArray = nb::ndarray<>;       // outputs: must be writable

// An imported array and its view. The array holds a reference to the Python object's memory
// for as long as the view is used.
template <typename Array>
struct Held {
  Array array;
  TensorView view;
};

// The dtype of an imported array, or nullopt for one qkv has no DType for. `bf16_bits`: the
// array is uint16 words that hold bfloat16 (numpy arrays of ml_dtypes.bfloat16 arrive so, as
// numpy exports neither DLPack nor a buffer for that dtype).
std::optional<DType> dtype_of(const nb::dlpack::dtype& dtype, bool bf16_bits);
// "float64", "int32", "bfloat16", ... for messages.
std::string dtype_text(const nb::dlpack::dtype& dtype);

// What an argument must be: its rank range (fewer than 4 dims are padded with leading dims of
// size 1 and stride 0: numpy's broadcasting rule) and its dtypes, with the words for messages.
struct Expect {
  int min_rank, max_rank;  // 0 <= min_rank <= max_rank <= 4
  const char* shape;       // e.g. "4: (B, Lq, Hq, D)"
  std::initializer_list<DType> dtypes;
  const char* dtype_names;  // e.g. "float32, bfloat16 or float16"
};

// Imports `object` as a CPU array and returns it as a 4-D view: TypeError for what is not an
// array or has another dtype, ValueError for another device or rank (and, for outputs, a
// read-only array).
Held<InArray> input_view(const char* name, nb::handle object, const Expect& expect,
                         bool bf16_bits = false);
Held<OutArray> output_view(const char* name, nb::handle object, const Expect& expect,
                           bool bf16_bits = false);

// The address of the first element nanobind sees for `object` (tests check zero copy with it).
std::uintptr_t data_address(nb::handle object);

}  // namespace qkv::python
