// The block-sparse case table and its check (sparse_cases.h).
#include "sparse_cases.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "kernels/kernels.h"

namespace qkv::testing {
namespace {

// The case's own mask (if any) AND the sparsity's pairs, as one full [B, Hq, Lq, Lk] mask.
std::vector<std::uint8_t> equivalent_mask(const Problem& pr, const Sparsity& sparsity) {
  const Case& c = pr.spec();
  const std::vector<std::uint8_t> sparse =
      sparse_mask(sparsity, c.seq_q, c.seq_kv, c.num_heads_q, c.align);
  const AttentionParams base = pr.params();
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(c.batch) * sparse.size());
  std::size_t at = 0;
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::size_t x = 0; x < sparse.size(); ++x, ++at) {
      const std::int64_t j = static_cast<std::int64_t>(x) % c.seq_kv;
      const std::int64_t i = static_cast<std::int64_t>(x) / c.seq_kv % c.seq_q;
      const std::int64_t h = static_cast<std::int64_t>(x) / c.seq_kv / c.seq_q;
      bool own = true;
      if (!base.mask.empty()) {
        const TensorView& m = base.mask;
        own = static_cast<const std::uint8_t*>(
                  m.data)[(m.sizes[0] == 1 ? 0 : b) * m.strides[0] +
                          (m.sizes[1] == 1 ? 0 : h) * m.strides[1] +
                          (m.sizes[2] == 1 ? 0 : i) * m.strides[2] + j * m.strides[3]] != 0;
      }
      mask[at] = own && sparse[x] != 0 ? 1 : 0;
    }
  }
  return mask;
}

}  // namespace

Result run_kernel(const Problem& pr, AttentionParams params, Kernel kernel, int num_threads,
                  bool with_probs) {
  params.kernel = kernel;
  params.num_threads = num_threads;
  return pr.run_with(params, with_probs);
}

// Sparse vs dense-with-the-equivalent-mask on every kernel, and flash vs the reference.
void check_sparse_case(SparseCase sc) {
  const Problem pr(sc.c);
  const Sparsity sparsity = sc.spec.make(sc.c);
  std::vector<std::uint8_t> mask = equivalent_mask(pr, sparsity);
  AttentionParams dense = pr.params();
  dense.mask = TensorView::contiguous(mask.data(), DType::kU8,
                                      {sc.c.batch, sc.c.num_heads_q, sc.c.seq_q, sc.c.seq_kv});
  AttentionParams sparse = pr.params();
  sparse.sparsity = sparsity;

  const Result ref = run_kernel(pr, sparse, Kernel::kReference, 0, true);
  const Result ref_dense = run_kernel(pr, dense, Kernel::kReference, 0, true);
  // The reference sees the same pairs either way: identical bits.
  EXPECT_TRUE(bit_equal(ref.out, ref_dense.out)) << "reference out";
  EXPECT_TRUE(bit_equal(ref.lse, ref_dense.lse)) << "reference lse";
  for (float x : ref.out) ASSERT_FALSE(std::isnan(x));

  // flash: skipping tiles and trimming them to the allowed keys only drops exact zeros, on the
  // same tile grid as the dense kernel: identical bits in f32, and within DESIGN.md section 5 of
  // the f64 reference (unit-scale inputs: the 2e-5 term).
  const Result flash = run_kernel(pr, sparse, Kernel::kFlash);
  const Result flash_dense = run_kernel(pr, dense, Kernel::kFlash);
  const double lse_tol = 2e-5 * std::max(1.0, max_abs(ref.lse));
  if (sc.c.dtype == DType::kF32) {
    EXPECT_TRUE(bit_equal(flash.out, flash_dense.out))
        << "flash out differs from dense flash + mask by "
        << max_abs_diff(flash.out, flash_dense.out);
    EXPECT_TRUE(bit_equal(flash.lse, flash_dense.lse))
        << "flash lse differs by " << max_abs_diff(flash.lse, flash_dense.lse);
    const double tol = 2e-5 * std::max(1.0, max_abs(ref.out));
    EXPECT_LE(max_abs_diff(flash.out, ref.out), tol) << "flash out vs reference";
    EXPECT_LE(max_abs_diff(flash.lse, ref.lse), lse_tol) << "flash lse vs reference";
  } else {
    // The bf16 paths round each probability exp(s - m) to bf16 against a running max m that
    // is lazy (it moves only by more than a slack; online_softmax-inl.h), and skipped tiles
    // move it at other keys than the dense walk does; their products also pair keys 2t, 2t + 1,
    // which a tile trimmed to an odd key pairs differently. So sparse and dense differ by the
    // probabilities' rounding (3.5e-3 at most here), and both are held to the reference with
    // the tolerance of the plain implementation on the same pairs (DESIGN.md section 5).
    const ProductPath path = pr.flash_path();
    const double tol = tolerance(ref.out, pr.plain(path, &mask).out);
    EXPECT_LE(max_abs_diff(flash.out, ref.out), tol) << "flash out vs reference";
    EXPECT_LE(max_abs_diff(flash_dense.out, ref.out), tol) << "dense flash out vs reference";
    EXPECT_LE(max_abs_diff(flash.lse, ref.lse), lse_tol) << "flash lse vs reference";
    std::printf("[ err/tol  ] %-60s flash %-16s %.3f  (tol %.2e)\n", sc.name().c_str(),
                product_path_name(path), max_abs_diff(flash.out, ref.out) / tol, tol);
  }

  // chunked applies the predicate pair by pair on every tile: identical to its masked run.
  const Result chunked = run_kernel(pr, sparse, Kernel::kChunked, 0, true);
  const Result chunked_dense = run_kernel(pr, dense, Kernel::kChunked, 0, true);
  EXPECT_TRUE(bit_equal(chunked.out, chunked_dense.out)) << "chunked out";
  EXPECT_TRUE(bit_equal(chunked.probs, chunked_dense.probs)) << "chunked probs";
  EXPECT_LE(max_abs_diff(chunked.probs, ref.probs), 2e-5) << "chunked probs vs reference";
}

std::vector<SparseCase> sparse_cases(DType dtype) {
  std::vector<SparseCase> cases;
  std::uint64_t seed = 500;
  auto add = [&](Case c, SparseSpec s) {
    c.seed = seed++;
    c.dtype = dtype;
    cases.push_back({c, s});
  };
  SparseSpec longformer{.name = "lf_w3", .window = 3};
  SparseSpec dilated{.name = "lf_w9_dil3_g", .window = 9, .dilation = 3, .global = {0}};
  SparseSpec lf_global{.name = "lf_w40_g", .window = 40, .global = {130, 0, 5, 5}};
  SparseSpec bigbird{.name = "bb_b16_r2_g1", .kind = SparseSpec::Kind::kBigBird};
  bigbird.bigbird = {.block = 16, .num_random_blocks = 2, .num_global_blocks = 1, .seed = 3};
  SparseSpec bigbird7{.name = "bb_b7_r3_g2", .kind = SparseSpec::Kind::kBigBird};
  bigbird7.bigbird = {.block = 7, .num_random_blocks = 3, .num_global_blocks = 2, .seed = 9};
  SparseSpec block{.name = "blk16x16", .kind = SparseSpec::Kind::kBlock};
  SparseSpec block_odd{.name = "blk100x7_heads",
                       .kind = SparseSpec::Kind::kBlock,
                       .block_q = 100,
                       .block_k = 7,
                       .per_head = true};
  SparseSpec block_one{.name = "blk1x1",
                       .kind = SparseSpec::Kind::kBlock,
                       .block_q = 1,
                       .block_k = 1,
                       .density = 0.3};
  SparseSpec block_wide{.name = "blk64x128_heads",
                        .kind = SparseSpec::Kind::kBlock,
                        .block_q = 64,
                        .block_k = 128,
                        .per_head = true,
                        .density = 0.6};

  // Odd sizes, square and not, every pattern.
  for (std::int64_t lq : {1, 7, 63, 65, 200, 517}) {
    for (std::int64_t lk : {1, 7, 63, 65, 200, 517}) {
      if (lq * lk > 100000 && lq != lk) continue;  // keep the reference's time down
      const Case c{.seq_q = lq, .seq_kv = lk, .head_dim = 16};
      for (const SparseSpec& s : {longformer, dilated, lf_global, bigbird7, block_odd, block_one}) {
        SparseSpec spec = s;
        if (spec.kind == SparseSpec::Kind::kLongformer) {
          std::erase_if(spec.global, [&](std::int64_t g) { return g >= lk; });  // bottom-right
        }
        add(c, spec);
      }
    }
  }
  // Every pattern with causal (both alignments), window, key lengths, mask, bias, softcap,
  // GQA, batches.
  for (const SparseSpec& spec :
       {longformer, dilated, lf_global, bigbird, bigbird7, block, block_odd, block_wide}) {
    for (Align align : {Align::kBottomRight, Align::kTopLeft}) {
      Case c{.batch = 2, .seq_q = 150, .seq_kv = 200, .num_heads_q = 4, .num_heads_kv = 2};
      c.head_dim = 24;
      c.causal = true;
      c.align = align;
      c.key_lengths = c.nan_padding = true;
      add(c, spec);
    }
    Case c{.batch = 2, .seq_q = 200, .seq_kv = 140, .num_heads_q = 6, .num_heads_kv = 3};
    c.head_dim = 32;
    c.head_dim_v = 20;
    c.mask = MaskKind::kRandom;
    c.bias = BiasKind::kWithNegInf;
    c.softcap = 10.0f;
    c.window_left = 80;
    c.window_right = 30;
    c.bhsd = true;
    add(c, spec);
    // Decoding: few queries, a GQA group's heads in one query block.
    c = {.batch = 2, .seq_q = 3, .seq_kv = 300, .num_heads_q = 12, .num_heads_kv = 3};
    c.head_dim = 16;
    c.causal = c.key_lengths = true;
    c.bias = BiasKind::kPerHeadRow;
    add(c, spec);
  }
  // Many query blocks per task, long enough for several key tiles on each side of the band.
  {
    const Case c{.seq_q = 700, .seq_kv = 700, .num_heads_q = 2, .head_dim = 16};
    SparseSpec wide{.name = "lf_w150_g", .window = 150, .global = {3, 400, 699}};
    add(c, wide);
    SparseSpec wide_dil{.name = "lf_w200_dil130", .window = 200, .dilation = 130};
    add(c, wide_dil);
    SparseSpec bb{.name = "bb_b64_r3_g2", .kind = SparseSpec::Kind::kBigBird};
    bb.bigbird = {.block = 64, .num_random_blocks = 3, .num_global_blocks = 2, .seed = 1};
    add(c, bb);
  }
  return cases;
}

}  // namespace qkv::testing
