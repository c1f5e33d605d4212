// A small strict JSON parser (RFC 8259) for the metadata files of model folders: the
// safetensors header, Hugging Face config.json, sentence-transformers' modules.json and
// 1_Pooling/config.json. Written for this project; no code is shared with another parser.
//
// Strict means: exactly one value surrounded by optional whitespace (space, tab, CR, LF) and
// nothing else; no comments, trailing commas, single quotes, NaN/Infinity or leading zeros;
// strings must be valid UTF-8 without raw control characters, escapes are the eight of the RFC
// plus \uXXXX (a surrogate pair must be complete); object keys must be unique; nesting deeper
// than kMaxJsonDepth arrays/objects is rejected (so a hostile file cannot exhaust the stack),
// and so is a document of more than kMaxJsonValues values (so memory stays bounded: a parsed
// value takes ~100 bytes, where "0," takes 2 in the text). Parsing is linear in the text.
//
// Errors throw qkv::Error "<where>: invalid JSON at line L, column C: <what>".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::io {

inline constexpr int kMaxJsonDepth = 64;
// Values (of any kind, nested ones included) in one document: at most ~200 MiB parsed. Real
// files have a few thousand (a safetensors header: ~8 per tensor).
inline constexpr std::int64_t kMaxJsonValues = std::int64_t{1} << 20;

struct JsonMember;

class JsonValue {
 public:
  enum class Kind : std::uint8_t { kNull, kBool, kNumber, kString, kArray, kObject };

  JsonValue() = default;  // null

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_number() const { return kind_ == Kind::kNumber; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }
  // A number written without fraction or exponent whose value fits in int64 ("384", "-1").
  bool is_integer() const { return kind_ == Kind::kNumber && integer_; }

  // Accessors; calling one of the wrong kind returns the empty / zero value.
  bool boolean() const { return boolean_; }
  double number() const { return number_; }              // any number (rounded to double)
  std::int64_t integer() const { return int_value_; }    // exact, when is_integer()
  const std::string& string() const { return string_; }  // a string, or a number's source text
  const std::vector<JsonValue>& array() const { return array_; }
  const std::vector<JsonMember>& members() const;  // an object's members in file order

  // The member named `key` of an object, or nullptr (also for a non-object).
  const JsonValue* find(std::string_view key) const;

 private:
  friend class JsonParser;

  Kind kind_ = Kind::kNull;
  bool boolean_ = false;
  bool integer_ = false;
  double number_ = 0;
  std::int64_t int_value_ = 0;
  std::string string_;
  std::vector<JsonValue> array_;
  std::vector<JsonMember> members_;  // vector allows an incomplete element type (C++17)
};

struct JsonMember {
  std::string key;
  JsonValue value;
};

// "null", "a boolean", "a number", "a string", "an array", "an object".
const char* json_kind_name(JsonValue::Kind kind);

// Parses `text` as one JSON document. `where` (a file name) starts every error message.
JsonValue parse_json(std::string_view text, const std::string& where);

// Reads the whole file at `path` (at most 64 MiB) and parses it; errors name the path.
JsonValue read_json_file(const std::string& path);

}  // namespace qkv::io
