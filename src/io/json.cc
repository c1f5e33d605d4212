#include "io/json.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <unordered_set>
#include <utility>

#include "io/input_file.h"
#include "qkv/error.h"

namespace qkv::io {

namespace {

// Config files are a few kilobytes; anything this large is not one.
constexpr std::uint64_t kMaxJsonFileBytes = 64ull << 20;

bool is_digit(char c) { return c >= '0' && c <= '9'; }

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

void append_utf8(std::string& out, std::uint32_t code_point) {
  if (code_point < 0x80) {
    out += static_cast<char>(code_point);
  } else if (code_point < 0x800) {
    out += static_cast<char>(0xc0 | code_point >> 6);
    out += static_cast<char>(0x80 | (code_point & 0x3f));
  } else if (code_point < 0x10000) {
    out += static_cast<char>(0xe0 | code_point >> 12);
    out += static_cast<char>(0x80 | (code_point >> 6 & 0x3f));
    out += static_cast<char>(0x80 | (code_point & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | code_point >> 18);
    out += static_cast<char>(0x80 | (code_point >> 12 & 0x3f));
    out += static_cast<char>(0x80 | (code_point >> 6 & 0x3f));
    out += static_cast<char>(0x80 | (code_point & 0x3f));
  }
}

// Length of the well-formed UTF-8 sequence starting at text[pos] (a byte >= 0x80), or 0.
// Rejects overlong forms, surrogates (U+D800..U+DFFF) and code points above U+10FFFF.
std::size_t utf8_sequence_length(std::string_view text, std::size_t pos) {
  const auto byte = [&](std::size_t i) {
    return i < text.size() ? static_cast<unsigned char>(text[i]) : 0u;
  };
  const unsigned lead = byte(pos);
  std::size_t length = 0;
  unsigned low = 0x80, high = 0xbf;  // allowed range of the second byte
  if (lead >= 0xc2 && lead <= 0xdf) {
    length = 2;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3;
    if (lead == 0xe0) low = 0xa0;   // overlong
    if (lead == 0xed) high = 0x9f;  // surrogates
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4;
    if (lead == 0xf0) low = 0x90;   // overlong
    if (lead == 0xf4) high = 0x8f;  // above U+10FFFF
  } else {
    return 0;
  }
  if (byte(pos + 1) < low || byte(pos + 1) > high) return 0;
  for (std::size_t i = 2; i < length; ++i) {
    if (byte(pos + i) < 0x80 || byte(pos + i) > 0xbf) return 0;
  }
  return length;
}

}  // namespace

// Recursive descent over the RFC 8259 grammar; depth counts open arrays and objects.
class JsonParser {
 public:
  JsonParser(std::string_view text, const std::string& where) : text_(text), where_(where) {}

  JsonValue parse_document() {
    skip_space();
    JsonValue value = parse_value(0);
    skip_space();
    if (pos_ != text_.size()) fail("unexpected text after the value");
    return value;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    std::size_t line = 1, column = 1;
    for (std::size_t i = 0; i < pos_ && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    throw Error(where_ + ": invalid JSON at line " + std::to_string(line) + ", column " +
                std::to_string(column) + ": " + what);
  }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }

  void skip_space() {
    while (!at_end() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' ||
                         text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  void expect_word(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) fail("unexpected character");
    pos_ += word.size();
  }

  JsonValue parse_value(int depth) {
    JsonValue value;
    if (at_end()) fail("unexpected end of input, expected a value");
    if (++values_ > kMaxJsonValues) {
      fail("more than " + std::to_string(kMaxJsonValues) + " values in one document (a limit of "
           "this parser; docs/limits.md)");
    }
    const char c = peek();
    if (c == '{' || c == '[') {
      if (depth >= kMaxJsonDepth) {
        fail("nesting deeper than " + std::to_string(kMaxJsonDepth) + " levels");
      }
      c == '{' ? parse_object(value, depth + 1) : parse_array(value, depth + 1);
    } else if (c == '"') {
      value.kind_ = JsonValue::Kind::kString;
      value.string_ = parse_string();
    } else if (c == '-' || is_digit(c)) {
      parse_number(value);
    } else if (c == 't') {
      expect_word("true");
      value.kind_ = JsonValue::Kind::kBool;
      value.boolean_ = true;
    } else if (c == 'f') {
      expect_word("false");
      value.kind_ = JsonValue::Kind::kBool;
    } else if (c == 'n') {
      expect_word("null");
    } else {
      fail("unexpected character, expected a value");
    }
    return value;
  }

  static constexpr std::size_t kScanLimit = 32;

  // Adds `key` to `keys` (filled from the object's members on first use); false if present.
  static bool insert_key(std::unordered_set<std::string>& keys, const JsonValue& object,
                         const std::string& key) {
    if (keys.empty()) {
      for (const JsonMember& member : object.members_) keys.insert(member.key);
    }
    return keys.insert(key).second;
  }

  void parse_object(JsonValue& value, int depth) {
    std::unordered_set<std::string> keys;  // used once the object has kScanLimit members
    value.kind_ = JsonValue::Kind::kObject;
    ++pos_;  // '{'
    skip_space();
    if (peek() == '}') {
      ++pos_;
      return;
    }
    while (true) {
      if (peek() != '"') fail("expected a string key");
      const std::size_t key_pos = pos_;
      std::string key = parse_string();
      // Duplicates: a scan while the object is small, a hash set past that, so that a file of
      // 80k keys is not 80k^2 / 2 comparisons.
      const bool duplicate = value.members_.size() < kScanLimit
                                 ? value.find(key) != nullptr
                                 : !insert_key(keys, value, key);
      if (duplicate) {
        pos_ = key_pos;
        fail("duplicate key \"" + key + "\"");
      }
      skip_space();
      if (peek() != ':') fail("expected ':' after a key");
      ++pos_;
      skip_space();
      JsonValue member = parse_value(depth);
      value.members_.push_back({std::move(key), std::move(member)});
      skip_space();
      if (peek() == ',') {
        ++pos_;
        skip_space();
      } else if (peek() == '}') {
        ++pos_;
        return;
      } else {
        fail("expected ',' or '}' in an object");
      }
    }
  }

  void parse_array(JsonValue& value, int depth) {
    value.kind_ = JsonValue::Kind::kArray;
    ++pos_;  // '['
    skip_space();
    if (peek() == ']') {
      ++pos_;
      return;
    }
    while (true) {
      value.array_.push_back(parse_value(depth));
      skip_space();
      if (peek() == ',') {
        ++pos_;
        skip_space();
      } else if (peek() == ']') {
        ++pos_;
        return;
      } else {
        fail("expected ',' or ']' in an array");
      }
    }
  }

  std::uint32_t parse_hex4() {
    std::uint32_t code = 0;
    for (int i = 0; i < 4; ++i) {
      const int digit = hex_value(peek());
      if (at_end() || digit < 0) fail("expected 4 hex digits after \\u");
      code = code << 4 | static_cast<std::uint32_t>(digit);
      ++pos_;
    }
    return code;
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      const char c = text_[pos_];
      const auto byte = static_cast<unsigned char>(c);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (byte < 0x20) fail("raw control character in a string (escape it)");
      if (byte >= 0x80) {
        const std::size_t length = utf8_sequence_length(text_, pos_);
        if (length == 0) fail("invalid UTF-8 in a string");
        out.append(text_.substr(pos_, length));
        pos_ += length;
        continue;
      }
      ++pos_;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_end()) fail("unterminated string");
      const char escape = text_[pos_++];
      switch (escape) {
        case '"':
        case '\\':
        case '/':
          out += escape;
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u':
          append_utf8(out, parse_unicode_escape());
          break;
        default:
          --pos_;
          fail(std::string("invalid escape '\\") + escape + "'");
      }
    }
  }

  // After "\u": one code point, combining a surrogate pair written as two escapes.
  std::uint32_t parse_unicode_escape() {
    const std::uint32_t first = parse_hex4();
    if (first >= 0xdc00 && first <= 0xdfff) fail("unpaired low surrogate in \\u escape");
    if (first < 0xd800 || first > 0xdbff) return first;
    if (text_.substr(pos_, 2) != "\\u") fail("high surrogate not followed by a \\u low surrogate");
    pos_ += 2;
    const std::uint32_t second = parse_hex4();
    if (second < 0xdc00 || second > 0xdfff) fail("high surrogate not followed by a low surrogate");
    return 0x10000 + ((first - 0xd800) << 10) + (second - 0xdc00);
  }

  // number = [ "-" ] ( "0" / [1-9] *DIGIT ) [ "." 1*DIGIT ] [ ( "e" / "E" ) [ "+" / "-" ] 1*DIGIT ]
  void parse_number(JsonValue& value) {
    const std::size_t start = pos_;
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
      if (is_digit(peek())) fail("leading zero in a number");
    } else if (is_digit(peek())) {
      while (is_digit(peek())) ++pos_;
    } else {
      fail("expected a digit");
    }
    bool integral = true;
    if (peek() == '.') {
      integral = false;
      ++pos_;
      if (!is_digit(peek())) fail("expected a digit after '.'");
      while (is_digit(peek())) ++pos_;
    }
    if (peek() == 'e' || peek() == 'E') {
      integral = false;
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (!is_digit(peek())) fail("expected a digit in the exponent");
      while (is_digit(peek())) ++pos_;
    }
    const std::string_view literal = text_.substr(start, pos_ - start);
    value.kind_ = JsonValue::Kind::kNumber;
    value.string_ = std::string(literal);
    const char* first = literal.data();
    const char* last = literal.data() + literal.size();
    // from_chars is locale-independent (strtod is not); out-of-range doubles become +-inf.
    const auto [end, error] = std::from_chars(first, last, value.number_);
    if (error == std::errc::result_out_of_range) {
      value.number_ = literal.front() == '-' ? -HUGE_VAL : HUGE_VAL;
    } else if (error != std::errc() || end != last) {
      fail("malformed number");
    }
    if (integral) {
      const auto [int_end, int_error] = std::from_chars(first, last, value.int_value_);
      value.integer_ = int_error == std::errc() && int_end == last;
    }
  }

  std::string_view text_;
  std::int64_t values_ = 0;
  std::size_t pos_ = 0;
  const std::string& where_;
};

const std::vector<JsonMember>& JsonValue::members() const { return members_; }

const JsonValue* JsonValue::find(std::string_view key) const {
  for (const JsonMember& member : members_) {
    if (member.key == key) return &member.value;
  }
  return nullptr;
}

const char* json_kind_name(JsonValue::Kind kind) {
  switch (kind) {
    case JsonValue::Kind::kNull:
      return "null";
    case JsonValue::Kind::kBool:
      return "a boolean";
    case JsonValue::Kind::kNumber:
      return "a number";
    case JsonValue::Kind::kString:
      return "a string";
    case JsonValue::Kind::kArray:
      return "an array";
    case JsonValue::Kind::kObject:
      return "an object";
  }
  return "?";
}

JsonValue parse_json(std::string_view text, const std::string& where) {
  return JsonParser(text, where).parse_document();
}

JsonValue read_json_file(const std::string& path) {
  const InputFile file(path, path);
  return parse_json(file.read_all(kMaxJsonFileBytes, "a JSON config file"), path);
}

}  // namespace qkv::io
