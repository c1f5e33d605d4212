#include "core/aligned_buffer.h"

#include <atomic>
#include <cstdlib>
#include <new>
#include <utility>

namespace qkv {
namespace {

constexpr std::size_t kAlignment = 64;
std::atomic<std::int64_t> g_current_bytes{0};
std::atomic<std::int64_t> g_peak_bytes{0};

void count(std::int64_t delta) {
  const std::int64_t now = g_current_bytes.fetch_add(delta) + delta;
  std::int64_t peak = g_peak_bytes.load();
  while (now > peak && !g_peak_bytes.compare_exchange_weak(peak, now)) {
  }
}

}  // namespace

AlignedBuffer::AlignedBuffer(std::size_t bytes) {
  if (bytes == 0) return;
  const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  data_ = std::aligned_alloc(kAlignment, rounded);
  if (data_ == nullptr) throw std::bad_alloc();
  bytes_ = rounded;
  count(static_cast<std::int64_t>(bytes_));
}

AlignedBuffer::~AlignedBuffer() {
  if (data_ != nullptr) {
    std::free(data_);
    count(-static_cast<std::int64_t>(bytes_));
  }
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    AlignedBuffer old(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

ScratchStats scratch_stats() { return {g_current_bytes.load(), g_peak_bytes.load()}; }

void reset_scratch_peak() { g_peak_bytes.store(g_current_bytes.load()); }

}  // namespace qkv
