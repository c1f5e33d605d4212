// Every fast kernel against the reference oracle (f64 accumulation) over one table of cases:
// odd sizes, every mask kind alone and combined, both alignments, GQA/MQA, Lq != Lk, Dv != D,
// head dims 16..256, fully masked rows, -inf bias, large logits, NaN in padded keys; on every
// Highway target this machine can run; and bit-identical results whatever the thread count.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "attention_case.h"
#include "bf16_skip.h"
#include "every_target.h"
#include "kernel_cases.h"
#include "kernels/cpu/bf16_dot.h"
#include "kernels/cpu/kv_head_major.h"
#include "kernels/kernels.h"
#include "kernels/product_path.h"

namespace qkv::testing {
namespace {

class KernelSweep : public ::testing::TestWithParam<Case> {};

TEST_P(KernelSweep, MatchesReference) { check_against_reference(Problem(GetParam())); }

INSTANTIATE_TEST_SUITE_P(Cases, KernelSweep, ::testing::ValuesIn(kernel_cases()),
                         [](const auto& info) { return info.param.name(); });

// The same table with q, k, v stored as bf16 and as f16 (the oracle reads the same bits).
INSTANTIATE_TEST_SUITE_P(Bf16, KernelSweep,
                         ::testing::ValuesIn(with_dtype(kernel_cases(), DType::kBF16)),
                         [](const auto& info) { return info.param.name(); });
INSTANTIATE_TEST_SUITE_P(F16, KernelSweep,
                         ::testing::ValuesIn(with_dtype(kernel_cases(), DType::kF16)),
                         [](const auto& info) { return info.param.name(); });

// The sweep above runs on the best target; here each compiled target this CPU supports is
// forced in turn, over the cases that exercise masks and tails.
TEST(KernelTargets, EveryTargetMatchesReference) {
  const std::vector<Case> cases = kernel_cases();
  for_each_target(attention_cpu_target_name, [&](std::int64_t) {
    for (std::size_t i = 0; i < cases.size(); i += 3) {
      SCOPED_TRACE(cases[i].name());
      check_against_reference(Problem(cases[i]));
      for (DType dtype : {DType::kBF16, DType::kF16}) {
        if (i % 9 != 0) continue;
        Case c = cases[i];
        c.dtype = dtype;
        SCOPED_TRACE(c.name());
        check_against_reference(Problem(c));
      }
    }
  });
}

// The flash kernel takes vdpbf16ps for bf16 where bf16dot::preferred() (AMD CPUs with
// AVX512-BF16), AMX tiles where amx::available() (Intel CPUs with AMX-BF16), and widens to f32
// everywhere else; the sweeps above run whichever this CPU takes. The others are forced here:
// the widening one (any CPU), the pairs wherever the CPU has AVX512-BF16 (an Intel CPU would
// otherwise never run them), and the tiles wherever it has AMX.
TEST(KernelTargets, Bf16WithoutVdpbf16psOrAmx) {
  bf16dot::set_enabled(false);
  amx::set_enabled(false);
  ASSERT_EQ(attention_flash_product_path(DType::kBF16), ProductPath::kBf16Widened);
  for (const Case& c : with_dtype(kernel_cases(), DType::kBF16)) {
    SCOPED_TRACE(c.name());
    check_against_reference(Problem(c));
  }
  amx::set_enabled(true);
  bf16dot::set_enabled(true);
}

TEST(KernelTargets, Bf16OnAmxWhereverAvailable) {
  QKV_SKIP_WITHOUT_AMX();
  ASSERT_EQ(attention_flash_product_path(DType::kBF16), ProductPath::kBf16Amx);
  for (const Case& c : with_dtype(kernel_cases(), DType::kBF16)) {
    SCOPED_TRACE(c.name());
    check_against_reference(Problem(c));
  }
}

// bf16dot::set_forced for a scope.
struct ForcedPairs {
  ForcedPairs() { bf16dot::set_forced(true); }
  ~ForcedPairs() { bf16dot::set_forced(false); }
};

TEST(KernelTargets, Bf16OnVdpbf16psWhereverAvailable) {
  QKV_SKIP_WITHOUT_BF16();
  const ForcedPairs forced;
  ASSERT_EQ(attention_flash_product_path(DType::kBF16), ProductPath::kBf16Pairs);
  for (const Case& c : with_dtype(kernel_cases(), DType::kBF16)) {
    SCOPED_TRACE(c.name());
    check_against_reference(Problem(c));
  }
}

// A bf16 multi-head decode step in BSHD (one query row per kv head, several kv heads) widens
// where the vdpbf16ps pairs are preferred but not forced (products-inl.h, FlashProductPath);
// GQA steps, two query rows, one kv head and BHSD keep the dtype's path. Each meets the
// reference on the path it reports.
TEST(KernelTargets, Bf16MultiHeadDecodeInBshdWidens) {
  Case mha{.batch = 2, .seq_q = 1, .seq_kv = 2100, .num_heads_q = 6, .head_dim = 40};
  mha.num_heads_kv = 6;
  mha.dtype = DType::kBF16;
  mha.key_lengths = true;
  const ProductPath dtype_path = attention_flash_product_path(DType::kBF16);
  const bool widens = dtype_path == ProductPath::kBf16Pairs;
  EXPECT_EQ(Problem(mha).flash_path(), widens ? ProductPath::kBf16Widened : dtype_path);
  check_against_reference(Problem(mha));
  Case others[4] = {mha, mha, mha, mha};
  others[0].num_heads_q = 12;  // GQA 12:6
  others[1].seq_q = 2;
  others[2].num_heads_q = others[2].num_heads_kv = 1;
  others[3].bhsd = true;
  for (const Case& c : others) {
    SCOPED_TRACE(c.name());
    EXPECT_EQ(Problem(c).flash_path(), dtype_path);
  }
  if (widens) {
    const ForcedPairs forced;  // qkv bench --products bf16-vdpbf16ps
    EXPECT_EQ(Problem(mha).flash_path(), ProductPath::kBf16Pairs);
    check_against_reference(Problem(mha));
  }
}

// flash_product_paths and pin_flash_product_path (`qkv bench --products`): the CPU's own choice
// comes first and the widened path is always there; every listed path pins (the kernel then
// reports it), every other is refused with the choice left as it was; unpinning restores the
// CPU's own choice. Which paths a CPU has: test_cli_attention.py, from its flags.
TEST(KernelTargets, ProductPathsPinAndRestore) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const ProductPath chosen = attention_flash_product_path(dtype);
    const struct Restore {  // the defaults back, however the test ends
      ~Restore() { unpin_flash_product_path(); }
    } restore;
    const std::vector<ProductPath> paths = flash_product_paths(dtype);
    ASSERT_FALSE(paths.empty());
    EXPECT_EQ(paths[0], chosen);
    EXPECT_NE(std::find(paths.begin(), paths.end(), WideningProductPath(dtype)), paths.end());
    EXPECT_EQ(attention_flash_product_path(dtype), chosen);
    for (ProductPath path : kProductPaths) {
      SCOPED_TRACE(product_path_name(path));
      const bool listed = std::find(paths.begin(), paths.end(), path) != paths.end();
      if (listed) {
        EXPECT_EQ(product_path_dtype(path), dtype);
      }
      EXPECT_EQ(pin_flash_product_path(dtype, path), listed);
      EXPECT_EQ(attention_flash_product_path(dtype), listed ? path : chosen);
      unpin_flash_product_path();  // the defaults: the CPU's own choice
      EXPECT_EQ(attention_flash_product_path(dtype), chosen);
      ASSERT_TRUE(pin_flash_product_path(dtype, chosen));
      EXPECT_TRUE(bf16dot::available() == bf16dot::cpu_supported());
    }
  }
}

// force_kv_head_major for a scope.
struct ForcedKvCopy {
  ForcedKvCopy() { force_kv_head_major(true); }
  ~ForcedKvCopy() { force_kv_head_major(false); }
};

// The head-major copy of K and V (kernels/cpu/kv_head_major.h), forced onto every case of the
// table whose walk allows it (K/V rows of several kv heads side by side, wide blocks, no key
// split), in every dtype, on every target: the walk over the copy gives the bits of the walk
// over K and V where they lie, on any thread count.
TEST(KernelKvCopy, SameBitsAsTheWalkInPlace) {
  for_each_target(attention_cpu_target_name, [&](std::int64_t) {
    std::int64_t copied = 0;
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (const Case& c : with_dtype(kernel_cases(), dtype)) {
        SCOPED_TRACE(c.name());
        const Problem problem(c);
        const Result in_place = problem.run(Kernel::kFlash, false);
        const std::int64_t before = kv_head_major_copies();
        const ForcedKvCopy forced;
        const Result walked = problem.run(Kernel::kFlash, false);
        if (kv_head_major_copies() == before) continue;  // BHSD, one kv head, narrow blocks
        ++copied;
        EXPECT_TRUE(bit_equal(in_place.out, walked.out));
        EXPECT_TRUE(bit_equal(in_place.lse, walked.lse));
        if (copied % 8 == 1) {
          AttentionParams params = problem.params();
          params.kernel = Kernel::kFlash;
          expect_same_bits_on_any_thread_count(problem, params);
        }
      }
    }
    std::printf("[ kv copy  ] %s: %lld cases walked a head-major copy\n",
                attention_cpu_target_name(), static_cast<long long>(copied));
    EXPECT_GE(copied, 6);  // AVX3 15, AVX2 9, scalar 24 (the table of 2026-12-07)
  });
}

// Unforced, the copy is taken where each kv head's rows lie apart, are read by many tasks and
// outgrow a core's L2 (flash_forward.cc, CopiesKvHeadMajor): an f32 GQA prefill whose 16 query
// heads per kv head make 8 tasks a head (blocks of 64 or 16 rows) over 1 MiB of K and V each,
// in BSHD; not in BHSD, nor with 7 queries (2 or 7 tasks a head), nor over a quarter of the
// keys. On every target.
TEST(KernelKvCopy, TakenWhereRowsAreReadByManyTasks) {
  const Case gqa{
      .seq_q = 512, .seq_kv = 8192, .num_heads_q = 32, .num_heads_kv = 2, .head_dim = 16};
  Case bhsd = gqa, short_q = gqa, short_kv = gqa;
  bhsd.bhsd = true;
  short_q.seq_q = 7;
  short_kv.seq_kv = 2048;
  for_each_target(attention_cpu_target_name, [&](std::int64_t) {
    for (const auto& [c, taken] :
         {std::pair{gqa, true}, {bhsd, false}, {short_q, false}, {short_kv, false}}) {
      SCOPED_TRACE(c.name());
      const Problem problem(c);
      const std::int64_t before = kv_head_major_copies();
      const Result r = problem.run(Kernel::kFlash, false);
      EXPECT_EQ(kv_head_major_copies() > before, taken);
      EXPECT_LT(max_abs(r.out), 1e30);  // ran: finite, written
    }
  });
}

TEST(KernelThreads, BitIdenticalWhateverTheThreadCount) {
  Case wide{.batch = 2, .seq_q = 300, .seq_kv = 333, .num_heads_q = 3, .head_dim = 64};
  wide.causal = wide.key_lengths = true;
  wide.bias = BiasKind::kRandom;
  // Key splits and the row-wise decode path.
  const Case decode{
      .seq_q = 1, .seq_kv = 5000, .num_heads_q = 8, .num_heads_kv = 2, .head_dim = 64};
  for (Case c : {wide, decode}) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      c.dtype = dtype;
      SCOPED_TRACE(c.name());
      const Problem problem(c);
      for (Kernel kernel : {Kernel::kFlash, Kernel::kChunked, Kernel::kReference}) {
        AttentionParams params = problem.params();
        params.kernel = kernel;
        expect_same_bits_on_any_thread_count(problem, params);
      }
      if (dtype == DType::kBF16 && bf16dot::available()) {  // the pairs, forced (see above)
        const ForcedPairs forced;
        SCOPED_TRACE("bf16-vdpbf16ps");
        AttentionParams params = problem.params();
        params.kernel = Kernel::kFlash;
        expect_same_bits_on_any_thread_count(problem, params);
      }
    }
  }
}

// Fully masked rows: out exactly 0 and lse exactly -inf, never NaN, in every kernel.
TEST(KernelEdges, FullyMaskedRowsGiveZeroAndNegInf) {
  Case c{.batch = 2, .seq_q = 10, .seq_kv = 4, .causal = true};
  c.align = Align::kBottomRight;  // Lq > Lk: the first 6 rows see no key
  c.key_lengths = true;           // and batch 1 has no keys at all
  c.nan_padding = true;
  const Problem problem(c);
  for (Kernel kernel : {Kernel::kReference, Kernel::kChunked, Kernel::kFlash}) {
    const Result r = problem.run(kernel, false);
    const std::int64_t d = c.head_dim;
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::int64_t i = 0; i < c.seq_q; ++i) {
        const bool empty = b == 1 || i < 6;  // batch 1 has key length 0
        if (!empty) continue;
        for (std::int64_t e = 0; e < d; ++e) EXPECT_EQ(r.out[(b * c.seq_q + i) * d + e], 0.0f);
        EXPECT_EQ(r.lse[b * c.seq_q + i], -std::numeric_limits<float>::infinity());
      }
    }
    for (float x : r.out) EXPECT_FALSE(std::isnan(x));
  }
}

// Large logits: softmax must subtract the max; a naive exp would overflow to inf / NaN.
TEST(KernelEdges, HugeLogitsStayFinite) {
  Case c{.seq_q = 70, .seq_kv = 70, .head_dim = 64};
  c.input_scale = 30.0f;  // |q.k| * scale ~ 1e3 and beyond
  const Problem problem(c);
  const Result ref = problem.run(Kernel::kReference, false);
  const Result flash = problem.run(Kernel::kFlash, false);
  for (float x : flash.out) ASSERT_TRUE(std::isfinite(x));
  EXPECT_LE(max_abs_diff(flash.out, ref.out), tolerance(ref.out, problem.plain().out));
}

}  // namespace
}  // namespace qkv::testing
