// attention_block and merge_attention (qkv/block_attention.h): a problem cut into query blocks
// and key blocks at uneven points, each pair computed at its positions and the key blocks merged
// (in two orders), equals attention over the whole, out and lse, for causal in both alignments,
// windows narrower than a block and wider than several, key lengths ending inside a block, GQA,
// Lq != Lk, Dv != D, bf16, every kernel. Rows that no key of any block allows stay 0 / -inf.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_case.h"
#include "expect_error.h"
#include "qkv/block_attention.h"

namespace qkv::testing {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// [start, end) of each piece when [0, n) is cut at `cuts` (sorted, inside (0, n)).
std::vector<std::pair<std::int64_t, std::int64_t>> pieces(std::int64_t n,
                                                          std::vector<std::int64_t> cuts) {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  std::int64_t start = 0;
  cuts.push_back(n);
  for (std::int64_t cut : cuts) {
    if (cut > start && cut <= n) out.emplace_back(start, cut), start = cut;
  }
  return out;
}

// dim 1 of `view` narrowed to [start, end).
TensorView rows(TensorView view, std::int64_t start, std::int64_t end) {
  view.data = static_cast<char*>(view.data) + start * view.strides[1] * dtype_size(view.dtype);
  view.sizes[1] = end - start;
  return view;
}

// The problem computed block by block: for each query block, its key blocks in `order`
// (forward or backward), each merged into the running result.
Result blockwise(const Problem& p, Kernel kernel, const std::vector<std::int64_t>& q_cuts,
                 const std::vector<std::int64_t>& k_cuts, bool backward) {
  const Case& c = p.spec();
  auto& self = const_cast<Problem&>(p);
  TensorView q = p.view(self.q, c.seq_q, c.num_heads_q, c.head_dim);
  TensorView k = p.view(self.k, c.seq_kv, c.num_heads_kv, c.head_dim);
  TensorView v = p.view(self.v, c.seq_kv, c.num_heads_kv, p.head_dim_v());
  if (c.dtype != DType::kF32) {
    for (auto [view, bits] : {std::pair{&q, &self.q16}, {&k, &self.k16}, {&v, &self.v16}}) {
      view->data = bits->data();
      view->dtype = c.dtype;
    }
  }
  Result r;
  r.out.assign(c.batch * c.seq_q * c.num_heads_q * p.head_dim_v(), 0.0f);
  r.lse.assign(c.batch * c.num_heads_q * c.seq_q, kNegInf);
  AttentionParams params = p.params();
  params.kernel = kernel;
  auto key_blocks = pieces(c.seq_kv, k_cuts);
  if (backward) std::reverse(key_blocks.begin(), key_blocks.end());
  for (const auto& [q0, q1] : pieces(c.seq_q, q_cuts)) {
    const std::int64_t n = q1 - q0;
    std::vector<float> out_all(c.batch * n * c.num_heads_q * p.head_dim_v(), 0.0f);
    std::vector<float> lse_all(c.batch * c.num_heads_q * n, kNegInf);
    const TensorView out = TensorView::contiguous(out_all.data(), DType::kF32,
                                                  {c.batch, n, c.num_heads_q, p.head_dim_v()});
    const TensorView lse =
        TensorView::contiguous(lse_all.data(), DType::kF32, {c.batch, c.num_heads_q, n, 1});
    for (const auto& [k0, k1] : key_blocks) {
      std::vector<float> part_out(out_all.size(), 7.0f), part_lse(lse_all.size(), 7.0f);
      const TensorView po = TensorView::contiguous(part_out.data(), DType::kF32, out.sizes);
      const TensorView pl = TensorView::contiguous(part_lse.data(), DType::kF32, lse.sizes);
      attention_block(rows(q, q0, q1), rows(k, k0, k1), rows(v, k0, k1), {.out = po, .lse = pl},
                      params,
                      {.q_offset = q0, .k_offset = k0, .seq_q = c.seq_q, .seq_kv = c.seq_kv});
      merge_attention(out, lse, po, pl);
    }
    for (std::int64_t b = 0; b < c.batch; ++b) {
      for (std::int64_t i = 0; i < n; ++i) {
        for (std::int64_t h = 0; h < c.num_heads_q; ++h) {
          for (std::int64_t d = 0; d < p.head_dim_v(); ++d) {
            r.out[((b * c.seq_q + q0 + i) * c.num_heads_q + h) * p.head_dim_v() + d] =
                out_all[((b * n + i) * c.num_heads_q + h) * p.head_dim_v() + d];
          }
          r.lse[(b * c.num_heads_q + h) * c.seq_q + q0 + i] = lse_all[(b * c.num_heads_q + h) * n + i];
        }
      }
    }
  }
  return r;
}

struct BlockCase {
  Case c;
  std::vector<std::int64_t> q_cuts, k_cuts;
};

std::vector<BlockCase> block_cases() {
  std::vector<BlockCase> cases;
  for (Align align : {Align::kBottomRight, Align::kTopLeft}) {
    cases.push_back({{.batch = 2, .seq_q = 70, .seq_kv = 70, .num_heads_q = 4, .num_heads_kv = 2,
                      .head_dim = 32, .causal = true, .align = align},
                     {17, 50}, {9, 40, 41}});
    cases.push_back({{.batch = 1, .seq_q = 33, .seq_kv = 90, .num_heads_q = 2, .num_heads_kv = 1,
                      .head_dim = 16, .head_dim_v = 7, .causal = true, .align = align},
                     {10}, {30, 60}});
    cases.push_back({{.batch = 1, .seq_q = 90, .seq_kv = 33, .num_heads_q = 3, .num_heads_kv = 3,
                      .head_dim = 8, .causal = true, .align = align},
                     {45, 46}, {11}});
    // Windows narrower than one block and wider than several.
    cases.push_back({{.batch = 1, .seq_q = 100, .seq_kv = 100, .num_heads_q = 2, .num_heads_kv = 1,
                      .head_dim = 16, .align = align, .window_left = 5, .window_right = 3},
                     {25, 50, 75}, {25, 50, 75}});
    cases.push_back({{.batch = 1, .seq_q = 100, .seq_kv = 100, .num_heads_q = 2, .num_heads_kv = 2,
                      .head_dim = 16, .causal = true, .align = align, .window_left = 60},
                     {20, 40, 60, 80}, {33, 66}});
  }
  // Key lengths ending inside blocks (one batch entry 0: rows with no key at all), softcap,
  // a scale, bf16 storage.
  cases.push_back({{.batch = 3, .seq_q = 40, .seq_kv = 65, .num_heads_q = 4, .num_heads_kv = 1,
                    .head_dim = 24, .key_lengths = true, .softcap = 5.0f},
                   {13}, {20, 21, 50}});
  cases.push_back({{.batch = 2, .seq_q = 64, .seq_kv = 64, .num_heads_q = 2, .num_heads_kv = 2,
                    .head_dim = 64, .causal = true, .scale = 0.2f, .dtype = DType::kBF16},
                   {32}, {16, 48}});
  cases.push_back({{.batch = 1, .seq_q = 1, .seq_kv = 200, .num_heads_q = 8, .num_heads_kv = 2,
                    .head_dim = 32, .causal = true},
                   {}, {50, 100, 150}});  // decode against a sharded cache
  return cases;
}

TEST(BlockAttention, BlocksMergedEqualTheWhole) {
  for (const BlockCase& bc : block_cases()) {
    const Problem p(bc.c);
    const Result whole = p.run(Kernel::kReference, false);
    const double tolerance = std::max(2e-5, 4 * max_abs_diff(p.plain().out, whole.out)) *
                             std::max(1.0, max_abs(whole.out));
    for (Kernel kernel : {Kernel::kFlash, Kernel::kChunked, Kernel::kReference}) {
      for (bool backward : {false, true}) {
        SCOPED_TRACE(bc.c.name() + " kernel " + std::to_string(int(kernel)) +
                     (backward ? " backward" : " forward"));
        const Result blocks = blockwise(p, kernel, bc.q_cuts, bc.k_cuts, backward);
        EXPECT_LE(max_abs_diff(blocks.out, whole.out), tolerance);
        EXPECT_LE(max_abs_diff(blocks.lse, whole.lse), 1e-4 * std::max(1.0, max_abs(whole.lse)));
        for (std::size_t i = 0; i < whole.lse.size(); ++i) {
          ASSERT_EQ(std::isinf(blocks.lse[i]), std::isinf(whole.lse[i])) << "row " << i;
        }
        for (float x : blocks.out) ASSERT_FALSE(std::isnan(x));
      }
    }
  }
}

TEST(BlockAttention, MergeKeepsEmptyRowsAndTakesTheOtherSide) {
  // Rows: both empty; only a; only b; both.
  std::vector<float> out = {0, 0, 1, 2, 0, 0, 3, 5}, lse = {kNegInf, 0.5f, kNegInf, 1.0f};
  const std::vector<float> out_b = {0, 0, 0, 0, 7, 8, 9, 11}, lse_b = {kNegInf, kNegInf, 2.0f, 1.0f};
  merge_attention(TensorView::contiguous(out.data(), DType::kF32, {1, 4, 1, 2}),
                  TensorView::contiguous(lse.data(), DType::kF32, {1, 1, 4, 1}),
                  TensorView::contiguous(const_cast<float*>(out_b.data()), DType::kF32, {1, 4, 1, 2}),
                  TensorView::contiguous(const_cast<float*>(lse_b.data()), DType::kF32, {1, 1, 4, 1}));
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(lse[0], kNegInf);
  EXPECT_EQ(out[2], 1.0f);
  EXPECT_EQ(out[3], 2.0f);
  EXPECT_EQ(lse[1], 0.5f);
  EXPECT_EQ(out[4], 7.0f);
  EXPECT_EQ(lse[2], 2.0f);
  EXPECT_FLOAT_EQ(out[6], 6.0f);  // equal weights: the mean
  EXPECT_FLOAT_EQ(out[7], 8.0f);
  EXPECT_FLOAT_EQ(lse[3], 1.0f + std::log(2.0f));
}

TEST(BlockAttention, ErrorsNameTheArgument) {
  std::vector<float> q(2 * 4 * 8, 0.5f), k(2 * 6 * 8, 0.5f), out(2 * 4 * 8), lse(2 * 4);
  const TensorView qv = TensorView::contiguous(q.data(), DType::kF32, {1, 4, 2, 8});
  const TensorView kv = TensorView::contiguous(k.data(), DType::kF32, {1, 6, 2, 8});
  const TensorView ov = TensorView::contiguous(out.data(), DType::kF32, {1, 4, 2, 8});
  const TensorView lv = TensorView::contiguous(lse.data(), DType::kF32, {1, 2, 4, 1});
  auto run = [&](BlockPositions pos, AttentionParams params = {}) {
    attention_block(qv, kv, kv, {.out = ov, .lse = lv}, params, pos);
  };
  expect_error([&] { run({.q_offset = 0, .k_offset = 0, .seq_q = 3, .seq_kv = 6}); },
               "positions: q_offset = 0 and seq_q = 3 do not hold a block of 4");
  expect_error([&] { run({.q_offset = 2, .k_offset = 1, .seq_q = 8, .seq_kv = 6}); },
               "positions: k_offset = 1 and seq_kv = 6 do not hold a block of 6");
  expect_error([&] { run({.q_offset = -1, .k_offset = 0, .seq_q = 8, .seq_kv = 6}); },
               "positions: q_offset = -1");
  std::vector<std::uint8_t> mask(24, 1);
  expect_error(
      [&] {
        run({.seq_q = 4, .seq_kv = 6},
            {.mask = TensorView::contiguous(mask.data(), DType::kU8, {1, 1, 4, 6})});
      },
      "mask: not available for a block");
  const std::int64_t lengths[] = {7};
  expect_error([&] { run({.seq_q = 4, .seq_kv = 6}, {.key_lengths = lengths}); },
               "key_lengths: entry 0 is 7, outside [0, seq_kv = 6]");
  // A whole-sequence key length past the block is fine: the block sees all its keys.
  const std::int64_t long_lengths[] = {100};
  EXPECT_NO_THROW(run({.k_offset = 50, .seq_q = 4, .seq_kv = 100}, {.key_lengths = long_lengths}));
  expect_error(
      [&] {
        merge_attention(ov, lv, ov, lv);
      },
      "out: its memory overlaps out_b's");
  std::vector<float> other(2 * 4 * 8);
  expect_error(
      [&] {
        merge_attention(ov, lv, TensorView::contiguous(other.data(), DType::kF32, {1, 4, 2, 7}),
                        lv);
      },
      "out_b: shape (1, 4, 2, 7) must be (1, 4, 2, 8)");
}

}  // namespace
}  // namespace qkv::testing
