// Tests of the JSON parser (src/io/json.h) and the safetensors reader (src/io/safetensors.h):
// valid and invalid JSON, round trips of synthetic files for every dtype, every error path by
// its message, f16/bf16 -> f32 conversion values, and (when QKV_MODEL_DIR is set) the real
// all-MiniLM-L6-v2 weights.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "expect_error.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "qkv/error.h"

namespace qkv::io {
namespace {

namespace fs = std::filesystem;

using qkv::testing::expect_error;

// ---------------------------------------------------------------------------------------------
// JSON

TEST(JsonTest, ParsesValuesInOrder) {
  const JsonValue v =
      parse_json(" {\"a\": [1, -2.5e3, true, false, null, \"x\"], \"b\": {}, \"c\": 0.25}\n", "t");
  ASSERT_TRUE(v.is_object());
  ASSERT_EQ(v.members().size(), 3u);
  EXPECT_EQ(v.members()[0].key, "a");
  EXPECT_EQ(v.members()[2].key, "c");
  const JsonValue* a = v.find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->array().size(), 6u);
  EXPECT_TRUE(a->array()[0].is_integer());
  EXPECT_EQ(a->array()[0].integer(), 1);
  EXPECT_FALSE(a->array()[1].is_integer());
  EXPECT_EQ(a->array()[1].number(), -2500.0);
  EXPECT_TRUE(a->array()[2].is_bool() && a->array()[2].boolean());
  EXPECT_TRUE(a->array()[3].is_bool() && !a->array()[3].boolean());
  EXPECT_TRUE(a->array()[4].is_null());
  EXPECT_EQ(a->array()[5].string(), "x");
  EXPECT_TRUE(v.find("b")->is_object());
  EXPECT_TRUE(v.find("b")->members().empty());
  EXPECT_EQ(v.find("c")->number(), 0.25);
  EXPECT_EQ(v.find("missing"), nullptr);
}

TEST(JsonTest, Numbers) {
  EXPECT_EQ(parse_json("9223372036854775807", "t").integer(), INT64_MAX);
  EXPECT_EQ(parse_json("-9223372036854775808", "t").integer(), INT64_MIN);
  const JsonValue big = parse_json("9223372036854775808", "t");  // past int64: a double only
  EXPECT_FALSE(big.is_integer());
  EXPECT_EQ(big.number(), 9223372036854775808.0);
  EXPECT_FALSE(parse_json("1.0", "t").is_integer());
  EXPECT_FALSE(parse_json("1e2", "t").is_integer());
  EXPECT_EQ(parse_json("1e2", "t").number(), 100.0);
  EXPECT_EQ(parse_json("-0", "t").integer(), 0);
  EXPECT_EQ(parse_json("1E-12", "t").number(), 1e-12);
  EXPECT_EQ(parse_json("1e400", "t").number(), std::numeric_limits<double>::infinity());
  EXPECT_EQ(parse_json("12.5", "t").string(), "12.5");  // the source text is kept
}

TEST(JsonTest, StringEscapesAndUtf8) {
  EXPECT_EQ(parse_json(R"("\"\\\/\b\f\n\r\t")", "t").string(), "\"\\/\b\f\n\r\t");
  EXPECT_EQ(parse_json(R"("\u0041\u00e9\u20ac")", "t").string(), "A\xc3\xa9\xe2\x82\xac");
  EXPECT_EQ(parse_json(R"("\ud83d\ude00")", "t").string(), "\xf0\x9f\x98\x80");  // U+1F600
  EXPECT_EQ(parse_json(R"("\u0000")", "t").string(), std::string(1, '\0'));
  EXPECT_EQ(parse_json("\"caf\xc3\xa9 \xf0\x9f\x98\x80\"", "t").string(),
            "caf\xc3\xa9 \xf0\x9f\x98\x80");
}

TEST(JsonTest, NestingLimit) {
  const std::string ok = std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']');
  EXPECT_TRUE(parse_json(ok, "t").is_array());
  const std::string deep =
      std::string(kMaxJsonDepth + 1, '[') + std::string(kMaxJsonDepth + 1, ']');
  expect_error([&] { parse_json(deep, "t"); }, "nesting deeper than 64 levels");
  const std::string hostile(100000, '[');  // must fail cleanly, not overflow the stack
  expect_error([&] { parse_json(hostile, "t"); }, "nesting deeper than 64 levels");
}

TEST(JsonTest, RejectsInvalidDocuments) {
  const std::pair<std::string, std::string> cases[] = {
      {"", "unexpected end of input"},
      {"   ", "unexpected end of input"},
      {"{", "expected a string key"},
      {"[1,]", "expected a value"},
      {"{\"a\":1,}", "expected a string key"},
      {"{\"a\" 1}", "expected ':'"},
      {"{\"a\":1 \"b\":2}", "expected ',' or '}'"},
      {"[1 2]", "expected ',' or ']'"},
      {"{1:2}", "expected a string key"},
      {"01", "leading zero"},
      {"1.", "expected a digit after '.'"},
      {".5", "expected a value"},
      {"-", "expected a digit"},
      {"1e", "expected a digit in the exponent"},
      {"+1", "expected a value"},
      {"tru", "unexpected character"},
      {"nul", "unexpected character"},
      {"NaN", "expected a value"},
      {"'a'", "expected a value"},
      {"\"abc", "unterminated string"},
      {"\"a\nb\"", "raw control character"},
      {"\"\\x\"", "invalid escape '\\x'"},
      {"\"\\u12\"", "expected 4 hex digits"},
      {"\"\\ud800\"", "high surrogate not followed"},
      {"\"\\ud800\\u0041\"", "high surrogate not followed by a low surrogate"},
      {"\"\\udc00\"", "unpaired low surrogate"},
      {"\"\xff\"", "invalid UTF-8"},
      {"\"\xc0\xaf\"", "invalid UTF-8"},      // overlong '/'
      {"\"\xed\xa0\x80\"", "invalid UTF-8"},  // an encoded surrogate
      {"\"\xe2\x82\"", "invalid UTF-8"},      // truncated sequence
      {"{\"a\":1,\"a\":2}", "duplicate key \"a\""},
      {"1 2", "unexpected text after the value"},
      {"[1] x", "unexpected text after the value"},
      {"// c\n1", "expected a value"},
  };
  for (const auto& [text, expected] : cases) {
    SCOPED_TRACE("input: " + text);
    // Init-captures: clang 14 cannot capture structured bindings themselves.
    expect_error([&, text = text] { parse_json(text, "f.json"); }, "f.json: invalid JSON at line ");
    expect_error([&, text = text] { parse_json(text, "f.json"); }, expected);
  }
}

TEST(JsonTest, ErrorNamesLineAndColumn) {
  expect_error([] { parse_json("{\n  \"a\": x}", "config.json"); },
               "config.json: invalid JSON at line 2, column 8: unexpected character");
}

// ---------------------------------------------------------------------------------------------
// Safetensors: a small writer for synthetic files.

struct TestTensor {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::string bytes;
};

std::string shape_json(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (d > 0) text += ',';
    text += std::to_string(shape[d]);  // appended alone: GCC 12 -Wrestrict false positive
  }
  return text + "]";
}

// A file from raw header text and data bytes.
std::string file_bytes(const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(header.size() >> (8 * i) & 0xff);
  return bytes + header + data;
}

// A well-formed file: tensors stored back to back in order, header padded with spaces so that
// the data starts at a multiple of 8 (as the reference writer does).
std::string safetensors_bytes(const std::vector<TestTensor>& tensors,
                              const std::string& metadata = "") {
  std::string header = "{";
  if (!metadata.empty()) header += "\"__metadata__\":" + metadata;
  std::string data;
  for (const TestTensor& t : tensors) {
    if (header.size() > 1) header += ",";
    const std::size_t begin = data.size();
    data += t.bytes;
    header += "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":" + shape_json(t.shape) +
              ",\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(data.size()) +
              "]}";
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  return file_bytes(header, data);
}

// `count` bytes 0, 1, 2, ... (mod 251).
std::string pattern(std::size_t count, int seed = 0) {
  std::string bytes(count, '\0');
  for (std::size_t i = 0; i < count; ++i) bytes[i] = static_cast<char>((i + seed) % 251);
  return bytes;
}

template <typename T>
std::string raw(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("qkv_st_test_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& bytes, const std::string& name = "model.safetensors") {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }
  // A file with one tensor entry written as raw JSON and `data_bytes` bytes of data.
  std::string write_entry(const std::string& entry, std::size_t data_bytes = 24) {
    return write(file_bytes("{\"w\":" + entry + "}", pattern(data_bytes)));
  }
  void expect_open_error(const std::string& path, const std::string& expected) {
    expect_error([&] { SafetensorsFile file(path); }, expected);
  }

  fs::path dir_;
};

TEST_F(SafetensorsTest, RoundTripsEveryDType) {
  const std::pair<const char*, int> dtypes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
  std::vector<TestTensor> tensors;
  int seed = 0;
  for (const auto& [name, size] : dtypes) {
    tensors.push_back({std::string("t.") + name, name, {2, 3}, pattern(6 * size, seed++)});
  }
  tensors.push_back({"scalar", "F32", {}, raw(std::vector<float>{7.5f})});
  tensors.push_back({"empty", "F32", {0, 4}, ""});
  tensors.push_back({"rank8", "U8", {1, 2, 1, 2, 1, 2, 1, 2}, pattern(16)});
  const std::string path = write(safetensors_bytes(tensors, "{\"format\":\"pt\",\"k\":\"\"}"));

  const SafetensorsFile file(path);
  EXPECT_EQ(file.path(), path);
  ASSERT_EQ(file.tensors().size(), tensors.size());
  for (const TestTensor& expected : tensors) {
    SCOPED_TRACE(expected.name);
    const SafetensorsTensor& t = file.tensor(expected.name);
    EXPECT_EQ(safetensors_dtype_name(t.dtype), expected.dtype);
    EXPECT_EQ(t.shape, expected.shape);
    ASSERT_EQ(t.bytes, expected.bytes.size());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(t.data), t.bytes), expected.bytes);
  }
  for (const auto& [name, size] : dtypes) {
    EXPECT_EQ(safetensors_dtype_size(file.tensor(std::string("t.") + name).dtype), size) << name;
  }
  EXPECT_EQ(file.metadata().size(), 2u);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_TRUE(file.contains("scalar"));
  EXPECT_FALSE(file.contains("t.F128"));
}

TEST_F(SafetensorsTest, WriterRoundTrips) {
  const std::vector<float> w = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -1.0f};
  const std::vector<std::uint16_t> half = {0x3f80, 0xbf80};
  const std::vector<std::int64_t> ids = {1, -2, 3};
  const float scalar = 9.5f;
  const std::string path = (dir_ / "written.safetensors").string();
  write_safetensors(path,
                    {{"layers.0.w", SafetensorsDType::kF32, {2, 3}, w.data()},
                     {"name with \"quotes\" and \\", SafetensorsDType::kBF16, {2}, half.data()},
                     {"ids", SafetensorsDType::kI64, {3}, ids.data()},
                     {"scalar", SafetensorsDType::kF32, {}, &scalar},
                     {"empty", SafetensorsDType::kF32, {0, 5}, nullptr}},
                    {{"format", "pt"}, {"note", "line\nbreak \"quoted\""}});
  EXPECT_EQ((fs::file_size(path) - 8 - 56) % 8, 0u);  // 56 data bytes; the header padded to 8
  const SafetensorsFile file(path);
  ASSERT_EQ(file.tensors().size(), 5u);
  EXPECT_EQ(file.tensor("layers.0.w").shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(file.read_f32("layers.0.w", std::vector<std::int64_t>{2, 3}), w);
  EXPECT_EQ(file.tensor("name with \"quotes\" and \\").dtype, SafetensorsDType::kBF16);
  EXPECT_EQ(file.read_f32("name with \"quotes\" and \\", std::vector<std::int64_t>{2}), (std::vector<float>{1.0f, -1.0f}));
  EXPECT_EQ(std::memcmp(file.tensor("ids").data, ids.data(), 24), 0);
  EXPECT_EQ(file.read_f32("scalar", std::vector<std::int64_t>{}), std::vector<float>{9.5f});
  EXPECT_EQ(file.tensor("empty").bytes, 0u);
  EXPECT_EQ(file.metadata().at("note"), "line\nbreak \"quoted\"");
  // Errors write nothing.
  const std::string bad = (dir_ / "bad.safetensors").string();
  expect_error([&] { write_safetensors(bad, {{"a", SafetensorsDType::kF32, {1}, w.data()},
                                             {"a", SafetensorsDType::kF32, {1}, w.data()}}); },
               "tensor 'a' is given twice");
  expect_error([&] { write_safetensors(bad, {{"", SafetensorsDType::kF32, {1}, w.data()}}); },
               "tensor name '' is not allowed");
  expect_error([&] { write_safetensors(bad, {{"n", SafetensorsDType::kF32, {-1}, w.data()}}); },
               "negative dimension");
  expect_error([&] { write_safetensors(bad, {{"n", SafetensorsDType::kF32, {2}, nullptr}}); },
               "has no data");
  EXPECT_FALSE(fs::exists(bad));
  expect_error([&] { write_safetensors(dir_.string(), {}); }, "is a directory");
}

TEST_F(SafetensorsTest, AcceptsGapsTrailingBytesAndAnEmptyHeader) {
  // Tensor 'b' before 'a' in the data, a 4-byte gap between them and 3 bytes after.
  const std::string header = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[8,12]},)"
                             R"("b":{"shape":[2],"data_offsets":[0,4],"dtype":"I16"}}   )";
  const SafetensorsFile file(write(file_bytes(header, pattern(15))));
  EXPECT_EQ(file.tensor("a").data - file.tensor("b").data, 8);
  EXPECT_EQ(static_cast<int>(file.tensor("a").data[0]), 8);
  const SafetensorsFile empty(write(file_bytes("{}", ""), "empty.safetensors"));
  EXPECT_TRUE(empty.tensors().empty());
}

TEST_F(SafetensorsTest, MovingKeepsTheMapping) {
  const std::vector<float> values = {1.0f, 2.0f, 3.0f};
  SafetensorsFile first(write(safetensors_bytes({{"x", "F32", {3}, raw(values)}})));
  const std::byte* data = first.tensor("x").data;
  SafetensorsFile second(std::move(first));
  EXPECT_EQ(second.tensor("x").data, data);
  SafetensorsFile third(write(safetensors_bytes({}), "other.safetensors"));
  third = std::move(second);
  EXPECT_EQ(third.read_f32("x", std::vector<std::int64_t>{3}), values);
}

TEST_F(SafetensorsTest, FileAndHeaderLengthErrors) {
  expect_open_error((dir_ / "absent.safetensors").string(), "absent.safetensors: cannot open");
  expect_open_error(dir_.string(), ": not a regular file");
  expect_open_error(write(""), "model.safetensors: file is 0 bytes, too short for the 8-byte");
  expect_open_error(write(std::string("\x02\0\0\0\0", 5)),
                    "model.safetensors: file is 5 bytes, too short");
  expect_open_error(write(file_bytes("{}", "").substr(0, 9)),
                    "model.safetensors: header length 2 runs past the end of the 9-byte file");
  expect_open_error(write(std::string("\xff\xff\xff\xff\xff\xff\xff\xff{}", 10)),
                    "header length 18446744073709551615 runs past the end of the 10-byte file");

  // A header length above 100 MiB in a file large enough to hold it (sparse: no disk used).
  const std::string big = write("");
  const std::uint64_t too_long = SafetensorsFile::kMaxHeaderBytes + 1;
  fs::resize_file(big, too_long + 8);
  {
    std::fstream out(big, std::ios::in | std::ios::out | std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(too_long >> (8 * i) & 0xff));
  }
  expect_open_error(big, "header length 104857601 is above the limit of 104857600 bytes");
}

TEST_F(SafetensorsTest, HeaderJsonErrors) {
  expect_open_error(write(file_bytes("{\"w\": ", "")),
                    "model.safetensors: header: invalid JSON at line 1, column 7");
  expect_open_error(write(file_bytes("{} x", "")), "header: invalid JSON");
  expect_open_error(write(file_bytes("[]", "")), "model.safetensors: header is an array");
  expect_open_error(write(file_bytes(R"({"__metadata__": []})", "")),
                    "'__metadata__' is an array, expected an object of strings");
  expect_open_error(write(file_bytes(R"({"__metadata__": {"epoch": 3}})", "")),
                    "'__metadata__' entry 'epoch' is a number, expected a string");
}

TEST_F(SafetensorsTest, TensorEntryErrors) {
  const std::pair<std::string, std::string> cases[] = {
      {"[]", "tensor 'w': entry is an array, expected an object"},
      {R"({"shape":[6],"data_offsets":[0,24]})", "tensor 'w': missing 'dtype'"},
      {R"({"dtype":"F32","data_offsets":[0,24]})", "tensor 'w': missing 'shape'"},
      {R"({"dtype":"F32","shape":[6]})", "tensor 'w': missing 'data_offsets'"},
      {R"({"dtype":"F32","shape":[6],"data_offsets":[0,24],"strides":[1]})",
       "tensor 'w': unexpected key 'strides'"},
      {R"({"dtype":4,"shape":[6],"data_offsets":[0,24]})", "dtype is a number, expected a string"},
      {R"({"dtype":"F128","shape":[6],"data_offsets":[0,24]})",
       "tensor 'w': unknown dtype 'F128' (known: BOOL, U8, I8, F8_E4M3"},
      {R"({"dtype":"f32","shape":[6],"data_offsets":[0,24]})", "unknown dtype 'f32'"},
      {R"({"dtype":"F32","shape":6,"data_offsets":[0,24]})",
       "tensor 'w': shape is a number, expected an array of integers"},
      {R"({"dtype":"F32","shape":[2,-3],"data_offsets":[0,24]})",
       "tensor 'w': shape[1] is a number -3, expected a non-negative integer"},
      {R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,24]})", "shape[0] is a number 1.5"},
      {R"({"dtype":"F32","shape":["6"],"data_offsets":[0,24]})", "shape[0] is a string"},
      {R"({"dtype":"U8","shape":[1,1,1,1,1,1,1,1,24],"data_offsets":[0,24]})",
       "tensor 'w': rank 9 is above 8"},
      {R"({"dtype":"F32","shape":[6],"data_offsets":[0]})",
       "tensor 'w': data_offsets must be an array [begin, end]"},
      {R"({"dtype":"F32","shape":[6],"data_offsets":{"begin":0}})", "data_offsets must be"},
      {R"({"dtype":"F32","shape":[6],"data_offsets":[-1,24]})",
       "data_offsets[0] is a number -1, expected a non-negative integer"},
      {R"({"dtype":"F32","shape":[0],"data_offsets":[24,0]})",
       "tensor 'w': data_offsets [24, 0] has begin > end"},
      {R"({"dtype":"F32","shape":[7],"data_offsets":[0,28]})",
       "tensor 'w': data_offsets [0, 28] run past the end of the 24-byte data section"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]})",
       "data_offsets[1] is a number 18446744073709551615, expected a non-negative integer"},
      {R"({"dtype":"F32","shape":[2,3],"data_offsets":[0,20]})",
       "model.safetensors: tensor 'w': data_offsets [0, 20] hold 20 bytes but shape (2, 3) f32 "
       "needs 24"},
      {R"({"dtype":"BF16","shape":[6],"data_offsets":[0,24]})",
       "data_offsets [0, 24] hold 24 bytes but shape (6,) bf16 needs 12"},
      {R"({"dtype":"F64","shape":[4611686018427387904,4],"data_offsets":[0,24]})",
       "hold 24 bytes but shape (4611686018427387904, 4) f64 needs more than 2^64"},
  };
  for (const auto& [entry, expected] : cases) {
    SCOPED_TRACE(entry);
    expect_open_error(write_entry(entry), expected);
  }
}

TEST_F(SafetensorsTest, SizeMismatchMessageMatchesTheDesign) {
  const std::string header = R"({"encoder.layer.0.attention.self.query.weight":)"
                             R"({"dtype":"F32","shape":[384,384],"data_offsets":[0,100]}})";
  expect_open_error(write(file_bytes(header, pattern(100))),
                    "model.safetensors: tensor 'encoder.layer.0.attention.self.query.weight': "
                    "data_offsets [0, 100] hold 100 bytes but shape (384, 384) f32 needs 589824");
}

TEST_F(SafetensorsTest, OverlappingTensorsAreRejected) {
  const std::string header =
      R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
      R"("z":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},)"  // empty: overlaps nothing
      R"("b":{"dtype":"U8","shape":[8],"data_offsets":[6,14]}})";
  expect_open_error(write(file_bytes(header, pattern(16))),
                    "model.safetensors: tensors 'a' [0, 8] and 'b' [6, 14] overlap");
  const std::string same = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})";
  expect_open_error(write(file_bytes(same, pattern(8))), "tensors 'a' [0, 8] and 'b' [0, 8]");
}

TEST_F(SafetensorsTest, ReadF32ConvertsHalfTypes) {
  const std::vector<std::uint16_t> f16 = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x3555,
                                          0x7c00, 0x8000, 0x0400, 0x7e00};
  const std::vector<float> f16_expected = {1.0f,     -2.0f, 65504.0f, 0x1p-24f, 0.333251953125f,
                                           INFINITY, -0.0f, 0x1p-14f};
  const std::vector<std::uint16_t> bf16 = {0x3f80, 0x4049, 0xff80, 0x0001, 0xc2f7, 0x7f7f};
  const std::vector<float> bf16_expected = {1.0f,      3.140625f, -INFINITY,
                                            0x1p-133f, -123.5f,   0x1.fep127f};
  const std::vector<float> f32 = {0.1f, -3.0e38f, 1e-45f, 42.0f};
  // An odd-sized U8 tensor first, so that the half tensors start at odd (unaligned) addresses.
  const std::string path = write(safetensors_bytes({{"pad", "U8", {1}, "x"},
                                                    {"h", "F16", {3, 3}, raw(f16)},
                                                    {"b", "BF16", {2, 3}, raw(bf16)},
                                                    {"f", "F32", {4}, raw(f32)},
                                                    {"i", "I64", {1}, pattern(8)}}));
  const SafetensorsFile file(path);
  const std::vector<float> h = file.read_f32("h", std::vector<std::int64_t>{3, 3});
  ASSERT_EQ(h.size(), 9u);
  for (std::size_t i = 0; i < f16_expected.size(); ++i) {
    EXPECT_EQ(h[i], f16_expected[i]) << "f16 bits 0x" << std::hex << f16[i];
  }
  EXPECT_TRUE(std::signbit(h[6]));
  EXPECT_TRUE(std::isnan(h[8]));
  EXPECT_EQ(file.read_f32("b", std::vector<std::int64_t>{2, 3}), bf16_expected);
  EXPECT_EQ(file.read_f32("f", std::vector<std::int64_t>{4}), f32);

  expect_error([&] { file.read_f32("i", std::vector<std::int64_t>{1}); },
               "model.safetensors: tensor 'i' has dtype i64; only f32, f16 and bf16 convert");
  expect_error(
      [&] {
        file.read_f32("f", std::vector<std::int64_t>{2, 2});
      },
      "model.safetensors: tensor 'f' has shape (4,), expected (2, 2)");
  expect_error([&] { file.read_f32("nope", std::vector<std::int64_t>{4}); },
               "model.safetensors: no tensor 'nope'");
}

TEST_F(SafetensorsTest, ViewF32ReadsAlignedF32InPlaceAndConvertsTheRest) {
  const std::vector<float> a = {1.5f, -2.0f, 3.25f};
  const std::vector<float> u = {4.0f, 5.0f};
  const std::uint8_t pad = 7;
  const std::vector<std::uint16_t> half = {0x3f80, 0xbf80};
  // 'a' at data offset 0 (the writer pads the header to 8 bytes): 4-byte aligned in the
  // mapping; 'u' after one byte of 'pad': not aligned.
  const std::string path = (dir_ / "views.safetensors").string();
  write_safetensors(path, {{"a", SafetensorsDType::kF32, {3}, a.data()},
                           {"pad", SafetensorsDType::kU8, {1}, &pad},
                           {"u", SafetensorsDType::kF32, {2}, u.data()},
                           {"b", SafetensorsDType::kBF16, {2}, half.data()}});
  const SafetensorsFile file(path);
  std::vector<float> storage;
  const std::span<const float> in_place = file.view_f32("a", std::vector<std::int64_t>{3}, storage);
  EXPECT_EQ(static_cast<const void*>(in_place.data()), file.tensor("a").data);
  EXPECT_TRUE(storage.empty());
  EXPECT_EQ(std::vector<float>(in_place.begin(), in_place.end()), a);
  EXPECT_EQ(file.read_f32("a", std::vector<std::int64_t>{3}), a);

  ASSERT_NE(reinterpret_cast<std::uintptr_t>(file.tensor("u").data) % alignof(float), 0u);
  const std::span<const float> copied = file.view_f32("u", std::vector<std::int64_t>{2}, storage);
  EXPECT_EQ(copied.data(), storage.data());
  EXPECT_EQ(storage, u);
  EXPECT_EQ(file.read_f32("u", std::vector<std::int64_t>{2}), u);
  const std::span<const float> widened = file.view_f32("b", std::vector<std::int64_t>{2}, storage);
  EXPECT_EQ(widened.data(), storage.data());
  EXPECT_EQ(storage, (std::vector<float>{1.0f, -1.0f}));

  expect_error(
      [&] {
        file.view_f32("a", std::vector<std::int64_t>{1, 3}, storage);
      },
      "views.safetensors: tensor 'a' has shape (3,), expected (1, 3)");
  expect_error([&] { file.view_f32("pad", std::vector<std::int64_t>{1}, storage); },
               "views.safetensors: tensor 'pad' has dtype u8; only f32, f16 and bf16 convert");
}

TEST_F(SafetensorsTest, ShapeMismatchMessageMatchesTheDesign) {
  const SafetensorsFile file(
      write(safetensors_bytes({{"w", "F32", {384, 384}, std::string(384 * 384 * 4, '\0')}})));
  expect_error(
      [&] {
        file.read_f32("w", std::vector<std::int64_t>{384, 1536});
      },
      "tensor 'w' has shape (384, 384), expected (384, 1536)");
  EXPECT_EQ(file.read_f32("w", std::vector<std::int64_t>{384, 384}).size(), 384u * 384u);
}

// The real all-MiniLM-L6-v2 weights, when a model folder is given (see docs/model-files.md).
TEST(SafetensorsModelTest, ReadsAllMiniLmL6V2) {
  const char* dir = std::getenv("QKV_MODEL_DIR");
  if (dir == nullptr) GTEST_SKIP() << "QKV_MODEL_DIR is not set";
  const SafetensorsFile file(std::string(dir) + "/model.safetensors");
  const std::vector<float> embeddings =
      file.read_f32("embeddings.word_embeddings.weight", std::vector<std::int64_t>{30522, 384});
  double sum_squares = 0;
  for (const float value : embeddings) {
    ASSERT_TRUE(std::isfinite(value));
    sum_squares += static_cast<double>(value) * value;
  }
  EXPECT_GT(sum_squares, 1.0);
  using Shape = std::vector<std::int64_t>;
  for (int layer = 0; layer < 6; ++layer) {
    const std::string prefix = "encoder.layer." + std::to_string(layer) + ".";
    const std::pair<std::string, Shape> weights[] = {{"attention.self.query.weight", {384, 384}},
                                                     {"attention.self.query.bias", {384}},
                                                     {"attention.self.key.weight", {384, 384}},
                                                     {"attention.self.value.weight", {384, 384}},
                                                     {"attention.output.dense.weight", {384, 384}},
                                                     {"attention.output.LayerNorm.weight", {384}},
                                                     {"intermediate.dense.weight", {1536, 384}},
                                                     {"output.dense.weight", {384, 1536}},
                                                     {"output.LayerNorm.bias", {384}}};
    for (const auto& [name, shape] : weights) {
      SCOPED_TRACE(prefix + name);
      const SafetensorsTensor& t = file.tensor(prefix + name);
      EXPECT_EQ(t.dtype, SafetensorsDType::kF32);
      EXPECT_EQ(t.shape, shape);
    }
  }
  EXPECT_FALSE(file.contains("encoder.layer.6.attention.self.query.weight"));
}

}  // namespace
}  // namespace qkv::io
