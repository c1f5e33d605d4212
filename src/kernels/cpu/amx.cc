// available() and set_enabled() of the AMX micro-kernels (amx.h). They run before anyone knows
// whether the CPU has AMX, so they live here, compiled with the default flags, not in
// amx_tiles.cc.
#include <atomic>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/bf16_dot.h"

#if defined(__x86_64__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace qkv::amx {
namespace {

std::atomic<bool> g_enabled{true};

#if defined(__x86_64__)
std::uint64_t xcr0() {
  std::uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}
#endif

// CPUID says AMX-TILE and AMX-BF16, the OS saves the tile state (XCR0 bits 17 and 18), and (Linux)
// this process may use it: the kernel grants XTILEDATA on request (arch_prctl), once per
// process for all its threads.
bool cpu_runs_amx_bf16() {
#if defined(__x86_64__)
  if (!bf16dot::cpu_supported()) return false;  // AVX512-BF16 packs the probabilities
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(1, 0, &eax, &ebx, &ecx, &edx) == 0 || (ecx & (1u << 27)) == 0) {
    return false;  // no OSXSAVE: xgetbv would fault
  }
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  const bool tile = (edx & (1u << 24)) != 0, bf16 = (edx & (1u << 22)) != 0;
  if (!tile || !bf16) return false;
  constexpr std::uint64_t kTileState = (1u << 17) | (1u << 18);
  if ((xcr0() & kTileState) != kTileState) return false;
#if defined(__linux__)
  constexpr int kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022, kXtileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) return false;
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kGetXcompPerm, &granted) != 0) return false;
  return (granted & (1ul << kXtileData)) != 0;
#else
  return false;  // other OSes: not attempted
#endif
#else
  return false;
#endif
}

}  // namespace

bool available() {
  static const bool supported = cpu_runs_amx_bf16();
  return supported && g_enabled.load(std::memory_order_relaxed);
}

void set_enabled(bool enabled) { g_enabled.store(enabled, std::memory_order_relaxed); }

}  // namespace qkv::amx
