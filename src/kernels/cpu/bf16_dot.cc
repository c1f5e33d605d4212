// available(), preferred() and their switches of the AVX512-BF16 micro-kernel (bf16_dot.h). They run before
// anyone knows whether the CPU has AVX-512, so they live here, compiled with the default flags,
// not in bf16_dot_avx512.cc.
#include "kernels/cpu/bf16_dot.h"

#include <atomic>

#include "core/cpu_vendor.h"

namespace qkv::bf16dot {
namespace {

std::atomic<bool> g_enabled{true};
std::atomic<bool> g_forced{false};

bool cpu_runs_avx512_bf16() {
#if defined(__x86_64__) || defined(__i386__)
  // libgcc's CPUID reader reports the AVX-512 features only when XCR0 says the OS saves the
  // opmask and zmm state.
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

}  // namespace

bool cpu_supported() {
  static const bool supported = cpu_runs_avx512_bf16();
  return supported;
}

bool available() { return cpu_supported() && g_enabled.load(std::memory_order_relaxed); }

void set_enabled(bool enabled) { g_enabled.store(enabled, std::memory_order_relaxed); }

bool preferred() {
  return available() && (cpu_is_amd() || g_forced.load(std::memory_order_relaxed));
}

void set_forced(bool forced) { g_forced.store(forced, std::memory_order_relaxed); }

bool forced() { return g_forced.load(std::memory_order_relaxed); }

}  // namespace qkv::bf16dot
