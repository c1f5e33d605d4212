// The AVX512-BF16 decode products (bf16dot::narrow_scores, narrow_values in
// src/kernels/cpu/bf16_narrow_avx512.cc) against float64 over heads x rows x depth / dv x keys,
// the scores with the heads of a key side by side (BSHD) and each head's keys side by side (BHSD,
// another walk: same bits), with padded strides: the padding holds NaN, which must never be
// read, and guard values between the outputs of neighbouring heads, which must stay untouched.
// Also pack_probs on one vector of lanes, in place, as the decode path calls it. Every test skips
// on CPUs without AVX512-BF16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bf16_skip.h"
#include "core/float16.h"
#include "core/splitmix64.h"
#include "hwy/aligned_allocator.h"
#include "kernels/cpu/bf16_dot.h"

namespace qkv::testing {
namespace {

constexpr std::uint16_t kNanBits = 0x7fc0;  // a bf16 quiet NaN
constexpr float kGuard = -12345.0f;

double widen(std::uint16_t bits) { return static_cast<double>(bf16_bits_to_f32(bits)); }

std::uint16_t random_bf16(SplitMix64& rng, float lo, float hi) {
  return f32_to_bf16_bits(lo + (hi - lo) * rng.uniform24());
}

// bad plus the elements of buffer outside the outputs that are no longer kGuard (reported, as
// "<label>[i]", while bad stays <= 3).
int stray_writes(const std::string& label, const std::vector<float>& buffer,
                 const std::vector<bool>& is_output, int bad) {
  for (std::size_t i = 0; i < buffer.size(); ++i) {
    if (!is_output[i] && buffer[i] != kGuard && ++bad <= 3) {
      ADD_FAILURE() << label << "[" << i << "] outside the outputs was written";
    }
  }
  return bad;
}

// Returns the number of mismatches (reported with the first few).
int run_scores_case(std::int64_t heads, std::int64_t rows, std::int64_t depth, std::int64_t num_k,
                    std::uint64_t seed) {
  SplitMix64 rng(seed);
  const std::string name = "heads " + std::to_string(heads) + " rows " + std::to_string(rows) +
                           " depth " + std::to_string(depth) + " keys " + std::to_string(num_k);
  const std::int64_t words = (depth + 1) / 2;
  // k: [num_k][heads][depth + 3] (heads inner, BSHD) one element past a 4-byte boundary, NaN in
  // the padding; k_outer holds the same rows as [heads][num_k][depth + 3] plus 2 (BHSD).
  const std::int64_t k_head_stride = depth + 3, k_row_stride = heads * k_head_stride;
  const std::int64_t outer_row_stride = depth + 3, outer_head_stride = num_k * (depth + 3) + 2;
  std::vector<std::uint16_t> k_storage(1 + num_k * k_row_stride, kNanBits);
  std::vector<std::uint16_t> outer_storage(1 + heads * outer_head_stride, kNanBits);
  std::uint16_t* k = k_storage.data() + 1;
  std::uint16_t* k_outer = outer_storage.data() + 1;
  for (std::int64_t j = 0; j < num_k; ++j) {
    for (std::int64_t n = 0; n < heads; ++n) {
      for (std::int64_t d = 0; d < depth; ++d) {
        k[j * k_row_stride + n * k_head_stride + d] = random_bf16(rng, -2.0f, 2.0f);
        k_outer[n * outer_head_stride + j * outer_row_stride + d] =
            k[j * k_row_stride + n * k_head_stride + d];
      }
    }
  }
  // q: [heads][rows][words] pair words (+0 past depth), NaN pairs between heads.
  const std::int64_t q_head_stride = rows * words + 5;
  std::vector<std::uint32_t> q(heads * q_head_stride, kNanBits | std::uint32_t{kNanBits} << 16);
  std::vector<double> q_values(heads * rows * depth);
  for (std::int64_t n = 0; n < heads; ++n) {
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t t = 0; t < words; ++t) {
        const std::uint16_t lo = random_bf16(rng, -2.0f, 2.0f);
        const std::uint16_t hi = 2 * t + 1 < depth ? random_bf16(rng, -2.0f, 2.0f) : 0;
        q[n * q_head_stride + r * words + t] = lo | std::uint32_t{hi} << 16;
        q_values[(n * rows + r) * depth + 2 * t] = widen(lo);
        if (2 * t + 1 < depth) q_values[(n * rows + r) * depth + 2 * t + 1] = widen(hi);
      }
    }
  }
  // st: row stride rows + 2, head stride num_k * (rows + 2) + 7; everything else is a guard.
  const std::int64_t st_row_stride = rows + 2, st_head_stride = num_k * st_row_stride + 7;
  std::vector<float> st(heads * st_head_stride, kGuard);
  std::vector<char> prefetched(4096);  // one range per key
  const float out_scale = 0.3f;

  bf16dot::narrow_scores({q.data(), q_head_stride, k, k_head_stride, k_row_stride, st.data(),
                          st_head_stride, st_row_stride, heads, rows, depth, num_k, out_scale,
                          prefetched.data(), 64, 128});
  // Heads outer (a walk head by head, blocks of keys of one head) gives the same bits.
  std::vector<float> st_outer(st.size(), kGuard);
  bf16dot::narrow_scores({q.data(), q_head_stride, k_outer, outer_head_stride, outer_row_stride,
                          st_outer.data(), st_head_stride, st_row_stride, heads, rows, depth, num_k,
                          out_scale, prefetched.data(), 8, 64});
  if (std::memcmp(st.data(), st_outer.data(), st.size() * sizeof(float)) != 0) {
    ADD_FAILURE() << name << ": heads outer changed the scores";
    return 1;
  }

  int bad = 0;
  std::vector<bool> written(st.size(), false);
  for (std::int64_t n = 0; n < heads; ++n) {
    for (std::int64_t j = 0; j < num_k; ++j) {
      for (std::int64_t r = 0; r < rows; ++r) {
        double sum = 0.0, magnitude = 0.0;
        for (std::int64_t d = 0; d < depth; ++d) {
          const double term = q_values[(n * rows + r) * depth + d] *
                              widen(k[j * k_row_stride + n * k_head_stride + d]);
          sum += term;
          magnitude += std::abs(term);
        }
        const std::int64_t at = n * st_head_stride + j * st_row_stride + r;
        written[at] = true;
        const double expected = out_scale * sum;
        const double tolerance = 1e-5 * out_scale * magnitude + 1e-30;
        if (!(std::abs(st[at] - expected) <= tolerance) && ++bad <= 3) {
          ADD_FAILURE() << name << ": head " << n << " key " << j << " row " << r << " = "
                        << st[at] << ", expected " << expected;
        }
      }
    }
  }
  return stray_writes(name + ": st", st, written, bad);
}

TEST(Bf16Narrow, ScoresMatchFloat64Reference) {
  QKV_SKIP_WITHOUT_BF16();
  int cases = 0, failed = 0;
  std::uint64_t seed = 1;
  for (std::int64_t heads : {1, 3, 4, 5, 8}) {
    for (std::int64_t rows : {1, 2, 4, 5, 6}) {
      for (std::int64_t depth : {1, 2, 31, 32, 33, 64, 128}) {
        for (std::int64_t num_k : {1, 3, 8, 37}) {
          ++cases;
          if (run_scores_case(heads, rows, depth, num_k, seed++) > 0) ++failed;
        }
      }
    }
  }
  EXPECT_EQ(cases, 700);
  EXPECT_EQ(failed, 0) << "of " << cases << " cases";
}

int run_values_case(std::int64_t heads, std::int64_t rows, std::int64_t num_k, std::int64_t dv,
                    std::uint64_t seed) {
  SplitMix64 rng(seed);
  const std::string name = "heads " + std::to_string(heads) + " rows " + std::to_string(rows) +
                           " keys " + std::to_string(num_k) + " dv " + std::to_string(dv);
  const std::int64_t pairs = (num_k + 1) / 2;
  // v: [num_k + 1][heads][dv + 3] one element past a 4-byte boundary; row num_k and the
  // padding hold NaN.
  const std::int64_t v_head_stride = dv + 3, v_row_stride = heads * v_head_stride;
  std::vector<std::uint16_t> v_storage(1 + (num_k + 1) * v_row_stride, kNanBits);
  std::uint16_t* v = v_storage.data() + 1;
  for (std::int64_t j = 0; j < num_k; ++j) {
    for (std::int64_t n = 0; n < heads; ++n) {
      for (std::int64_t e = 0; e < dv; ++e) {
        v[j * v_row_stride + n * v_head_stride + e] = random_bf16(rng, -2.0f, 2.0f);
      }
    }
  }
  // pp: [heads][pairs][rows + 1] pair words, probabilities in [0, 1]; an odd last pair has +0.
  const std::int64_t pp_row_stride = rows + 1, pp_head_stride = pairs * pp_row_stride + 3;
  std::vector<std::uint32_t> pp(heads * pp_head_stride, 0xdeadbeefu);
  for (std::int64_t n = 0; n < heads; ++n) {
    for (std::int64_t t = 0; t < pairs; ++t) {
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::uint16_t lo = random_bf16(rng, 0.0f, 1.0f);
        const std::uint16_t hi = 2 * t + 1 < num_k ? random_bf16(rng, 0.0f, 1.0f) : 0;
        pp[n * pp_head_stride + t * pp_row_stride + r] = lo | std::uint32_t{hi} << 16;
      }
    }
  }
  // o: row stride dv + 5, head stride rows * (dv + 5) + 2, random where the outputs are.
  const std::int64_t o_row_stride = dv + 5, o_head_stride = rows * o_row_stride + 2;
  std::vector<float> o(heads * o_head_stride, kGuard);
  std::vector<bool> is_output(o.size(), false);
  for (std::int64_t n = 0; n < heads; ++n) {
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t e = 0; e < dv; ++e) {
        const std::int64_t at = n * o_head_stride + r * o_row_stride + e;
        o[at] = rng.uniform24() * 4.0f - 2.0f;
        is_output[at] = true;
      }
    }
  }
  const std::vector<float> o_before = o;

  bf16dot::narrow_values({pp.data(), pp_head_stride, pp_row_stride, v, v_head_stride,
                          v_row_stride, o.data(), o_head_stride, o_row_stride, heads, rows, num_k,
                          dv});
  // The same call with a prefetch range (the next tile's K in the flash kernel; here a buffer of
  // 1 to 65 lines, so that some steps ask for no line and some for several) gives the same bits
  // and returns (a prefetch that ran past its range cannot be seen here: it never faults).
  std::vector<float> o_prefetched = o_before;
  const std::vector<char> ahead(64 * (1 + seed % 65));
  bf16dot::narrow_values({pp.data(), pp_head_stride, pp_row_stride, v, v_head_stride,
                          v_row_stride, o_prefetched.data(), o_head_stride, o_row_stride, heads,
                          rows, num_k, dv, ahead.data(), static_cast<std::int64_t>(ahead.size())});
  if (std::memcmp(o.data(), o_prefetched.data(), o.size() * sizeof(float)) != 0) {
    ADD_FAILURE() << name << ": a prefetch range changed the result";
    return 1;
  }

  int bad = 0;
  for (std::int64_t n = 0; n < heads; ++n) {
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t e = 0; e < dv; ++e) {
        const std::int64_t at = n * o_head_stride + r * o_row_stride + e;
        double sum = o_before[at], magnitude = std::abs(sum);
        for (std::int64_t j = 0; j < num_k; ++j) {
          const std::uint32_t word = pp[n * pp_head_stride + j / 2 * pp_row_stride + r];
          const double prob = widen(static_cast<std::uint16_t>(j % 2 == 0 ? word : word >> 16));
          const double term = prob * widen(v[j * v_row_stride + n * v_head_stride + e]);
          sum += term;
          magnitude += std::abs(term);
        }
        const double tolerance = 1e-5 * magnitude + 1e-30;
        if (!(std::abs(o[at] - sum) <= tolerance) && ++bad <= 3) {
          ADD_FAILURE() << name << ": head " << n << " row " << r << " column " << e << " = "
                        << o[at] << ", expected " << sum;
        }
      }
    }
  }
  return stray_writes(name + ": o", o, is_output, bad);
}

TEST(Bf16Narrow, ValuesMatchFloat64Reference) {
  QKV_SKIP_WITHOUT_BF16();
  int cases = 0, failed = 0;
  std::uint64_t seed = 1000;
  for (std::int64_t heads : {1, 3, 4, 5}) {
    for (std::int64_t rows : {1, 3, 4, 6}) {
      // 37 keys: single rows of several heads (BSHD here) take the values in chunks of 16 keys,
      // keys outermost (the bits of a plain walk, checked against float64 below).
      for (std::int64_t num_k : {1, 2, 3, 8, 9, 37}) {
        for (std::int64_t dv : {1, 16, 17, 33, 64, 65, 130}) {
          ++cases;
          if (run_values_case(heads, rows, num_k, dv, seed++) > 0) ++failed;
        }
      }
    }
  }
  EXPECT_EQ(cases, 672);
  EXPECT_EQ(failed, 0) << "of " << cases << " cases";
}

// The decode path packs one vector of lanes (rows <= 16) in place: pair t of lane l from rows
// 2t and 2t + 1, lanes past 16 and rows past the pairs untouched.
TEST(Bf16Narrow, PackProbsOneVectorInPlace) {
  QKV_SKIP_WITHOUT_BF16();
  constexpr std::int64_t kLanes = bf16dot::kLanes;
  SplitMix64 rng(5);
  for (std::int64_t num_k : {1, 2, 7, 128}) {
    SCOPED_TRACE("num_k " + std::to_string(num_k));
    auto st = hwy::AllocateAligned<float>(num_k * kLanes);
    for (std::int64_t i = 0; i < num_k * kLanes; ++i) st[i] = rng.uniform24();
    const std::vector<float> before(st.get(), st.get() + num_k * kLanes);
    std::uint32_t* pt = reinterpret_cast<std::uint32_t*>(st.get());

    bf16dot::pack_probs(st.get(), num_k, 1, pt);

    const std::int64_t pairs = (num_k + 1) / 2;
    for (std::int64_t t = 0; t < num_k; ++t) {
      for (std::int64_t l = 0; l < kLanes; ++l) {
        if (t < pairs && l < 16) {
          const std::uint32_t lo = f32_to_bf16_bits(before[2 * t * kLanes + l]);
          const std::uint32_t hi =
              2 * t + 1 < num_k ? f32_to_bf16_bits(before[(2 * t + 1) * kLanes + l]) : 0u;
          ASSERT_EQ(pt[t * kLanes + l], lo | hi << 16) << "t " << t << " l " << l;
        } else {
          ASSERT_EQ(st[t * kLanes + l], before[t * kLanes + l]) << "t " << t << " l " << l;
        }
      }
    }
  }
}

}  // namespace
}  // namespace qkv::testing
