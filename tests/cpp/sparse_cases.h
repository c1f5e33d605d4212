// Block-sparse attention's case table (qkv/sparse.h): every layout (Longformer, dilated, global
// tokens, BigBird, block layouts shared or per head) over odd sizes and with causal/window, key
// lengths, masks, bias, softcap, GQA and decoding; and the check each case passes, sparse
// against dense attention given the equivalent explicit mask. test_sparse_attention.cc runs it
// in f32 and bf16; the emulated AMX tiles' binary (tests/amx_emulated/) in bf16 and f16 on the
// AMX path.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attention_case.h"
#include "qkv/sparse.h"

namespace qkv::testing {

// A sparsity plus the storage its spans and views point into.
struct SparseSpec {
  std::string name = {};
  enum class Kind { kLongformer, kBigBird, kBlock } kind = Kind::kLongformer;
  std::int64_t window = 3, dilation = 1;
  std::vector<std::int64_t> global = {};
  BigBirdSparsity bigbird = {};
  std::int64_t block_q = 16, block_k = 16;
  bool per_head = false;
  double density = 0.4;
  std::vector<std::uint8_t> layout = {};  // kBlock: [1, Hq or 1, nqb, nkb]

  Sparsity make(const Case& c) {
    switch (kind) {
      case Kind::kLongformer:
        return LongformerSparsity{.window = window, .dilation = dilation, .global = global};
      case Kind::kBigBird:
        return bigbird;
      case Kind::kBlock:
        break;
    }
    const std::int64_t heads = per_head ? c.num_heads_q : 1;
    const std::int64_t nqb = (c.seq_q + block_q - 1) / block_q;
    const std::int64_t nkb = (c.seq_kv + block_k - 1) / block_k;
    if (layout.empty()) {
      std::mt19937_64 rng(c.seed * 7 + 1);
      std::bernoulli_distribution keep(density);
      layout.resize(static_cast<std::size_t>(heads * nqb * nkb));
      for (auto& x : layout) x = density >= 1.0 || keep(rng) ? 1 : 0;
      // A query block with no key block at all: fully masked rows.
      if (density < 1.0 && nqb > 1) std::fill(layout.begin() + nkb, layout.begin() + 2 * nkb, 0);
    }
    return BlockSparsity{
        .layout = TensorView::contiguous(layout.data(), DType::kU8, {1, heads, nqb, nkb}),
        .block_q = block_q,
        .block_k = block_k};
  }
};

struct SparseCase {
  Case c;
  SparseSpec spec;
  std::string name() const { return c.name() + "_" + spec.name; }
};
inline void PrintTo(const SparseCase& c, std::ostream* os) { *os << c.name(); }

// The table with q, k, v stored as dtype.
std::vector<SparseCase> sparse_cases(DType dtype = DType::kF32);

// A test name for the case (gtest's name generator): its name, alphanumerics only, and index.
inline std::string sparse_case_name(const ::testing::TestParamInfo<SparseCase>& info) {
  std::string name = info.param.name();
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name + "_" + std::to_string(info.index);
}

// Problem::run with a free choice of AttentionParams.
Result run_kernel(const Problem& pr, AttentionParams params, Kernel kernel, int num_threads = 0,
                  bool with_probs = false);

// Sparse vs dense-with-the-equivalent-mask on every kernel (the same bits), and, in f32, flash
// vs the reference.
void check_sparse_case(SparseCase sc);

}  // namespace qkv::testing
