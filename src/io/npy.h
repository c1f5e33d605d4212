// Reading and writing NumPy .npy files: format versions 1.0, 2.0 and 3.0, C order, the element
// types the CLI needs (float32 '<f4', bool '|b1', uint8 '|u1', int32 '<i4', int64 '<i8'), rank
// 0 to 4. Written from the format description in numpy.lib.format; no code is shared with numpy.
//
//   file = "\x93NUMPY" | major | minor | header_len (u16 for 1.0, u32 for 2.0/3.0, little-endian)
//          | header (a Python dict literal: {'descr': ..., 'fortran_order': ..., 'shape': (...)})
//          | data (numel * itemsize bytes, nothing after)
//
// Every error throws qkv::Error whose message starts with the label and the path, e.g.
//   "--q q.npy: unsupported dtype '<f8' (float64); expected float32, bool, uint8, int32 or int64".
//
// Writing never leaves a partial file: data goes to a temporary file beside the destination
// that is renamed into place only once it was written completely. NpyWriteSet extends this to
// several files, so that a command that fails half-way leaves none of its outputs behind.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "qkv/tensor.h"

namespace qkv::io {

// An owning n-d array as read from (or to be written to) a .npy file, in C order.
struct NpyArray {
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;  // rank 0..4; rank 0 holds one element

  std::int64_t numel() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  // 64-byte aligned and never null (an empty array still owns one aligned block).
  void* data() const { return storage.get(); }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(storage.get());
  }

  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> storage;
};

// Allocates an uninitialised array; throws qkv::Error naming `label` if the shape is negative,
// has more than 4 dims, or its byte count overflows.
NpyArray make_npy_array(DType dtype, std::vector<std::int64_t> shape, const std::string& label);

// Reads and validates a whole .npy file. `label` (e.g. "--q") prefixes every error message,
// followed by the path.
NpyArray read_npy(const std::string& path, const std::string& label = {});

// Writes `data` (C order, numel * itemsize bytes) as a version 1.0 .npy file whose data starts
// at a multiple of 64 bytes, via a temporary file renamed into place.
void write_npy(const std::string& path, DType dtype, std::span<const std::int64_t> shape,
               const void* data, const std::string& label = {});

// Several output files committed together. stage() writes each file completely to a temporary
// file beside its destination; commit() renames them all into place. A set destroyed before
// commit() (an exception anywhere) deletes its temporary files, so nothing partial remains.
// If a rename fails during commit(), the files already renamed are removed too (an all-or-none
// attempt; a file they replaced is gone either way) and the error is rethrown.
class NpyWriteSet {
 public:
  NpyWriteSet() = default;
  ~NpyWriteSet();
  NpyWriteSet(const NpyWriteSet&) = delete;
  NpyWriteSet& operator=(const NpyWriteSet&) = delete;

  void stage(const std::string& path, DType dtype, std::span<const std::int64_t> shape,
             const void* data, const std::string& label = {});
  void stage(const std::string& path, const NpyArray& array, const std::string& label = {}) {
    stage(path, array.dtype, array.shape, array.data(), label);
  }
  void commit();

 private:
  struct Staged {
    std::string path;
    std::string temp_path;
    std::string where;  // "label path", for messages
  };
  std::vector<Staged> staged_;
};

// One output .npy written in pieces, for results too large to hold at once: the header (the
// whole shape, known up front) goes to a temporary file beside `path`, append() adds data in C
// order, commit() checks that exactly numel * itemsize bytes arrived and renames the file into
// place. Destroyed before commit() (an exception anywhere), it deletes the temporary file, so
// a failed command never leaves a partial output.
class NpyRowWriter {
 public:
  NpyRowWriter(const std::string& path, DType dtype, std::span<const std::int64_t> shape,
               const std::string& label = {});
  ~NpyRowWriter();
  NpyRowWriter(const NpyRowWriter&) = delete;
  NpyRowWriter& operator=(const NpyRowWriter&) = delete;

  void append(const void* data, std::size_t bytes);
  void commit();

 private:
  void discard();

  std::string where_;  // "label path", for messages
  std::string destination_;
  std::string temp_path_;
  int fd_ = -1;
  std::uint64_t expected_bytes_ = 0;
  std::uint64_t written_bytes_ = 0;
};

// NumPy's names: "float32", "bfloat16", "float16", "bool", "uint8", "int32", "int64".
const char* npy_type_name(DType dtype);
// NumPy's shape notation: "()", "(3,)", "(2, 3)".
std::string npy_shape_string(std::span<const std::int64_t> shape);

}  // namespace qkv::io
