// Output files written safely (npy.cc, safetensors_writer.cc): each is written completely to a
// temporary file beside its destination (the same file system) and renamed into place, so no
// reader sees a partial file and an error leaves none behind. Errors throw qkv::Error
// "<where>: <what>".
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <utility>

#include <unistd.h>

namespace qkv::io {

// An open descriptor, closed on scope exit.
class File {
 public:
  explicit File(int fd) : fd_(fd) {}
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  int fd() const { return fd_; }
  // Closes now, reporting the error close() may carry for buffered writes.
  int close() { return ::close(std::exchange(fd_, -1)); }

 private:
  int fd_;
};

// The file an output written to `path` really replaces: through a symbolic link, the file it
// points to (the link is kept); never a directory, device or FIFO (/dev/null) replaced by a
// file.
std::string output_destination(const std::string& path, const std::string& where);

// Creates a new, empty temporary file beside `path`; returns its descriptor and sets
// `temp_path`.
int create_temp(const std::string& path, std::string& temp_path, const std::string& where);

// Writes all `size` bytes (retrying short writes and EINTR).
void write_fully(int fd, const void* data, std::size_t size, const std::string& where);

// `path` <- the concatenation of `pieces` (pointer, size), via a temporary file renamed into
// place.
void write_file_atomically(const std::string& path,
                           std::span<const std::pair<const void*, std::size_t>> pieces,
                           const std::string& where);

}  // namespace qkv::io
