#include "io/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "qkv/error.h"

namespace qkv::io {

InputFile::InputFile(const std::string& path, const std::string& where) : where_(where) {
  // O_NONBLOCK: opening a FIFO without a writer returns at once instead of waiting for one.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd_ < 0) throw Error(where + ": cannot open: " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    const std::string reason = std::strerror(errno);
    ::close(fd_);
    throw Error(where + ": cannot stat: " + reason);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw Error(where + ": not a regular file");
  }
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
  size_ = static_cast<std::uint64_t>(st.st_size);
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string InputFile::read_all(std::uint64_t max_bytes, const std::string& what) const {
  if (size_ > max_bytes) {
    throw Error(where_ + ": " + std::to_string(size_) + " bytes is above the limit of " +
                std::to_string(max_bytes) + " for " + what);
  }
  std::string text(static_cast<std::size_t>(size_), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(where_ + ": read failed: " + std::strerror(errno));
    if (n == 0) break;  // the file shrank while reading
    done += static_cast<std::size_t>(n);
  }
  text.resize(done);
  return text;
}

}  // namespace qkv::io
