// The AMX micro-kernels (src/kernels/cpu/amx.h) against float64 sums of the same bf16 values:
// scores over depths and key counts that do and do not fill a tile pair (16, 32 keys), values
// with and without a rescale (factors of exactly 1 skip it), key_end (each 16-lane vector's keys;
// the lanes past it must not count, whatever st holds there), padded value dims, pack_probs
// bit for bit against f32_to_bf16_bits, the fused softmax step against the two passes it
// replaces, and the peak probe. In qkv_tests every test skips on
// CPUs without AMX-BF16 (the flash kernel's whole case table on the AMX path is in
// test_attention_kernels.cc); qkv_amx_emulated_tests (tests/amx_emulated/) runs them, and that
// table, on a C++ model of the tile instructions wherever the CPU has AVX512-BF16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_case.h"
#include "bf16_skip.h"
#include "core/float16.h"
#include "core/splitmix64.h"
#include "hwy/aligned_allocator.h"
#include "kernel_cases.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/fast_exp.h"
#include "kernels/product_path.h"

namespace qkv::testing {
namespace {

using amx::kLanes;

template <typename T>
hwy::AlignedFreeUniquePtr<T[]> zeros(std::size_t n) {
  auto p = hwy::AllocateAligned<T>(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = T{};
  return p;
}

float bf16_of(std::uint16_t bits) { return bf16_bits_to_f32(bits); }

std::uint16_t random_bf16(SplitMix64& rng) {  // in [-2, 2)
  return f32_to_bf16_bits(rng.uniform24() * 4.0f - 2.0f);
}

TEST(Amx, ScoresMatchFloat64) {
  QKV_SKIP_WITHOUT_AMX();
  SplitMix64 rng(7);
  for (std::int64_t depth : {32, 64, 128}) {
    for (std::int64_t num_k : {1, 15, 16, 17, 31, 32, 33, 100, 128}) {
      const std::int64_t rows = amx::round_up(num_k, 16), k_stride = depth + 32;  // (gap)
      auto k = zeros<std::uint16_t>(rows * k_stride);
      auto qp = zeros<std::uint32_t>(depth / 2 * kLanes);
      auto st = zeros<float>(rows * kLanes);
      for (std::int64_t j = 0; j < num_k; ++j)
        for (std::int64_t d = 0; d < depth; ++d) k[j * k_stride + d] = random_bf16(rng);
      for (std::int64_t i = 0; i < depth / 2 * kLanes; ++i) {
        qp[i] = random_bf16(rng) | static_cast<std::uint32_t>(random_bf16(rng)) << 16;
      }
      const float scale = 0.125f;
      {
        const amx::TileScope scope;
        amx::scores(k.get(), k_stride, qp.get(), depth, num_k, scale, st.get());
      }
      for (std::int64_t j = 0; j < rows; ++j) {
        for (std::int64_t l = 0; l < kLanes; ++l) {
          double want = 0.0, magnitude = 0.0;
          for (std::int64_t d = 0; d < depth; ++d) {
            const std::uint32_t w = qp[d / 2 * kLanes + l];
            const double q = bf16_of(static_cast<std::uint16_t>(d % 2 == 0 ? w : w >> 16));
            want += q * bf16_of(k[j * k_stride + d]);
            magnitude += std::fabs(q * bf16_of(k[j * k_stride + d]));
          }
          const double err = std::fabs(st[j * kLanes + l] - scale * want);
          ASSERT_LE(err, scale * magnitude * 1e-6 + 1e-30) << "depth " << depth << " num_k "
                                                           << num_k << " key " << j << " lane " << l;
        }
      }
    }
  }
}

// pack_probs bit for bit, and the keys past key_end (and past num_k) packed as +0 whatever st
// holds there (-inf, NaN).
TEST(Amx, PackProbsRoundsAndZeroesPastTheEnds) {
  QKV_SKIP_WITHOUT_AMX();
  SplitMix64 rng(11);
  const std::int64_t num_k = 45;
  const std::int64_t key_end[4] = {6, 17, 32, 45};
  auto st = zeros<float>(64 * kLanes);
  for (std::int64_t j = 0; j < 64; ++j) {
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const bool inside = j < key_end[l / 16];
      st[j * kLanes + l] = inside ? rng.uniform24()
                           : (j + l) % 2 == 0 ? -std::numeric_limits<float>::infinity()
                                              : std::numeric_limits<float>::quiet_NaN();
    }
  }
  auto pp = zeros<std::uint32_t>(40 * kLanes);
  for (std::int64_t i = 0; i < 40 * kLanes; ++i) pp[i] = 0xdeadbeefu;
  amx::pack_probs(st.get(), num_k, key_end, pp.get());
  for (std::int64_t t = 0; t < 32; ++t) {  // round_up(45, 32) / 2 rows written
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const auto half = [&](std::int64_t j) -> std::uint32_t {
        return j < key_end[l / 16] ? f32_to_bf16_bits(st[j * kLanes + l]) : 0u;
      };
      ASSERT_EQ(pp[t * kLanes + l], half(2 * t) | half(2 * t + 1) << 16) << t << " " << l;
    }
  }
  EXPECT_EQ(pp[32 * kLanes], 0xdeadbeefu);  // rows past round_up(num_k, 32) / 2 untouched
}

// The fused softmax step against the two passes it replaces, bit for bit: p =
// fastexp::Pow2CoarseHalf(fma(s, c, -(m2 - 1/2))) through pow2_coarse_half_cpu, rounded to bf16
// as pack_probs
// does, the row sums added in key order. Vector 0 keeps its running max; vector 1 has one lane
// whose scores rise past the slack, vector 2 one lane with no running max yet (both must be left
// to the caller, their state untouched); vector 3 keeps it with masked (-inf) scores inside.
TEST(Amx, SoftmaxPackLazyMatchesTheTwoPasses) {
  QKV_SKIP_WITHOUT_AMX();
  SplitMix64 rng(17);
  const std::int64_t num_k = 45;
  const std::int64_t key_end[4] = {6, 17, 32, 45};
  const float c = 0.125f * 1.44269504f, slack = 12.0f;
  const float inf = std::numeric_limits<float>::infinity();
  auto st = zeros<float>(64 * kLanes);
  auto row_max = zeros<float>(kLanes), row_sum = zeros<float>(kLanes), alpha = zeros<float>(kLanes);
  for (std::int64_t l = 0; l < kLanes; ++l) {
    row_max[l] = l == 37 ? -inf : 8.0f * rng.uniform24() - 4.0f;
    row_sum[l] = 1.0f + rng.uniform24();
    alpha[l] = 0.5f;
  }
  for (std::int64_t j = 0; j < 64; ++j) {
    for (std::int64_t l = 0; l < kLanes; ++l) {
      // Scores s with s * c within [m2 - 10, m2 + 2]: inside the slack.
      float s = (row_max[l] + 12.0f * rng.uniform24() - 10.0f) / c;
      if (l == 21 && j == 9) s = (row_max[l] + slack + 0.5f) / c;  // past the slack
      if (l >= 48 && (j + l) % 5 == 0) s = -inf;                    // masked
      st[j * kLanes + l] = j < key_end[l / 16] ? s : std::numeric_limits<float>::quiet_NaN();
    }
  }
  auto pp = zeros<std::uint32_t>(32 * kLanes);
  for (std::int64_t i = 0; i < 32 * kLanes; ++i) pp[i] = 0xdeadbeefu;
  const std::vector<float> max_before(row_max.get(), row_max.get() + kLanes);
  const std::vector<float> sum_before(row_sum.get(), row_sum.get() + kLanes);
  const unsigned redo = amx::softmax_pack_lazy(st.get(), num_k, key_end, c, slack, row_max.get(),
                                               row_sum.get(), alpha.get(), pp.get());
  EXPECT_EQ(redo, 0b0110u);
  for (std::int64_t l = 0; l < kLanes; ++l) {
    const int x = static_cast<int>(l / 16);
    EXPECT_EQ(row_max[l], max_before[l]) << l;
    if (redo >> x & 1u) {
      EXPECT_EQ(row_sum[l], sum_before[l]) << l;
      EXPECT_EQ(alpha[l], 0.5f) << l;
      continue;
    }
    EXPECT_EQ(alpha[l], 1.0f) << l;
    std::vector<float> arg(key_end[x]), p(key_end[x]);
    for (std::int64_t j = 0; j < key_end[x]; ++j) {
      arg[j] = std::fma(st[j * kLanes + l], c, -(row_max[l] - 0.5f));
    }
    pow2_coarse_half_cpu(arg.data(), p.data(), key_end[x]);
    float sum = 0.0f;
    for (float v : p) sum += v;
    EXPECT_EQ(row_sum[l], sum_before[l] + sum) << l;
    for (std::int64_t t = 0; t < 32; ++t) {  // round_up(45, 32) / 2 pair rows
      const auto half = [&](std::int64_t j) -> std::uint32_t {
        return j < key_end[x] ? f32_to_bf16_bits(p[j]) : 0u;
      };
      ASSERT_EQ(pp[t * kLanes + l], half(2 * t) | half(2 * t + 1) << 16) << t << " " << l;
    }
  }
}

// exp_pack, the second pass where the running max moves (a block's first tile), bit for bit
// against the two passes (p = fastexp::Pow2CoarseHalf(fma(s, c, -(shift - 1/2))) through
// pow2_coarse_half_cpu, summed in key order, rounded to bf16 as pack_probs does), on vector 1
// of 4 with a key end that is odd, masked (-inf) scores inside and NaN past it; a shift of 0
// (no running max yet) on some lanes. The other vectors' pair words stay as they were.
TEST(Amx, ExpPackMatchesTheTwoPasses) {
  QKV_SKIP_WITHOUT_AMX();
  SplitMix64 rng(23);
  const std::int64_t num_k = 45;
  const std::int64_t key_end[4] = {6, 17, 32, 45};
  const int x = 1;
  const float c = 0.125f * 1.44269504f;
  const float inf = std::numeric_limits<float>::infinity();
  auto st = zeros<float>(64 * kLanes);
  auto shift = zeros<float>(16), sum = zeros<float>(16);
  for (std::int64_t l = 0; l < 16; ++l) shift[l] = l % 5 == 0 ? 0.0f : 8.0f * rng.uniform24();
  for (std::int64_t j = 0; j < 64; ++j) {
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const float s = (j + l) % 7 == 0 ? -inf : (16.0f * rng.uniform24() - 8.0f) / c;
      st[j * kLanes + l] = j < key_end[l / 16] ? s : std::numeric_limits<float>::quiet_NaN();
    }
  }
  auto pp = zeros<std::uint32_t>(32 * kLanes);
  for (std::int64_t i = 0; i < 32 * kLanes; ++i) pp[i] = 0xdeadbeefu;
  amx::exp_pack(st.get(), num_k, key_end, x, c, shift.get(), sum.get(), pp.get());
  for (std::int64_t l = 0; l < kLanes; ++l) {
    if (l / 16 != x) {
      for (std::int64_t t = 0; t < 32; ++t) ASSERT_EQ(pp[t * kLanes + l], 0xdeadbeefu) << l;
      continue;
    }
    const std::int64_t end = key_end[x];
    std::vector<float> arg(end), p(end);
    for (std::int64_t j = 0; j < end; ++j) {
      arg[j] = std::fma(st[j * kLanes + l], c, -(shift[l % 16] - 0.5f));
    }
    pow2_coarse_half_cpu(arg.data(), p.data(), end);
    float total = 0.0f;
    for (float v : p) total += v;
    EXPECT_EQ(sum[l % 16], total) << l;
    for (std::int64_t t = 0; t < 32; ++t) {  // round_up(45, 32) / 2 pair rows
      const auto half = [&](std::int64_t j) -> std::uint32_t {
        return j < end ? f32_to_bf16_bits(p[j]) : 0u;
      };
      ASSERT_EQ(pp[t * kLanes + l], half(2 * t) | half(2 * t + 1) << 16) << t << " " << l;
    }
  }
}

TEST(Amx, ValuesMatchFloat64WithRescaleAndKeyEnds) {
  QKV_SKIP_WITHOUT_AMX();
  SplitMix64 rng(13);
  for (std::int64_t dv : {8, 16, 40, 64, 128}) {
    for (std::int64_t num_k : {1, 31, 32, 33, 128}) {
      for (bool with_ends : {false, true}) {
        const std::int64_t rows = amx::round_up(dv, 16), vt_stride = 128;
        const std::int64_t keys = amx::round_up(num_k, 32);
        std::int64_t key_end[4] = {num_k / 4, num_k / 3, num_k / 2, num_k};
        auto vt = zeros<std::uint16_t>(rows * vt_stride);
        for (std::int64_t e = 0; e < dv; ++e)
          for (std::int64_t j = 0; j < num_k; ++j) vt[e * vt_stride + j] = random_bf16(rng);
        auto st = zeros<float>(keys * kLanes);
        for (std::int64_t i = 0; i < num_k * kLanes; ++i) st[i] = rng.uniform24();
        auto pp = zeros<std::uint32_t>(keys / 2 * kLanes);
        amx::pack_probs(st.get(), num_k, with_ends ? key_end : nullptr, pp.get());
        auto ot = zeros<float>(rows * kLanes);
        auto alpha = zeros<float>(kLanes);
        for (std::int64_t l = 0; l < kLanes; ++l) alpha[l] = l < 32 ? 1.0f : 0.5f + l * 0.01f;
        for (std::int64_t i = 0; i < rows * kLanes; ++i) ot[i] = rng.uniform24() - 0.5f;
        std::vector<double> want(rows * kLanes);
        for (std::int64_t e = 0; e < rows; ++e) {
          for (std::int64_t l = 0; l < kLanes; ++l) {
            double sum = static_cast<double>(alpha[l]) * ot[e * kLanes + l];
            const std::int64_t end = with_ends ? key_end[l / 16] : num_k;
            for (std::int64_t j = 0; j < end; ++j) {
              sum += static_cast<double>(bf16_of(f32_to_bf16_bits(st[j * kLanes + l]))) *
                     bf16_of(vt[e * vt_stride + j]);
            }
            want[e * kLanes + l] = sum;
          }
        }
        {
          const amx::TileScope scope;
          amx::values(vt.get(), vt_stride, pp.get(), num_k, dv, alpha.get(),
                      with_ends ? key_end : nullptr, ot.get());
        }
        for (std::int64_t i = 0; i < rows * kLanes; ++i) {
          ASSERT_NEAR(ot[i], want[i], 1e-5 * (1.0 + num_k))
              << "dv " << dv << " num_k " << num_k << " ends " << with_ends << " at " << i;
        }
      }
    }
  }
}

// A block of at most 32 rows runs the products on half the lanes (lanes = 32) and the softmax on
// two query vectors (vecs = 0b0011): those lanes get the bits of a full run, and the other half
// of st, ot, pp, row_sum and alpha is neither written (its sentinels stay: NaN, 7, 0xdeadbeef)
// nor read (the NaNs of st, row_max, row_sum and alpha would spread).
TEST(Amx, HalfTheLanesLeaveTheOtherHalfAlone) {
  QKV_SKIP_WITHOUT_AMX();
  SplitMix64 rng(19);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::int64_t depth = 64, num_k = 45, dv = 40, rows = 48, dv_rows = 48, half = kLanes / 2;
  const std::int64_t key_end[4] = {20, 45, 45, 45};
  auto k = zeros<std::uint16_t>(rows * depth);
  auto qp = zeros<std::uint32_t>(depth / 2 * kLanes);
  auto vt = zeros<std::uint16_t>(dv_rows * 64);
  for (std::int64_t i = 0; i < num_k * depth; ++i) k[i] = random_bf16(rng);
  for (std::int64_t i = 0; i < depth / 2 * kLanes; ++i) {
    qp[i] = random_bf16(rng) | static_cast<std::uint32_t>(random_bf16(rng)) << 16;
  }
  for (std::int64_t e = 0; e < dv; ++e)
    for (std::int64_t j = 0; j < num_k; ++j) vt[e * 64 + j] = random_bf16(rng);
  std::vector<float> ot0(dv_rows * kLanes);
  for (float& x : ot0) x = rng.uniform24() - 0.5f;
  struct Run {
    hwy::AlignedFreeUniquePtr<float[]> st, ot, row_max, row_sum, alpha;
    hwy::AlignedFreeUniquePtr<std::uint32_t[]> pp;
    unsigned redo = 0;
  };
  const auto run = [&](std::int64_t lanes) {
    Run r{zeros<float>(rows * kLanes), zeros<float>(dv_rows * kLanes),
          zeros<float>(kLanes),        zeros<float>(kLanes),
          zeros<float>(kLanes),        zeros<std::uint32_t>(32 * kLanes)};
    for (std::int64_t i = 0; i < rows * kLanes; ++i) r.st[i] = i % kLanes < lanes ? 0.0f : nan;
    for (std::int64_t i = 0; i < dv_rows * kLanes; ++i) {
      r.ot[i] = i % kLanes < lanes ? ot0[i] : 7.0f;
    }
    for (std::int64_t i = 0; i < 32 * kLanes; ++i) r.pp[i] = 0xdeadbeefu;
    for (std::int64_t l = 0; l < kLanes; ++l) {
      r.row_max[l] = l < lanes ? 2.0f : nan;
      r.row_sum[l] = l < lanes ? 1.0f : nan;
      r.alpha[l] = l < lanes ? 0.5f : nan;
    }
    const unsigned vecs = lanes == kLanes ? 0xFu : 0x3u;
    const amx::TileScope scope;
    amx::scores(k.get(), depth, qp.get(), depth, num_k, 0.125f, r.st.get(), lanes);
    r.redo = amx::softmax_pack_lazy(r.st.get(), num_k, key_end, 0.18f, 40.0f, r.row_max.get(),
                                    r.row_sum.get(), r.alpha.get(), r.pp.get(), vecs);
    amx::values(vt.get(), 64, r.pp.get(), num_k, dv, r.alpha.get(), key_end, r.ot.get(), lanes);
    return r;
  };
  const Run full = run(kLanes), part = run(half);
  EXPECT_EQ(full.redo, 0u);
  EXPECT_EQ(part.redo, 0u);
  const auto same = [](float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; };
  for (std::int64_t j = 0; j < rows; ++j) {
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const float want = l < half ? full.st[j * kLanes + l] : nan;
      ASSERT_TRUE(same(part.st[j * kLanes + l], want)) << "st key " << j << " lane " << l;
    }
  }
  for (std::int64_t e = 0; e < dv_rows; ++e) {
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const float want = l < half ? full.ot[e * kLanes + l] : 7.0f;
      ASSERT_TRUE(same(part.ot[e * kLanes + l], want)) << "ot dim " << e << " lane " << l;
    }
  }
  for (std::int64_t t = 0; t < 32; ++t) {
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const std::uint32_t want = l < half ? full.pp[t * kLanes + l] : 0xdeadbeefu;
      ASSERT_EQ(part.pp[t * kLanes + l], want) << "pp pair " << t << " lane " << l;
    }
  }
  for (std::int64_t l = 0; l < kLanes; ++l) {
    ASSERT_TRUE(same(part.row_sum[l], l < half ? full.row_sum[l] : nan)) << l;
    ASSERT_TRUE(same(part.alpha[l], l < half ? full.alpha[l] : nan)) << l;
  }
}

// f16 on the tiles (f16-amx-split) splits each value into bf16 hi + lo and drops the lo x lo
// products. Every q row (a, -30) and k row (a, 30), a = 30 + 3/64 (bf16 hi 30, lo 3/64, the
// largest lo an f16 of that binade leaves): q.k = a^2 - 900 = 2.8 for every key, and each score
// loses lo^2 * scale = 1.55e-3 on the split path. The softmax does not see a shift shared by all
// keys, lse does: lse = 2.0 + ln 42 = 5.7, where DESIGN.md's floor allows 1.1e-4. The kernel
// check sizes lse's tolerance by the plain implementation of the path's own arithmetic
// (Problem::plain drops the same products), as fuzz_attention now does; on the widened path
// (amx::available() switched off) the error stays at f32's (here 1.9e-5: q.k cancels 900 - 897).
TEST(Amx, F16SplitDropsTheLoLoProductsAndLseSaysSo) {
  QKV_SKIP_WITHOUT_AMX();
  Case c{.seq_q = 20, .seq_kv = 42, .head_dim = 2, .head_dim_v = 5};  // wide blocks: decode
                                                                      // blocks widen
  c.dtype = DType::kF16;
  Problem problem(c);
  const float a = 30.0f + 3.0f / 64.0f, lo = a - round_to_bf16(a);
  ASSERT_EQ(lo, 3.0f / 64.0f);
  // Rows (a, second): the f32 values the reference reads and the f16 bits the kernels read.
  const auto fill = [&](std::vector<float>& values, std::vector<std::uint16_t>& bits,
                        float second) {
    for (std::size_t i = 0; i < values.size(); ++i) {
      values[i] = i % 2 == 0 ? a : second;
      bits[i] = f32_to_f16_bits(values[i]);
    }
  };
  fill(problem.q, problem.q16, -30.0f);
  fill(problem.k, problem.k16, 30.0f);
  const double dropped = static_cast<double>(lo) * lo / std::sqrt(2.0);
  const Result ref = problem.run(Kernel::kReference, false);
  for (bool tiles : {true, false}) {
    amx::set_enabled(tiles);
    ASSERT_EQ(problem.flash_path(), tiles ? ProductPath::kF16Amx : ProductPath::kF16Widened);
    check_against_reference(problem);
    const Result flash = problem.run(Kernel::kFlash, false);
    for (std::size_t i = 0; i < ref.lse.size(); ++i) {
      const double err = static_cast<double>(ref.lse[i]) - flash.lse[i];
      if (tiles) {
        EXPECT_NEAR(err, dropped, 0.1 * dropped) << "lse " << i;
      } else {
        EXPECT_NEAR(err, 0.0, 2e-5 * std::abs(ref.lse[i])) << "lse " << i;
      }
    }
  }
  amx::set_enabled(true);
}

TEST(Amx, SwitchAndPeakProbe) {
  QKV_SKIP_WITHOUT_AMX();
  amx::set_enabled(false);
  EXPECT_FALSE(amx::available());
  amx::set_enabled(true);
  EXPECT_TRUE(amx::available());
  // 2^-11 * 2^-11 * 32 products per step into each of 4 tiles of 256 outputs: 2^-17 per output.
  const std::int64_t steps = 1000;
  EXPECT_DOUBLE_EQ(amx::peak_probe(steps), 4.0 * 256 * steps * std::ldexp(1.0, -17));
}

// The overlap probe runs what each part names: the tiles part kOverlapTileProducts products
// per round (4 accumulators, 2^-17 per output and product, as above), the softmax part the
// fused exp and packing (a positive sum that doubles with the rounds), and both parts together
// the sum of the two.
TEST(Amx, OverlapProbeRunsEachPart) {
  QKV_SKIP_WITHOUT_AMX();
  const std::int64_t steps = 200;
  const double tiles = amx::overlap_probe(steps, amx::OverlapPart::kTiles);
  EXPECT_DOUBLE_EQ(tiles, 256.0 * amx::kOverlapTileProducts * steps * std::ldexp(1.0, -17));
  const double softmax = amx::overlap_probe(steps, amx::OverlapPart::kSoftmax);
  EXPECT_GT(softmax, 0.0);
  // The sums grow by the same amount with each `steps` rounds more; the checksum's other terms
  // (the last pair word's two probabilities, the scores' max) stay.
  const double twice = amx::overlap_probe(2 * steps, amx::OverlapPart::kSoftmax);
  const double thrice = amx::overlap_probe(3 * steps, amx::OverlapPart::kSoftmax);
  EXPECT_GT(twice - softmax, 0.0);
  EXPECT_NEAR(thrice - twice, twice - softmax, 1e-4 * thrice);
  EXPECT_NEAR(amx::overlap_probe(steps, amx::OverlapPart::kBoth), tiles + softmax,
              1e-9 * (tiles + softmax));
}

}  // namespace
}  // namespace qkv::testing
