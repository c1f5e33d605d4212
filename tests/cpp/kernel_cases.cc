// The kernel tests' case table and their check (test_attention_kernels.cc; the emulated AMX
// tiles' binary, tests/amx_emulated/, runs the same table on the AMX path).
#include "kernel_cases.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "kernels/kernels.h"

namespace qkv::testing {
namespace {

void expect_close(const char* what, const std::string& kernel, const std::vector<float>& got,
                  const std::vector<float>& want, double tol) {
  const double err = max_abs_diff(got, want);
  EXPECT_LE(err, tol) << what << " of " << kernel << ": max abs error " << err << " > " << tol;
}

}  // namespace

std::vector<Case> kernel_cases() {
  std::vector<Case> cases;
  std::uint64_t seed = 100;
  auto add = [&](Case c) {
    c.seed = seed++;
    cases.push_back(c);
  };
  // Odd sizes, square and not, plain.
  for (std::int64_t lq : {1, 3, 7, 63, 64, 65, 127, 200}) {
    for (std::int64_t lk : {1, 7, 64, 65, 129, 200}) {
      add({.seq_q = lq, .seq_kv = lk, .head_dim = 16});
    }
  }
  // Head dims, including non-powers of two; Dv != D.
  for (std::int64_t d : {1, 16, 40, 64, 80, 96, 128, 256}) {
    add({.seq_q = 33, .seq_kv = 70, .head_dim = d});
  }
  for (std::int64_t dv : {1, 17, 48, 130}) {
    add({.seq_q = 20, .seq_kv = 150, .head_dim = 32, .head_dim_v = dv});
  }
  // GQA / MQA, batches.
  for (auto [hq, hkv] : {std::pair{4, 2}, {6, 1}, {8, 8}, {3, 3}}) {
    Case c{.batch = 2, .seq_q = 19, .seq_kv = 45, .head_dim = 24};
    c.num_heads_q = hq;
    c.num_heads_kv = hkv;
    add(c);
  }
  // Many query blocks per kv head: the flash kernel walks the keys once for several blocks
  // (and several heads of a GQA group) whose allowed ranges differ.
  for (bool causal : {false, true}) {
    Case c{.batch = 2, .seq_q = 300, .seq_kv = 310, .num_heads_q = 8, .num_heads_kv = 2};
    c.causal = causal;
    c.window_left = causal ? 100 : -1;
    c.key_lengths = c.nan_padding = true;
    add(c);
  }
  // Decoding: one or a few queries, the heads of a GQA group packed into one query block.
  for (std::int64_t lq : {1, 3}) {
    Case c{.batch = 2, .seq_kv = 300, .num_heads_q = 12, .num_heads_kv = 3, .head_dim = 32};
    c.seq_q = lq;
    c.causal = c.key_lengths = true;
    c.mask = MaskKind::kRandom;
    c.bias = BiasKind::kPerHeadRow;
    add(c);
  }
  // Long decode steps: key splits, and tasks that hold several kv heads, which the bf16
  // vdpbf16ps decode path serves in one call (runs of 4 and 8 heads, of 2 per batch with
  // different key lengths); 4 and 1 rows per block, 6 rows (4 + 1 + 1), odd head dims and an
  // odd last tile.
  {
    Case c{.seq_q = 1, .seq_kv = 4096, .num_heads_q = 32, .num_heads_kv = 8, .head_dim = 128};
    add(c);
    c.num_heads_q = c.num_heads_kv = 16;
    c.head_dim = 40;
    c.head_dim_v = 17;
    add(c);
    c.batch = 2;
    c.seq_kv = 8191;
    c.num_heads_q = 12;
    c.num_heads_kv = 2;
    c.head_dim = 33;
    c.head_dim_v = 130;
    c.key_lengths = c.causal = true;
    add(c);
    c.seq_q = 2;  // 2 queries x 6 heads: 12 rows
    c.seq_kv = 4097;
    add(c);
    // BHSD, where each narrow block is a task of its own: multi-head and GQA, split.
    c.seq_q = 1;
    c.num_heads_q = c.num_heads_kv = 6;
    c.head_dim = c.head_dim_v = 64;
    c.bhsd = true;
    add(c);
    c.num_heads_q = 12;
    c.head_dim = 33;
    c.head_dim_v = 130;
    c.key_lengths = false;
    add(c);
    // BHSD decode steps whose blocks are wide (12 rows of a 4:1 group; 32 rows, two blocks per
    // kv head on AVX2): V staged reading ahead (Staging::read_ahead); an odd last tile.
    c = Case{.seq_q = 3, .seq_kv = 1500, .num_heads_q = 8, .num_heads_kv = 2, .head_dim = 48};
    c.head_dim_v = 72;
    c.bhsd = true;
    add(c);
    c.seq_q = 4;
    c.num_heads_q = 16;
    c.causal = true;
    add(c);
    // The same in BSHD with K rows 2 KiB apart (4 kv heads, D = 128): an f32 K read in place
    // (Staging::k_in_place); 12 rows, Lk past a tile boundary.
    c = Case{.seq_q = 3, .seq_kv = 1100, .num_heads_q = 16, .num_heads_kv = 4, .head_dim = 128};
    c.head_dim_v = 40;
    add(c);
    // A chunk of queries against a long cache: 9 blocks of 16 rows per kv head on AVX2 (72 in
    // all), fewer than kSplitBelowItems there, so the keys split with groups of wide blocks;
    // causal (bottom-right) with an odd last tile.
    c = Case{.seq_q = 130, .seq_kv = 2100, .num_heads_q = 8, .num_heads_kv = 8, .head_dim = 16};
    c.causal = true;
    add(c);
  }
  // Causal and windows, both alignments, Lq <, =, > Lk.
  for (Align align : {Align::kBottomRight, Align::kTopLeft}) {
    for (auto [lq, lk] : {std::pair{70, 70}, {65, 200}, {200, 65}, {1, 300}, {130, 131}}) {
      Case c{.seq_q = lq, .seq_kv = lk, .head_dim = 32, .align = align};
      for (auto [causal, left, right] :
           {std::tuple{true, -1, -1}, {false, 17, 5}, {false, 0, -1}, {true, 40, -1}}) {
        c.causal = causal;
        c.window_left = left;
        c.window_right = right;
        add(c);
      }
    }
  }
  // Key lengths (padding), with NaN in the padded keys and values.
  for (bool nan : {false, true}) {
    for (auto [lq, lk] : {std::pair{37, 77}, {1, 150}, {129, 129}}) {
      Case c{.batch = 3, .seq_q = lq, .seq_kv = lk, .num_heads_q = 2, .head_dim = 20};
      c.key_lengths = true;
      c.nan_padding = nan;
      add(c);
      c.causal = true;
      add(c);
    }
  }
  // Attend masks and biases, alone and combined with everything.
  const Case masked{.batch = 2, .seq_q = 45, .seq_kv = 140, .num_heads_q = 2, .head_dim = 16};
  for (MaskKind m : {MaskKind::kRandom, MaskKind::kRowBroadcast, MaskKind::kKeyPadding}) {
    Case c = masked;
    c.mask = m;
    add(c);
  }
  for (BiasKind b : {BiasKind::kRandom, BiasKind::kWithNegInf, BiasKind::kPerHeadRow}) {
    Case c = masked;
    c.bias = b;
    add(c);
  }
  {
    Case c{.batch = 3, .seq_q = 66, .seq_kv = 190, .num_heads_q = 4, .num_heads_kv = 2};
    c.head_dim = 40;
    c.head_dim_v = 24;
    c.causal = true;
    c.window_left = 60;
    c.key_lengths = c.nan_padding = true;
    c.mask = MaskKind::kRandom;
    c.bias = BiasKind::kWithNegInf;
    c.softcap = 5.0f;
    c.bhsd = true;
    add(c);
  }
  // Softcap, explicit scale, large logits (|q.k| ~ 1e3), BHSD strides.
  {
    Case c{.seq_q = 50, .seq_kv = 90, .head_dim = 64, .softcap = 30.0f};
    add(c);
    c.softcap = 0.0f;
    c.scale = 0.37f;
    add(c);
    c.scale.reset();
    c.input_scale = 4.0f;  // q.k ~ 16 * sqrt(64) ... up to ~1e3 after scale on the tails
    c.scale = 1.0f;
    add(c);
    // The same logits over 5 key tiles: the running max jumps by far more than the lazy max's
    // slack between tiles (bf16 paths that round probabilities keep a stale max otherwise).
    c.seq_kv = 600;
    add(c);
    c.seq_kv = 90;
    c.input_scale = 1.0f;
    c.scale.reset();
    c.bhsd = true;
    c.num_heads_q = 3;
    add(c);
    c.bhsd = false;
    c.dim_strided = true;  // elements along D 3 apart: the packings' strided branches
    add(c);
  }
  // Large values in a short head (|q|, |k| ~ 30, D = 2, GQA, Dv != D), the shape of the input on
  // which fuzz_attention found f16-amx-split's lse off by more than an f32-level tolerance. These
  // random values pass either way; the rows that pin the split's dropped lo x lo products are
  // test_amx.cc's Amx.F16SplitDropsTheLoLoProductsAndLseSaysSo.
  {
    Case c{.batch = 2, .seq_q = 9, .seq_kv = 42, .num_heads_q = 3, .num_heads_kv = 1};
    c.head_dim = 2;
    c.head_dim_v = 19;
    c.input_scale = 30.0f;
    add(c);
  }
  // (Appended, so the cases above keep their seeds.) Five to eight rows per kv head: narrow blocks
  // on AVX2 since 2026-12-06 (wide before; on AVX-512 up to 16 rows are), products in a group of 4
  // rows and one of 1-3. MQA 8:1 with a mask, a bias and a softcap; 2 queries of a 4:1 group (8
  // rows) causal over padded keys, split; 5 rows in BHSD with Dv != D and a window.
  {
    Case c{.batch = 2, .seq_q = 1, .seq_kv = 333, .num_heads_q = 8, .num_heads_kv = 1};
    c.head_dim = 40;
    c.head_dim_v = 17;
    c.mask = MaskKind::kRandom;
    c.bias = BiasKind::kWithNegInf;
    c.softcap = 5.0f;
    add(c);
    c = Case{.batch = 2, .seq_q = 2, .seq_kv = 2100, .num_heads_q = 8, .num_heads_kv = 2};
    c.head_dim = 64;
    c.causal = c.key_lengths = c.nan_padding = true;
    add(c);
    c = Case{.seq_q = 5, .seq_kv = 150, .num_heads_q = 2, .num_heads_kv = 2, .head_dim = 33};
    c.head_dim_v = 130;
    c.window_left = 70;
    c.bhsd = true;
    add(c);
  }
  return cases;
}

std::vector<Case> with_dtype(std::vector<Case> cases, DType dtype) {
  for (Case& c : cases) c.dtype = dtype;
  return cases;
}

void check_against_reference(const Problem& problem) {
  const Result ref = problem.run(Kernel::kReference, true);
  // Each kernel against the plain implementation of its own product path.
  const DType dtype = problem.spec().dtype;
  const ProductPath flash_path = problem.flash_path();
  const ProductPath chunked_path = WideningProductPath(dtype);
  const Result flash_plain = problem.plain(flash_path);
  const Result chunked_plain =
      chunked_path == flash_path ? flash_plain : problem.plain(chunked_path);
  const double tol = tolerance(ref.out, flash_plain.out);
  const double chunked_tol = tolerance(ref.out, chunked_plain.out);
  const double lse_tol = tolerance(ref.lse, flash_plain.lse);
  const double chunked_lse_tol = tolerance(ref.lse, chunked_plain.lse);
  // The probabilities by the same rule (a fixed 2e-5 until 2026-12-06: logits near 1e3 carry
  // |s| * 2^-24 ~ 3e-5 into p in any f32 implementation, the plain one's included).
  const double probs_tol = tolerance(ref.probs, chunked_plain.probs);
  // The reference honours the contract too: fully masked rows give out 0 / lse -inf, no NaN.
  for (float x : ref.out) ASSERT_FALSE(std::isnan(x));

  const Result flash = problem.run(Kernel::kFlash, false);
  expect_close("out", "flash", flash.out, ref.out, tol);
  expect_close("lse", "flash", flash.lse, ref.lse, lse_tol);

  double chunked_err = 0.0;
  for (std::int64_t chunk : {1, 128, 1000}) {
    const Result chunked = problem.run(Kernel::kChunked, true, 0, chunk);
    expect_close("out", "chunked", chunked.out, ref.out, chunked_tol);
    expect_close("lse", "chunked", chunked.lse, ref.lse, chunked_lse_tol);
    expect_close("probs", "chunked", chunked.probs, ref.probs, probs_tol);
    chunked_err = std::max(chunked_err, max_abs_diff(chunked.out, ref.out));
  }
  // The paths that ran, and how much of the tolerance each used (DESIGN.md section 5: the
  // tolerance is 4x the plain implementation's error, so honest ratios sit well below 1 but
  // not at 0).
  std::printf("[ err/tol  ] %-44s flash %-16s %.3f  chunked %-16s %.3f  (tol %.2e, %.2e)\n",
              problem.spec().name().c_str(), product_path_name(flash_path),
              max_abs_diff(flash.out, ref.out) / tol, product_path_name(chunked_path),
              chunked_err / chunked_tol, tol, chunked_tol);
}

}  // namespace qkv::testing
