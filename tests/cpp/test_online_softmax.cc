// The online softmax step (kernels/cpu/online_softmax-inl.h) on every compiled target, against
// float64: tile after tile, each probability against exp(s - max) for the running max the step
// keeps (in base 2), alpha exactly 1 where the max stays, and the final row_sum * 2^row_max
// against the sum of exp(s) over every tile; with the scale deferred to the softmax (the AMX
// path's Products::SoftmaxScale) as with pre-scaled scores: bit for bit when the scale is a power
// of two, within rounding otherwise; the coarse 2^x and lazy max of the bf16-rounding paths.
// The deferred scale is otherwise reached only on an AMX CPU: this test runs it everywhere.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "test_online_softmax.cc"  // (tests/cpp is on the include path)
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <vector>

#include "core/splitmix64.h"
#include "every_target.h"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/cpu/online_softmax-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv {
namespace HWY_NAMESPACE {
namespace {

using namespace tiles;

// One OnlineSoftmaxTile step on kBlockQ lanes: st [num_k][kBlockQ] in place; state = row_max,
// row_sum, alpha ([3][kBlockQ]).
void Step(float* st, std::int64_t num_k, float* state, float score_scale, bool coarse) {
  QueryBlock qb;
  qb.row_max = state;
  qb.row_sum = state + kBlockQ;
  qb.alpha = state + 2 * kBlockQ;
  if (coarse) {
    OnlineSoftmaxTile<true>(qb, num_k, st, kQueryVecs, nullptr, score_scale);
  } else {
    OnlineSoftmaxTile<false>(qb, num_k, st, kQueryVecs, nullptr, score_scale);
  }
}

std::int64_t BlockQ() { return kBlockQ; }
std::int64_t VecLanes() { return kLanes; }
const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace qkv
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv {
namespace {

HWY_EXPORT(Step);
HWY_EXPORT(BlockQ);
HWY_EXPORT(VecLanes);
HWY_EXPORT(TargetName);

void step(float* st, std::int64_t num_k, float* state, float score_scale, bool coarse) {
  HWY_DYNAMIC_DISPATCH(Step)(st, num_k, state, score_scale, coarse);
}
std::int64_t block_q() { return HWY_DYNAMIC_DISPATCH(BlockQ)(); }
std::int64_t vec_lanes() { return HWY_DYNAMIC_DISPATCH(VecLanes)(); }
const char* target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace
}  // namespace qkv

namespace qkv::testing {
namespace {

// What a target's step works on: kBlockQ lanes in vectors of kLanes; whether MulAdd is fused
// (SCALAR rounds the product s * c apart: |s * c| * 2^-24 more in the argument).
struct Geometry {
  std::int64_t lanes, vec_lanes;
  bool fused;
};

// body(geometry) once per compiled target this CPU supports (every_target.h).
template <class Body>
void for_each_geometry(Body body) {
  for_each_target(target_name, [&](std::int64_t target) {
    body(Geometry{block_q(), vec_lanes(), target != HWY_SCALAR});
  });
}

// Vectors aligned as the kernels' scratch is (the step's loads and stores are aligned).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const Aligned64&) const { return true; }
};
using AlignedFloats = std::vector<float, Aligned64<float>>;

struct State {
  AlignedFloats v;
  explicit State(std::int64_t lanes) : v(3 * lanes) {
    for (std::int64_t l = 0; l < lanes; ++l) {
      v[l] = -std::numeric_limits<float>::infinity();  // row_max
      v[lanes + l] = 0.0f;                              // row_sum
    }
  }
};

// Tiles of scores (natural units, already scaled) for `lanes` queries: per tile num_k keys.
// Tile 0 sets the max; tile 1 lies below it (alpha must be exactly 1); tile 2 raises it by up
// to 3 (within the lazy slack of 12 in base 2); tile 3 raises it by ~20 (past the slack); some
// -inf pairs (masked) in every tile and one lane (5) fully masked until tile 2.
std::vector<std::vector<float>> make_tiles(std::int64_t lanes, std::int64_t num_k,
                                           double spread) {
  SplitMix64 rng(11);
  const double raise[] = {0.0, 0.0, 3.0, 20.0};
  std::vector<std::vector<float>> tiles(4, std::vector<float>(num_k * lanes));
  for (int t = 0; t < 4; ++t) {
    for (std::int64_t j = 0; j < num_k; ++j) {
      for (std::int64_t l = 0; l < lanes; ++l) {
        const double u = rng.uniform24();
        // Tile 1 lies below every score of tile 0, so below its max.
        const double s = t == 1 ? -0.5 * spread - 1.0 - u * 0.5 * spread
                                : (u - 0.5) * spread + raise[t];
        const bool masked = (j * 7 + l * 3 + t) % 11 == 0 || (l == 5 && t < 2);
        tiles[t][j * lanes + l] = masked ? -std::numeric_limits<float>::infinity()
                                         : static_cast<float>(s);
      }
    }
  }
  return tiles;
}

void check(float score_scale, bool coarse, double spread) {
  for_each_geometry([&](const Geometry& g) {
    const std::int64_t lanes = g.lanes;
    constexpr std::int64_t kKeys = 37;
    const auto tiles = make_tiles(lanes, kKeys, spread);
    State pre(lanes), deferred(lanes);
    std::vector<double> true_sum(lanes, 0.0);
    std::vector<double> true_max(lanes, -std::numeric_limits<double>::infinity());
    const double p_tol = coarse ? 3.2e-6 : 2.5e-7;
    for (std::size_t t = 0; t < tiles.size(); ++t) {
      // Pre-scaled: the scores as they are, score_scale 1. Deferred: the scores divided by the
      // scale (what the AMX tiles leave), the scale applied by the softmax.
      AlignedFloats a(tiles[t].begin(), tiles[t].end()), b = a;
      for (float& x : b) x = static_cast<float>(x / score_scale);
      const std::vector<float> old_max(pre.v.begin(), pre.v.begin() + lanes);
      step(a.data(), kKeys, pre.v.data(), 1.0f, coarse);
      step(b.data(), kKeys, deferred.v.data(), score_scale, coarse);
      const bool exact = std::exp2(std::round(std::log2(score_scale))) == score_scale;
      for (std::int64_t l = 0; l < lanes; ++l) {
        const float m2 = pre.v[l];  // the running max in base 2
        for (std::int64_t j = 0; j < kKeys; ++j) {
          const float s = tiles[t][j * lanes + l];
          true_sum[l] += std::exp(static_cast<double>(s));
          if (s > true_max[l]) true_max[l] = s;
          const double got = a[j * lanes + l];
          if (exact) {
            ASSERT_EQ(std::bit_cast<std::uint32_t>(a[j * lanes + l]),
                      std::bit_cast<std::uint32_t>(b[j * lanes + l]))
                << "deferred scale differs: tile " << t << " lane " << l << " key " << j;
          }
          if (std::isinf(s)) {  // a masked pair: exactly +0 on both
            ASSERT_EQ(std::bit_cast<std::uint32_t>(a[j * lanes + l]), 0u) << t << " " << l;
            ASSERT_EQ(std::bit_cast<std::uint32_t>(b[j * lanes + l]), 0u) << t << " " << l;
            continue;
          }
          // p = 2^(s * c - m2) with c = log2e rounded to float (c's own error, 1.3e-8
          // relative, scales every score alike: a temperature of 1 + 1.3e-8), and the
          // argument rounded once: |x| * 2^-24 more.
          const double c = static_cast<float>(1.4426950408889634);
          const double x = static_cast<double>(s) * c - m2;
          const double want = std::exp2(x);
          const double arg_err = (std::fabs(x) + (g.fused ? 0.0 : std::fabs(s * c))) * 1.2e-7;
          ASSERT_LE(std::fabs(got - want), want * (p_tol + arg_err) + 1e-30)
              << "tile " << t << " lane " << l << " key " << j << " s " << s;
          // Deferred, any scale: s / scale, c = scale * log2e and the max are rounded apart.
          ASSERT_NEAR(b[j * lanes + l], got,
                      want * (2 * p_tol + 2 * arg_err + std::fabs(m2) * 3e-7) + 1e-30)
              << "deferred: tile " << t << " lane " << l << " key " << j;
        }
        // The max stays: alpha is exactly 1 (tile 1 lies below tile 0's max).
        if (t == 1 && std::isfinite(old_max[l])) {
          EXPECT_EQ(pre.v[2 * lanes + l], 1.0f) << l;
        }
        // Lazy max (coarse): tile 2's rise stays within the slack, so the max stays where
        // every lane of the vector had one (lane 5's vector had none: it moves).
        bool vector_started = true;
        for (std::int64_t i = l / g.vec_lanes * g.vec_lanes; i < (l / g.vec_lanes + 1) * g.vec_lanes;
             ++i) {
          vector_started = vector_started && std::isfinite(old_max[i]);
        }
        if (coarse && t == 2 && vector_started && spread < 12.0) {
          EXPECT_EQ(pre.v[l], old_max[l]) << "lazy max moved, lane " << l;
        }
        // The max is at least the true max in base 2 (up to its rounding), or lazily below it.
        if (!std::isfinite(true_max[l])) {
          EXPECT_EQ(pre.v[l], -std::numeric_limits<float>::infinity()) << l;
        } else if (!coarse) {
          EXPECT_NEAR(pre.v[l], true_max[l] * 1.4426950408889634,
                      1e-6 * std::fabs(pre.v[l]) + 1e-6);
        }
      }
    }
    // row_sum * 2^m2 = sum of exp(s) over everything seen.
    for (std::int64_t l = 0; l < lanes; ++l) {
      const double got = pre.v[lanes + l] * std::exp2(static_cast<double>(pre.v[l]));
      EXPECT_NEAR(got, true_sum[l], true_sum[l] * (coarse ? 4e-6 : 1e-6) +
                                        true_sum[l] * 1.2e-7 * std::fabs(pre.v[l]))
          << "lane " << l;
      const double got_b = deferred.v[lanes + l] * std::exp2(static_cast<double>(deferred.v[l]));
      EXPECT_NEAR(got_b, true_sum[l], true_sum[l] * (coarse ? 4e-6 : 1e-6) +
                                          true_sum[l] * 1.2e-7 * std::fabs(deferred.v[l]))
          << "deferred, lane " << l;
    }
  });
}

TEST(OnlineSoftmax, MatchesFloat64EveryTarget) { check(1.0f, false, 8.0); }
TEST(OnlineSoftmax, DeferredPowerOfTwoScaleIsBitIdentical) { check(0.125f, false, 8.0); }
TEST(OnlineSoftmax, DeferredScaleWithinRounding) { check(1.0f / std::sqrt(96.0f), false, 8.0); }
TEST(OnlineSoftmax, CoarseLazyMaxMatchesFloat64) { check(1.0f, true, 8.0); }
TEST(OnlineSoftmax, CoarseDeferredScale) {
  check(0.125f, true, 8.0);
  check(1.0f / std::sqrt(96.0f), true, 8.0);
}
TEST(OnlineSoftmax, LargeLogits) {
  check(1.0f, false, 200.0);
  check(1.0f, true, 200.0);
}

}  // namespace
}  // namespace qkv::testing
#endif  // HWY_ONCE
