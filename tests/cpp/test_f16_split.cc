// The f16 split of the AMX path (SplitF16, SplitF16Lanes in kernels/cpu/tile_staging-inl.h) on
// every compiled target, over all 65536 f16 bit patterns: hi is f16 rounded to bf16 (nearest
// even, as f32_to_bf16_bits), hi + lo is the f16 value exactly for every finite one, lo is 0 for
// inf and NaN (hi carries them), and the vector split gives the scalar one's bits.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "test_f16_split.cc"  // (tests/cpp is on the include path)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/float16.h"
#include "every_target.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/tile_staging-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace {

// hi, lo of each of n f16 (n a multiple of the target's lanes), by the scalar and vector splits.
void Split(const std::uint16_t* f16, std::int64_t n, std::uint16_t* hi, std::uint16_t* lo,
           std::uint16_t* hi_lanes, std::uint16_t* lo_lanes) {
  for (std::int64_t i = 0; i < n; ++i) {
    const tiles::SplitBf16 x = tiles::SplitF16(f16[i]);
    hi[i] = x.hi;
    lo[i] = x.lo;
  }
  const auto* src = reinterpret_cast<const hwy::float16_t*>(f16);
  for (std::int64_t i = 0; i < n; i += tiles::kLanes) {
    tiles::SplitF16Lanes(src + i, hi_lanes + i, lo_lanes + i);
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv {
namespace {

HWY_EXPORT(Split);
HWY_EXPORT(TargetName);

const char* target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

TEST(F16Split, EveryF16ExactlyHiPlusLoEveryTarget) {
  constexpr std::int64_t n = 1 << 16;
  std::vector<std::uint16_t> f16(n), hi(n), lo(n), hi_lanes(n), lo_lanes(n);
  for (std::int64_t i = 0; i < n; ++i) f16[i] = static_cast<std::uint16_t>(i);
  testing::for_each_target(target_name, [&](std::int64_t) {
    HWY_DYNAMIC_DISPATCH(Split)(f16.data(), n, hi.data(), lo.data(), hi_lanes.data(),
                                lo_lanes.data());
    std::int64_t finite = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const float x = f16_bits_to_f32(f16[i]);
      ASSERT_EQ(hi[i], hi_lanes[i]) << "f16 bits " << i;
      ASSERT_EQ(lo[i], lo_lanes[i]) << "f16 bits " << i;
      ASSERT_EQ(hi[i], f32_to_bf16_bits(x)) << "f16 bits " << i;
      if (!std::isfinite(x)) {
        ASSERT_EQ(lo[i], 0u) << "f16 bits " << i;
        continue;
      }
      ++finite;
      const float h = bf16_bits_to_f32(hi[i]), l = bf16_bits_to_f32(lo[i]);
      ASSERT_EQ(static_cast<double>(h) + static_cast<double>(l), static_cast<double>(x))
          << "f16 bits " << i;
      // lo is a normal bf16 or zero (the tiles read bf16 subnormals as zero).
      ASSERT_TRUE(l == 0.0f || std::fabs(l) >= 0x1p-126f) << "f16 bits " << i;
    }
    EXPECT_EQ(finite, n - 2 * 1024);  // all but the 2 x 1024 inf and NaN patterns
  });
}

}  // namespace
}  // namespace qkv
#endif  // HWY_ONCE
