#include "tools/memory_probe.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/aligned_buffer.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace qkv::tools {
namespace {

// Value in bytes of the "<field>:   123 kB" line of /proc/self/status; -1 if unavailable.
std::int64_t read_status_kb(const char* field) {
  std::FILE* file = std::fopen("/proc/self/status", "r");
  if (file == nullptr) return -1;
  char line[256];
  std::int64_t value = -1;
  const std::size_t field_length = std::strlen(field);
  while (std::fgets(line, sizeof(line), file) != nullptr) {
    if (std::strncmp(line, field, field_length) == 0 && line[field_length] == ':') {
      long long kb = 0;
      if (std::sscanf(line + field_length + 1, "%lld", &kb) == 1) value = kb * 1024;
      break;
    }
  }
  std::fclose(file);
  return value;
}

// Resets VmHWM to the current RSS ("5" = reset the peak RSS; Linux >= 4.0).
bool reset_peak_rss() {
  std::FILE* file = std::fopen("/proc/self/clear_refs", "w");
  if (file == nullptr) return false;
  const bool written = std::fputs("5", file) >= 0;
  // The write reaches the kernel at fclose; a failure there (EINVAL on old kernels) counts too.
  return std::fclose(file) == 0 && written;
}

void release_free_heap() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace

bool process_peak_available() {
  return reset_peak_rss() && read_status_kb("VmHWM") >= 0 && read_status_kb("VmRSS") >= 0;
}

MemoryUsage measure_peak_memory(const std::function<void()>& call) {
  release_free_heap();
  const ScratchStats scratch_before = scratch_stats();
  reset_scratch_peak();
  const bool process = reset_peak_rss();
  const std::int64_t rss_before = process ? read_status_kb("VmRSS") : -1;

  call();

  const std::int64_t hwm_after = process ? read_status_kb("VmHWM") : -1;
  MemoryUsage usage;
  usage.has_process_peak = process && rss_before >= 0 && hwm_after >= 0;
  usage.process_peak_extra =
      usage.has_process_peak ? std::max<std::int64_t>(0, hwm_after - rss_before) : 0;
  usage.scratch_peak_extra = scratch_stats().peak_bytes - scratch_before.current_bytes;
  usage.method = usage.has_process_peak ? "vmhwm" : "scratch";
  return usage;
}

}  // namespace qkv::tools
