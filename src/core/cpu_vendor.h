// The CPU's vendor, for the few tuning choices whose measurements differed between AMD and Intel
// cores (docs/kernels.md): a CPUID fact, so one CPU makes the same choice, and gives the same
// bits, in every run.
#pragma once

namespace qkv {

inline bool cpu_is_amd() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
#else
  return false;
#endif
}

}  // namespace qkv
