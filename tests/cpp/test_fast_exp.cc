// qkv's vectorised exp (kernels/cpu/fast_exp-inl.h) on every compiled target: its maximum
// relative error over every 7th float of [-87.33, 0] against double exp (hwy::Exp's printed
// beside it), exact values (exp(0) = 1, exp(-inf) = +0, +0 below the cut, never a denormal or
// NaN), monotonicity over a dense sample and between adjacent floats, tails and misaligned arrays;
// and the online softmax's 2^x (Pow2, Pow2Coarse): error against double exp2 over [-126, 16],
// exact powers of two, +0 below the cut, normal results above it.
// FastExpSpeed only prints ns per element of both exps (run it alone:
// --gtest_filter='FastExpSpeed*').
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "every_target.h"
#include "hwy/targets.h"
#include "kernels/cpu/fast_exp.h"

namespace qkv::testing {
namespace {

using ExpFn = void (*)(const float*, float*, std::int64_t);

// The bound the sweep asserts: the measured maximum (1.82e-7 on AVX3 and AVX2, 1.79e-7 on
// SCALAR, where MulAdd rounds twice) rounded up; under the 2 ulp = 2.4e-7 the design asks for.
constexpr double kMaxRelError = 1.9e-7;
constexpr float kSweepLow = -87.33f;  // the sweep covers [kSweepLow, 0]
constexpr float kMinArg = -87.3365f;  // fast_exp-inl.h's cut: below it the result is +0
constexpr float kInf = std::numeric_limits<float>::infinity();

struct ErrorStats {
  double max_rel = 0.0;
  float worst_x = 0.0f;
  std::int64_t count = 0;
  bool bad_value = false;  // NaN, negative, or a denormal/zero where exp is normal
};

// What the sweep measures: an exp, and whether on SCALAR too (hwy::Exp's SCALAR code is slow
// enough to double the sweep's time, and the comparison is about the vector targets).
struct Subject {
  ExpFn fn;
  bool on_scalar;
};

// Every subject on every target against double exp, on every `stride`-th float of
// [kSweepLow, -0] (bit patterns upward from -0: negative floats grow in magnitude with their
// pattern). Chunk by chunk, so the double reference is computed once for all of them.
// Returns stats[subject][target], targets in SupportedAndGeneratedTargets() order (count 0:
// not measured).
std::vector<std::vector<ErrorStats>> sweep(const std::vector<Subject>& subjects,
                                           std::uint32_t stride) {
  const std::uint32_t first = std::bit_cast<std::uint32_t>(-0.0f);
  const std::uint32_t last = std::bit_cast<std::uint32_t>(kSweepLow);
  const std::size_t num_targets = hwy::SupportedAndGeneratedTargets().size();
  constexpr std::int64_t kChunk = 1 << 16;
  std::vector<float> x(kChunk), y(kChunk);
  std::vector<double> ref(kChunk), inv_ref(kChunk);
  std::vector<std::vector<ErrorStats>> stats(subjects.size(), std::vector<ErrorStats>(num_targets));
  std::uint64_t bits = first;
  while (bits <= last) {
    std::int64_t n = 0;
    for (; n < kChunk && bits <= last; ++n, bits += stride) {
      x[n] = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
      ref[n] = std::exp(static_cast<double>(x[n]));
      inv_ref[n] = 1.0 / ref[n];
    }
    for (std::size_t f = 0; f < subjects.size(); ++f) {
      std::size_t t = 0;
      for_each_target(fast_exp_cpu_target_name, [&](std::int64_t target) {
        ErrorStats& s = stats[f][t++];
        if (target == HWY_SCALAR && !subjects[f].on_scalar) return;
        subjects[f].fn(x.data(), y.data(), n);
        // A branch-free pass (the sweep's hot loop), then the worst x only if it beats s.
        double chunk_max = 0.0;
        bool bad = false;
        for (std::int64_t i = 0; i < n; ++i) {
          chunk_max =
              std::max(chunk_max, std::fabs(static_cast<double>(y[i]) - ref[i]) * inv_ref[i]);
          bad |= !(y[i] >= std::numeric_limits<float>::min());  // NaN is caught here
        }
        s.bad_value = s.bad_value || bad;
        s.count += n;
        if (chunk_max <= s.max_rel) return;
        s.max_rel = chunk_max;
        for (std::int64_t i = 0; i < n; ++i) {
          if (std::fabs(static_cast<double>(y[i]) - ref[i]) * inv_ref[i] == chunk_max)
            s.worst_x = x[i];
        }
      });
    }
  }
  return stats;
}

std::vector<float> apply(ExpFn fn, std::vector<float> x) {
  fn(x.data(), x.data(), static_cast<std::int64_t>(x.size()));
  return x;
}

TEST(FastExp, MaxRelativeErrorEveryTarget) {
  const auto stats = sweep({{exp_nonpositive_cpu, true}, {exp_hwy_cpu, false}}, 7);
  const std::vector<std::int64_t> targets = hwy::SupportedAndGeneratedTargets();
  for (std::size_t t = 0; t < targets.size(); ++t) {
    const char* target = hwy::TargetName(targets[t]);
    const ErrorStats& fast = stats[0][t];
    const ErrorStats& hwy_exp = stats[1][t];
    std::printf("[ fastexp ] %-6s ExpNonPositive max rel. error %.3e at x = %.9g (%lld floats)",
                target, fast.max_rel, fast.worst_x, static_cast<long long>(fast.count));
    if (hwy_exp.count > 0) {
      std::printf("; hwy::Exp %.3e at x = %.9g", hwy_exp.max_rel, hwy_exp.worst_x);
    }
    std::printf("\n");
    SCOPED_TRACE(target);
    EXPECT_LE(fast.max_rel, kMaxRelError) << "worst x = " << fast.worst_x;
    EXPECT_FALSE(fast.bad_value) << "a NaN, negative or subnormal result in [-87.33, 0]";
  }
}

// ---------------------------------------------------------------------------------------------
// fastexp::Pow2 / Pow2Coarse (the online softmax's 2^x) against double exp2.

constexpr double kPow2MaxRelError = 2.0e-7;  // 1.7e-7 measured (AVX3, AVX2), 1.93e-7 on SCALAR
constexpr double kPow2CoarseMaxRelError = 3.0e-6;  // 2.95e-6 measured (Pow2CoarseHalf)
// pow2_coarse_cpu(x) rounds x + 1/2 once more before Pow2CoarseHalf: up to half an ulp of 16
// (2^-20, times ln2 in 2^x's relative error) on top; 3.53e-6 measured at x = 15.8.
constexpr double kPow2CoarseOfXMaxRelError = kPow2CoarseMaxRelError + 0x1p-20 * 0.6931472;
constexpr float kMinPow2Arg = -126.0f;             // below it: +0

// Max relative error of fn against exp2 on every `stride`-th float between low and high (both
// of one sign), and whether any result was NaN, negative or below FLT_MIN.
ErrorStats sweep_pow2(ExpFn fn, float low, float high, std::uint32_t stride) {
  std::uint32_t a = std::bit_cast<std::uint32_t>(low), b = std::bit_cast<std::uint32_t>(high);
  if (a > b) std::swap(a, b);
  std::vector<float> x;
  for (std::uint64_t bits = a; bits <= b; bits += stride) {
    x.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(bits)));
  }
  std::vector<float> y(x.size());
  fn(x.data(), y.data(), static_cast<std::int64_t>(x.size()));
  ErrorStats s;
  s.count = static_cast<std::int64_t>(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double ref = std::exp2(static_cast<double>(x[i]));
    const double err = std::fabs(static_cast<double>(y[i]) - ref) / ref;
    if (err > s.max_rel) {
      s.max_rel = err;
      s.worst_x = x[i];
    }
    s.bad_value = s.bad_value || !(y[i] >= std::numeric_limits<float>::min());
  }
  return s;
}

TEST(FastPow2, MaxRelativeErrorEveryTarget) {
  const std::tuple<ExpFn, const char*, double> subjects[] = {
      {pow2_cpu, "Pow2", kPow2MaxRelError}, {pow2_coarse_cpu, "Pow2Coarse", kPow2CoarseOfXMaxRelError}};
  for_each_target(fast_exp_cpu_target_name, [&](std::int64_t target) {
    const char* name = hwy::TargetName(target);
    SCOPED_TRACE(name);
    for (const auto& [fn, label, bound] : subjects) {
      // Every 29th float of [-126, -0] (the softmax's domain), every 97th of (0, 16] (the lazy
      // running max's): 49M floats, every r of [-1/2, 1/2] many times over.
      const ErrorStats neg = sweep_pow2(fn, kMinPow2Arg, -0.0f, 29);
      const ErrorStats pos = sweep_pow2(fn, std::numeric_limits<float>::denorm_min(), 16.0f, 97);
      const ErrorStats& worst = neg.max_rel >= pos.max_rel ? neg : pos;
      std::printf("[ fastexp ] %-6s %s max rel. error %.3e at x = %.9g (%lld floats)\n", name,
                  label, worst.max_rel, worst.worst_x,
                  static_cast<long long>(neg.count + pos.count));
      EXPECT_LE(worst.max_rel, bound) << label << ", worst x = " << worst.worst_x;
      EXPECT_FALSE(neg.bad_value || pos.bad_value) << label << ": a NaN, negative or subnormal";
    }
  });
}

// Pow2CoarseHalf, the bf16 softmax's form: 2^(xh - 1/2) against double exp2 over the softmax's
// domain shifted by one half (every 29th float of [-125.5, -0], every 97th of (0, 16.5]).
TEST(FastPow2, CoarseHalfMaxRelativeErrorEveryTarget) {
  const auto half_shifted = [](const float* xh, float* y, std::int64_t n) {
    pow2_coarse_half_cpu(xh, y, n);
    // sweep_pow2 compares with 2^xh: scale by 2^(1/2) in double, rounded once to float, so
    // the comparison adds at most half an ulp (3e-8) to the error it reports.
    for (std::int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(y[i] * std::sqrt(2.0));
  };
  for_each_target(fast_exp_cpu_target_name, [&](std::int64_t target) {
    SCOPED_TRACE(hwy::TargetName(target));
    const ErrorStats neg = sweep_pow2(half_shifted, kMinPow2Arg + 0.5f, -0.0f, 29);
    const ErrorStats pos =
        sweep_pow2(half_shifted, std::numeric_limits<float>::denorm_min(), 16.5f, 97);
    const ErrorStats& worst = neg.max_rel >= pos.max_rel ? neg : pos;
    std::printf("[ fastexp ] %-6s Pow2CoarseHalf max rel. error %.3e at xh = %.9g\n",
                hwy::TargetName(target), worst.max_rel, worst.worst_x);
    EXPECT_LE(worst.max_rel, kPow2CoarseMaxRelError + 3e-8) << "worst xh = " << worst.worst_x;
    // Integers n at xh = n + 1/2: exactly 2^n; below the cut (xh < -125.5) +0; every float of
    // [-125.5, -124.5]: normal.
    for (int n = -126; n <= 16; ++n) {
      EXPECT_EQ(apply(pow2_coarse_half_cpu, {n + 0.5f})[0], std::ldexp(1.0f, n)) << n;
    }
    const std::vector<float> below = {std::nextafter(-125.5f, -kInf), -126.0f, -1e30f, -kInf};
    for (float v : apply(pow2_coarse_half_cpu, below)) {
      EXPECT_EQ(std::bit_cast<std::uint32_t>(v), 0u) << v;
    }
    std::vector<float> edge;
    for (float v = -125.5f; v <= -124.5f; v = std::nextafter(v, 0.0f)) edge.push_back(v);
    for (float v : apply(pow2_coarse_half_cpu, edge)) {
      EXPECT_GE(v, std::numeric_limits<float>::min()) << v;
    }
  });
}

TEST(FastPow2, ExactValuesEveryTarget) {
  const float max = std::numeric_limits<float>::max();
  for_each_target(fast_exp_cpu_target_name, [&](std::int64_t) {
    for (ExpFn fn : {pow2_cpu, pow2_coarse_cpu}) {
      // Integers are exact (r = 0, p = 1): 2^-126 = FLT_MIN up to 2^16.
      std::vector<float> ints;
      for (int n = -126; n <= 16; ++n) ints.push_back(static_cast<float>(n));
      const std::vector<float> y = apply(fn, ints);
      for (std::size_t i = 0; i < ints.size(); ++i) {
        EXPECT_EQ(y[i], std::ldexp(1.0f, static_cast<int>(ints[i]))) << ints[i];
      }
      EXPECT_EQ(apply(fn, {-0.0f})[0], 1.0f);
      // Below the cut and -inf: exactly +0, never NaN or a denormal.
      const std::vector<float> below = {std::nextafter(kMinPow2Arg, -kInf), -126.5f, -149.0f,
                                        -1e4f, -1e30f, -max, -kInf};
      for (float v : apply(fn, below)) EXPECT_EQ(std::bit_cast<std::uint32_t>(v), 0u) << v;
      // Every float of [-126, -125]: normal (the exponent field never reaches 0).
      std::vector<float> edge;
      for (float v = kMinPow2Arg; v <= -125.0f; v = std::nextafter(v, 0.0f)) edge.push_back(v);
      for (float v : apply(fn, edge)) EXPECT_GE(v, std::numeric_limits<float>::min()) << v;
    }
  });
}

TEST(FastExp, ExactValuesAndNoNaNEveryTarget) {
  const float tiny = std::numeric_limits<float>::denorm_min();
  const float min_normal = std::numeric_limits<float>::min();
  const float max = std::numeric_limits<float>::max();
  for_each_target(fast_exp_cpu_target_name, [&](std::int64_t) {
    const std::vector<float> y = apply(exp_nonpositive_cpu, {0.0f, -0.0f, -kInf});
    EXPECT_EQ(y[0], 1.0f);
    EXPECT_EQ(y[1], 1.0f);
    EXPECT_EQ(std::bit_cast<std::uint32_t>(y[2]), 0u) << "exp(-inf) must be +0, is " << y[2];
    // Below the cut: exactly +0, never NaN or a denormal.
    const std::vector<float> below = {
        std::nextafter(kMinArg, -kInf), -87.5f, -88.0f, -103.0f, -104.5f, -1e4f, -1e30f, -max};
    for (float v : apply(exp_nonpositive_cpu, below)) {
      EXPECT_EQ(std::bit_cast<std::uint32_t>(v), 0u) << v;
    }
    // Tiny arguments: 1 (or the float just below), never NaN.
    for (float v : apply(exp_nonpositive_cpu, {-tiny, -min_normal, -1e-30f, -1e-8f})) {
      EXPECT_TRUE(v == 1.0f || v == std::nextafter(1.0f, 0.0f)) << v;
    }
    // Every float between the cut and the sweep's end: normal results within the bound.
    std::vector<float> edge;
    for (float v = kMinArg; v <= kSweepLow; v = std::nextafter(v, 0.0f)) edge.push_back(v);
    const std::vector<float> y_edge = apply(exp_nonpositive_cpu, edge);
    for (std::size_t i = 0; i < edge.size(); ++i) {
      const double ref = std::exp(static_cast<double>(edge[i]));
      EXPECT_GE(y_edge[i], min_normal) << edge[i];
      EXPECT_LE(std::fabs(y_edge[i] - ref) / ref, kMaxRelError) << edge[i];
    }
  });
}

TEST(FastExp, MonotoneEveryTarget) {
  // 2^21 evenly spaced points of [kMinArg, 0] (neighbours 4.2e-5 apart), and every float in
  // windows of 2^20 adjacent floats where a plain Horner form inverts (near -0.03 and -0.06:
  // the rounding of q * r in p = 1 + r * q jitters by about the step of exp) and across
  // reduction boundaries (x = -(k + 1/2) ln2, where n changes).
  constexpr std::int64_t kPoints = 1 << 21, kWindow = 1 << 20;
  std::vector<std::vector<float>> samples(1, std::vector<float>(kPoints));
  for (std::int64_t i = 0; i < kPoints; ++i) {
    samples[0][i] = static_cast<float>(static_cast<double>(kMinArg) * i / (kPoints - 1));
  }
  const double ln2 = std::log(2.0);
  for (double start : {-0.03, -0.06, -0.5 * ln2, -1.5 * ln2, -30.5 * ln2, -125.5 * ln2}) {
    std::vector<float>& window = samples.emplace_back(kWindow);
    const std::uint32_t first =
        std::bit_cast<std::uint32_t>(static_cast<float>(start)) - kWindow / 2;
    for (std::int64_t i = 0; i < kWindow; ++i) {
      window[i] = std::bit_cast<float>(static_cast<std::uint32_t>(first + i));  // x falls with i
    }
  }
  for_each_target(fast_exp_cpu_target_name, [&](std::int64_t) {
    for (const std::vector<float>& x : samples) {
      const std::vector<float> y = apply(exp_nonpositive_cpu, x);
      std::int64_t inversions = 0;
      for (std::size_t i = 1; i < x.size(); ++i) inversions += y[i] > y[i - 1];
      EXPECT_EQ(inversions, 0) << "sample starting at x = " << x[0];
    }
  });
}

TEST(FastExp, TailsAndMisalignedArraysMatchTheVectorPath) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-90.0f, 0.0f);
  std::vector<float> x(64 + 3);
  for (float& v : x) v = dist(rng);
  x[5] = -kInf;
  x[40] = 0.0f;
  for_each_target(fast_exp_cpu_target_name, [&](std::int64_t) {
    std::vector<float> whole(x.size());
    exp_nonpositive_cpu(x.data(), whole.data(), static_cast<std::int64_t>(x.size()));
    for (std::int64_t offset = 0; offset < 3; ++offset) {
      for (std::int64_t n = 0; n + offset <= static_cast<std::int64_t>(x.size()); n += 5) {
        std::vector<float> y(x.size(), -1.0f);
        exp_nonpositive_cpu(x.data() + offset, y.data() + offset, n);
        for (std::int64_t i = 0; i < static_cast<std::int64_t>(x.size()); ++i) {
          const bool inside = i >= offset && i < offset + n;
          // Inside: the same bits as the whole-array call (elementwise); outside: untouched.
          EXPECT_EQ(std::bit_cast<std::uint32_t>(y[i]),
                    std::bit_cast<std::uint32_t>(inside ? whole[i] : -1.0f))
              << "offset " << offset << " n " << n << " i " << i;
        }
      }
    }
  });
}

// Prints ns per element of both exps on 4096 floats of [-20, 0] (plus some -inf, as masked
// pairs give), repeated, on each vector target; asserts nothing about time. Best of 5 trials,
// alternating the two.
TEST(FastExpSpeed, NsPerElementVsHwyExp) {
  constexpr std::int64_t kN = 4096, kReps = 4000, kTrials = 5;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-20.0f, 0.0f);
  std::vector<float> x(kN), y(kN);
  for (std::int64_t i = 0; i < kN; ++i) x[i] = i % 61 == 0 ? -kInf : dist(rng);
  const auto time_ns = [&](ExpFn fn) {
    const auto start = std::chrono::steady_clock::now();
    for (std::int64_t r = 0; r < kReps; ++r) fn(x.data(), y.data(), kN);
    const auto stop = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::nano>(stop - start).count() / (kN * kReps);
  };
  for_each_target(fast_exp_cpu_target_name, [&](std::int64_t target) {
    if (target == HWY_SCALAR) return;  // the vector targets are what the kernels run
    double fast = 1e30, hwy_exp = 1e30;
    for (std::int64_t t = 0; t < kTrials; ++t) {
      fast = std::min(fast, time_ns(exp_nonpositive_cpu));
      hwy_exp = std::min(hwy_exp, time_ns(exp_hwy_cpu));
    }
    std::printf(
        "[ fastexp ] %s: ExpNonPositive %.4f ns/elem, hwy::Exp %.4f ns/elem, "
        "hwy/fast = %.2f\n",
        hwy::TargetName(target), fast, hwy_exp, hwy_exp / fast);
  });
}

}  // namespace
}  // namespace qkv::testing
