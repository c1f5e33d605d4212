// Block-sparse attention (qkv/sparse.h): every layout against the dense kernels given the
// equivalent explicit mask (built by qkv::sparse_mask from the shared per-pair predicate), with
// causal/window, key lengths, masks, bias, softcap, GQA, Lq != Lk and odd sizes; the predicate
// itself against hand-written matrices; layouts that allow everything against dense attention;
// BigBird's draw; fully masked rows; every Highway target; thread invariance; validation. The
// sweep runs in f32 and in bf16 (the CPU's bf16 flash path; sparse_cases.cc says what bf16
// holds it to).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <variant>

#include "attention_case.h"
#include "every_target.h"
#include "expect_error.h"
#include "kernels/kernels.h"
#include "qkv/sparse.h"
#include "sparse_cases.h"

namespace qkv::testing {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

class SparseSweep : public ::testing::TestWithParam<SparseCase> {};

TEST_P(SparseSweep, MatchesDenseWithEquivalentMask) { check_sparse_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, SparseSweep, ::testing::ValuesIn(sparse_cases()), sparse_case_name);
// bf16 storage: the flash kernel's bf16 path on this CPU (vdpbf16ps on AMD, widened elsewhere;
// the AMX path in tests/amx_emulated/).
INSTANTIATE_TEST_SUITE_P(Bf16, SparseSweep, ::testing::ValuesIn(sparse_cases(DType::kBF16)),
                         sparse_case_name);

// The shared predicate against matrices written out by hand (Lq = Lk = 6, so i' = i).
TEST(SparsePredicate, LongformerByHand) {
  const std::int64_t global[] = {4};
  const auto mask = sparse_mask(LongformerSparsity{.window = 1, .dilation = 1, .global = global}, 6,
                                6, 1, Align::kBottomRight);
  const char* want =
      "110010"
      "111010"
      "011110"
      "001110"
      "111111"
      "000011";
  for (int x = 0; x < 36; ++x)
    EXPECT_EQ(mask[x], want[x] - '0') << "pair " << x / 6 << "," << x % 6;
  // Dilation 2, window 4, no globals: |i - j| <= 4 and even.
  const auto dilated =
      sparse_mask(LongformerSparsity{.window = 4, .dilation = 2}, 6, 6, 1, Align::kTopLeft);
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 6; ++j)
      EXPECT_EQ(dilated[i * 6 + j], std::abs(i - j) <= 4 && (i - j) % 2 == 0) << i << "," << j;
  // Bottom-right, Lq = 2 < Lk = 5: queries sit at positions 3 and 4.
  const auto decode = sparse_mask(LongformerSparsity{.window = 1}, 2, 5, 1, Align::kBottomRight);
  const std::vector<std::uint8_t> want_decode = {0, 0, 1, 1, 1, 0, 0, 0, 1, 1};
  EXPECT_EQ(decode, want_decode);
}

TEST(SparsePredicate, BlockLayoutByHand) {
  // Lq = 5, Lk = 4, blocks (2, 3): 3 x 2 block matrix.
  std::uint8_t layout[] = {1, 0, 0, 1, 1, 1};
  const auto mask =
      sparse_mask(BlockSparsity{.layout = TensorView::contiguous(layout, DType::kU8, {1, 1, 3, 2}),
                                .block_q = 2,
                                .block_k = 3},
                  5, 4, 1, Align::kBottomRight);
  const std::vector<std::uint8_t> want = {1, 1, 1, 0, 1, 1, 1, 0, 0, 0,
                                          0, 1, 0, 0, 0, 1, 1, 1, 1, 1};
  EXPECT_EQ(mask, want);
}

// BigBird's layout: global rows and columns, the 3-block window, exactly r random blocks per
// other row, reproducible from the seed and different for another seed or head.
TEST(SparseBigBird, LayoutStructureAndSeed) {
  const BigBirdSparsity s{.block = 16, .num_random_blocks = 3, .num_global_blocks = 2, .seed = 1};
  const std::int64_t heads = 2, n = 1024, nb = n / 16;
  const auto layout = bigbird_layout(s, n, n, heads);
  ASSERT_EQ(layout.size(), static_cast<std::size_t>(heads * nb * nb));
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t qb = 0; qb < nb; ++qb) {
      const std::uint8_t* row = layout.data() + (h * nb + qb) * nb;
      std::int64_t fixed = 0, ones = 0;
      for (std::int64_t kb = 0; kb < nb; ++kb) {
        const bool must = qb < 2 || kb < 2 || std::abs(qb - kb) <= 1;
        if (must) {
          EXPECT_EQ(row[kb], 1) << h << " " << qb << " " << kb;
        }
        fixed += must;
        ones += row[kb];
      }
      EXPECT_EQ(ones, qb < 2 ? nb : fixed + 3) << "head " << h << " row " << qb;
    }
  }
  EXPECT_EQ(layout, bigbird_layout(s, n, n, heads));
  BigBirdSparsity other = s;
  other.seed = 2;
  EXPECT_NE(layout, bigbird_layout(other, n, n, heads));
  EXPECT_NE(std::vector<std::uint8_t>(layout.begin(), layout.begin() + nb * nb),
            std::vector<std::uint8_t>(layout.begin() + nb * nb, layout.end()));
  // Fewer candidates than r: every block is attended.
  const auto small =
      bigbird_layout({.block = 4, .num_random_blocks = 9, .num_global_blocks = 1}, 20, 20, 1);
  for (std::uint8_t x : small) EXPECT_EQ(x, 1);
}

// The first draws, written down so docs/sparse.md's description stays honest: seed 1, head 0,
// query block 2 of a 10 x 10 grid (block 8, Lq = Lk = 80), g = 1, r = 2.
TEST(SparseBigBird, DocumentedDraw) {
  const auto layout = bigbird_layout(
      {.block = 8, .num_random_blocks = 2, .num_global_blocks = 1, .seed = 1}, 80, 80, 1);
  // Re-derive: candidates {4..9} (0 global; 1, 2, 3 window), stream state = 1 ^ (2 * C).
  std::uint64_t state = 1ull ^ (2ull * 0xD1B54A32D192ED03ull);
  const auto next = [&] {
    state += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  std::vector<std::int64_t> cand = {4, 5, 6, 7, 8, 9};
  std::vector<std::uint8_t> want(10, 0);
  want[0] = want[1] = want[2] = want[3] = 1;
  for (int t = 0; t < 2; ++t) {
    const std::size_t pick = t + next() % (cand.size() - t);
    std::swap(cand[t], cand[pick]);
    want[cand[t]] = 1;
  }
  EXPECT_EQ(std::vector<std::uint8_t>(layout.begin() + 20, layout.begin() + 30), want);
}

// A pattern that allows every pair gives exactly the dense result, bit for bit.
TEST(SparseEdges, CoveringEverythingEqualsDense) {
  for (bool causal : {false, true}) {
    Case c{.batch = 2, .seq_q = 333, .seq_kv = 517, .num_heads_q = 4, .num_heads_kv = 2};
    c.head_dim = 32;
    c.causal = causal;
    c.key_lengths = true;
    c.bias = BiasKind::kRandom;
    const Problem pr(c);
    SparseSpec full{.kind = SparseSpec::Kind::kBlock, .block_q = 64, .block_k = 64, .density = 1.0};
    const std::int64_t all[] = {0, 1};
    const Sparsity patterns[] = {
        full.make(c), LongformerSparsity{.window = 100000},
        LongformerSparsity{.window = 0, .global = all},  // not everything: control below
        BigBirdSparsity{.block = 64, .num_random_blocks = 0, .num_global_blocks = 9}};
    for (Kernel kernel : {Kernel::kFlash, Kernel::kChunked, Kernel::kReference}) {
      const Result dense = run_kernel(pr, pr.params(), kernel);
      for (int n = 0; n < 4; ++n) {
        AttentionParams params = pr.params();
        params.sparsity = patterns[n];
        const Result sparse = run_kernel(pr, params, kernel);
        const bool equal = bit_equal(sparse.out, dense.out) && bit_equal(sparse.lse, dense.lse);
        EXPECT_EQ(equal, n != 2) << "pattern " << n << " kernel " << static_cast<int>(kernel);
      }
    }
  }
}

// Rows the sparsity leaves without keys: out exactly 0, lse exactly -inf, never NaN.
TEST(SparseEdges, FullyMaskedRows) {
  const Case c{.seq_q = 130, .seq_kv = 130, .num_heads_q = 2};
  const Problem pr(c);
  std::vector<std::uint8_t> layout = {1, 0, 0,  // query block 1 (rows 64..127) attends nothing
                                      0, 0, 0,  //
                                      0, 0, 1};
  AttentionParams params = pr.params();
  params.sparsity =
      BlockSparsity{.layout = TensorView::contiguous(layout.data(), DType::kU8, {1, 1, 3, 3}),
                    .block_q = 64,
                    .block_k = 64};
  for (Kernel kernel : {Kernel::kFlash, Kernel::kChunked, Kernel::kReference}) {
    const Result r = run_kernel(pr, params, kernel);
    for (std::int64_t h = 0; h < 2; ++h) {
      for (std::int64_t i = 0; i < 130; ++i) {
        const bool empty = i >= 64 && i < 128;
        EXPECT_EQ(r.lse[h * 130 + i] == kNegInf, empty) << h << "," << i;
        if (!empty) continue;
        for (std::int64_t e = 0; e < c.head_dim; ++e) {
          EXPECT_EQ(r.out[(i * 2 + h) * c.head_dim + e], 0.0f);
        }
      }
    }
    for (float x : r.out) EXPECT_FALSE(std::isnan(x));
  }
}

// Each compiled Highway target this CPU supports, over a subset of the sweep.
TEST(SparseTargets, EveryTargetMatchesDense) {
  const std::vector<SparseCase> cases = sparse_cases();
  for_each_target(attention_cpu_target_name, [&](std::int64_t) {
    for (std::size_t i = 0; i < cases.size(); i += 7) {
      SCOPED_TRACE(cases[i].name());
      check_sparse_case(cases[i]);
    }
  });
}

TEST(SparseThreads, BitIdenticalWhateverTheThreadCount) {
  Case c{.batch = 2, .seq_q = 600, .seq_kv = 640, .num_heads_q = 4, .num_heads_kv = 2};
  c.head_dim = 32;
  c.causal = c.key_lengths = true;
  const std::int64_t global[] = {0, 300};
  const Sparsity patterns[] = {
      LongformerSparsity{.window = 100, .dilation = 2, .global = global},
      BigBirdSparsity{.block = 32, .num_random_blocks = 3, .num_global_blocks = 1, .seed = 5}};
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    c.dtype = dtype;
    const Problem pr(c);
    for (const Sparsity& sparsity : patterns) {
      AttentionParams params = pr.params();
      params.sparsity = sparsity;
      for (Kernel kernel : {Kernel::kFlash, Kernel::kChunked}) {
        params.kernel = kernel;
        expect_same_bits_on_any_thread_count(pr, params);
      }
    }
  }
}

// Pairs counted for effective GFLOP/s agree with the dense mask's count.
TEST(SparsePairs, AllowedPairsMatchTheMask) {
  const std::int64_t global[] = {2, 50, 51};
  SparseSpec block{.kind = SparseSpec::Kind::kBlock, .block_q = 10, .block_k = 7, .per_head = true};
  const Case shape{.seq_q = 90, .seq_kv = 120, .num_heads_q = 3};
  const Sparsity patterns[] = {
      LongformerSparsity{.window = 9, .dilation = 4, .global = global},
      LongformerSparsity{.window = 30, .global = global},
      BigBirdSparsity{.block = 8, .num_random_blocks = 2, .num_global_blocks = 1, .seed = 4},
      block.make(shape)};
  for (const Sparsity& sparsity : patterns) {
    for (bool causal : {false, true}) {
      AttentionParams params;
      params.sparsity = sparsity;
      params.causal = causal;
      params.window_left = causal ? 40 : -1;
      const auto mask = sparse_mask(sparsity, 90, 120, 3, params.align);
      double count = 0;
      for (std::int64_t h = 0; h < 3; ++h)
        for (std::int64_t i = 0; i < 90; ++i)
          for (std::int64_t j = 0; j < 120; ++j) {
            const std::int64_t diag = i + 30;
            const bool range = (!causal || j <= diag) && (!causal || j >= diag - 40);
            count += range && mask[(h * 90 + i) * 120 + j] != 0;
          }
      EXPECT_DOUBLE_EQ(sparse_allowed_pairs(90, 120, 3, params), count / 3);
    }
  }
}

TEST(SparseValidation, NamesTheArgumentAndSizes) {
  const Problem pr(Case{.seq_q = 100, .seq_kv = 130});
  const auto attempt = [&](Sparsity sparsity) {
    AttentionParams params = pr.params();
    params.sparsity = sparsity;
    run_kernel(pr, params, Kernel::kAuto);
  };
  expect_error([&] { attempt(LongformerSparsity{.window = -1}); },
               "sparsity: Longformer window w = -1 must be >= 0");
  expect_error([&] { attempt(LongformerSparsity{.window = 3, .dilation = 0}); },
               "sparsity: Longformer dilation = 0 must be >= 1");
  const std::int64_t bad_global[] = {5, 130};
  expect_error([&] { attempt(LongformerSparsity{.window = 3, .global = bad_global}); },
               "global position 130 is outside [0, 130) (Lq = 100, Lk = 130)");
  expect_error([&] { attempt(BigBirdSparsity{.block = 0}); }, "sparsity: BigBird block = 0");
  expect_error([&] { attempt(BigBirdSparsity{.block = 8, .num_random_blocks = -2}); },
               "BigBird random = -2 must be >= 0");
  std::vector<std::uint8_t> layout(2 * 3);
  expect_error(
      [&] {
        attempt(
            BlockSparsity{.layout = TensorView::contiguous(layout.data(), DType::kU8, {1, 1, 3, 2}),
                          .block_q = 64,
                          .block_k = 64});
      },
      "sparsity: block layout shape (1, 1, 3, 2) does not match (1, 1 or Hq = 1, "
      "ceil(Lq / block_q) = 2, ceil(Lk / block_k) = 3)");
  expect_error(
      [&] {
        attempt(
            BlockSparsity{.layout = TensorView::contiguous(layout.data(), DType::kU8, {1, 1, 2, 3}),
                          .block_q = 0,
                          .block_k = 64});
      },
      "block sizes (block_q, block_k) = (0, 64) must be >= 1");
  std::vector<float> f32_layout(6);
  expect_error(
      [&] {
        attempt(BlockSparsity{
            .layout = TensorView::contiguous(f32_layout.data(), DType::kF32, {1, 1, 2, 3}),
            .block_q = 64,
            .block_k = 64});
      },
      "sparsity: block layout dtype f32 is not supported");
}

}  // namespace
}  // namespace qkv::testing
