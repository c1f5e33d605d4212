#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <utility>

#include "core/float16.h"
#include "io/input_file.h"
#include "io/json.h"
#include "io/npy.h"
#include "qkv/error.h"

namespace qkv::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swaps");

namespace {

struct DTypeEntry {
  SafetensorsDType dtype;
  const char* name;
  int size;
};

// Every dtype of the format (safetensors 0.4); the table is the one place that lists them.
constexpr DTypeEntry kDTypes[] = {
    {SafetensorsDType::kBool, "BOOL", 1},      {SafetensorsDType::kU8, "U8", 1},
    {SafetensorsDType::kI8, "I8", 1},          {SafetensorsDType::kF8E4M3, "F8_E4M3", 1},
    {SafetensorsDType::kF8E5M2, "F8_E5M2", 1}, {SafetensorsDType::kI16, "I16", 2},
    {SafetensorsDType::kU16, "U16", 2},        {SafetensorsDType::kF16, "F16", 2},
    {SafetensorsDType::kBF16, "BF16", 2},      {SafetensorsDType::kI32, "I32", 4},
    {SafetensorsDType::kU32, "U32", 4},        {SafetensorsDType::kF32, "F32", 4},
    {SafetensorsDType::kF64, "F64", 8},        {SafetensorsDType::kI64, "I64", 8},
    {SafetensorsDType::kU64, "U64", 8},
};

std::optional<SafetensorsDType> dtype_of_name(std::string_view name) {
  for (const DTypeEntry& entry : kDTypes) {
    if (name == entry.name) return entry.dtype;
  }
  return std::nullopt;
}

std::string known_dtype_list() {
  std::string list;
  for (const DTypeEntry& entry : kDTypes)
    list += (list.empty() ? "" : ", ") + std::string(entry.name);
  return list;
}

// "f32", "bf16", "bool": the lower-case form used in messages, as in DType's names.
std::string lower_name(SafetensorsDType dtype) {
  std::string name = safetensors_dtype_name(dtype);
  for (char& c : name) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return name;
}

std::uint64_t read_u64_le(const unsigned char* bytes) {
  std::uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = value << 8 | bytes[i];
  return value;
}

// Validation of the parsed header. `at` is "<path>" and `data_bytes` the size of the data part.
class HeaderChecker {
 public:
  HeaderChecker(const std::string& at, const std::byte* data, std::uint64_t data_bytes)
      : at_(at), data_(data), data_bytes_(data_bytes) {}

  void check(const JsonValue& header, std::map<std::string, SafetensorsTensor>& tensors,
             std::map<std::string, std::string>& metadata) {
    if (!header.is_object()) {
      fail(std::string("header is ") + json_kind_name(header.kind()) + ", expected an object");
    }
    struct Range {
      std::uint64_t begin, end;
      const std::string* name;
    };
    std::vector<Range> ranges;
    for (const JsonMember& member : header.members()) {
      if (member.key == "__metadata__") {
        read_metadata(member.value, metadata);
        continue;
      }
      const auto [it, inserted] = tensors.emplace(member.key, SafetensorsTensor{});
      std::uint64_t begin = 0;
      std::uint64_t end = 0;
      read_tensor(member.key, member.value, it->second, begin, end);
      if (begin < end) ranges.push_back({begin, end, &it->first});
    }
    // Tensors may leave gaps (the reference writer never does) but must not share bytes.
    std::sort(ranges.begin(), ranges.end(),
              [](const Range& a, const Range& b) { return a.begin < b.begin; });
    for (std::size_t i = 1; i < ranges.size(); ++i) {
      const Range& a = ranges[i - 1];
      const Range& b = ranges[i];
      if (b.begin < a.end) {
        fail("tensors '" + *a.name + "' " + offsets_text(a.begin, a.end) + " and '" + *b.name +
             "' " + offsets_text(b.begin, b.end) + " overlap");
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw Error(at_ + ": " + what); }
  [[noreturn]] void fail_tensor(const std::string& name, const std::string& what) const {
    fail("tensor '" + name + "': " + what);
  }

  static std::string offsets_text(std::uint64_t begin, std::uint64_t end) {
    // Appended piecewise: GCC 12 warns (-Wrestrict, a false positive) on "a" + b chains here.
    std::string text = "[";
    text += std::to_string(begin);
    text += ", ";
    text += std::to_string(end);
    text += ']';
    return text;
  }

  void read_metadata(const JsonValue& value, std::map<std::string, std::string>& metadata) const {
    if (!value.is_object()) {
      fail(std::string("'__metadata__' is ") + json_kind_name(value.kind()) +
           ", expected an object of strings");
    }
    for (const JsonMember& member : value.members()) {
      if (!member.value.is_string()) {
        fail("'__metadata__' entry '" + member.key + "' is " + json_kind_name(member.value.kind()) +
             ", expected a string");
      }
      metadata.emplace(member.key, member.value.string());
    }
  }

  // A non-negative integer, or an error naming `what` (e.g. "shape[1]").
  std::uint64_t non_negative(const std::string& name, const JsonValue& value,
                             const std::string& what) const {
    if (!value.is_integer() || value.integer() < 0) {
      const std::string shown = value.is_number() ? " " + value.string() : "";
      fail_tensor(name, what + " is " + json_kind_name(value.kind()) + shown +
                            ", expected a non-negative integer");
    }
    return static_cast<std::uint64_t>(value.integer());
  }

  void read_tensor(const std::string& name, const JsonValue& entry, SafetensorsTensor& tensor,
                   std::uint64_t& begin, std::uint64_t& end) const {
    if (!entry.is_object()) {
      fail_tensor(name, std::string("entry is ") + json_kind_name(entry.kind()) +
                            ", expected an object with dtype, shape and data_offsets");
    }
    for (const JsonMember& member : entry.members()) {
      if (member.key != "dtype" && member.key != "shape" && member.key != "data_offsets") {
        fail_tensor(name, "unexpected key '" + member.key + "'");
      }
    }
    const JsonValue* dtype = entry.find("dtype");
    const JsonValue* shape = entry.find("shape");
    const JsonValue* offsets = entry.find("data_offsets");
    if (dtype == nullptr) fail_tensor(name, "missing 'dtype'");
    if (shape == nullptr) fail_tensor(name, "missing 'shape'");
    if (offsets == nullptr) fail_tensor(name, "missing 'data_offsets'");

    if (!dtype->is_string()) {
      fail_tensor(name,
                  std::string("dtype is ") + json_kind_name(dtype->kind()) + ", expected a string");
    }
    const std::optional<SafetensorsDType> parsed = dtype_of_name(dtype->string());
    if (!parsed) {
      fail_tensor(name,
                  "unknown dtype '" + dtype->string() + "' (known: " + known_dtype_list() + ")");
    }
    tensor.dtype = *parsed;

    if (!shape->is_array()) {
      fail_tensor(name, std::string("shape is ") + json_kind_name(shape->kind()) +
                            ", expected an array of integers");
    }
    if (shape->array().size() > static_cast<std::size_t>(SafetensorsFile::kMaxRank)) {
      fail_tensor(name, "rank " + std::to_string(shape->array().size()) + " is above " +
                            std::to_string(SafetensorsFile::kMaxRank));
    }
    for (std::size_t d = 0; d < shape->array().size(); ++d) {
      const std::uint64_t size =
          non_negative(name, shape->array()[d], "shape[" + std::to_string(d) + "]");
      tensor.shape.push_back(static_cast<std::int64_t>(size));
    }
    const std::string shape_text = npy_shape_string(tensor.shape);

    if (!offsets->is_array() || offsets->array().size() != 2) {
      fail_tensor(name, "data_offsets must be an array [begin, end]");
    }
    begin = non_negative(name, offsets->array()[0], "data_offsets[0]");
    end = non_negative(name, offsets->array()[1], "data_offsets[1]");
    if (begin > end)
      fail_tensor(name, "data_offsets " + offsets_text(begin, end) + " has begin > end");
    if (end > data_bytes_) {
      fail_tensor(name, "data_offsets " + offsets_text(begin, end) + " run past the end of the " +
                            std::to_string(data_bytes_) + "-byte data section");
    }

    // product(shape) * size, where any overflow of 64 bits means "more than the file holds".
    std::uint64_t needed = static_cast<std::uint64_t>(safetensors_dtype_size(tensor.dtype));
    bool overflow = false;
    for (const std::int64_t size : tensor.shape) {
      overflow =
          overflow || __builtin_mul_overflow(needed, static_cast<std::uint64_t>(size), &needed);
    }
    const std::string needs = overflow ? "more than 2^64" : std::to_string(needed);
    if (overflow || needed != end - begin) {
      fail_tensor(name, "data_offsets " + offsets_text(begin, end) + " hold " +
                            std::to_string(end - begin) + " bytes but shape " + shape_text + " " +
                            lower_name(tensor.dtype) + " needs " + needs);
    }
    tensor.data = data_ + begin;
    tensor.bytes = static_cast<std::size_t>(needed);
  }

  const std::string& at_;
  const std::byte* data_;
  std::uint64_t data_bytes_;
};


}  // namespace

int safetensors_dtype_size(SafetensorsDType dtype) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.dtype == dtype) return entry.size;
  }
  return 0;
}

const char* safetensors_dtype_name(SafetensorsDType dtype) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.dtype == dtype) return entry.name;
  }
  return "?";
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const InputFile file(path, path);
  const std::uint64_t file_bytes = file.size();
  if (file_bytes < 8) {
    throw Error(path + ": file is " + std::to_string(file_bytes) +
                " bytes, too short for the 8-byte header length of a safetensors file");
  }

  void* mapping = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, file.fd(), 0);
  if (mapping == MAP_FAILED) throw Error(path + ": cannot mmap: " + std::strerror(errno));
  mapping_ = mapping;
  mapping_bytes_ = file_bytes;
  try {
    const auto* bytes = static_cast<const unsigned char*>(mapping_);
    const std::uint64_t header_bytes = read_u64_le(bytes);
    if (header_bytes > file_bytes - 8) {
      throw Error(path + ": header length " + std::to_string(header_bytes) +
                  " runs past the end of the " + std::to_string(file_bytes) + "-byte file");
    }
    if (header_bytes > kMaxHeaderBytes) {
      throw Error(path + ": header length " + std::to_string(header_bytes) +
                  " is above the limit of " + std::to_string(kMaxHeaderBytes) + " bytes");
    }
    const std::string_view header_text(reinterpret_cast<const char*>(bytes + 8), header_bytes);
    const JsonValue header = parse_json(header_text, path + ": header");
    const auto* data = static_cast<const std::byte*>(mapping_) + 8 + header_bytes;
    HeaderChecker(path, data, file_bytes - 8 - header_bytes).check(header, tensors_, metadata_);
  } catch (...) {
    unmap();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      mapping_bytes_(std::exchange(other.mapping_bytes_, 0)),
      tensors_(std::move(other.tensors_)),
      metadata_(std::move(other.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapping_bytes_ = std::exchange(other.mapping_bytes_, 0);
    tensors_ = std::move(other.tensors_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

void SafetensorsFile::unmap() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
  mapping_ = nullptr;
  mapping_bytes_ = 0;
}

const SafetensorsTensor& SafetensorsFile::tensor(const std::string& name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) throw Error(path_ + ": no tensor '" + name + "'");
  return it->second;
}

std::span<const float> SafetensorsFile::view_f32(const std::string& name,
                                                 std::span<const std::int64_t> expected_shape,
                                                 std::vector<float>& storage) const {
  const SafetensorsTensor& t = tensor(name);
  if (!std::equal(t.shape.begin(), t.shape.end(), expected_shape.begin(), expected_shape.end())) {
    throw Error(path_ + ": tensor '" + name + "' has shape " + npy_shape_string(t.shape) +
                ", expected " + npy_shape_string(expected_shape));
  }
  const std::size_t count = t.bytes / static_cast<std::size_t>(safetensors_dtype_size(t.dtype));
  switch (t.dtype) {
    case SafetensorsDType::kF32:
      // (The mapping's bytes are no object of another type; little-endian like the host.)
      if (reinterpret_cast<std::uintptr_t>(t.data) % alignof(float) == 0) {
        return {reinterpret_cast<const float*>(t.data), count};
      }
      storage.resize(count);
      if (t.bytes > 0) std::memcpy(storage.data(), t.data, t.bytes);
      return storage;
    case SafetensorsDType::kF16:
    case SafetensorsDType::kBF16: {
      const bool is_f16 = t.dtype == SafetensorsDType::kF16;
      storage.resize(count);
      for (std::size_t i = 0; i < count; ++i) {
        std::uint16_t bits;
        std::memcpy(&bits, t.data + 2 * i, 2);  // the mapping gives no alignment
        storage[i] = is_f16 ? qkv::f16_bits_to_f32(bits) : qkv::bf16_bits_to_f32(bits);
      }
      return storage;
    }
    default:
      throw Error(path_ + ": tensor '" + name + "' has dtype " + lower_name(t.dtype) +
                  "; only f32, f16 and bf16 convert to f32");
  }
}

std::vector<float> SafetensorsFile::read_f32(const std::string& name,
                                             std::span<const std::int64_t> expected_shape) const {
  std::vector<float> storage;
  const std::span<const float> values = view_f32(name, expected_shape, storage);
  if (values.data() == storage.data()) return storage;
  return {values.begin(), values.end()};  // one copy, no zero-fill before it
}

}  // namespace qkv::io
