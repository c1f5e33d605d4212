// AlignedBuffer: owning, 64-byte aligned, uninitialised scratch memory. Every allocation made
// by a kernel goes through it, so the bytes a kernel holds can be counted (scratch_stats()).
#pragma once

#include <cstddef>
#include <cstdint>

namespace qkv {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Bytes currently held by AlignedBuffers, and the most held at once since the last reset.
struct ScratchStats {
  std::int64_t current_bytes;
  std::int64_t peak_bytes;
};
ScratchStats scratch_stats();
void reset_scratch_peak();

}  // namespace qkv
