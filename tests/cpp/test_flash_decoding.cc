// Flash-decoding: the flash kernel on decode shapes (few queries, long keys), where it splits the
// keys into ranges merged with their LSEs and runs blocks of few rows on its row-by-row decode
// path (src/kernels/cpu/flash_forward.cc, docs/kernels.md). Against the reference oracle with
// DESIGN.md section 5's tolerance: Lq in {1, 2, 5}, Lk in {1, 100, 2047, 4099, 20000}, GQA 32:8
// and MQA 8:1, key lengths (0 and partial, NaN past them), causal bottom-right, windows, -inf
// bias, masks, softcap, odd head dims, BHSD, Longformer sparsity; on every Highway target; and
// bit-identical on 1, 2, 3 and 5 threads.
//
// Which shapes split: fewer than 64 query blocks (a block holds up to 64 rows of one kv head's
// (head, query) space on AVX-512, 16 on AVX2), or fewer than 128 when every block is narrow (at
// most 16 rows per kv head on AVX-512, 4 on AVX2), and Lk >= 2048. So Lk = 4099 and 20000 split
// here and Lk <= 2047 does not; the decode path takes blocks of at most 16 rows (AVX-512; 4 on
// AVX2).
#include <gtest/gtest.h>

#include <cstring>

#include "attention_case.h"
#include "every_target.h"
#include "kernels/kernels.h"
#include "qkv/sparse.h"

namespace qkv::testing {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct DecodeCase {
  Case c;
  std::vector<std::int64_t> global = {};  // Longformer global positions (with sparse_window)
  std::int64_t sparse_window = -1;        // >= 0: Longformer sparsity of this window
  std::int64_t sparse_dilation = 1;
  std::string name() const {
    std::string s = c.name();
    if (sparse_window >= 0) {
      s += "_longformer" + std::to_string(sparse_window) + "d" + std::to_string(sparse_dilation);
    }
    return s;
  }
};
void PrintTo(const DecodeCase& c, std::ostream* os) { *os << c.name(); }

AttentionParams params_of(const Problem& pr, const DecodeCase& dc) {
  AttentionParams params = pr.params();
  if (dc.sparse_window >= 0) {
    params.sparsity = LongformerSparsity{
        .window = dc.sparse_window, .dilation = dc.sparse_dilation, .global = dc.global};
  }
  return params;
}

// qkv::attention with the case's params (and sparsity) on `kernel`.
Result run(const Problem& pr, const DecodeCase& dc, Kernel kernel) {
  AttentionParams params = params_of(pr, dc);
  params.kernel = kernel;
  return pr.run_with(params, /*with_probs=*/false);
}

// Two batch entries of `seq_q` queries on `seq_kv` keys, 32 query heads on 8 kv heads: the base
// of the mask and the sparsity cases.
DecodeCase gqa_32_8(std::int64_t seq_q, std::int64_t seq_kv) {
  const Case c{.batch = 2, .seq_q = seq_q, .seq_kv = seq_kv, .num_heads_q = 32, .num_heads_kv = 8};
  return {.c = c};
}

std::vector<DecodeCase> decode_cases() {
  std::vector<DecodeCase> cases;
  std::uint64_t seed = 900;
  auto add = [&](DecodeCase dc) {
    dc.c.seed = seed++;
    cases.push_back(dc);
  };
  // The sweep: every (heads, Lq, Lk), causal bottom-right with key lengths (one batch entry has
  // none, the others part; NaN past them, which a split must never read).
  for (auto [hq, hkv] : {std::pair{32, 8}, {8, 1}}) {
    for (std::int64_t lq : {1, 2, 5}) {
      for (std::int64_t lk : {1, 100, 2047, 4099, 20000}) {
        DecodeCase dc{.c = {.seq_q = lq, .seq_kv = lk, .num_heads_q = hq, .num_heads_kv = hkv}};
        dc.c.batch = lk >= 20000 ? 2 : 3;
        dc.c.head_dim = lk >= 20000 ? 32 : 64;
        dc.c.causal = dc.c.key_lengths = dc.c.nan_padding = true;
        add(dc);
      }
    }
  }
  // Every key, no padding (the splits all hold keys); head_dim 128 (the bench shape's).
  for (std::int64_t lq : {1, 2}) {
    for (std::int64_t lk : {2047, 4099}) {
      const Case c{
          .seq_q = lq, .seq_kv = lk, .num_heads_q = 32, .num_heads_kv = 8, .head_dim = 128};
      add({.c = c});
    }
  }
  // Multi-head decoding (Hq = Hkv) and GQA at B = 4: 32 to 127 narrow query blocks, which split
  // the keys since 2026-12-03, in groups of up to 32 within one batch entry's heads (on AVX-512:
  // B = 2, Hkv = 24 in groups of 24; B = 3, Hkv = 40 in groups of 20), with key lengths and NaN
  // padding past them.
  for (auto [b, hq, hkv, lk, d] : {std::tuple{1, 32, 32, 4099, 64}, {2, 24, 24, 4099, 64},
                                   {4, 32, 8, 4099, 64}, {3, 40, 40, 2100, 16}}) {
    DecodeCase dc{.c = {.batch = b, .seq_q = 1, .seq_kv = lk, .num_heads_q = hq}};
    dc.c.num_heads_kv = hkv;
    dc.c.head_dim = d;
    dc.c.key_lengths = dc.c.nan_padding = b > 1;
    add(dc);
  }
  // The same in BHSD, where every narrow block is a task of its own (one head's K and V rows as
  // two runs, flash_forward.cc PlanWork): multi-head at B = 1 and 2 (key lengths, NaN past them)
  // and GQA, split; 128 blocks, which do not split.
  for (auto [b, hq, hkv, lk] : {std::tuple{1, 32, 32, 4099}, {2, 12, 12, 8191},
                                {2, 16, 4, 4099}, {4, 32, 32, 300}}) {
    DecodeCase dc{.c = {.batch = b, .seq_q = 1, .seq_kv = lk, .num_heads_q = hq}};
    dc.c.num_heads_kv = hkv;
    dc.c.head_dim = 64;
    dc.c.key_lengths = dc.c.nan_padding = b > 1;
    dc.c.bhsd = true;
    add(dc);
  }
  // Masks and biases on split shapes and on one that does not split; GQA 32:8 (4 or 20 rows
  // per kv head) and multi-head 8:8 (1 or 5: one-row blocks, whose softmax runs along the keys).
  for (auto [hq, hkv] : {std::pair{32, 8}, {8, 8}}) {
    for (std::int64_t lk : {2047, 4099}) {
      for (std::int64_t lq : {1, 5}) {
        DecodeCase dc = gqa_32_8(lq, lk);
        dc.c.num_heads_q = hq;
        dc.c.num_heads_kv = hkv;
        dc.c.head_dim = 48;
        // A window that leaves most splits empty, with causal (bottom-right).
        dc.c.causal = true;
        dc.c.window_left = 700;
        dc.c.key_lengths = true;
        add(dc);
        dc.c.causal = false;
        dc.c.window_left = -1;
        dc.c.key_lengths = false;
        dc.c.bias = BiasKind::kWithNegInf;  // -inf bias entries (whole rows for some)
        add(dc);
        dc.c.bias = BiasKind::kPerHeadRow;
        dc.c.mask = MaskKind::kRandom;
        add(dc);
        dc.c.mask = MaskKind::kNone;
        dc.c.bias = BiasKind::kNone;
        dc.c.softcap = 20.0f;
        dc.c.head_dim = 40;  // not a multiple of the lanes
        dc.c.head_dim_v = 24;
        add(dc);
        dc.c.softcap = 0.0f;
        dc.c.head_dim = 64;
        dc.c.head_dim_v = -1;
        dc.c.bhsd = true;
        dc.c.num_heads_q = 6;  // GQA 6:2 or multi-head 6:6, BHSD strides
        dc.c.num_heads_kv = hq == hkv ? 6 : 2;
        add(dc);
      }
    }
  }
  // Top-left causal with Lq > 1: the early rows see only the first keys (most splits empty).
  {
    DecodeCase dc{.c = {.seq_q = 5, .seq_kv = 4099, .num_heads_q = 8, .num_heads_kv = 1}};
    dc.c.causal = true;
    dc.c.align = Align::kTopLeft;
    add(dc);
  }
  // Longformer: a band at the end of the keys plus global columns near the start, so the split
  // in between has nothing; and with dilation.
  for (std::int64_t lq : {1, 2}) {
    for (std::int64_t lk : {4099, 20000}) {
      DecodeCase dc = gqa_32_8(lq, lk);
      dc.c.head_dim = 32;
      dc.c.key_lengths = lk < 20000;
      dc.sparse_window = 300;
      dc.global = {5, 0, 1500};
      add(dc);
      dc.sparse_dilation = 3;
      dc.global = {};
      add(dc);
    }
  }
  {  // The same on one-row blocks (multi-head 8:8), whose sparsity is applied pair by pair.
    DecodeCase dc = gqa_32_8(1, 4099);
    dc.c.num_heads_q = dc.c.num_heads_kv = 8;
    dc.c.head_dim = 32;
    dc.c.key_lengths = true;
    dc.sparse_window = 300;
    dc.global = {5, 0, 1500};
    add(dc);
  }
  return cases;
}

void check_against_reference(const DecodeCase& dc) {
  const Problem pr(dc.c);
  const Result ref = run(pr, dc, Kernel::kReference);
  const Result flash = run(pr, dc, Kernel::kFlash);
  // DESIGN.md section 5: max(2e-5 * max(1, max|ref|), 4 x the plain f32 error). The plain f32
  // loops do not know sparsity: sparse cases use the 2e-5 term (unit-scale inputs).
  const double tol = dc.sparse_window >= 0 ? 2e-5 * std::max(1.0, max_abs(ref.out))
                                           : tolerance(ref.out, pr.plain().out);
  EXPECT_LE(max_abs_diff(flash.out, ref.out), tol) << "out";
  EXPECT_LE(max_abs_diff(flash.lse, ref.lse), 2e-5 * std::max(1.0, max_abs(ref.lse))) << "lse";
  for (float x : flash.out) ASSERT_FALSE(std::isnan(x));
  // Rows with no allowed key: out exactly 0, lse exactly -inf (the reference agrees on which).
  const std::int64_t dv = pr.head_dim_v();
  for (std::size_t row = 0; row < ref.lse.size(); ++row) {
    if (ref.lse[row] != kNegInf) continue;
    ASSERT_EQ(flash.lse[row], kNegInf) << "row " << row;
    // lse is [B, Hq, Lq]; out is [B, Lq, Hq, Dv] (BSHD) or [B, Hq, Lq, Dv] (BHSD).
    const std::int64_t b = row / (dc.c.num_heads_q * dc.c.seq_q);
    const std::int64_t h = row / dc.c.seq_q % dc.c.num_heads_q, i = row % dc.c.seq_q;
    const std::int64_t out_row = dc.c.bhsd ? row : (b * dc.c.seq_q + i) * dc.c.num_heads_q + h;
    for (std::int64_t e = 0; e < dv; ++e) ASSERT_EQ(flash.out[out_row * dv + e], 0.0f);
  }
}

class FlashDecoding : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(FlashDecoding, MatchesReference) { check_against_reference(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, FlashDecoding, ::testing::ValuesIn(decode_cases()),
                         [](const auto& info) { return info.param.name(); });

// The same on every compiled target this CPU supports (AVX2 has 16-row blocks and a 4-row
// decode path; SCALAR 4 and 1), over a third of the cases.
TEST(FlashDecodingTargets, EveryTargetMatchesReference) {
  const std::vector<DecodeCase> cases = decode_cases();
  for_each_target(attention_cpu_target_name, [&](std::int64_t target) {
    for (std::size_t i = target % 3; i < cases.size(); i += 3) {
      if (cases[i].c.seq_kv >= 20000) continue;  // the scalar target takes a while
      SCOPED_TRACE(cases[i].name());
      check_against_reference(cases[i]);
    }
  });
}

// The splits are fixed by the shape and merged in a fixed order: the same bits on any number of
// threads, on every target.
TEST(FlashDecodingThreads, BitIdenticalWhateverTheThreadCount) {
  std::vector<DecodeCase> cases;
  for (auto [lq, hq, hkv] :
       {std::tuple{1, 32, 8}, {1, 8, 1}, {2, 32, 8}, {5, 32, 8}, {1, 24, 24}}) {
    DecodeCase dc{.c = {.batch = 2, .seq_q = lq, .seq_kv = 9000, .num_heads_q = hq}};
    dc.c.num_heads_kv = hkv;
    dc.c.head_dim = 64;
    dc.c.causal = dc.c.key_lengths = true;
    dc.c.bias = BiasKind::kRandom;
    dc.c.seed = 77 + lq;
    cases.push_back(dc);
  }
  cases.push_back(cases.back());  // multi-head in BHSD: one block per task
  cases.back().c.bhsd = true;
  cases.push_back(cases.front());
  cases.back().sparse_window = 200;
  cases.back().global = {3};
  for_each_target(attention_cpu_target_name, [&](std::int64_t) {
    for (const DecodeCase& dc : cases) {
      SCOPED_TRACE(dc.name());
      const Problem pr(dc.c);
      AttentionParams params = params_of(pr, dc);
      params.kernel = Kernel::kFlash;
      expect_same_bits_on_any_thread_count(pr, params);
    }
  });
}

}  // namespace
}  // namespace qkv::testing
