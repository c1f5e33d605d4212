#include "io/npy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string_view>
#include <system_error>
#include <utility>

#include "io/input_file.h"
#include "io/output_file.h"
#include "qkv/error.h"

namespace qkv::io {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicSize = 6;
constexpr std::size_t kAlignment = 64;  // data offset and buffer alignment
constexpr int kMaxRank = 4;
// numpy writes headers of a few hundred bytes at most (and its own reader stops at 10000 by
// default); a longer one is a corrupt or hostile file, not worth allocating for.
constexpr std::uint64_t kMaxHeaderBytes = 1 << 20;

std::string where(const std::string& label, const std::string& path) {
  return label.empty() ? path : label + " " + path;
}

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw Error(where + ": " + what);
}

// Element count of `shape`, or nullopt if it (or its byte count) does not fit in int64.
std::optional<std::int64_t> checked_numel(std::span<const std::int64_t> shape, int itemsize) {
  std::int64_t numel = 1;
  for (const std::int64_t size : shape) {
    if (__builtin_mul_overflow(numel, size, &numel)) return std::nullopt;
  }
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<std::int64_t>(itemsize), &bytes)) {
    return std::nullopt;
  }
  return numel;
}

// ---------------------------------------------------------------------------------------------
// Header parsing. The header is a Python dict literal as written by numpy.lib.format, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// We accept exactly that grammar: string keys; values that are strings, True/False, tuples of
// integers, or (only to report them) bracketed structured-dtype descriptions.

struct HeaderValue {
  enum class Kind { kString, kBool, kTuple, kOther } kind = Kind::kOther;
  std::string text;  // the string, or the raw source text for kOther
  bool boolean = false;
  std::vector<std::int64_t> tuple;
};

class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& where) : text_(text), where_(where) {}

  // Parses the whole header into (key, value) pairs in file order.
  std::vector<std::pair<std::string, HeaderValue>> parse_dict() {
    skip_space();
    if (!eat('{')) fail(where_, "header is not a dict: " + quoted_header());
    std::vector<std::pair<std::string, HeaderValue>> items;
    skip_space();
    while (!eat('}')) {
      std::string key = parse_string();
      skip_space();
      if (!eat(':')) malformed("expected ':' after key '" + key + "'");
      skip_space();
      items.emplace_back(std::move(key), parse_value());
      skip_space();
      if (eat(',')) {
        skip_space();
      } else if (peek() != '}') {
        malformed("expected ',' or '}'");
      }
    }
    skip_space();
    if (pos_ != text_.size()) malformed("unexpected text after the dict");
    return items;
  }

 private:
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  bool eat(char c) {
    if (peek() != c || pos_ >= text_.size()) return false;
    ++pos_;
    return true;
  }
  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\t' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  std::string quoted_header() const {
    std::string shown(text_.substr(0, 200));
    while (!shown.empty() && (shown.back() == ' ' || shown.back() == '\n')) shown.pop_back();
    return "\"" + shown + (text_.size() > 200 ? "...\"" : "\"");
  }
  [[noreturn]] void malformed(const std::string& what) const {
    fail(where_, "malformed header (" + what + " at offset " + std::to_string(pos_) +
                     "): " + quoted_header());
  }

  std::string parse_string() {
    const char quote = peek();
    if (quote != '\'' && quote != '"') malformed("expected a quoted string");
    ++pos_;
    const std::size_t end = text_.find(quote, pos_);
    if (end == std::string_view::npos) malformed("unterminated string");
    std::string value(text_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return value;
  }

  std::int64_t parse_int() {
    const bool negative = eat('-');
    if (peek() < '0' || peek() > '9') malformed("expected an integer");
    std::int64_t value = 0;
    while (peek() >= '0' && peek() <= '9') {
      const int digit = peek() - '0';
      if (__builtin_mul_overflow(value, 10, &value) ||
          __builtin_add_overflow(value, negative ? -digit : digit, &value)) {
        fail(where_, "shape dimension too large in header: " + quoted_header());
      }
      ++pos_;
    }
    eat('L');  // Python 2 long suffix, written by very old numpy versions
    return value;
  }

  HeaderValue parse_value() {
    HeaderValue value;
    const char c = peek();
    if (c == '\'' || c == '"') {
      value.kind = HeaderValue::Kind::kString;
      value.text = parse_string();
    } else if (text_.substr(pos_, 4) == "True") {
      value.kind = HeaderValue::Kind::kBool;
      value.boolean = true;
      pos_ += 4;
    } else if (text_.substr(pos_, 5) == "False") {
      value.kind = HeaderValue::Kind::kBool;
      pos_ += 5;
    } else if (c == '(') {
      value.kind = HeaderValue::Kind::kTuple;
      ++pos_;
      skip_space();
      while (!eat(')')) {
        value.tuple.push_back(parse_int());
        skip_space();
        if (eat(',')) {
          skip_space();
        } else if (peek() != ')') {
          malformed("expected ',' or ')' in tuple");
        }
      }
    } else if (c == '[' || c == '{') {
      value.kind = HeaderValue::Kind::kOther;
      value.text = skip_bracketed();
    } else {
      malformed("unexpected value");
    }
    return value;
  }

  // Skips a balanced [...] or {...} (strings inside may hold brackets) and returns its text.
  std::string skip_bracketed() {
    const std::size_t start = pos_;
    int depth = 0;
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c == '\'' || c == '"') {
        parse_string();
        continue;
      }
      ++pos_;
      if (c == '[' || c == '{' || c == '(') ++depth;
      if ((c == ']' || c == '}' || c == ')') && --depth == 0) {
        return std::string(text_.substr(start, pos_ - start));
      }
    }
    malformed("unbalanced brackets");
  }

  std::string_view text_;
  std::size_t pos_ = 0;
  const std::string& where_;
};

struct NpyHeader {
  DType dtype;
  std::vector<std::int64_t> shape;
};

const char* numpy_name_of_descr(std::string_view descr) {
  // Names for the descrs users are most likely to pass by mistake, for the error message.
  static constexpr std::pair<const char*, const char*> kKnown[] = {{"<f8", "float64"},
                                                                   {"<f2", "float16"},
                                                                   {">f4", "big-endian float32"},
                                                                   {"<i2", "int16"},
                                                                   {"|i1", "int8"},
                                                                   {"<u2", "uint16"},
                                                                   {"<u4", "uint32"},
                                                                   {"<u8", "uint64"},
                                                                   {"<c8", "complex64"},
                                                                   {"<c16", "complex128"},
                                                                   {"|O", "object"},
                                                                   {">i8", "big-endian int64"},
                                                                   {">i4", "big-endian int32"},
                                                                   {">f8", "big-endian float64"}};
  for (const auto& [d, name] : kKnown) {
    if (descr == d) return name;
  }
  return nullptr;
}

// Maps a descr to a supported dtype. Byte order does not apply to one-byte types, so any order
// mark is accepted for them; multi-byte types must be little-endian.
std::optional<DType> dtype_of_descr(std::string_view descr) {
  if (descr.size() != 3) return std::nullopt;
  const char order = descr[0];
  const std::string_view type = descr.substr(1);
  const bool any_order = order == '|' || order == '<' || order == '>' || order == '=';
  const bool little = order == '<' || order == '=';
  if (any_order && type == "b1") return DType::kBool;
  if (any_order && type == "u1") return DType::kU8;
  if (little && type == "f4") return DType::kF32;
  if (little && type == "i4") return DType::kI32;
  if (little && type == "i8") return DType::kI64;
  return std::nullopt;
}

NpyHeader parse_header(std::string_view text, const std::string& where) {
  HeaderParser parser(text, where);
  const auto items = parser.parse_dict();
  const HeaderValue* descr = nullptr;
  const HeaderValue* fortran_order = nullptr;
  const HeaderValue* shape = nullptr;
  for (const auto& [key, value] : items) {
    const HeaderValue** slot = key == "descr"           ? &descr
                               : key == "fortran_order" ? &fortran_order
                               : key == "shape"         ? &shape
                                                        : nullptr;
    if (slot == nullptr) fail(where, "unexpected key '" + key + "' in header");
    if (*slot != nullptr) fail(where, "key '" + key + "' appears twice in header");
    *slot = &value;
  }
  const std::pair<const char*, const HeaderValue*> required[] = {
      {"descr", descr}, {"fortran_order", fortran_order}, {"shape", shape}};
  for (const auto& [name, value] : required) {
    if (value == nullptr) fail(where, std::string("header has no '") + name + "' key");
  }

  NpyHeader header;
  const std::string descr_text = descr->kind == HeaderValue::Kind::kString ? "'" + descr->text + "'"
                                 : descr->text.empty()                     ? "(not a string)"
                                                                           : descr->text;
  const std::optional<DType> dtype =
      descr->kind == HeaderValue::Kind::kString ? dtype_of_descr(descr->text) : std::nullopt;
  if (!dtype) {
    const char* known =
        descr->kind == HeaderValue::Kind::kString ? numpy_name_of_descr(descr->text) : "structured";
    fail(where, "unsupported dtype " + descr_text + (known ? std::string(" (") + known + ")" : "") +
                    "; expected float32, bool, uint8, int32 or int64");
  }
  header.dtype = *dtype;

  if (fortran_order->kind != HeaderValue::Kind::kBool) {
    fail(where, "'fortran_order' in header is not True or False");
  }
  if (fortran_order->boolean) {
    fail(where,
         "array is in Fortran order; only C order is supported (save "
         "np.ascontiguousarray(a))");
  }

  if (shape->kind != HeaderValue::Kind::kTuple) fail(where, "'shape' in header is not a tuple");
  header.shape = shape->tuple;
  const std::string shape_text = npy_shape_string(header.shape);
  if (header.shape.size() > kMaxRank) {
    fail(where, "rank " + std::to_string(header.shape.size()) + " is not supported (at most " +
                    std::to_string(kMaxRank) + " dims): shape " + shape_text);
  }
  for (const std::int64_t size : header.shape) {
    if (size < 0) fail(where, "negative dimension in shape " + shape_text);
  }
  if (!checked_numel(header.shape, dtype_size(header.dtype))) {
    fail(where, "shape " + shape_text + " is too large");
  }
  return header;
}

// ---------------------------------------------------------------------------------------------
// File helpers.


// Reads up to `size` bytes at the current position; returns how many were read.
std::size_t read_fully(int fd, void* data, std::size_t size, const std::string& where) {
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, static_cast<char*>(data) + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(where, std::string("read failed: ") + std::strerror(errno));
    if (n == 0) break;
    done += static_cast<std::size_t>(n);
  }
  return done;
}


std::uint32_t little_endian(const unsigned char* bytes, int count) {
  std::uint32_t value = 0;
  for (int i = count - 1; i >= 0; --i) value = value << 8 | bytes[i];
  return value;
}

const char* descr_of(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "<f4";
    case DType::kBool:
      return "|b1";
    case DType::kU8:
      return "|u1";
    case DType::kI32:
      return "<i4";
    case DType::kI64:
      return "<i8";
    case DType::kBF16:
    case DType::kF16:
    case DType::kF64:  // (.npy files of attention are f32: the CLI never writes f64)
      break;
  }
  return nullptr;
}

// The full version 1.0 preamble and header for an array, padded with spaces and ended by '\n'
// so that the data starts at a multiple of kAlignment.
std::string encode_header(DType dtype, std::span<const std::int64_t> shape,
                          const std::string& where) {
  const char* descr = descr_of(dtype);
  if (descr == nullptr) {
    fail(where, std::string("cannot write dtype ") + npy_type_name(dtype) + " to .npy");
  }
  std::string dict = std::string("{'descr': '") + descr +
                     "', 'fortran_order': False, 'shape': " + npy_shape_string(shape) + ", }";
  const std::size_t preamble = kMagicSize + 2 + 2;
  const std::size_t unpadded = preamble + dict.size() + 1;  // + '\n'
  const std::size_t total = (unpadded + kAlignment - 1) / kAlignment * kAlignment;
  dict.append(total - unpadded, ' ');
  dict += '\n';
  const std::size_t header_len = dict.size();
  std::string bytes(kMagic, kMagicSize);
  bytes += '\x01';
  bytes += '\x00';
  bytes += static_cast<char>(header_len & 0xff);
  bytes += static_cast<char>(header_len >> 8);
  return bytes + dict;
}


// The header of an array about to be written, after checking its shape.
std::string checked_header(DType dtype, std::span<const std::int64_t> shape,
                           std::int64_t& numel, const std::string& where) {
  for (const std::int64_t size : shape) {
    if (size < 0) fail(where, "negative dimension in shape " + npy_shape_string(shape));
  }
  const auto checked = checked_numel(shape, dtype_size(dtype));
  if (!checked) fail(where, "shape " + npy_shape_string(shape) + " is too large");
  numel = *checked;
  return encode_header(dtype, shape, where);
}

// Creates a new temporary file beside `path` and writes the whole array to it; returns its name.
std::string write_temp(const std::string& path, DType dtype, std::span<const std::int64_t> shape,
                       const void* data, const std::string& where) {
  std::int64_t numel = 0;
  const std::string header = checked_header(dtype, shape, numel, where);
  std::string temp_path;
  File file(create_temp(path, temp_path, where));
  try {
    write_fully(file.fd(), header.data(), header.size(), where);
    write_fully(file.fd(), data, static_cast<std::size_t>(numel) * dtype_size(dtype), where);
    if (file.close() != 0) fail(where, std::string("write failed: ") + std::strerror(errno));
  } catch (...) {
    ::unlink(temp_path.c_str());
    throw;
  }
  return temp_path;
}


}  // namespace

// ---------------------------------------------------------------------------------------------

std::int64_t NpyArray::numel() const {
  std::int64_t numel = 1;
  for (const std::int64_t size : shape) numel *= size;
  return numel;
}

NpyArray make_npy_array(DType dtype, std::vector<std::int64_t> shape, const std::string& label) {
  const std::string shape_text = npy_shape_string(shape);
  if (shape.size() > kMaxRank) fail(label, "rank of shape " + shape_text + " is above 4");
  for (const std::int64_t size : shape) {
    if (size < 0) fail(label, "negative dimension in shape " + shape_text);
  }
  const auto numel = checked_numel(shape, dtype_size(dtype));
  if (!numel) fail(label, "shape " + shape_text + " is too large");
  const std::size_t bytes = static_cast<std::size_t>(*numel) * dtype_size(dtype);
  // Round up to the alignment (aligned_alloc requires it) and never allocate zero bytes, so an
  // empty array still has a non-null pointer (a null TensorView means "absent").
  const std::size_t rounded =
      std::max<std::size_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  NpyArray array;
  array.dtype = dtype;
  array.shape = std::move(shape);
  array.storage.reset(static_cast<std::byte*>(std::aligned_alloc(kAlignment, rounded)));
  if (array.storage == nullptr) {
    fail(label,
         "out of memory allocating " + std::to_string(bytes) + " bytes for shape " + shape_text);
  }
  return array;
}

NpyArray read_npy(const std::string& path, const std::string& label) {
  const std::string at = where(label, path);
  const InputFile file(path, at);
  const std::uint64_t file_size = file.size();

  // Magic and version.
  unsigned char preamble[kMagicSize + 2 + 4];
  const std::size_t got = read_fully(file.fd(), preamble, kMagicSize + 2, at);
  if (got < kMagicSize || std::memcmp(preamble, kMagic, kMagicSize) != 0) {
    fail(at, "not a .npy file (bad magic string)");
  }
  if (got < kMagicSize + 2) fail(at, "truncated header (file ends inside the version)");
  const int major = preamble[kMagicSize];
  const int minor = preamble[kMagicSize + 1];
  if (major < 1 || major > 3 || minor != 0) {
    fail(at, "unsupported .npy format version " + std::to_string(major) + "." +
                 std::to_string(minor) + " (expected 1.0, 2.0 or 3.0)");
  }

  // Header length: u16 in version 1.0, u32 after.
  const int length_bytes = major == 1 ? 2 : 4;
  if (read_fully(file.fd(), preamble + kMagicSize + 2, length_bytes, at) !=
      static_cast<std::size_t>(length_bytes)) {
    fail(at, "truncated header (file ends inside the header length)");
  }
  const std::uint64_t header_len = little_endian(preamble + kMagicSize + 2, length_bytes);
  const std::uint64_t data_offset = kMagicSize + 2 + length_bytes + header_len;
  if (data_offset > file_size) {
    fail(at, "truncated header (header length " + std::to_string(header_len) +
                 " runs past the end of the " + std::to_string(file_size) + "-byte file)");
  }
  if (header_len > kMaxHeaderBytes) {
    fail(at, "header length " + std::to_string(header_len) + " is implausibly large (at most " +
                 std::to_string(kMaxHeaderBytes) + " bytes are read)");
  }
  std::string header_text(header_len, '\0');
  if (read_fully(file.fd(), header_text.data(), header_len, at) != header_len) {
    fail(at, "truncated header (file changed while reading)");
  }
  NpyHeader header = parse_header(header_text, at);

  // Data: exactly numel * itemsize bytes, nothing after. Checked against the file's size
  // before anything is allocated: a 100-byte file may claim 64 GiB.
  const std::optional<std::int64_t> numel =
      checked_numel(header.shape, dtype_size(header.dtype));
  if (numel && *numel >= 0) {
    const std::uint64_t expected =
        static_cast<std::uint64_t>(*numel) * static_cast<std::uint64_t>(dtype_size(header.dtype));
    const std::uint64_t available = file_size - data_offset;
    const std::string what = "shape " + npy_shape_string(header.shape) + " of " +
                             npy_type_name(header.dtype) + " needs " + std::to_string(expected) +
                             " data bytes, ";
    if (available < expected) {
      fail(at, "truncated data: " + what + "the file has " + std::to_string(available));
    }
    if (available > expected) {
      fail(at, "trailing bytes after the data: " + what + "the file has " +
                   std::to_string(available));
    }
  }
  NpyArray array = make_npy_array(header.dtype, std::move(header.shape), at);
  const std::uint64_t expected = array.nbytes();
  if (read_fully(file.fd(), array.data(), expected, at) != expected) {
    fail(at, "truncated data (file changed while reading)");
  }
  return array;
}

void write_npy(const std::string& path, DType dtype, std::span<const std::int64_t> shape,
               const void* data, const std::string& label) {
  NpyWriteSet set;
  set.stage(path, dtype, shape, data, label);
  set.commit();
}

NpyWriteSet::~NpyWriteSet() {
  for (const Staged& staged : staged_) ::unlink(staged.temp_path.c_str());
}

void NpyWriteSet::stage(const std::string& path, DType dtype, std::span<const std::int64_t> shape,
                        const void* data, const std::string& label) {
  const std::string at = where(label, path);
  std::string destination = output_destination(path, at);
  staged_.reserve(staged_.size() + 1);  // so that push_back below cannot throw
  std::string temp_path = write_temp(destination, dtype, shape, data, at);
  staged_.push_back({std::move(destination), std::move(temp_path), at});
}

void NpyWriteSet::commit() {
  for (std::size_t i = 0; i < staged_.size(); ++i) {
    if (std::rename(staged_[i].temp_path.c_str(), staged_[i].path.c_str()) != 0) {
      const std::string reason = std::strerror(errno);
      for (std::size_t done = 0; done < i; ++done) ::unlink(staged_[done].path.c_str());
      staged_.erase(staged_.begin(), staged_.begin() + i);  // the destructor removes the rest
      fail(staged_.front().where, "cannot rename the finished file into place: " + reason);
    }
  }
  staged_.clear();
}

NpyRowWriter::NpyRowWriter(const std::string& path, DType dtype,
                           std::span<const std::int64_t> shape, const std::string& label)
    : where_(where(label, path)) {
  destination_ = output_destination(path, where_);
  std::int64_t numel = 0;
  const std::string header = checked_header(dtype, shape, numel, where_);
  expected_bytes_ = static_cast<std::uint64_t>(numel) * dtype_size(dtype);
  fd_ = create_temp(destination_, temp_path_, where_);
  try {
    write_fully(fd_, header.data(), header.size(), where_);
  } catch (...) {
    discard();
    throw;
  }
}

NpyRowWriter::~NpyRowWriter() { discard(); }

void NpyRowWriter::discard() {
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  if (!temp_path_.empty()) ::unlink(temp_path_.c_str());
  temp_path_.clear();
}

void NpyRowWriter::append(const void* data, std::size_t bytes) {
  if (fd_ < 0) fail(where_, "append after commit");
  if (written_bytes_ + bytes > expected_bytes_) {
    fail(where_, "more data than the shape holds (" + std::to_string(expected_bytes_) + " bytes)");
  }
  write_fully(fd_, data, bytes, where_);
  written_bytes_ += bytes;
}

void NpyRowWriter::commit() {
  if (fd_ < 0) fail(where_, "commit after commit");
  if (written_bytes_ != expected_bytes_) {
    fail(where_, "wrote " + std::to_string(written_bytes_) + " of " +
                     std::to_string(expected_bytes_) + " bytes");
  }
  if (::close(std::exchange(fd_, -1)) != 0) {
    fail(where_, std::string("write failed: ") + std::strerror(errno));
  }
  if (std::rename(temp_path_.c_str(), destination_.c_str()) != 0) {
    fail(where_, std::string("cannot rename the finished file into place: ") +
                     std::strerror(errno));
  }
  temp_path_.clear();
}

const char* npy_type_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kBool:
      return "bool";
    case DType::kU8:
      return "uint8";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kF64:
      return "float64";
  }
  return "?";
}

std::string npy_shape_string(std::span<const std::int64_t> shape) {
  std::string text = "(";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (d > 0) text += ", ";
    text += std::to_string(shape[d]);
  }
  if (shape.size() == 1) text += ",";
  return text + ")";
}

}  // namespace qkv::io
