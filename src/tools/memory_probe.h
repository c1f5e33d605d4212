// Peak extra memory of one call, for benchmarks and the demo.
//
// Two numbers where the platform allows:
//  - process: the peak resident set during the call minus the resident set just before it.
//    On Linux, writing "5" to /proc/self/clear_refs resets VmHWM (the RSS high-water mark) to the
//    current RSS; after the call, VmHWM - VmRSS(before) is the peak extra resident memory,
//    whoever allocated it (kernel scratch, the OpenMP runtime, page-touched outputs).
//  - scratch: the peak bytes held by qkv::AlignedBuffer (all kernel scratch goes through it)
//    above what was held before the call (qkv::scratch_stats()).
// Where clear_refs cannot be written (not Linux, or a restricted /proc) only the scratch number
// is available; `method` says which was used.
#pragma once

#include <cstdint>
#include <functional>

namespace qkv::tools {

struct MemoryUsage {
  bool has_process_peak = false;        // false: clear_refs/VmHWM unavailable
  std::int64_t process_peak_extra = 0;  // bytes; VmHWM(after) - VmRSS(before); 0 if unavailable
  std::int64_t scratch_peak_extra = 0;  // bytes; AlignedBuffer peak during the call above before
  const char* method = "scratch";       // "vmhwm" (process and scratch) or "scratch" (only)

  // The number to report as "peak extra memory": process when available, else scratch.
  std::int64_t peak_extra_bytes() const {
    return has_process_peak ? process_peak_extra : scratch_peak_extra;
  }
};

// Runs `call` once and measures its peak extra memory. Before the call, freed heap memory is
// handed back to the OS (glibc malloc_trim) so that the call's allocations show up as new
// resident pages rather than reusing pages already counted in the RSS before.
MemoryUsage measure_peak_memory(const std::function<void()>& call);

// Whether the process measurement (clear_refs + VmHWM) works on this machine.
bool process_peak_available();

}  // namespace qkv::tools
