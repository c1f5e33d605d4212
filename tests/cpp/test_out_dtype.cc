// out in the inputs' dtype (DESIGN.md: outputs f32 or the input dtype): with bf16/f16 q, k and
// v, attention() also takes a bf16/f16 out and writes the f32 result rounded to nearest even
// (kernel_params.h, out16). Every kernel, wide and narrow (decode) blocks, key splits, tails of
// Dv, BHSD strides, rows with no key: the rounded out must be, bit for bit, f32_to_half_bits of
// the f32 out of the same call, and lse unchanged. Then the boundary: an out of another dtype,
// and the ops whose out stays f32 (attention_block, attention_backward), throw before writing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "attention_case.h"
#include "core/float16.h"
#include "every_target.h"
#include "expect_error.h"
#include "kernels/kernels.h"
#include "qkv/attention.h"
#include "qkv/attention_backward.h"
#include "qkv/block_attention.h"

namespace qkv::testing {
namespace {

struct OutCase {
  Case c;
  Kernel kernel;
};

std::string kernel_name(Kernel kernel) {
  return kernel == Kernel::kReference ? "reference"
         : kernel == Kernel::kChunked ? "chunked"
                                      : "flash";
}

void PrintTo(const OutCase& oc, std::ostream* os) {
  *os << oc.c.name() << "_" << kernel_name(oc.kernel);
}

std::vector<OutCase> out_cases() {
  std::vector<Case> cases;
  std::uint64_t seed = 4200;
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    auto add = [&](Case c) {
      c.dtype = dtype;
      c.seed = seed++;
      cases.push_back(c);
    };
    // Wide blocks with a partial last one, Dv a multiple of the lanes.
    add({.batch = 2, .seq_q = 70, .seq_kv = 47, .num_heads_q = 4, .num_heads_kv = 2});
    cases.back().head_dim = 64;
    // Dv not a multiple of the lanes (element-by-element tail), D != Dv.
    add({.seq_q = 33, .seq_kv = 90, .num_heads_q = 2, .head_dim = 40, .head_dim_v = 24});
    cases.back().causal = true;
    // Dv = 56: squares of the lanes, then (AVX-512) an element-by-element tail of 8.
    add({.seq_q = 70, .seq_kv = 47, .num_heads_q = 2, .head_dim = 32, .head_dim_v = 56});
    // Key lengths (an entry with none: rows of zeros), NaN past them, a window.
    add({.batch = 3, .seq_q = 20, .seq_kv = 150, .num_heads_q = 3, .num_heads_kv = 3});
    cases.back().window_left = 40;
    cases.back().window_right = 5;
    cases.back().key_lengths = cases.back().nan_padding = true;
    // BHSD strides, a random mask, large logits.
    add({.batch = 2, .seq_q = 65, .seq_kv = 65, .num_heads_q = 2, .num_heads_kv = 2});
    cases.back().mask = MaskKind::kRandom;
    cases.back().input_scale = 8.0f;
    cases.back().bhsd = true;
    // Decode: narrow blocks, GQA, the keys split (Lk >= 2048) and merged.
    add({.batch = 2, .seq_q = 1, .seq_kv = 4099, .num_heads_q = 32, .num_heads_kv = 8});
    cases.back().key_lengths = true;
    add({.seq_q = 3, .seq_kv = 2500, .num_heads_q = 8, .head_dim = 128, .causal = true});
    cases.back().bhsd = true;
  }
  std::vector<OutCase> out;
  for (const Case& c : cases) {
    for (Kernel kernel : {Kernel::kReference, Kernel::kChunked, Kernel::kFlash}) {
      out.push_back({c, kernel});
    }
  }
  return out;
}

class OutDtype : public ::testing::TestWithParam<OutCase> {};

// q, k and v of a problem as attention() takes them: its bf16/f16 bits where the case has them.
struct Inputs {
  TensorView q, k, v;
};
Inputs stored_inputs(const Problem& pr) {
  auto& self = const_cast<Problem&>(pr);
  const Case& c = pr.spec();
  Inputs in{pr.view(self.q, c.seq_q, c.num_heads_q, c.head_dim),
            pr.view(self.k, c.seq_kv, c.num_heads_kv, c.head_dim),
            pr.view(self.v, c.seq_kv, c.num_heads_kv, pr.head_dim_v())};
  if (c.dtype == DType::kF32) return in;
  for (auto [view, bits] : {std::pair{&in.q, &self.q16}, {&in.k, &self.k16}, {&in.v, &self.v16}}) {
    view->data = bits->data();
    view->dtype = c.dtype;
  }
  return in;
}

// The f32 out and lse of one call, and the bf16/f16 out (bits) and lse of another.
struct TwoCalls {
  std::vector<float> out, lse, lse16;
  std::vector<std::uint16_t> out16;
};

TwoCalls run_both(const Problem& pr, Kernel kernel) {
  AttentionParams params = pr.params();
  params.kernel = kernel;
  TwoCalls r;
  const Result f32 = pr.run_with(params, /*with_probs=*/false);
  r.out = f32.out;
  r.lse = f32.lse;
  // The same call with out in the inputs' dtype: the f32 view's strides over 16-bit elements.
  const Case& c = pr.spec();
  std::vector<float> scratch(r.out.size());
  TensorView out = pr.view(scratch, c.seq_q, c.num_heads_q, pr.head_dim_v());
  r.out16.assign(r.out.size(), 0x7777);
  out.data = r.out16.data();
  out.dtype = c.dtype;
  r.lse16.assign(r.lse.size(), 7.0f);
  const TensorView lse =
      TensorView::contiguous(r.lse16.data(), DType::kF32, {c.batch, c.num_heads_q, c.seq_q, 1});
  const Inputs in = stored_inputs(pr);
  attention(in.q, in.k, in.v, {.out = out, .lse = lse}, params);
  return r;
}

void check_rounded(const OutCase& oc) {
  const Problem pr(oc.c);
  const TwoCalls r = run_both(pr, oc.kernel);
  ASSERT_EQ(r.out16.size(), r.out.size());
  std::int64_t mismatches = 0, zeros = 0;
  for (std::size_t i = 0; i < r.out.size(); ++i) {
    const std::uint16_t want = f32_to_half_bits(oc.c.dtype, r.out[i]);
    const bool both_nan =
        std::isnan(r.out[i]) && std::isnan(half_bits_to_f32(oc.c.dtype, r.out16[i]));
    if (r.out16[i] != want && !both_nan) {
      if (mismatches++ < 5) {
        ADD_FAILURE() << "element " << i << ": f32 " << r.out[i] << " -> bits " << want
                      << ", got bits " << r.out16[i];
      }
    }
    zeros += r.out[i] == 0.0f;
  }
  EXPECT_EQ(mismatches, 0);
  // lse is the same f32 either way.
  for (std::size_t i = 0; i < r.lse.size(); ++i) {
    EXPECT_EQ(std::memcmp(&r.lse[i], &r.lse16[i], sizeof(float)), 0) << "lse " << i;
  }
  if (oc.c.key_lengths && oc.c.batch > 1) {
    EXPECT_GT(zeros, 0) << "(a row with no key: zeros)";
  }
}

TEST_P(OutDtype, IsTheF32OutRoundedToNearestEven) { check_rounded(GetParam()); }

// The same on every compiled target this CPU supports (bf16 rounds in integer operations on
// each; f16 by the hardware conversion on AVX2/AVX3 and element by element on SCALAR), the
// chunked and flash kernels (the reference has no targets).
TEST(OutDtypeTargets, EveryTargetRoundsTheSame) {
  const std::vector<OutCase> cases = out_cases();
  for_each_target(attention_cpu_target_name, [&](std::int64_t) {
    for (const OutCase& oc : cases) {
      if (oc.kernel == Kernel::kReference) continue;
      SCOPED_TRACE(oc.c.name() + "_" + kernel_name(oc.kernel));
      check_rounded(oc);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Cases, OutDtype, ::testing::ValuesIn(out_cases()),
                         [](const ::testing::TestParamInfo<OutCase>& info) {
                           return info.param.c.name() + "_" + kernel_name(info.param.kernel);
                         });

// B = 1, Lq = 4, Lk = 6, Hq = 2, Hkv = 1, D = 16 stored as `dtype`.
Case small_case(DType dtype) {
  return {.seq_q = 4, .seq_kv = 6, .num_heads_q = 2, .head_dim = 16, .dtype = dtype};
}

// f32 q, k, v and bf16 inputs with an f16 out (or the reverse): rejected, nothing written.
TEST(OutDtypeBoundary, OtherDtypesThrowBeforeWriting) {
  for (auto [in, out_dtype, message] :
       {std::tuple{DType::kF32, DType::kBF16, "out: dtype bf16 is not supported (expected f32)"},
        {DType::kBF16, DType::kF16,
         "out: dtype f16 is not supported (expected f32, or bf16 as q, k and v are)"},
        {DType::kF16, DType::kBF16,
         "out: dtype bf16 is not supported (expected f32, or f16 as q, k and v are)"}}) {
    const Problem pr(small_case(in));
    const Inputs x = stored_inputs(pr);
    std::vector<std::uint16_t> out16(4 * 2 * 16, 0x7777);
    const TensorView out = TensorView::contiguous(out16.data(), out_dtype, {1, 4, 2, 16});
    expect_error([&] { attention(x.q, x.k, x.v, {.out = out}, pr.params()); }, message);
    for (std::uint16_t word : out16) ASSERT_EQ(word, 0x7777);
  }
}

// attention_block (whose outs are merged in f32) and attention_backward (which reads the
// forward's out) keep out f32.
TEST(OutDtypeBoundary, BlockAndBackwardKeepOutF32) {
  const Problem pr(small_case(DType::kBF16));
  const Inputs x = stored_inputs(pr);
  std::vector<std::uint16_t> out16(4 * 2 * 16, 0x7777);
  const TensorView out = TensorView::contiguous(out16.data(), DType::kBF16, {1, 4, 2, 16});
  std::vector<float> lse(8, 0.0f);
  const TensorView lse_view = TensorView::contiguous(lse.data(), DType::kF32, {1, 2, 4, 1});
  expect_error(
      [&] {
        attention_block(x.q, x.k, x.v, {.out = out, .lse = lse_view}, AttentionParams{},
                        BlockPositions{.seq_q = 4, .seq_kv = 6});
      },
      "out: dtype bf16 is not supported (expected f32)");
  for (std::uint16_t word : out16) ASSERT_EQ(word, 0x7777);
  std::vector<float> dout(4 * 2 * 16, 0.0f), dq(4 * 2 * 16), dk(6 * 16), dv(6 * 16);
  const AttentionGrads grads{.dq = TensorView::contiguous(dq.data(), DType::kF32, {1, 4, 2, 16}),
                             .dk = TensorView::contiguous(dk.data(), DType::kF32, {1, 6, 1, 16}),
                             .dv = TensorView::contiguous(dv.data(), DType::kF32, {1, 6, 1, 16})};
  expect_error(
      [&] {
        attention_backward(x.q, x.k, x.v, out, lse_view,
                           TensorView::contiguous(dout.data(), DType::kF32, {1, 4, 2, 16}), grads,
                           AttentionParams{});
      },
      "out: dtype bf16 is not supported (expected f32)");
}

}  // namespace
}  // namespace qkv::testing
