// The AVX512-BF16 micro-kernel (src/kernels/cpu/bf16_dot.h): outer_product against a float64
// reference over rows x depth x alpha x accumulate x out_scale x K-like / V-like strides x
// skipping (row_end, depth_end; rows past `rows` and skipped rows untouched), pack_probs bit for
// bit against f32_to_bf16_bits (odd and even key counts, ties, overflow), the set_enabled switch
// and the peak probe's arithmetic. Every test skips on CPUs without AVX512-BF16.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "bf16_skip.h"
#include "core/float16.h"
#include "core/splitmix64.h"
#include "hwy/aligned_allocator.h"
#include "kernels/cpu/bf16_dot.h"

namespace qkv::testing {
namespace {

using bf16dot::kLanes;


float random_bf16_value(SplitMix64& rng) {  // in [-2, 2), rounded to bf16
  return round_to_bf16(rng.uniform24() * 4.0f - 2.0f);
}

std::uint32_t pair_word(float lo, float hi) {
  return static_cast<std::uint32_t>(f32_to_bf16_bits(lo)) |
         static_cast<std::uint32_t>(f32_to_bf16_bits(hi)) << 16;
}

// dot2 of two pair words in float64: bf16 widens to f32 exactly, and the products are exact.
double dot2(std::uint32_t x, std::uint32_t y) {
  auto lo = [](std::uint32_t w) { return static_cast<double>(bf16_bits_to_f32(w & 0xffffu)); };
  auto hi = [](std::uint32_t w) { return static_cast<double>(bf16_bits_to_f32(w >> 16)); };
  return lo(x) * lo(y) + hi(x) * hi(y);
}

enum class Skip { kNone, kRows, kDepth };

struct OuterCase {
  std::int64_t rows, depth;
  bool alpha, accumulate, v_like;
  float out_scale;
  Skip skip;
  std::string name() const {
    return "rows" + std::to_string(rows) + "_depth" + std::to_string(depth) +
           (alpha ? "_alpha" : "") + (accumulate ? "_acc" : "") + (v_like ? "_Vlike" : "_Klike") +
           "_scale" + std::to_string(out_scale) +
           (skip == Skip::kRows    ? "_rowend"
            : skip == Skip::kDepth ? "_depthend"
                                   : "");
  }
};

// Runs one case; returns the number of mismatching elements (reported with the first few).
int run_outer_case(const OuterCase& oc, std::uint64_t seed) {
  SplitMix64 rng(seed);
  const std::int64_t rows = oc.rows, depth = oc.depth;
  // K-like: b is [rows][depth] (a key row per micro-kernel row); V-like: b is [depth][rows + 3]
  // (a value row per pair of keys, with padding past the last row used).
  const std::int64_t b_row_stride = oc.v_like ? 1 : depth;
  const std::int64_t b_depth_stride = oc.v_like ? rows + 3 : 1;
  const std::int64_t b_words = oc.v_like ? depth * (rows + 3) : rows * depth;

  auto a = hwy::AllocateAligned<std::uint32_t>(depth * kLanes);
  for (std::int64_t i = 0; i < depth * kLanes; ++i) {
    a[i] = pair_word(random_bf16_value(rng), random_bf16_value(rng));
  }
  // b one word past a 64-byte boundary: the kernel must accept any 4-byte alignment.
  std::vector<std::uint32_t> b_storage(b_words + 1);
  std::uint32_t* b = b_storage.data() + 1;
  for (std::int64_t i = 0; i < b_words; ++i) {
    b[i] = pair_word(random_bf16_value(rng), random_bf16_value(rng));
  }
  auto alpha = hwy::AllocateAligned<float>(kLanes);
  for (std::int64_t l = 0; l < kLanes; ++l) alpha[l] = rng.uniform24();
  // Two guard rows past `rows` must come back untouched.
  constexpr float kGuard = -12345.0f;
  const std::int64_t c_rows = rows + 2;
  auto c = hwy::AllocateAligned<float>(c_rows * kLanes);
  std::vector<float> c_before(c_rows * kLanes);
  for (std::int64_t i = 0; i < c_rows * kLanes; ++i) {
    c[i] = i < rows * kLanes ? rng.uniform24() * 8.0f - 4.0f : kGuard;
    c_before[i] = c[i];
  }

  // Skipping: vector x (lanes [16x, 16x + 16)) computes rows [0, rows * (x + 1) / 4) or sums
  // depth [0, depth * (x + 1) / 4): non-decreasing, the last is all, and some are 0 or equal.
  std::int64_t row_end[4], depth_end[4];
  for (int x = 0; x < 4; ++x) {
    row_end[x] = rows * (x + 1) / 4;
    depth_end[x] = depth * (x + 1) / 4;
  }
  bf16dot::outer_product(a.get(), b, rows, b_row_stride, b_depth_stride, depth, c.get(),
                         oc.alpha ? alpha.get() : nullptr, oc.accumulate, oc.out_scale,
                         oc.skip == Skip::kRows ? row_end : nullptr,
                         oc.skip == Skip::kDepth ? depth_end : nullptr);

  int bad = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const double old = c_before[r * kLanes + l];
      const std::int64_t x = l / 16;
      // A row past row_end[x] may be skipped (left as it was) or computed.
      const bool may_skip = oc.skip == Skip::kRows && r >= row_end[x];
      if (may_skip && c[r * kLanes + l] == c_before[r * kLanes + l]) continue;
      const double init =
          oc.alpha ? static_cast<double>(alpha[l]) * old : (oc.accumulate ? old : 0.0);
      double sum = 0.0, magnitude = 0.0;
      const std::int64_t terms = oc.skip == Skip::kDepth ? depth_end[x] : depth;
      for (std::int64_t t = 0; t < terms; ++t) {
        const double term = dot2(a[t * kLanes + l], b[r * b_row_stride + t * b_depth_stride]);
        sum += term;
        magnitude += std::abs(term);
      }
      const double expected = init + oc.out_scale * sum;
      // f32 accumulation: a relative 1e-5 of everything summed.
      const double tolerance = 1e-5 * (std::abs(init) + oc.out_scale * magnitude) + 1e-30;
      const double got = c[r * kLanes + l];
      if (!(std::abs(got - expected) <= tolerance) && ++bad <= 3) {
        ADD_FAILURE() << oc.name() << " c[" << r << "][" << l << "] = " << got << ", expected "
                      << expected << " (tolerance " << tolerance << ")";
      }
    }
  }
  for (std::int64_t i = rows * kLanes; i < c_rows * kLanes; ++i) {
    if (c[i] != kGuard && ++bad <= 3) {
      ADD_FAILURE() << oc.name() << ": guard row element " << i - rows * kLanes << " written";
    }
  }
  return bad;
}

TEST(Bf16Dot, OuterProductMatchesFloat64Reference) {
  QKV_SKIP_WITHOUT_BF16();
  int cases = 0, failed_cases = 0;
  std::uint64_t seed = 1;
  for (std::int64_t rows : {1, 3, 4, 5, 8, 13}) {
    for (std::int64_t depth : {1, 2, 7, 32, 64, 65}) {
      for (bool alpha : {false, true}) {
        for (bool accumulate : {false, true}) {
          for (bool v_like : {false, true}) {
            for (float out_scale : {1.0f, 0.125f}) {
              for (Skip skip : {Skip::kNone, Skip::kRows, Skip::kDepth}) {
                const OuterCase oc{rows, depth, alpha, accumulate, v_like, out_scale, skip};
                ++cases;
                if (run_outer_case(oc, seed++) > 0) ++failed_cases;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 1728);
  EXPECT_EQ(failed_cases, 0) << "of " << cases << " cases";
}

// Cancellation: sums that come out near zero are still within the f32-accumulation bound, and
// exact when every partial sum is representable.
TEST(Bf16Dot, OuterProductExactOnRepresentableSums) {
  QKV_SKIP_WITHOUT_BF16();
  constexpr std::int64_t rows = 6, depth = 9;
  auto a = hwy::AllocateAligned<std::uint32_t>(depth * kLanes);
  std::vector<std::uint32_t> b(rows * depth);
  auto c = hwy::AllocateAligned<float>(rows * kLanes);
  // Small integers: every product and partial sum is an exact f32.
  for (std::int64_t t = 0; t < depth; ++t) {
    for (std::int64_t l = 0; l < kLanes; ++l) {
      a[t * kLanes + l] = pair_word(static_cast<float>(l % 7 - 3), static_cast<float>(t - 4));
    }
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t t = 0; t < depth; ++t) {
      b[r * depth + t] = pair_word(static_cast<float>(r - 2), static_cast<float>(t % 3 + 1));
    }
  }
  bf16dot::outer_product(a.get(), b.data(), rows, depth, 1, depth, c.get(), nullptr, false, 0.5f);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t l = 0; l < kLanes; ++l) {
      double expected = 0.0;
      for (std::int64_t t = 0; t < depth; ++t)
        expected += dot2(a[t * kLanes + l], b[r * depth + t]);
      ASSERT_EQ(c[r * kLanes + l], static_cast<float>(0.5 * expected)) << "r " << r << " l " << l;
    }
  }
}

// Probabilities: random values in [0, 1], exact ties both ways, values that round up across a
// binade, zero, the smallest normal and the largest finite float (which rounds to infinity).
TEST(Bf16Dot, PackProbsMatchesF32ToBf16Bits) {
  QKV_SKIP_WITHOUT_BF16();
  SplitMix64 rng(7);
  const float specials[] = {
      0.0f,
      1.0f,
      std::bit_cast<float>(0x3f808000u),  // tie, kept part even: rounds down
      std::bit_cast<float>(0x3f818000u),  // tie, kept part odd: rounds up
      std::bit_cast<float>(0x3f808001u),  // just above a tie: up
      std::bit_cast<float>(0x3f807fffu),  // just below a tie: down
      std::bit_cast<float>(0x3fffffffu),  // rounds up into the next binade (2.0)
      std::numeric_limits<float>::min(),  // smallest normal
      std::numeric_limits<float>::max(),  // rounds to +inf
      0.5f,
      1e-30f,
  };
  for (std::int64_t num_k : {1, 2, 3, 8, 31, 64, 65, 128, 129}) {
    SCOPED_TRACE("num_k " + std::to_string(num_k));
    const std::int64_t pairs = (num_k + 1) / 2;
    // One row past num_k holds NaN: reading it for the odd tail would show up in the output.
    auto st = hwy::AllocateAligned<float>((num_k + 1) * kLanes);
    for (std::int64_t i = 0; i < num_k * kLanes; ++i) {
      st[i] = rng.next() % 4 == 0 ? specials[rng.next() % std::size(specials)] : rng.uniform24();
    }
    for (std::int64_t l = 0; l < kLanes; ++l) {
      st[num_k * kLanes + l] = std::numeric_limits<float>::quiet_NaN();
    }
    // One guard row past the last pair must stay untouched.
    auto pt = hwy::AllocateAligned<std::uint32_t>((pairs + 1) * kLanes);
    for (std::int64_t i = 0; i < (pairs + 1) * kLanes; ++i) pt[i] = 0xdeadbeefu;

    bf16dot::pack_probs(st.get(), num_k, 4, pt.get());

    for (std::int64_t t = 0; t < pairs; ++t) {
      for (std::int64_t l = 0; l < kLanes; ++l) {
        const std::uint32_t lo = f32_to_bf16_bits(st[2 * t * kLanes + l]);
        const std::uint32_t hi =
            2 * t + 1 < num_k ? f32_to_bf16_bits(st[(2 * t + 1) * kLanes + l]) : 0u;  // +0.0
        ASSERT_EQ(pt[t * kLanes + l], lo | hi << 16) << "t " << t << " l " << l;
      }
    }
    for (std::int64_t l = 0; l < kLanes; ++l) ASSERT_EQ(pt[pairs * kLanes + l], 0xdeadbeefu);
  }
}

// The one documented difference from f32_to_bf16_bits: vcvtne2ps2bf16 treats f32 subnormals as
// zero (vdpbf16ps would read them as zero anyway).
TEST(Bf16Dot, PackProbsTurnsSubnormalsToZero) {
  QKV_SKIP_WITHOUT_BF16();
  auto st = hwy::AllocateAligned<float>(2 * kLanes);
  for (std::int64_t i = 0; i < 2 * kLanes; ++i) {
    st[i] = std::numeric_limits<float>::denorm_min() * static_cast<float>(i + 1);
  }
  auto pt = hwy::AllocateAligned<std::uint32_t>(kLanes);
  bf16dot::pack_probs(st.get(), 2, 4, pt.get());
  for (std::int64_t l = 0; l < kLanes; ++l) EXPECT_EQ(pt[l], 0u) << "l " << l;
}

TEST(Bf16Dot, SetEnabledSwitchesAvailable) {
  QKV_SKIP_WITHOUT_BF16();
  bf16dot::set_enabled(false);
  const bool while_disabled = bf16dot::available();
  bf16dot::set_enabled(true);
  EXPECT_FALSE(while_disabled);
  EXPECT_TRUE(bf16dot::available());
}

// preferred(): the vendor rule (AMD), or forced; never without available().
TEST(Bf16Dot, PreferredFollowsTheVendorUnlessForced) {
  QKV_SKIP_WITHOUT_BF16();
  __builtin_cpu_init();
  EXPECT_EQ(bf16dot::preferred(), static_cast<bool>(__builtin_cpu_is("amd")));
  bf16dot::set_forced(true);
  const bool forced = bf16dot::preferred();
  bf16dot::set_enabled(false);
  const bool forced_but_disabled = bf16dot::preferred();
  bf16dot::set_enabled(true);
  bf16dot::set_forced(false);
  EXPECT_TRUE(forced);
  EXPECT_FALSE(forced_but_disabled);
}

// Each step adds 2^-11 * 2^-11 twice = 2^-21 to every lane of chains starting at 1 + 0.01 i,
// exact in f32 (even one product at a time) while the values stay in [1, 2): the sum is known in
// closed form.
TEST(Bf16Dot, PeakProbeComputesItsChains) {
  QKV_SKIP_WITHOUT_BF16();
  constexpr std::int64_t steps = 100000;
  const double sum = bf16dot::peak_probe(steps);
  ASSERT_TRUE(std::isfinite(sum));
  double expected = 0.0;
  for (int i = 0; i < 12; ++i) {
    expected +=
        16.0 * (static_cast<double>(1.0f + 0.01f * static_cast<float>(i)) + steps * 0x1.0p-21);
  }
  EXPECT_NEAR(sum, expected, 1e-6 * expected);
}

}  // namespace
}  // namespace qkv::testing
