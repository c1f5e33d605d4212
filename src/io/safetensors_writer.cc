// write_safetensors (io/safetensors.h): the header as JSON, then the tensors' bytes.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "io/output_file.h"
#include "io/safetensors.h"
#include "qkv/error.h"

namespace qkv::io {
namespace {

// `text` as a JSON string literal.
std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      static const char* const kHex = "0123456789abcdef";
      out += "\\u00";
      out += kHex[u >> 4];
      out += kHex[u & 15];
    } else {
      out += c;  // UTF-8 bytes pass through
    }
  }
  return out + "\"";
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  auto fail = [&](const std::string& what) { throw Error(path + ": " + what); };
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) header += ",";
      header += json_string(key) + ":" + json_string(value);
      first = false;
    }
    header += "}";
  }
  std::set<std::string> names;
  std::uint64_t offset = 0;
  for (const SafetensorsEntry& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") fail("tensor name '" + t.name + "' is not allowed");
    if (!names.insert(t.name).second) fail("tensor '" + t.name + "' is given twice");
    if (t.shape.size() > static_cast<std::size_t>(SafetensorsFile::kMaxRank)) {
      fail("tensor '" + t.name + "' has rank " + std::to_string(t.shape.size()) + " (at most " +
           std::to_string(SafetensorsFile::kMaxRank) + ")");
    }
    std::uint64_t bytes = static_cast<std::uint64_t>(safetensors_dtype_size(t.dtype));
    std::string shape;
    for (const std::int64_t size : t.shape) {
      if (size < 0) fail("tensor '" + t.name + "' has a negative dimension");
      if (__builtin_mul_overflow(bytes, static_cast<std::uint64_t>(size), &bytes)) {
        fail("tensor '" + t.name + "' is too large");
      }
      if (!shape.empty()) shape += ',';
      shape += std::to_string(size);
    }
    if (bytes > 0 && t.data == nullptr) fail("tensor '" + t.name + "' has no data");
    if (header.size() > 1) header += ",";
    header += json_string(t.name) + ":{\"dtype\":\"" + safetensors_dtype_name(t.dtype) +
              "\",\"shape\":[" + shape + "],\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + bytes) + "]}";
    offset += bytes;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<std::uint8_t>(header.size() >> (8 * i));
  // The pieces: the length, the header, each tensor's bytes.
  std::vector<std::pair<const void*, std::size_t>> pieces = {{length, 8},
                                                             {header.data(), header.size()}};
  for (const SafetensorsEntry& t : tensors) {
    std::size_t bytes = static_cast<std::size_t>(safetensors_dtype_size(t.dtype));
    for (const std::int64_t size : t.shape) bytes *= static_cast<std::size_t>(size);
    if (bytes > 0) pieces.emplace_back(t.data, bytes);
  }
  write_file_atomically(path, pieces, path);
}

}  // namespace qkv::io
