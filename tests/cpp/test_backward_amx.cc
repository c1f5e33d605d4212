// The flash backward's bf16 products on AMX tiles (AmxBackward, kernels/cpu/backward_products-
// inl.h) and on vdpbf16ps pairs (PairBackward) against the f64 oracle, within DESIGN.md's
// tolerance: 4x the error of the plain implementation that rounds what the paths round
// (plain_backward_bf16: dout, p and du to bf16 where they enter a product), over every mask,
// bias (with dbias) and softcap, odd sizes, GQA, D = 130 with Dv = 24, BHSD strides and a decode
// row; the same bits on any thread count; the widened path when both are switched off. Each case
// logs its error over its tolerance. In qkv_tests the tiles' tests skip on CPUs without
// AMX-BF16 (qkv_amx_emulated_tests runs them on the C++ model of the tile instructions wherever
// the CPU has AVX512-BF16) and the pairs' on CPUs without AVX512-BF16 (pinned there, so they
// run on Intel CPUs too, where the kernel would not pick them).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "attention_case.h"
#include "bf16_skip.h"
#include "kernels/cpu/amx.h"
#include "kernels/product_path.h"
#include "qkv/attention_backward.h"

namespace qkv::testing {
namespace {

std::vector<Case> backward_amx_cases() {
  std::vector<Case> cases = {
      {.batch = 2, .seq_q = 7, .seq_kv = 9, .num_heads_q = 2, .num_heads_kv = 1, .head_dim = 8},
      {.batch = 1,
       .seq_q = 200,
       .seq_kv = 200,
       .num_heads_q = 2,
       .num_heads_kv = 1,
       .head_dim = 64,
       .causal = true},
      {.batch = 1,
       .seq_q = 70,
       .seq_kv = 300,
       .num_heads_q = 2,
       .num_heads_kv = 2,
       .head_dim = 130,
       .head_dim_v = 24,
       .causal = true,
       .align = Align::kTopLeft},
      {.batch = 2,
       .seq_q = 150,
       .seq_kv = 203,
       .num_heads_q = 4,
       .num_heads_kv = 2,
       .head_dim = 40},
      {.batch = 1,
       .seq_q = 257,
       .seq_kv = 257,
       .num_heads_q = 2,
       .num_heads_kv = 2,
       .head_dim = 32,
       .window_left = 70,
       .window_right = 5,
       .softcap = 3.0f},
      {.batch = 3,
       .seq_q = 90,
       .seq_kv = 180,
       .num_heads_q = 2,
       .num_heads_kv = 1,
       .head_dim = 16,
       .key_lengths = true,
       .nan_padding = true,
       .mask = MaskKind::kKeyPadding,
       .bhsd = true},
      {.batch = 1,
       .seq_q = 1,
       .seq_kv = 333,
       .num_heads_q = 8,
       .num_heads_kv = 2,
       .head_dim = 64,
       .causal = true},
      {.batch = 2,
       .seq_q = 131,
       .seq_kv = 77,
       .num_heads_q = 4,
       .num_heads_kv = 2,
       .head_dim = 16,
       .bias = BiasKind::kShared},
      {.batch = 3,
       .seq_q = 70,
       .seq_kv = 90,
       .num_heads_q = 2,
       .num_heads_kv = 2,
       .head_dim = 8,
       .key_lengths = true,
       .bias = BiasKind::kPerKey},
      {.batch = 2,
       .seq_q = 100,
       .seq_kv = 100,
       .num_heads_q = 2,
       .num_heads_kv = 1,
       .head_dim = 8,
       .causal = true,
       .bias = BiasKind::kPerHeadRow,
       .softcap = 2.5f},
      {.batch = 1,
       .seq_q = 66,
       .seq_kv = 40,
       .num_heads_q = 2,
       .num_heads_kv = 2,
       .head_dim = 8,
       .bias = BiasKind::kWithNegInf},
      {.batch = 2,
       .seq_q = 65,
       .seq_kv = 129,
       .num_heads_q = 3,
       .num_heads_kv = 3,
       .head_dim = 128,
       .mask = MaskKind::kRandom,
       .input_scale = 3.0f},
      {.batch = 2,
       .seq_q = 97,
       .seq_kv = 140,
       .num_heads_q = 4,
       .num_heads_kv = 2,
       .head_dim = 48,
       .causal = true,
       .dim_strided = true},
  };
  for (Case& c : cases) c.dtype = DType::kBF16;
  return cases;
}

// The flash backward of `c` on the path the switches leave (tiles, pairs or widened), against
// the oracle: within the plain bf16 implementation's tolerance on the tiles and pairs, 2e-5
// widened.
void expect_backward_matches_reference(const Case& c, const char* path, float dropout_p = 0.0f) {
  SCOPED_TRACE(c.name() + (dropout_p > 0.0f ? " dropout" : ""));
  Problem pr(c);
  AttentionParams params = pr.params();
  params.dropout_p = dropout_p;
  params.seed = 11;
  params.offset = 5;
  ASSERT_STREQ(backward_product_path(params, DType::kBF16), path);
  const bool rounds = std::string(path) != "bf16-widened-fma";
  std::vector<float> dout = normal_values(pr.q.size() / c.head_dim * pr.head_dim_v(), 8);
  const bool with_dbias = !pr.bias.empty();
  const Grads ref = run_backward(pr, params, dout, with_dbias, 0, Kernel::kReference);
  const Grads flash = run_backward(pr, params, dout, with_dbias, 0, Kernel::kFlash);
  const Grads plain = rounds ? plain_backward_bf16(pr, params, dout, with_dbias) : Grads{};
  std::string ratios;
  for (auto [name, a, b, yardstick] : {std::tuple{"dq", &flash.dq, &ref.dq, &plain.dq},
                                       {"dk", &flash.dk, &ref.dk, &plain.dk},
                                       {"dv", &flash.dv, &ref.dv, &plain.dv},
                                       {"dbias", &flash.dbias, &ref.dbias, &plain.dbias}}) {
    if (b->empty()) continue;
    const double error = max_abs_diff(*a, *b);
    const double tol = rounds ? tolerance(*b, *yardstick) : 2e-5 * std::max(1.0, max_abs(*b));
    EXPECT_LE(error, tol) << name;
    // The path rounds as the plain loops do, so it lies far closer to them than they lie to
    // the oracle: within half their error (measured: at most 6.8% of it, where a rounded p
    // flips to a neighbour; a dk scaled 0.1% wrong breaks this, not the tolerance).
    if (rounds) {
      EXPECT_LE(max_abs_diff(*a, *yardstick), 0.125 * tol) << name << " vs the plain loops";
    }
    char buf[128];
    std::snprintf(buf, sizeof(buf), " %s %.3g/%.3g=%.2f (vs plain %.3g)", name, error, tol,
                  error / tol, rounds ? max_abs_diff(*a, *yardstick) : 0.0);
    ratios += buf;
  }
  std::printf("[ backward %s ] %s%s:%s\n", path, c.name().c_str(),
              dropout_p > 0.0f ? " dropout" : "", ratios.c_str());
}

// Pins the backward's bf16 products to `path` for the scope (the kernel's own choice after).
struct PinnedBackward {
  explicit PinnedBackward(ProductPath path)
      : pinned(pin_backward_product_path(DType::kBF16, path)) {}
  ~PinnedBackward() { unpin_flash_product_path(); }
  bool pinned;
};

void expect_same_bits_on_any_thread_count() {
  for (const Case& c : backward_amx_cases()) {
    SCOPED_TRACE(c.name());
    Problem pr(c);
    const AttentionParams params = pr.params();
    std::vector<float> dout = normal_values(pr.q.size() / c.head_dim * pr.head_dim_v(), 9);
    expect_same_grads_on_any_thread_count(pr, params, dout, {2, 3});
  }
}

TEST(BackwardAmx, MatchesReferenceWithinThePlainBf16Error) {
  QKV_SKIP_WITHOUT_AMX();
  const PinnedBackward pin(ProductPath::kBf16Amx);
  ASSERT_TRUE(pin.pinned);
  for (const Case& c : backward_amx_cases()) expect_backward_matches_reference(c, "bf16-amx");
}

// Dropout: p z weights dout in dv, z dp enters ds (the forward's mask, rebuilt by the kernel).
TEST(BackwardAmx, DropoutMatchesReferenceWithinThePlainBf16Error) {
  QKV_SKIP_WITHOUT_AMX();
  const PinnedBackward pin(ProductPath::kBf16Amx);
  ASSERT_TRUE(pin.pinned);
  const std::vector<Case> cases = backward_amx_cases();
  for (const std::size_t i : {std::size_t{1}, std::size_t{3}, std::size_t{4}, std::size_t{9}}) {
    expect_backward_matches_reference(cases[i], "bf16-amx", 0.2f);
  }
}

TEST(BackwardAmx, WidenedWhereTheTilesAndPairsAreOff) {
  const PinnedBackward pin(ProductPath::kBf16Widened);
  ASSERT_TRUE(pin.pinned);
  for (const Case& c : backward_amx_cases()) {
    expect_backward_matches_reference(c, "bf16-widened-fma");
  }
}

// Each task and each dbias task loads its own tile configuration; dq's turns fix the order of
// its sums: the same bits on any thread count.
TEST(BackwardAmx, SameBitsOnAnyThreadCount) {
  QKV_SKIP_WITHOUT_AMX();
  const PinnedBackward pin(ProductPath::kBf16Amx);
  ASSERT_TRUE(pin.pinned);
  expect_same_bits_on_any_thread_count();
}

TEST(BackwardPairs, MatchesReferenceWithinThePlainBf16Error) {
  QKV_SKIP_WITHOUT_BF16();
  const PinnedBackward pin(ProductPath::kBf16Pairs);
  ASSERT_TRUE(pin.pinned);
  for (const Case& c : backward_amx_cases()) {
    expect_backward_matches_reference(c, "bf16-vdpbf16ps");
  }
}

TEST(BackwardPairs, DropoutMatchesReferenceWithinThePlainBf16Error) {
  QKV_SKIP_WITHOUT_BF16();
  const PinnedBackward pin(ProductPath::kBf16Pairs);
  ASSERT_TRUE(pin.pinned);
  const std::vector<Case> cases = backward_amx_cases();
  for (const std::size_t i : {std::size_t{1}, std::size_t{3}, std::size_t{4}, std::size_t{9}}) {
    expect_backward_matches_reference(cases[i], "bf16-vdpbf16ps", 0.2f);
  }
}

TEST(BackwardPairs, SameBitsOnAnyThreadCount) {
  QKV_SKIP_WITHOUT_BF16();
  const PinnedBackward pin(ProductPath::kBf16Pairs);
  ASSERT_TRUE(pin.pinned);
  expect_same_bits_on_any_thread_count();
}

}  // namespace
}  // namespace qkv::testing
