// The flash kernel's AMX path (AmxProducts in src/kernels/cpu/products-inl.h, bf16 and f16) over
// the kernel tests' whole case table and the block-sparse one, on any CPU with AVX512-BF16: this
// binary links amx_emulated.cc, which runs src/kernels/cpu/amx_tiles.cc with its tile
// instructions modelled in C++. So the
// path's staging (K rows, V columns transposed in registers, zero padding), packed query pairs,
// deferred scale, key ends per lane vector and tile scopes per task are checked against the
// reference oracle where the CPU has no AMX (qkv_tests runs the same on the real tiles, where
// it has). The same binary also runs tests/cpp/test_amx.cc (the micro-kernels against float64)
// on the model, which checks the model against amx.h's contract.
#include <gtest/gtest.h>

#include <thread>
#include <utility>
#include <vector>

#include "attention_case.h"
#include "bf16_skip.h"
#include "kernel_cases.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/bf16_dot.h"
#include "kernels/kernels.h"
#include "kernels/product_path.h"
#include "sparse_cases.h"

namespace qkv::testing {
namespace {

// On AMD CPUs the flash kernel prefers the vdpbf16ps pairs to the tiles (bf16dot::preferred);
// switched off for a scope, bf16 takes the (emulated) tiles, as on an Intel CPU with AMX, and so
// does f16 (as bf16 hi + lo parts).
struct PairsOff {
  PairsOff() { bf16dot::set_enabled(false); }
  ~PairsOff() { bf16dot::set_enabled(true); }
};

template <class Param>
class OnEmulatedTiles : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    QKV_SKIP_WITHOUT_AMX() << " (here: no AVX512-BF16, which amx_tiles.cc's other code needs)";
    ASSERT_EQ(attention_flash_product_path(DType::kBF16), ProductPath::kBf16Amx);
    ASSERT_EQ(attention_flash_product_path(DType::kF16), ProductPath::kF16Amx);
  }
  const PairsOff pairs_off_;
};

using AmxEmulated = OnEmulatedTiles<Case>;
TEST_P(AmxEmulated, FlashMatchesReference) { check_against_reference(Problem(GetParam())); }

INSTANTIATE_TEST_SUITE_P(Bf16, AmxEmulated,
                         ::testing::ValuesIn(with_dtype(kernel_cases(), DType::kBF16)),
                         [](const auto& info) { return info.param.name(); });
INSTANTIATE_TEST_SUITE_P(F16, AmxEmulated,
                         ::testing::ValuesIn(with_dtype(kernel_cases(), DType::kF16)),
                         [](const auto& info) { return info.param.name(); });

// Block sparsity on the tiles: against dense attention with the equivalent mask and the
// reference (sparse_cases.h).
using AmxEmulatedSparse = OnEmulatedTiles<SparseCase>;

TEST_P(AmxEmulatedSparse, MatchesDenseWithEquivalentMask) { check_sparse_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Bf16, AmxEmulatedSparse, ::testing::ValuesIn(sparse_cases(DType::kBF16)),
                         sparse_case_name);
INSTANTIATE_TEST_SUITE_P(F16, AmxEmulatedSparse, ::testing::ValuesIn(sparse_cases(DType::kF16)),
                         sparse_case_name);

// Each task loads its own tile configuration (TaskScope): results are the same bits whatever
// the thread count, with key splits and several query blocks per kv head, dense and sparse.
TEST(AmxEmulatedThreads, BitIdenticalWhateverTheThreadCount) {
  QKV_SKIP_WITHOUT_AMX();
  const PairsOff pairs_off;
  Case wide{.batch = 2, .seq_q = 300, .seq_kv = 333, .num_heads_q = 3, .head_dim = 64};
  wide.causal = wide.key_lengths = true;
  wide.bias = BiasKind::kRandom;
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    wide.dtype = dtype;
    const Problem problem(wide);
    AttentionParams params = problem.params();
    params.kernel = Kernel::kFlash;
    expect_same_bits_on_any_thread_count(problem, params);
    const std::int64_t global[] = {0, 150};
    params.sparsity = LongformerSparsity{.window = 60, .dilation = 2, .global = global};
    expect_same_bits_on_any_thread_count(problem, params);
  }
}

// Several threads calling the AMX path at once (std::threads; scripts/test_sanitizers.sh runs
// this under TSan with OMP_NUM_THREADS=1, since libgomp's barriers are invisible to TSan): each
// gets the bits of the same call made alone. Shapes and dtypes differ between threads, so
// scratch or tile state shared between calls would show.
TEST(AmxEmulatedConcurrency, ThreadsCallingAtOnceGetTheirOwnBits) {
  QKV_SKIP_WITHOUT_AMX();
  const PairsOff pairs_off;
  std::vector<Case> cases;
  for (int i = 0; i < 4; ++i) {
    Case c{.batch = 1 + i % 2, .seq_q = 70 + 37 * i, .seq_kv = 150 + 61 * i, .num_heads_q = 2};
    c.head_dim = 32 + 16 * i;
    c.causal = i % 2 == 0;
    c.dtype = i < 2 ? DType::kBF16 : DType::kF16;
    c.seed = 900 + i;
    cases.push_back(c);
  }
  std::vector<Problem> problems(cases.begin(), cases.end());
  std::vector<Result> alone, together(cases.size());
  for (const Problem& problem : problems) alone.push_back(problem.run(Kernel::kFlash, false));
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < problems.size(); ++i) {
    threads.emplace_back([&, i] {
      for (int round = 0; round < 3; ++round) together[i] = problems[i].run(Kernel::kFlash, false);
    });
  }
  for (std::thread& t : threads) t.join();
  for (std::size_t i = 0; i < problems.size(); ++i) {
    EXPECT_TRUE(bit_equal(together[i].out, alone[i].out)) << cases[i].name();
    EXPECT_TRUE(bit_equal(together[i].lse, alone[i].lse)) << cases[i].name();
  }
}

// `qkv bench --products` on a CPU with both AVX512-BF16 and AMX (here the emulated tiles): all
// three bf16 paths and both f16 ones are listed and pin, AMX included where the vendor's choice
// is the pairs (AMD), and a run on each pinned path meets the reference.
TEST(AmxEmulatedProductPaths, EveryPathPins) {
  QKV_SKIP_WITHOUT_AMX();
  const ProductPath bf16_chosen = attention_flash_product_path(DType::kBF16);
  const struct Restore {  // the defaults back, however the test ends
    ~Restore() { unpin_flash_product_path(); }
  } restore;
  const std::vector<ProductPath> bf16 = flash_product_paths(DType::kBF16);
  const std::vector<ProductPath> f16 = flash_product_paths(DType::kF16);
  EXPECT_EQ(bf16.size(), 3u);
  EXPECT_EQ(f16, (std::vector<ProductPath>{ProductPath::kF16Amx, ProductPath::kF16Widened}));
  Case c{
      .batch = 1, .seq_q = 70, .seq_kv = 90, .num_heads_q = 4, .num_heads_kv = 2, .head_dim = 24};
  c.causal = true;
  const std::pair<DType, ProductPath> runs[] = {{DType::kBF16, ProductPath::kBf16Pairs},
                                                {DType::kBF16, ProductPath::kBf16Amx},
                                                {DType::kBF16, ProductPath::kBf16Widened},
                                                {DType::kF16, ProductPath::kF16Amx},
                                                {DType::kF16, ProductPath::kF16Widened}};
  for (const auto& [dtype, path] : runs) {
    SCOPED_TRACE(product_path_name(path));
    c.dtype = dtype;
    ASSERT_TRUE(pin_flash_product_path(dtype, path));
    ASSERT_EQ(attention_flash_product_path(dtype), path);
    check_against_reference(Problem(c));
  }
  ASSERT_TRUE(pin_flash_product_path(DType::kBF16, bf16_chosen));
  EXPECT_EQ(attention_flash_product_path(DType::kBF16), bf16_chosen);
}

// The model is not vacuous: it faults where the hardware would.
TEST(AmxEmulatedModel, FaultsOnTilesWithoutConfiguration) {
  QKV_SKIP_WITHOUT_AMX();
  alignas(64) float st[16 * amx::kLanes] = {};
  alignas(64) std::uint32_t qp[16 * amx::kLanes] = {};
  alignas(64) std::uint16_t k[16 * 32] = {};
  EXPECT_DEATH(amx::scores(k, 32, qp, 32, 16, 1.0f, st), "no tile configuration loaded");
}

}  // namespace
}  // namespace qkv::testing
