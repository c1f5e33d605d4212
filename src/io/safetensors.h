// Reading Hugging Face .safetensors files (written from the format description at
// github.com/huggingface/safetensors; no code is shared with that library):
//
//   file = header_len (u64, little-endian) | header (JSON, header_len bytes) | data
//   header = { "__metadata__": {"key": "string", ...},        (optional)
//              "<tensor name>": {"dtype": "F32", "shape": [384, 384],
//                                "data_offsets": [begin, end]}, ... }
//
// Offsets are bytes relative to the start of data; tensors are C order, little-endian.
// The file is mapped read-only with mmap and every tensor is validated when it is opened (see
// docs/model-files.md for the full list); afterwards a tensor's bytes are a pointer into the
// mapping, valid for the SafetensorsFile's lifetime (moving the object keeps them valid).
//
// Every error throws qkv::Error starting with the path and, where one is involved, the tensor:
//   "model.safetensors: tensor 'encoder.layer.0.attention.self.query.weight': data_offsets
//    [0, 100] hold 100 bytes but shape (384, 384) f32 needs 589824"
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace qkv::io {

// The element types of the format (its names upper-case: "F32", "BF16", "BOOL", ...).
enum class SafetensorsDType : std::uint8_t {
  kBool,
  kU8,
  kI8,
  kF8E4M3,
  kF8E5M2,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
};

// Bytes per element.
int safetensors_dtype_size(SafetensorsDType dtype);
// The format's name: "F32", "F8_E4M3", "BOOL".
const char* safetensors_dtype_name(SafetensorsDType dtype);

struct SafetensorsTensor {
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<std::int64_t> shape;  // rank 0..8; rank 0 holds one element
  const std::byte* data = nullptr;  // into the mapping; no alignment is guaranteed
  std::size_t bytes = 0;            // product(shape) * dtype size
};

class SafetensorsFile {
 public:
  static constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;  // 100 MiB (the reference: 100 MB)
  static constexpr int kMaxRank = 8;

  // Maps and validates the whole file; throws qkv::Error naming `path` on any problem.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // Throws "<path>: no tensor 'name'" if absent.
  const SafetensorsTensor& tensor(const std::string& name) const;

  // The tensor converted to float32 (f32 copied; f16 and bf16 widened exactly), after checking
  // that its shape is `expected_shape`:
  //   "<path>: tensor 'x' has shape (384, 384), expected (384, 1536)".
  // Other dtypes throw; nothing is rounded or narrowed.
  std::vector<float> read_f32(const std::string& name,
                              std::span<const std::int64_t> expected_shape) const;
  // The same values without a copy where the file allows one: an f32 tensor whose bytes lie
  // 4-byte aligned in the mapping (as Hugging Face's writer leaves them) is viewed where it lies,
  // valid for this file's lifetime; any other tensor is converted into `storage` (replacing what
  // it held) and viewed there. The same checks and errors as read_f32. (A model's load then
  // copies each weight once, into the layer that owns it; docs/cli-embed.md, "Start-up".)
  std::span<const float> view_f32(const std::string& name,
                                  std::span<const std::int64_t> expected_shape,
                                  std::vector<float>& storage) const;

 private:
  void unmap();

  std::string path_;
  void* mapping_ = nullptr;
  std::size_t mapping_bytes_ = 0;
  std::map<std::string, SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// ---------------------------------------------------------------------------------------------
// Writing (safetensors_writer.cc).

// A tensor to write: its bytes are C order, little-endian, product(shape) * dtype size.
struct SafetensorsEntry {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<std::int64_t> shape;
  const void* data = nullptr;
};

// Writes a .safetensors file: the tensors' data in the given order, the header's JSON padded
// with spaces to a multiple of 8 bytes (as Hugging Face's writer does), optional
// "__metadata__" strings; via a temporary file renamed into place (io/output_file.h).
// SafetensorsFile reads it back. Throws qkv::Error "<path>: ..." for an empty, duplicate or
// reserved ("__metadata__") name, a rank above kMaxRank, a negative dimension, or a null data
// pointer with bytes to write.
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace qkv::io
