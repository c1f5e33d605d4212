// Machine probes for benchmarks: the fp32 FMA peak and the streaming-read bandwidth of this
// machine, measured in-process on the same threads the kernels will use (DESIGN.md section 6:
// quote GFLOP/s as a fraction of the peak measured in the same run).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "hwy/aligned_allocator.h"

namespace qkv::tools {

struct FmaPeak {
  // Zero (and hwy_target "none") until a probe fills it in: a probe that did not run reads 0.
  double gflops = 0.0;  // fp32 GFLOP/s over all threads (one FMA = 2 FLOPs), best of repeats
  double single_thread_gflops = 0.0;  // the same on one thread (from the calibration run)
  int num_threads = 0;                // threads that ran the probe at once
  std::string hwy_target = "none";    // Highway target the dispatcher chose, e.g. "AVX3", "AVX2"
  int lanes = 0;                      // fp32 lanes per vector on that target
  double checksum = 0.0;  // sum of every accumulator: returned so no loop can be optimised away
};

// Runs 12 independent vector FMA chains per thread for about `seconds_per_repeat` on
// `num_threads` threads at once (0 = OpenMP's default), best of at least `repeats` (more, up to
// 12, while the best is under 85% of the single-thread rate times the threads that have a core).
FmaPeak measure_fma_peak(int num_threads, double seconds_per_repeat = 0.1, int repeats = 3);

// The same probe on AVX512-BF16 (`vdpbf16ps`, bf16 pairs accumulated in f32; bf16dot::peak_probe
// in src/kernels/cpu/bf16_dot.h): gflops counts 4 FLOPs per f32 lane per instruction (two
// multiply-adds), hwy_target is "AVX512_BF16" (not a Highway target: the kernel is raw
// intrinsics) and lanes 16. Where the CPU lacks AVX512-BF16 (or bf16dot::set_enabled(false)),
// nothing runs: gflops = 0 and hwy_target = "none".
FmaPeak measure_bf16_peak(int num_threads, double seconds_per_repeat = 0.1, int repeats = 3);

// The same probe on AMX tiles (`tdpbf16ps`, 16 x 16 x 32 bf16 products accumulated in f32;
// amx::peak_probe in src/kernels/cpu/amx.h): 4 independent tile products per step, 16384 FLOPs
// each; hwy_target is "AMX_BF16" and lanes 16. Where the CPU lacks AMX-BF16 (or
// amx::set_enabled(false)), nothing runs: gflops = 0 and hwy_target = "none".
FmaPeak measure_amx_peak(int num_threads, double seconds_per_repeat = 0.1, int repeats = 3);

// The median of timings (the mean of the middle two for an even count; 0 for none).
double median(std::vector<double> values);

// Whether the AMX tile unit and the vector units run at once on this core (amx::overlap_probe):
// the tile products alone, the softmax's vector code alone, and both interleaved, each timed on
// the calling thread in `rounds` rounds taking turns (medians). together / (tiles + softmax)
// near 1 means they take turns; together / (the longer of the two) near 1, that one hides the
// other. All 0 where the CPU lacks AMX-BF16 (or amx::set_enabled(false)).
struct AmxOverlap {
  double tiles_seconds = 0.0, softmax_seconds = 0.0, together_seconds = 0.0;
  std::int64_t iterations = 0;  // probe rounds per timed call
  double checksum = 0.0;
  double together_over_sum() const {
    return tiles_seconds + softmax_seconds > 0.0
               ? together_seconds / (tiles_seconds + softmax_seconds)
               : 0.0;
  }
  double together_over_longer() const {
    const double longer = tiles_seconds > softmax_seconds ? tiles_seconds : softmax_seconds;
    return longer > 0.0 ? together_seconds / longer : 0.0;
  }
};
AmxOverlap measure_amx_overlap(double seconds_per_call = 0.02, int rounds = 7);

struct ReadBandwidth {
  double gbytes_per_second = 0.0;  // 1e9 bytes/s read, over all threads, best of repeats
  int num_threads = 0;
  double buffer_mib = 0.0;  // size of the buffer swept (much larger than the last-level cache)
  bool huge_pages = false;  // the buffer was advised onto huge pages (core/huge_pages.h)
  double checksum = 0.0;    // sum of the buffer: returned so the reads cannot be optimised away
};

// MiB a read probe sweeps by default: 256, or twice the last-level cache this CPU reports where
// that is larger (sysconf's L3, else L2), but at most a quarter of the physical memory. A sweep
// must evict what a kernel read: on a CPU whose L3 reads 480 MiB, K and V (128-256 MiB) stayed
// in it across 256 MiB sweeps, and a decode step's calls ran 1.2-1.45x faster as a run went on.
double read_probe_mib();

// A streaming read: a `buffer_mib` MiB buffer of 32-bit words split into one slice per thread
// (each thread first-touches its own slice); sweep() reads it once on all threads
// (read_buffers) and returns the GB/s. The buffer lives as long as the probe, so a benchmark can
// sweep between its timed repeats and compare medians taken under the same conditions
// (cmd_bench.cc).
class ReadProbe {
 public:
  explicit ReadProbe(int num_threads, double buffer_mib = read_probe_mib());
  double sweep();
  int num_threads() const { return threads_; }
  double buffer_mib() const { return buffer_mib_; }
  bool huge_pages() const { return huge_pages_; }  // advised onto huge pages, as bench's operands
  double checksum() const;  // sum of the sweeps' sums: they cannot be optimised away

 private:
  int threads_;
  double buffer_mib_;
  std::int64_t count_;
  hwy::AlignedFreeUniquePtr<std::uint32_t[]> data_;
  bool huge_pages_ = false;
  std::uint64_t sum_ = 0;  // of every sweep's words
};

// One streaming read of existing buffers (a decode benchmark's K and V arrays), each split into
// one slice per thread of `num_threads` (0 = OpenMP's default), as 32-bit words with integer
// adds; returns their bytes / seconds in 1e9 bytes/s and adds the words' sum to *checksum, so
// the reads cannot be optimised away. What a plain read gets from a kernel's own pages, beside
// the probe's own buffer (on the VM of these sessions the bandwidth moved with what other
// processes had just done to memory: docs/cli-bench-demo.md, "The kernel's own pages").
struct ByteRange {
  const void* data;  // 4-byte aligned
  std::size_t bytes;
};
double read_buffers(const std::vector<ByteRange>& ranges, int num_threads, std::uint64_t* checksum);

// The best of `repeats` sweeps of a fresh ReadProbe (freed before returning).
ReadBandwidth measure_read_bandwidth(int num_threads, double buffer_mib = read_probe_mib(),
                                     int repeats = 5);

}  // namespace qkv::tools
