// FMA-peak and read-bandwidth probes. The vector loops are compiled once per Highway target
// (foreach_target; the set is limited by HWY_DISABLED_TARGETS in CMakeLists.txt) and the best
// target this CPU supports is picked at run time, as the kernels do.
#include <cstdint>
#include <cstring>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tools/fma_probe.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// After foreach_target.h.
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::tools {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The Highway target this copy of the code was compiled for (a HWY_* bit).
std::int64_t CompiledTarget() { return HWY_TARGET; }

// fp32 lanes per full vector on this target.
int FloatLanes() { return static_cast<int>(hn::Lanes(hn::ScalableTag<float>())); }

// 12 independent FMA chains, `iterations` steps each: 12 * Lanes * 2 FLOPs per step. Twelve
// chains cover FMA latency (4-5 cycles) x throughput (2 per cycle) on current x86 cores and still
// fit AVX2's 16 registers with the two constants. a = a * mul + add converges to
// add / (1 - mul), so values stay normal (no overflow, no denormal slow path). Returns the sum of
// all lanes of all chains so the compiler must run every FMA.
float FmaChains(std::int64_t iterations, float start, float mul_value, float add_value) {
  const hn::ScalableTag<float> d;
  const auto mul = hn::Set(d, mul_value);
  const auto add = hn::Set(d, add_value);
  auto a0 = hn::Set(d, start + 0.0f), a1 = hn::Set(d, start + 0.01f);
  auto a2 = hn::Set(d, start + 0.02f), a3 = hn::Set(d, start + 0.03f);
  auto a4 = hn::Set(d, start + 0.04f), a5 = hn::Set(d, start + 0.05f);
  auto a6 = hn::Set(d, start + 0.06f), a7 = hn::Set(d, start + 0.07f);
  auto a8 = hn::Set(d, start + 0.08f), a9 = hn::Set(d, start + 0.09f);
  auto a10 = hn::Set(d, start + 0.10f), a11 = hn::Set(d, start + 0.11f);
  for (std::int64_t i = 0; i < iterations; ++i) {
    a0 = hn::MulAdd(a0, mul, add);
    a1 = hn::MulAdd(a1, mul, add);
    a2 = hn::MulAdd(a2, mul, add);
    a3 = hn::MulAdd(a3, mul, add);
    a4 = hn::MulAdd(a4, mul, add);
    a5 = hn::MulAdd(a5, mul, add);
    a6 = hn::MulAdd(a6, mul, add);
    a7 = hn::MulAdd(a7, mul, add);
    a8 = hn::MulAdd(a8, mul, add);
    a9 = hn::MulAdd(a9, mul, add);
    a10 = hn::MulAdd(a10, mul, add);
    a11 = hn::MulAdd(a11, mul, add);
  }
  const auto sum = hn::Add(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)),
                           hn::Add(hn::Add(hn::Add(a4, a5), hn::Add(a6, a7)),
                                   hn::Add(hn::Add(a8, a9), hn::Add(a10, a11))));
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

// Wrapping sum of the 32-bit words of data[0, count) with four vector accumulators (enough loads
// in flight to be limited by memory, not by the add latency): integer adds, so any bit pattern
// (floats, bf16 pairs, f16) reads at the same speed (no denormal assists).
std::uint32_t SumWords(const std::uint32_t* HWY_RESTRICT data, std::int64_t count) {
  const hn::ScalableTag<std::uint32_t> d;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(d));
  auto s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
  std::int64_t i = 0;
  for (; i + 4 * lanes <= count; i += 4 * lanes) {
    s0 = hn::Add(s0, hn::LoadU(d, data + i));
    s1 = hn::Add(s1, hn::LoadU(d, data + i + lanes));
    s2 = hn::Add(s2, hn::LoadU(d, data + i + 2 * lanes));
    s3 = hn::Add(s3, hn::LoadU(d, data + i + 3 * lanes));
  }
  // The lanes added as unsigned scalars: SumOfLanes on AVX3 is _mm512_reduce_add_epi32, whose
  // signed adds overflow (undefined behaviour: UBSan stops there).
  HWY_ALIGN std::uint32_t lanes_out[hn::MaxLanes(d)];
  hn::Store(hn::Add(hn::Add(s0, s1), hn::Add(s2, s3)), d, lanes_out);
  std::uint32_t total = 0;
  for (std::int64_t l = 0; l < lanes; ++l) total += lanes_out[l];
  for (; i < count; ++i) {
    std::uint32_t word;  // (the buffers hold floats or 16-bit values: no aliasing read)
    std::memcpy(&word, data + i, sizeof(word));
    total += word;
  }
  return total;
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::tools
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "core/huge_pages.h"
#include "core/parallel.h"
#include "hwy/aligned_allocator.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/bf16_dot.h"
#include "tools/fma_probe.h"

namespace qkv::tools {

HWY_EXPORT(CompiledTarget);
HWY_EXPORT(FloatLanes);
HWY_EXPORT(FmaChains);
HWY_EXPORT(SumWords);

namespace {

constexpr int kFmaChains = 12;   // must match FmaChains above
constexpr int kBf16Chains = 12;  // must match bf16dot::peak_probe
constexpr int kMaxRepeats = 12;  // of the all-thread FMA run

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// What both peak probes share. `chains(iterations, task)` runs one probe kernel for `iterations`
// steps on the calling thread (`task`: which of the parallel copies, for distinct inputs) and
// returns its checksum; one step is `flops_per_iteration` FLOPs. Fills gflops,
// single_thread_gflops, num_threads and checksum.
FmaPeak measure_peak(int num_threads, double seconds_per_repeat, int repeats,
                     double flops_per_iteration,
                     const std::function<double(std::int64_t, std::int64_t)>& chains) {
  const int threads = resolve_num_threads(num_threads);
  double checksum = 0.0;

  // Calibrate on one thread: grow the iteration count until one call takes >= 20 ms (this also
  // wakes the core up from a low clock), then scale to seconds_per_repeat.
  std::int64_t iterations = 1 << 14;
  double single_gflops = 0.0;
  while (true) {
    const auto start = std::chrono::steady_clock::now();
    checksum += chains(iterations, 0);
    const double seconds = seconds_since(start);
    if (seconds >= 0.02 || iterations >= (std::int64_t{1} << 40)) {
      single_gflops = flops_per_iteration * iterations / seconds / 1e9;
      iterations = std::max<std::int64_t>(
          1, static_cast<std::int64_t>(iterations * seconds_per_repeat / std::max(seconds, 1e-9)));
      break;
    }
    iterations *= 4;
  }

  // All threads at once, one task each; the wall time of the slowest thread counts. On a shared
  // machine the scheduler sometimes stacks two of our threads on one core for a whole repeat (or
  // another process takes one), which halves the figure: keep repeating (up to kMaxRepeats)
  // until the best reaches 85% of the single-thread rate times the threads that have a core.
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const double expected = 0.85 * single_gflops * std::min(threads, cores);
  std::vector<double> sums(threads, 0.0);
  double best_gflops = 0.0;
  for (int repeat = 0; repeat < kMaxRepeats; ++repeat) {
    if (repeat >= std::max(repeats, 1) && best_gflops >= expected) break;
    const auto start = std::chrono::steady_clock::now();
    parallel_for(threads, threads, [&](std::int64_t task, int /*thread*/) {
      sums[task] += chains(iterations, task);
    });
    const double seconds = seconds_since(start);
    best_gflops = std::max(best_gflops, flops_per_iteration * iterations * threads / seconds / 1e9);
  }
  for (double sum : sums) checksum += sum;

  FmaPeak peak;
  peak.gflops = best_gflops;
  peak.single_thread_gflops = single_gflops;
  peak.num_threads = threads;
  peak.checksum = checksum;
  return peak;
}

}  // namespace

FmaPeak measure_fma_peak(int num_threads, double seconds_per_repeat, int repeats) {
  const int lanes = HWY_DYNAMIC_DISPATCH(FloatLanes)();
  FmaPeak peak =
      measure_peak(num_threads, seconds_per_repeat, repeats, 2.0 * kFmaChains * lanes,
                   [](std::int64_t iterations, std::int64_t task) {
                     return static_cast<double>(HWY_DYNAMIC_DISPATCH(FmaChains)(
                         iterations, 1.0f + 0.001f * static_cast<float>(task), 0.999999f, 1e-6f));
                   });
  peak.hwy_target = hwy::TargetName(HWY_DYNAMIC_DISPATCH(CompiledTarget)());
  peak.lanes = lanes;
  return peak;
}

namespace {

// A probe of instructions outside Highway (raw intrinsics, chosen by CPUID): gflops = 0 and
// hwy_target "none" where `available` is false; else measure_peak of `probe`, named `name`.
FmaPeak measure_intrinsics_peak(bool available, const char* name, int num_threads,
                                double seconds_per_repeat, int repeats, double flops_per_iteration,
                                double (*probe)(std::int64_t)) {
  if (!available) {
    FmaPeak none{};
    none.num_threads = resolve_num_threads(num_threads);
    none.hwy_target = "none";
    return none;
  }
  FmaPeak peak = measure_peak(num_threads, seconds_per_repeat, repeats, flops_per_iteration,
                              [probe](std::int64_t iterations, std::int64_t /*task*/) {
                                return probe(iterations);
                              });
  peak.hwy_target = name;
  peak.lanes = 16;
  return peak;
}

}  // namespace

FmaPeak measure_bf16_peak(int num_threads, double seconds_per_repeat, int repeats) {
  // One vdpbf16ps: 16 f32 lanes x 2 multiply-adds = 64 FLOPs; 12 chains per step.
  return measure_intrinsics_peak(bf16dot::available(), "AVX512_BF16", num_threads,
                                 seconds_per_repeat, repeats, 4.0 * kBf16Chains * 16,
                                 bf16dot::peak_probe);
}

FmaPeak measure_amx_peak(int num_threads, double seconds_per_repeat, int repeats) {
  // One tdpbf16ps: 16 x 16 outputs x 32 multiply-adds = 16384 FLOPs; 4 per step.
  return measure_intrinsics_peak(amx::available(), "AMX_BF16", num_threads, seconds_per_repeat,
                                 repeats, 4.0 * 16 * 16 * 32 * 2, amx::peak_probe);
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

AmxOverlap measure_amx_overlap(double seconds_per_call, int rounds) {
  AmxOverlap overlap;
  if (!amx::available()) return overlap;
  // Iterations for about seconds_per_call of the two together (the longest of the three).
  std::int64_t iterations = 64;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    overlap.checksum += amx::overlap_probe(iterations, amx::OverlapPart::kBoth);
    const double seconds = seconds_since(start);
    if (seconds >= seconds_per_call / 4 || iterations >= (std::int64_t{1} << 30)) {
      iterations = std::max<std::int64_t>(
          1, static_cast<std::int64_t>(static_cast<double>(iterations) * seconds_per_call /
                                       std::max(seconds, 1e-9)));
      break;
    }
    iterations *= 4;
  }
  const amx::OverlapPart parts[3] = {amx::OverlapPart::kTiles, amx::OverlapPart::kSoftmax,
                                     amx::OverlapPart::kBoth};
  std::vector<double> seconds[3];
  for (int round = 0; round < std::max(rounds, 1); ++round) {
    for (int i = 0; i < 3; ++i) {
      const auto start = std::chrono::steady_clock::now();
      overlap.checksum += amx::overlap_probe(iterations, parts[i]);
      seconds[i].push_back(seconds_since(start));
    }
  }
  overlap.tiles_seconds = median(seconds[0]);
  overlap.softmax_seconds = median(seconds[1]);
  overlap.together_seconds = median(seconds[2]);
  overlap.iterations = iterations;
  return overlap;
}

namespace {

// The words [begin, end) that thread `task` of `threads` reads of `count`: slices rounded to 16
// words (64 bytes), so threads never share a cache line.
struct WordSlice {
  std::int64_t begin = 0, end = 0;
};
WordSlice SliceOf(std::int64_t count, int threads, std::int64_t task) {
  const std::int64_t slice = (count / threads + 15) / 16 * 16;
  const std::int64_t begin = std::min(count, task * slice);
  return {begin, std::min(count, begin + slice)};
}

}  // namespace

double read_probe_mib() {
  constexpr double kMinMib = 256.0, kMiB = 1024.0 * 1024.0;
  long cache = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (cache <= 0) cache = sysconf(_SC_LEVEL2_CACHE_SIZE);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  const double memory_mib =
      pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) / kMiB : 0.0;
  double mib = std::max(kMinMib, 2.0 * static_cast<double>(std::max(cache, 0L)) / kMiB);
  if (memory_mib > 0.0) mib = std::min(mib, std::max(kMinMib, memory_mib / 4.0));
  return mib;
}

ReadProbe::ReadProbe(int num_threads, double buffer_mib)
    : threads_(resolve_num_threads(num_threads)),
      buffer_mib_(buffer_mib),
      count_(static_cast<std::int64_t>(buffer_mib * 1024.0 * 1024.0 / 4.0)),
      data_(hwy::AllocateAligned<std::uint32_t>(static_cast<std::size_t>(count_))) {
  std::uint32_t* data = data_.get();
  // On huge pages where the kernel grants them, like the operands of `qkv bench`
  // (core/huge_pages.h): K/V's fraction of this probe then compares like with like.
  huge_pages_ = advise_huge_pages(data, static_cast<std::size_t>(count_) * 4);
  // First touch by the thread that will read the slice in sweep() (NUMA placement).
  parallel_for(threads_, threads_, [&](std::int64_t task, int /*thread*/) {
    const WordSlice slice = SliceOf(count_, threads_, task);
    for (std::int64_t i = slice.begin; i < slice.end; ++i) {
      data[i] = static_cast<std::uint32_t>(i & 1023);
    }
  });
}

double ReadProbe::sweep() {
  return read_buffers({{data_.get(), static_cast<std::size_t>(count_) * 4}}, threads_, &sum_);
}

double ReadProbe::checksum() const { return static_cast<double>(sum_); }

double read_buffers(const std::vector<ByteRange>& ranges, int num_threads,
                    std::uint64_t* checksum) {
  const int threads = resolve_num_threads(num_threads);
  std::vector<std::uint64_t> sums(static_cast<std::size_t>(threads), 0);
  double bytes = 0.0;
  const auto start = std::chrono::steady_clock::now();
  for (const ByteRange& range : ranges) {
    // Whole 32-bit words, one slice per thread (the words of a range's last 0-3 bytes are not
    // read).
    const auto* words = static_cast<const std::uint32_t*>(range.data);
    const std::int64_t count = static_cast<std::int64_t>(range.bytes / 4);
    parallel_for(threads, threads, [&](std::int64_t task, int /*thread*/) {
      const WordSlice slice = SliceOf(count, threads, task);
      sums[task] += HWY_DYNAMIC_DISPATCH(SumWords)(words + slice.begin, slice.end - slice.begin);
    });
    bytes += static_cast<double>(count) * 4.0;
  }
  const double gbytes_per_second = bytes / seconds_since(start) / 1e9;
  for (std::uint64_t sum : sums) *checksum += sum;
  return gbytes_per_second;
}

ReadBandwidth measure_read_bandwidth(int num_threads, double buffer_mib, int repeats) {
  ReadProbe probe(num_threads, buffer_mib);
  double best = 0.0;
  for (int repeat = 0; repeat < std::max(repeats, 1); ++repeat) best = std::max(best, probe.sweep());
  ReadBandwidth bandwidth;
  bandwidth.gbytes_per_second = best;
  bandwidth.num_threads = probe.num_threads();
  bandwidth.buffer_mib = buffer_mib;
  bandwidth.huge_pages = probe.huge_pages();
  bandwidth.checksum = probe.checksum();
  return bandwidth;
}

}  // namespace qkv::tools

#endif  // HWY_ONCE
