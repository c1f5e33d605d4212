// Opening a file of untrusted origin for reading. A path given by a user may name a FIFO with
// no writer, a terminal or a device: open(2) on those blocks or reads forever. InputFile opens
// with O_NONBLOCK, refuses anything that is not a regular file before reading a byte, and
// then reads normally.
#pragma once

#include <cstdint>
#include <string>

namespace qkv::io {

class InputFile {
 public:
  // Throws qkv::Error "<where>: cannot open: <reason>" or "<where>: not a regular file".
  InputFile(const std::string& path, const std::string& where);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  int fd() const { return fd_; }
  std::uint64_t size() const { return size_; }  // bytes, when opened

  // The whole file; qkv::Error "<where>: <size> bytes is above the limit of <max_bytes> for
  // <what>" when it is larger (checked before reading).
  std::string read_all(std::uint64_t max_bytes, const std::string& what) const;

 private:
  int fd_ = -1;
  std::uint64_t size_ = 0;
  std::string where_;
};

}  // namespace qkv::io
