// Output files written safely (io/output_file.h).
#include "io/output_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "qkv/error.h"

namespace qkv::io {
namespace {

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw Error(where + ": " + what);
}

std::atomic<unsigned> g_temp_counter{0};

}  // namespace

// Creates a new, empty temporary file beside `path` (the same file system, so rename() is
// atomic); returns its descriptor and sets `temp_path`.
int create_temp(const std::string& path, std::string& temp_path, const std::string& where) {
  // A hidden name beside the destination, short enough even when the destination's name is
  // near the 255-byte limit.
  const std::size_t slash = path.rfind('/');
  const std::string directory = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string base = path.substr(directory.size(), 200);
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    temp_path = directory + "." + base + ".tmp-" + std::to_string(::getpid()) + "-" +
                std::to_string(g_temp_counter.fetch_add(1));
    fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) fail(where, std::string("cannot create output file: ") + std::strerror(errno));
  return fd;
}

void write_fully(int fd, const void* data, std::size_t size, const std::string& where) {
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, static_cast<const char*>(data) + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(where, std::string("write failed: ") + std::strerror(errno));
    done += static_cast<std::size_t>(n);
  }
}

std::string output_destination(const std::string& path, const std::string& at) {
  if (path.empty()) fail(at, "empty output path");
  std::filesystem::path link = path;
  struct stat st;
  for (int hops = 0; ::lstat(link.c_str(), &st) == 0 && S_ISLNK(st.st_mode); ++hops) {
    std::error_code error;
    const std::filesystem::path target = std::filesystem::read_symlink(link, error);
    if (error || hops == 40) fail(at, "cannot resolve the symbolic link");
    link = target.is_absolute() ? target : link.parent_path() / target;  // may still dangle
  }
  std::string destination = link.string();
  if (::stat(destination.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) fail(at, "is a directory");
    if (!S_ISREG(st.st_mode)) {
      fail(at,
           "exists and is not a regular file (outputs are written to a temporary file and "
           "renamed into place)");
    }
  }
  return destination;
}

void write_file_atomically(const std::string& path,
                           std::span<const std::pair<const void*, std::size_t>> pieces,
                           const std::string& where) {
  const std::string destination = output_destination(path, where);
  std::string temp_path;
  File file(create_temp(destination, temp_path, where));
  try {
    for (const auto& [data, size] : pieces) write_fully(file.fd(), data, size, where);
    if (file.close() != 0) fail(where, std::string("write failed: ") + std::strerror(errno));
    if (std::rename(temp_path.c_str(), destination.c_str()) != 0) {
      fail(where, std::string("cannot rename the finished file into place: ") +
                      std::strerror(errno));
    }
  } catch (...) {
    ::unlink(temp_path.c_str());
    throw;
  }
}

}  // namespace qkv::io
