// KvCache's storage: f32, bf16 and f16 caches, appends from any-stride views (rounded to the
// cache's dtype, nearest, ties to even, or copied bit for bit when already in it), growth that
// keeps what is cached, and the errors of a wrong dtype or shape.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/float16.h"
#include "expect_error.h"
#include "qkv/layers/kv_cache.h"

namespace qkv::testing {
namespace {

constexpr std::int64_t kBatch = 2, kHeads = 3, kHeadDim = 5;

// Value (b, t, h, d) of the t-th appended token: distinct, with rounding ties and specials.
float token_value(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t d) {
  const std::int64_t i = ((b * 100 + t) * kHeads + h) * kHeadDim + d;
  switch (i % 7) {
    case 0:
      return 1.0f + 0x1p-8f;  // a bf16 tie: rounds to even (1.0)
    case 1:
      return 1.0f + 3 * 0x1p-8f;  // a bf16 tie: rounds up to even
    case 2:
      return 1.0f + 0x1p-11f;  // an f16 tie
    case 3:
      return i % 2 ? 1e-6f : -0.0f;  // an f16 subnormal; the sign of zero
    case 4:
      return i % 3 ? std::numeric_limits<float>::infinity() : 7e4f;  // past f16's range
    default:
      return std::sin(static_cast<float>(i)) * 3.0f;
  }
}

// [B, n, Hkv, D] tokens first .. first + n - 1, stored BHSD (heads outer): a strided BSHD view.
struct Tokens {
  std::vector<float> data;
  TensorView view;
  Tokens(std::int64_t first, std::int64_t n) : data(kBatch * kHeads * n * kHeadDim) {
    for (std::int64_t b = 0; b < kBatch; ++b)
      for (std::int64_t h = 0; h < kHeads; ++h)
        for (std::int64_t t = 0; t < n; ++t)
          for (std::int64_t d = 0; d < kHeadDim; ++d)
            data[((b * kHeads + h) * n + t) * kHeadDim + d] = token_value(b, first + t, h, d);
    view.data = data.data();
    view.dtype = DType::kF32;
    view.sizes = {kBatch, n, kHeads, kHeadDim};
    view.strides = {kHeads * n * kHeadDim, kHeadDim, n * kHeadDim, 1};
  }
};

// Every cached element of `view` is token_value rounded to the cache's dtype, bit for bit.
void expect_cached(const TensorView& view, std::int64_t size, DType dtype) {
  ASSERT_EQ(view.dtype, dtype);
  ASSERT_EQ(view.sizes, (std::array<std::int64_t, 4>{kBatch, size, kHeads, kHeadDim}));
  for (std::int64_t b = 0; b < kBatch; ++b)
    for (std::int64_t t = 0; t < size; ++t)
      for (std::int64_t h = 0; h < kHeads; ++h)
        for (std::int64_t d = 0; d < kHeadDim; ++d) {
          const float want = token_value(b, t, h, d);
          const std::int64_t at = view.offset(b, t, h, d);
          if (dtype == DType::kF32) {
            const float got = static_cast<const float*>(view.data)[at];
            ASSERT_EQ(std::signbit(got), std::signbit(want));
            ASSERT_EQ(got, want) << "b=" << b << " t=" << t << " h=" << h << " d=" << d;
          } else {
            ASSERT_EQ(static_cast<const std::uint16_t*>(view.data)[at],
                      f32_to_half_bits(dtype, want))
                << dtype_name(dtype) << " b=" << b << " t=" << t << " h=" << h << " d=" << d;
          }
        }
}

TEST(KvCache, AppendsRoundEveryDtypeAndGrowingKeepsThem) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (std::int64_t max_seq : {0, 40}) {
      KvCache cache(kBatch, kHeads, kHeadDim, max_seq, dtype);
      EXPECT_EQ(cache.dtype(), dtype);
      std::int64_t size = 0;
      for (std::int64_t n : {3, 1, 13, 4, 19}) {  // a growing cache doubles past 16 and 32
        const Tokens tokens(size, n);
        cache.append(tokens.view, tokens.view);
        size += n;
        ASSERT_EQ(cache.size(), size);
        expect_cached(cache.keys(), size, dtype);
        expect_cached(cache.values(), size, dtype);
      }
      EXPECT_EQ(cache.capacity(), max_seq > 0 ? 40 : 64);
      cache.truncate(7);
      const Tokens again(7, 2);
      cache.append(again.view, again.view);
      expect_cached(cache.keys(), 9, dtype);
    }
  }
}

// The stores are head-major, [B, Hkv, capacity, head_dim]: each kv head's tokens one run, which a
// decode step reads as one ascending stream (docs/layers.md, "KvCache"); a growing cache keeps
// that order in its new capacity.
TEST(KvCache, StoresEachKvHeadsTokensAsOneRun) {
  for (std::int64_t max_seq : {0, 40}) {
    KvCache cache(kBatch, kHeads, kHeadDim, max_seq, DType::kBF16);
    const Tokens first(0, 3), more(3, 14);  // a growing cache: 16, then doubled to 32
    cache.append(first.view, first.view);
    cache.append(more.view, more.view);
    const std::int64_t capacity = cache.capacity();
    ASSERT_EQ(capacity, max_seq > 0 ? 40 : 32);
    const std::array<std::int64_t, 4> head_major = {kHeads * capacity * kHeadDim, kHeadDim,
                                                    capacity * kHeadDim, 1};
    EXPECT_EQ(cache.keys().strides, head_major);
    EXPECT_EQ(cache.values().strides, head_major);
    expect_cached(cache.keys(), 17, DType::kBF16);
  }
}

TEST(KvCache, HalfInputsInTheCachesDtypeAreCopiedBitForBit) {
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const Tokens tokens(0, 6);
    // The same tokens already in the cache's dtype, contiguous BSHD.
    std::vector<std::uint16_t> bits(tokens.data.size());
    for (std::int64_t b = 0; b < kBatch; ++b)
      for (std::int64_t t = 0; t < 6; ++t)
        for (std::int64_t h = 0; h < kHeads; ++h)
          for (std::int64_t d = 0; d < kHeadDim; ++d)
            bits[((b * 6 + t) * kHeads + h) * kHeadDim + d] =
                f32_to_half_bits(dtype, token_value(b, t, h, d));
    const TensorView half =
        TensorView::contiguous(bits.data(), dtype, {kBatch, 6, kHeads, kHeadDim});
    KvCache cache(kBatch, kHeads, kHeadDim, 0, dtype);
    cache.append(half, tokens.view);  // k already rounded, v rounded by the cache
    expect_cached(cache.keys(), 6, dtype);
    expect_cached(cache.values(), 6, dtype);
  }
}

TEST(KvCache, RejectsWrongDtypesAndShapes) {
  expect_error([] { KvCache(1, 2, 4, 0, DType::kF64); },
               "KvCache: dtype f64 (expected f32, bf16 or f16)");
  const Tokens tokens(0, 2);
  std::vector<std::uint16_t> bits(tokens.data.size());
  const TensorView f16 = TensorView::contiguous(bits.data(), DType::kF16, tokens.view.sizes);
  KvCache bf16_cache(kBatch, kHeads, kHeadDim, 0, DType::kBF16);
  expect_error([&] { bf16_cache.append(f16, tokens.view); },
               "KvCache::append: k: shape (2, 2, 3, 5) (f16) does not match the cache's "
               "(2, 2, 3, 5) (f32 or bf16)");
  KvCache f32_cache(kBatch, kHeads, kHeadDim);
  expect_error([&] { f32_cache.append(tokens.view, f16); },
               "KvCache::append: v: shape (2, 2, 3, 5) (f16) does not match the cache's "
               "(2, 2, 3, 5) (f32)");
  KvCache other(kBatch, kHeads + 1, kHeadDim, 0, DType::kF16);
  expect_error([&] { other.append(tokens.view, tokens.view); },
               "does not match the cache's (2, 2, 4, 5) (f32 or f16)");
  EXPECT_EQ(bf16_cache.size(), 0);
  EXPECT_EQ(f32_cache.size(), 0);
}

}  // namespace
}  // namespace qkv::testing
