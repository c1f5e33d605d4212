// Tests of the .npy reader/writer (src/io/npy.h): round trips for every dtype and rank 0..4,
// byte-exact agreement with what numpy 1.24 writes, and every error path by its message.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "io/npy.h"
#include "qkv/error.h"

namespace qkv::io {
namespace {

namespace fs = std::filesystem;

class NpyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("qkv_npy_test_" + std::to_string(::getpid()) + "_" +
                                        info->test_suite_name() + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  void write_bytes(const std::string& name, const std::string& bytes) const {
    std::ofstream(path(name), std::ios::binary) << bytes;
  }
  std::string read_bytes(const std::string& name) const {
    std::ifstream in(path(name), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::set<std::string> listing() const {
    std::set<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) {
      names.insert(entry.path().filename().string());
    }
    return names;
  }

  // A .npy file with the given version, raw header text and data bytes.
  static std::string npy_bytes(const std::string& header, const std::string& data, int major = 1,
                               int minor = 0) {
    std::string bytes =
        std::string("\x93NUMPY", 6) + static_cast<char>(major) + static_cast<char>(minor);
    const std::size_t len = header.size();
    bytes += static_cast<char>(len & 0xff);
    bytes += static_cast<char>((len >> 8) & 0xff);
    if (major >= 2) {
      bytes += static_cast<char>((len >> 16) & 0xff);
      bytes += static_cast<char>((len >> 24) & 0xff);
    }
    return bytes + header + data;
  }
  static std::string dict(const std::string& descr, const std::string& shape,
                          const std::string& fortran = "False") {
    return "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape +
           ", }\n";
  }

  // Expects read_npy(name) to throw qkv::Error whose message starts with "--x <path>: " and
  // contains `fragment`.
  void expect_read_error(const std::string& name, const std::string& fragment) const {
    try {
      read_npy(path(name), "--x");
      ADD_FAILURE() << "no error reading " << name << "; expected '" << fragment << "'";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind("--x " + path(name) + ": ", 0), 0u) << message;
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "message '" << message << "' lacks '" << fragment << "'";
    }
  }

  // Writes `bytes` to `name`, then expects reading it to fail as in expect_read_error.
  void expect_bad_file(const std::string& name, const std::string& bytes,
                       const std::string& fragment) const {
    write_bytes(name, bytes);
    expect_read_error(name, fragment);
  }

  fs::path dir_;
};

template <typename T>
std::string bytes_of(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

TEST_F(NpyTest, RoundTripEveryDTypeAndRank) {
  const std::vector<std::vector<std::int64_t>> shapes = {
      {}, {5}, {2, 3}, {2, 1, 3}, {2, 3, 1, 5}, {0}, {3, 0, 2}, {1, 1, 1, 1}};
  for (const DType dtype : {DType::kF32, DType::kBool, DType::kU8, DType::kI32, DType::kI64}) {
    for (const auto& shape : shapes) {
      SCOPED_TRACE(std::string(npy_type_name(dtype)) + " " + npy_shape_string(shape));
      NpyArray array = make_npy_array(dtype, shape, "test");
      auto* bytes = static_cast<unsigned char*>(array.data());
      for (std::size_t i = 0; i < array.nbytes(); ++i) {
        bytes[i] = dtype == DType::kBool ? (i % 3 == 0) : static_cast<unsigned char>(i * 37 + 1);
      }
      write_npy(path("a.npy"), array.dtype, array.shape, array.data(), "--out");
      EXPECT_EQ(listing(), std::set<std::string>{"a.npy"});  // no temporary file left

      const std::string file = read_bytes("a.npy");
      const std::size_t header_len =
          static_cast<unsigned char>(file[8]) | static_cast<unsigned char>(file[9]) << 8;
      EXPECT_EQ((10 + header_len) % 64, 0u);
      EXPECT_EQ(file.size(), 10 + header_len + array.nbytes());
      EXPECT_EQ(file[10 + header_len - 1], '\n');

      const NpyArray back = read_npy(path("a.npy"));
      EXPECT_EQ(back.dtype, dtype);
      EXPECT_EQ(back.shape, shape);
      EXPECT_EQ(back.numel(), array.numel());
      ASSERT_NE(back.data(), nullptr);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(back.data()) % 64, 0u);
      EXPECT_EQ(std::memcmp(back.data(), array.data(), array.nbytes()), 0);
    }
  }
}

TEST_F(NpyTest, WritesTheSameBytesAsNumpy) {
  // np.save(f, np.arange(6, dtype='<f4').reshape(2, 3)) with numpy 1.24: 118-byte header.
  const std::vector<float> values = {0, 1, 2, 3, 4, 5};
  const std::vector<std::int64_t> shape = {2, 3};
  write_npy(path("a.npy"), DType::kF32, shape, values.data());
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  header += std::string(118 - 1 - header.size(), ' ') + "\n";
  EXPECT_EQ(read_bytes("a.npy"), npy_bytes(header, bytes_of(values)));
}

TEST_F(NpyTest, ReadsVersions2And3AndOtherSpellings) {
  const std::vector<std::int32_t> values = {7, -8, 9};
  write_bytes("v2.npy", npy_bytes(dict("<i4", "(3,)"), bytes_of(values), 2));
  write_bytes("v3.npy", npy_bytes(dict("<i4", "(3,)"), bytes_of(values), 3));
  // Double quotes, another key order, no trailing comma, no padding, a Python 2 long suffix.
  write_bytes("spelled.npy",
              npy_bytes("{\"shape\": (1,3L), \"fortran_order\": False, \"descr\": \"<i4\"}",
                        bytes_of(values)));
  for (const char* name : {"v2.npy", "v3.npy", "spelled.npy"}) {
    SCOPED_TRACE(name);
    const NpyArray array = read_npy(path(name));
    EXPECT_EQ(array.dtype, DType::kI32);
    EXPECT_EQ(array.numel(), 3);
    EXPECT_EQ(array.as<std::int32_t>()[1], -8);
  }
  EXPECT_EQ(read_npy(path("spelled.npy")).shape, (std::vector<std::int64_t>{1, 3}));
  // One-byte types take any byte-order mark.
  write_bytes("u8.npy", npy_bytes(dict("<u1", "(2,)"), "\x01\x02"));
  EXPECT_EQ(read_npy(path("u8.npy")).dtype, DType::kU8);
}

TEST_F(NpyTest, MissingFile) { expect_read_error("none.npy", "cannot open"); }

TEST_F(NpyTest, NotARegularFile) {
  fs::create_directory(path("d.npy"));
  expect_read_error("d.npy", "not a regular file");
}

TEST_F(NpyTest, BadMagic) {
  expect_bad_file("a.npy", "PK\x03\x04 this is a zip file", "not a .npy file (bad magic string)");
  expect_bad_file("empty.npy", "", "bad magic");
  expect_bad_file("short.npy", "\x93NU", "bad magic");
}

TEST_F(NpyTest, BadVersion) {
  expect_bad_file("a.npy", npy_bytes(dict("<f4", "(1,)"), std::string(4, '\0'), 4),
                  "unsupported .npy format version 4.0");
  expect_bad_file("b.npy", npy_bytes(dict("<f4", "(1,)"), std::string(4, '\0'), 1, 1),
                  "unsupported .npy format version 1.1");
  expect_bad_file("c.npy", npy_bytes(dict("<f4", "(1,)"), std::string(4, '\0'), 0),
                  "unsupported .npy format version 0.0");
}

TEST_F(NpyTest, TruncatedHeader) {
  expect_bad_file("a.npy", std::string("\x93NUMPY\x01", 7),
                  "truncated header (file ends inside the version)");
  expect_bad_file("b.npy", std::string("\x93NUMPY\x02\x00\x10\x00", 10),
                  "truncated header (file ends inside the header length)");
  const std::string full = npy_bytes(dict("<f4", "(1,)"), "");
  expect_bad_file("c.npy", full.substr(0, full.size() - 5), "truncated header (header length");
  // A v2 header length near 4 GiB must be rejected without trying to read it.
  expect_bad_file("d.npy", std::string("\x93NUMPY\x02\x00\xff\xff\xff\xff{}", 14),
                  "header length 4294967295 runs past the end");
  std::string huge = npy_bytes("", "", 2);
  huge[10] = '\x01';
  huge[11] = '\x01';  // header length 0x01010000 = 16842752, and the file is that long
  huge.resize(12 + 0x01010000, ' ');
  expect_bad_file("e.npy", huge, "header length 16842752 is implausibly large");
}

TEST_F(NpyTest, HeaderNotADict) {
  expect_bad_file("a.npy", npy_bytes("[('descr', '<f4')]\n", ""), "header is not a dict");
  expect_bad_file("b.npy", npy_bytes("", ""), "header is not a dict");
}

TEST_F(NpyTest, MalformedHeader) {
  expect_bad_file("a.npy", npy_bytes("{'descr': '<f4' 'shape': (1,)}", std::string(4, '\0')),
                  "malformed header (expected ',' or '}'");
  expect_bad_file("b.npy", npy_bytes("{'descr': '<f4, 'shape': (1,)}", ""), "malformed header");
  expect_bad_file("c.npy",
                  npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,)} x", ""),
                  "unexpected text after the dict");
  expect_bad_file("d.npy",
                  npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1, a)}", ""),
                  "expected an integer");
  expect_bad_file("e.npy", npy_bytes("{'descr': '<f4', 'fortran_order': None, 'shape': (1,)}", ""),
                  "unexpected value");
  expect_bad_file("f.npy", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,", ""),
                  "malformed header");
}

TEST_F(NpyTest, MissingDuplicateAndUnexpectedKeys) {
  expect_bad_file("a.npy", npy_bytes("{'descr': '<f4', 'fortran_order': False, }", ""),
                  "header has no 'shape' key");
  expect_bad_file("b.npy", npy_bytes("{'shape': (1,), 'fortran_order': False, }", ""),
                  "header has no 'descr' key");
  expect_bad_file("c.npy", npy_bytes("{'descr': '<f4', 'shape': (1,), }", ""),
                  "header has no 'fortran_order' key");
  expect_bad_file("d.npy",
                  npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}", ""),
                  "malformed header");  // 1 is not a value numpy writes
  expect_bad_file("e.npy",
                  npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': ''}", ""),
                  "unexpected key 'x' in header");
  expect_bad_file(
      "f.npy",
      npy_bytes("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': ()}", ""),
      "key 'descr' appears twice");
}

TEST_F(NpyTest, FortranOrder) {
  expect_bad_file("a.npy", npy_bytes(dict("<f4", "(2, 2)", "True"), std::string(16, '\0')),
                  "Fortran order; only C order is supported");
  expect_bad_file("b.npy", npy_bytes("{'descr': '<f4', 'fortran_order': 'no', 'shape': ()}", ""),
                  "'fortran_order' in header is not True or False");
}

TEST_F(NpyTest, UnsupportedDescr) {
  expect_bad_file("a.npy", npy_bytes(dict("<f8", "(1,)"), std::string(8, '\0')),
                  "unsupported dtype '<f8' (float64); expected float32, bool, uint8");
  expect_bad_file("b.npy", npy_bytes(dict(">f4", "(1,)"), std::string(4, '\0')),
                  "unsupported dtype '>f4' (big-endian float32)");
  expect_bad_file("c.npy", npy_bytes(dict("<f2", "(1,)"), std::string(2, '\0')),
                  "unsupported dtype '<f2' (float16)");
  expect_bad_file("d.npy", npy_bytes(dict("<U7", "(1,)"), std::string(28, '\0')),
                  "unsupported dtype '<U7'; expected");
  expect_bad_file("e.npy",
                  npy_bytes("{'descr': [('a', '<f4'), ('b', '<i4')], 'fortran_order': "
                            "False, 'shape': (1,), }",
                            std::string(8, '\0')),
                  "unsupported dtype [('a', '<f4'), ('b', '<i4')] (structured)");
}

TEST_F(NpyTest, BadShapes) {
  expect_bad_file("neg.npy", npy_bytes(dict("<f4", "(2, -1)"), ""),
                  "negative dimension in shape (2, -1)");
  expect_bad_file("huge.npy", npy_bytes(dict("<f4", "(4294967296, 4294967296)"), ""),
                  "shape (4294967296, 4294967296) is too large");
  expect_bad_file("bytes.npy", npy_bytes(dict("<i8", "(1152921504606846976, 2)"), ""),
                  "is too large");  // fits as elements, not as bytes
  expect_bad_file("digits.npy", npy_bytes(dict("<f4", "(99999999999999999999,)"), ""),
                  "shape dimension too large");
  expect_bad_file("rank5.npy", npy_bytes(dict("<f4", "(1, 1, 1, 1, 1)"), std::string(4, '\0')),
                  "rank 5 is not supported (at most 4 dims): shape (1, 1, 1, 1, 1)");
  expect_bad_file("list.npy",
                  npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': [1]}", ""),
                  "'shape' in header is not a tuple");
}

TEST_F(NpyTest, TruncatedData) {
  expect_bad_file("a.npy", npy_bytes(dict("<f4", "(2, 3)"), std::string(23, '\0')),
                  "truncated data: shape (2, 3) of float32 needs 24 data bytes, the file has 23");
  expect_bad_file("b.npy", npy_bytes(dict("<i8", "(1,)"), ""), "truncated data");
}

TEST_F(NpyTest, TrailingBytes) {
  expect_bad_file("a.npy", npy_bytes(dict("|b1", "(3,)"), std::string(4, '\1')),
                  "trailing bytes after the data: shape (3,) of bool needs 3 data bytes, the "
                  "file has 4");
  expect_bad_file("b.npy", npy_bytes(dict("<f4", "()"), std::string(8, '\0')), "trailing bytes");
}

TEST_F(NpyTest, ErrorWithoutLabelStartsWithPath) {
  try {
    read_npy(path("none.npy"));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(path("none.npy") + ": cannot open", 0), 0u) << e.what();
  }
}

TEST_F(NpyTest, WriteReplacesAnExistingFile) {
  write_bytes("a.npy", "old contents");
  const std::vector<std::int64_t> values = {1, 2};
  const std::vector<std::int64_t> shape = {2};
  write_npy(path("a.npy"), DType::kI64, shape, values.data());
  EXPECT_EQ(read_npy(path("a.npy")).as<std::int64_t>()[1], 2);
  EXPECT_EQ(listing(), std::set<std::string>{"a.npy"});
}

TEST_F(NpyTest, WriteErrorsLeaveNothing) {
  const float value = 1.0f;
  const std::vector<std::int64_t> shape = {1};
  EXPECT_THROW(
      {
        try {
          write_npy(path("missing/a.npy"), DType::kF32, shape, &value, "--out");
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("--out " + path("missing/a.npy") +
                                               ": cannot create output file"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
  fs::create_directory(path("d.npy"));
  EXPECT_THROW(write_npy(path("d.npy"), DType::kF32, shape, &value), Error);
  EXPECT_THROW(write_npy(path("e.npy"), DType::kBF16, shape, &value), Error);  // not a npy type
  EXPECT_EQ(listing(), std::set<std::string>{"d.npy"});
}

TEST_F(NpyTest, WriteThroughASymlinkKeepsTheLink) {
  const std::vector<std::int32_t> values = {5};
  const std::vector<std::int64_t> shape = {1};
  fs::create_directory(path("real"));
  fs::create_symlink("real/target.npy", path("link.npy"));  // dangling until written
  write_npy(path("link.npy"), DType::kI32, shape, values.data());
  EXPECT_TRUE(fs::is_symlink(path("link.npy")));
  EXPECT_EQ(read_npy(path("real/target.npy")).as<std::int32_t>()[0], 5);
  EXPECT_EQ(listing(), (std::set<std::string>{"link.npy", "real"}));
}

TEST_F(NpyTest, NeverReplacesADeviceOrFifo) {
  const float value = 1.0f;
  const std::vector<std::int64_t> shape = {1};
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0644), 0);
  try {
    write_npy(path("fifo"), DType::kF32, shape, &value, "--out");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exists and is not a regular file"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(fs::is_fifo(path("fifo")));
  EXPECT_EQ(listing(), std::set<std::string>{"fifo"});
}

TEST_F(NpyTest, WriteSetCommitsAllOrNothing) {
  const std::vector<float> values = {1, 2, 3};
  const std::vector<std::int64_t> shape = {3};
  write_bytes("keep.npy", "old");
  {
    NpyWriteSet set;
    set.stage(path("keep.npy"), DType::kF32, shape, values.data());
    set.stage(path("b.npy"), DType::kF32, shape, values.data());
    EXPECT_EQ(listing().size(), 3u);  // keep.npy and two temporary files
    // Destroyed without commit (as when an exception unwinds): nothing changes.
  }
  EXPECT_EQ(listing(), std::set<std::string>{"keep.npy"});
  EXPECT_EQ(read_bytes("keep.npy"), "old");

  {
    NpyWriteSet set;
    set.stage(path("keep.npy"), DType::kF32, shape, values.data());
    EXPECT_THROW(set.stage(path("nodir/c.npy"), DType::kF32, shape, values.data()), Error);
  }
  EXPECT_EQ(listing(), std::set<std::string>{"keep.npy"});
  EXPECT_EQ(read_bytes("keep.npy"), "old");

  {
    NpyWriteSet set;
    set.stage(path("a.npy"), DType::kF32, shape, values.data());
    set.stage(path("b.npy"), DType::kF32, shape, values.data());
    // b.npy becomes a non-empty directory after staging, so its rename fails in commit().
    fs::create_directories(path("b.npy/inside"));
    EXPECT_THROW(set.commit(), Error);
  }
  EXPECT_EQ(listing(), (std::set<std::string>{"b.npy", "keep.npy"}));
  fs::remove_all(path("b.npy"));

  {
    NpyWriteSet set;
    set.stage(path("a.npy"), DType::kF32, shape, values.data());
    set.stage(path("b.npy"), DType::kF32, shape, values.data());
    set.commit();
  }
  EXPECT_EQ(listing(), (std::set<std::string>{"a.npy", "b.npy", "keep.npy"}));
  EXPECT_EQ(read_npy(path("b.npy")).as<float>()[2], 3.0f);
}

TEST_F(NpyTest, RowWriterStreamsAndCommitsOnlyWhenComplete) {
  const std::vector<float> data = {1, 2, 3, 4, 5, 6};
  const std::vector<std::int64_t> shape = {3, 2};
  {
    NpyRowWriter writer(path("rows.npy"), DType::kF32, shape, "--out");
    writer.append(data.data(), 2 * sizeof(float));
    EXPECT_FALSE(fs::exists(path("rows.npy")));  // nothing visible before commit
    writer.append(data.data() + 2, 4 * sizeof(float));
    writer.commit();
  }
  write_npy(path("whole.npy"), DType::kF32, shape, data.data());
  EXPECT_EQ(read_bytes("rows.npy"), read_bytes("whole.npy"));  // same bytes as write_npy
  EXPECT_EQ(listing(), (std::set<std::string>{"rows.npy", "whole.npy"}));

  // Too little data: commit fails and the temporary file is removed.
  try {
    NpyRowWriter writer(path("short.npy"), DType::kF32, shape, "--out");
    writer.append(data.data(), 5 * sizeof(float));
    writer.commit();
    ADD_FAILURE() << "commit of an incomplete file succeeded";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("--out " + path("short.npy") + ": wrote 20 of 24"),
              std::string::npos)
        << error.what();
  }
  // Too much data, or an exception before commit: nothing is left behind either.
  try {
    NpyRowWriter writer(path("long.npy"), DType::kF32, shape, "--out");
    writer.append(data.data(), 6 * sizeof(float));
    writer.append(data.data(), sizeof(float));
    ADD_FAILURE() << "append past the shape succeeded";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("more data than the shape holds"), std::string::npos);
  }
  EXPECT_EQ(listing(), (std::set<std::string>{"rows.npy", "whole.npy"}));
  EXPECT_THROW(NpyRowWriter(dir_.string(), DType::kF32, shape, "--out"), Error);  // a directory
}

TEST_F(NpyTest, MakeArrayChecksShape) {
  EXPECT_THROW(make_npy_array(DType::kF32, {-1}, "x"), Error);
  EXPECT_THROW(make_npy_array(DType::kF32, {1, 1, 1, 1, 1}, "x"), Error);
  EXPECT_THROW(make_npy_array(DType::kI64, {std::int64_t{1} << 62, 4}, "x"), Error);
  const NpyArray empty = make_npy_array(DType::kF32, {0, 4}, "x");
  EXPECT_NE(empty.data(), nullptr);
  EXPECT_EQ(empty.nbytes(), 0u);
}

TEST(NpyNames, ShapeStringsAndTypeNames) {
  EXPECT_EQ(npy_shape_string(std::vector<std::int64_t>{}), "()");
  EXPECT_EQ(npy_shape_string(std::vector<std::int64_t>{3}), "(3,)");
  EXPECT_EQ(npy_shape_string(std::vector<std::int64_t>{2, 3}), "(2, 3)");
  EXPECT_STREQ(npy_type_name(DType::kF32), "float32");
  EXPECT_STREQ(npy_type_name(DType::kBool), "bool");
  EXPECT_STREQ(npy_type_name(DType::kI64), "int64");
}

}  // namespace
}  // namespace qkv::io
