// Dropout on the attention probabilities (AttentionParams::dropout_p, kernels/dropout_mask.h):
// the keep rate within binomial bounds and independent across offsets; the reference's output
// equals P * keep / (1 - p) times v computed by hand from its own probabilities; flash equals
// the reference on every target (wide, decode and key-split shapes, bf16); the same bits on any
// thread count; the backward against finite differences of the forward with the same seed and
// flash against the reference; the errors.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "attention_case.h"
#include "every_target.h"
#include "kernels/dropout_mask.h"
#include "kernels/kernels.h"
#include "qkv/attention_backward.h"
#include "qkv/block_attention.h"
#include "qkv/error.h"

namespace qkv::testing {
namespace {

AttentionParams with_dropout(AttentionParams p, float dropout_p, std::uint64_t seed = 7,
                             std::uint64_t offset = 3) {
  p.dropout_p = dropout_p;
  p.seed = seed;
  p.offset = offset;
  return p;
}

TEST(Dropout, KeepRateWithinBinomialBounds) {
  for (float p : {0.1f, 0.5f, 0.9f}) {
    const std::uint32_t threshold = dropout_threshold(p);
    std::int64_t kept = 0, n = 0, same = 0;
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 4; ++h)
        for (std::int64_t i = 0; i < 256; ++i) {
          const std::uint64_t row = dropout_row(11, 0, b, h, i, 4, 256);
          const std::uint64_t next = dropout_row(11, 1, b, h, i, 4, 256);  // the next offset
          for (std::int64_t j = 0; j < 256; ++j, ++n) {
            const bool keep = dropout_bits(row, j) >= threshold;
            kept += keep;
            same += keep == (dropout_bits(next, j) >= threshold);
          }
        }
    const double q = 1.0 - p, sigma = std::sqrt(p * q / n);
    EXPECT_NEAR(static_cast<double>(kept) / n, q, 5 * sigma) << p;
    // Independent masks agree with probability p^2 + q^2.
    const double agree = p * p + q * q, sigma_agree = std::sqrt(agree * (1 - agree) / n);
    EXPECT_NEAR(static_cast<double>(same) / n, agree, 5 * sigma_agree) << p;
  }
}

TEST(Dropout, ReferenceIsTheDefinition) {
  const Case c{.batch = 2, .seq_q = 9, .seq_kv = 13, .num_heads_q = 4, .num_heads_kv = 2,
               .head_dim = 8, .head_dim_v = 5, .causal = true};
  Problem pr(c);
  const float p = 0.3f;
  AttentionParams params = with_dropout(pr.params(), p);
  params.kernel = Kernel::kReference;
  const Result r = pr.run_with(params, /*with_probs=*/true);
  const Result plain = pr.run(Kernel::kReference, true);
  EXPECT_TRUE(bit_equal(r.probs, plain.probs));  // probs and lse are P's
  EXPECT_TRUE(bit_equal(r.lse, plain.lse));
  const std::uint32_t threshold = dropout_threshold(p);
  double max_error = 0;
  for (std::int64_t b = 0; b < c.batch; ++b)
    for (std::int64_t h = 0; h < c.num_heads_q; ++h)
      for (std::int64_t i = 0; i < c.seq_q; ++i) {
        const std::uint64_t row = dropout_row(7, 3, b, h, i, c.num_heads_q, c.seq_q);
        for (std::int64_t e = 0; e < 5; ++e) {
          double acc = 0;
          for (std::int64_t j = 0; j < c.seq_kv; ++j) {
            if (dropout_bits(row, j) < threshold) continue;
            const double prob = plain.probs[((b * c.num_heads_q + h) * c.seq_q + i) * c.seq_kv + j];
            acc += prob / (1.0 - p) * pr.v[((b * c.seq_kv + j) * c.num_heads_kv + h / 2) * 5 + e];
          }
          const double got = r.out[((b * c.seq_q + i) * c.num_heads_q + h) * 5 + e];
          max_error = std::max(max_error, std::abs(got - acc));
        }
      }
  EXPECT_LE(max_error, 1e-6);
  EXPECT_GT(max_abs_diff(r.out, plain.out), 1e-2);  // dropout did something
}

std::vector<Case> dropout_cases() {
  return {
      {.batch = 2, .seq_q = 150, .seq_kv = 203, .num_heads_q = 4, .num_heads_kv = 2,
       .head_dim = 40},
      {.batch = 1, .seq_q = 200, .seq_kv = 200, .num_heads_q = 2, .num_heads_kv = 1, .head_dim = 64,
       .causal = true, .softcap = 3.0f},
      {.batch = 1, .seq_q = 70, .seq_kv = 300, .num_heads_q = 2, .num_heads_kv = 2, .head_dim = 16,
       .window_left = 40, .window_right = 3, .key_lengths = true, .bias = BiasKind::kRandom},
      // Decoding (the narrow path without dropout) and key splits.
      {.batch = 1, .seq_q = 1, .seq_kv = 3000, .num_heads_q = 8, .num_heads_kv = 2, .head_dim = 64,
       .causal = true},
      {.batch = 1, .seq_q = 3, .seq_kv = 500, .num_heads_q = 2, .num_heads_kv = 2, .head_dim = 32,
       .mask = MaskKind::kRandom, .bhsd = true},
  };
}

TEST(Dropout, FlashEqualsReferenceOnEveryTarget) {
  for_each_target(attention_cpu_target_name, [&](std::int64_t) {
    for (Case c : dropout_cases()) {
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        c.dtype = dtype;
        SCOPED_TRACE(c.name());
        Problem pr(c);
        AttentionParams params = with_dropout(pr.params(), 0.25f);
        params.kernel = Kernel::kReference;
        const Result ref = pr.run_with(params, false);
        params.kernel = Kernel::kFlash;
        const Result flash = pr.run_with(params, false);
        EXPECT_LE(max_abs_diff(flash.out, ref.out),
                  (dtype == DType::kF32 ? 2e-5 : 2e-2) * std::max(1.0, max_abs(ref.out)));
        EXPECT_LE(max_abs_diff(flash.lse, ref.lse), 1e-4 * std::max(1.0, max_abs(ref.lse)));
      }
    }
  });
}

TEST(Dropout, SameBitsOnAnyThreadCount) {
  for (const Case& c : dropout_cases()) {
    SCOPED_TRACE(c.name());
    Problem pr(c);
    AttentionParams params = with_dropout(pr.params(), 0.4f);
    params.kernel = Kernel::kFlash;
    expect_same_bits_on_any_thread_count(pr, params);
  }
}

TEST(Dropout, ZeroIsOff) {
  Problem pr(dropout_cases()[0]);
  AttentionParams params = with_dropout(pr.params(), 0.0f, 123, 456);
  params.kernel = Kernel::kFlash;
  EXPECT_TRUE(bit_equal(pr.run_with(params, false).out, pr.run(Kernel::kFlash, false).out));
}

TEST(Dropout, BackwardMatchesFiniteDifferences) {
  const Case c{.batch = 1, .seq_q = 7, .seq_kv = 9, .num_heads_q = 2, .num_heads_kv = 1,
               .head_dim = 4, .causal = true, .align = Align::kTopLeft};
  Problem pr(c);
  const AttentionParams params = with_dropout(pr.params(), 0.3f);
  std::vector<float> dout = normal_values(pr.q.size(), 5);
  const Grads g = run_backward(pr, params, dout, false, 0, Kernel::kReference);
  auto loss = [&] { return reference_loss(pr, params, dout); };
  for (auto [x, grad] : {std::pair{&pr.q, &g.dq}, {&pr.k, &g.dk}, {&pr.v, &g.dv}}) {
    const std::vector<float> r = normal_values(x->size(), 9), saved = *x;
    const double eps = 1e-3;
    for (std::size_t i = 0; i < x->size(); ++i) (*x)[i] = saved[i] + eps * r[i];
    const double up = loss();
    for (std::size_t i = 0; i < x->size(); ++i) (*x)[i] = saved[i] - eps * r[i];
    const double down = loss();
    *x = saved;
    double analytic = 0, norm = 0;
    for (std::size_t i = 0; i < x->size(); ++i) {
      analytic += static_cast<double>((*grad)[i]) * r[i];
      norm += static_cast<double>((*grad)[i]) * (*grad)[i];
    }
    EXPECT_NEAR(analytic, (up - down) / (2 * eps), 1e-4 * (std::sqrt(norm) + 1));
  }
}

TEST(Dropout, FlashBackwardEqualsReferenceAndKeepsItsBits) {
  for_each_target(attention_cpu_target_name, [&](std::int64_t) {
    for (const Case& c : dropout_cases()) {
      SCOPED_TRACE(c.name());
      Problem pr(c);
      const AttentionParams params = with_dropout(pr.params(), 0.2f);
      std::vector<float> dout = normal_values(pr.q.size() / c.head_dim * pr.head_dim_v(), 6);
      const Grads ref = run_backward(pr, params, dout, false, 0, Kernel::kReference);
      const Grads flash = run_backward(pr, params, dout, false, 0, Kernel::kFlash);
      EXPECT_LE(max_abs_diff(flash.dq, ref.dq), 2e-5 * std::max(1.0, max_abs(ref.dq)));
      EXPECT_LE(max_abs_diff(flash.dk, ref.dk), 2e-5 * std::max(1.0, max_abs(ref.dk)));
      EXPECT_LE(max_abs_diff(flash.dv, ref.dv), 2e-5 * std::max(1.0, max_abs(ref.dv)));
    }
  });
  Problem pr(dropout_cases()[1]);
  const AttentionParams params = with_dropout(pr.params(), 0.2f);
  std::vector<float> dout = normal_values(pr.q.size(), 6);
  const Grads one = run_backward(pr, params, dout, false, 1, Kernel::kFlash);
  const Grads three = run_backward(pr, params, dout, false, 3, Kernel::kFlash);
  EXPECT_TRUE(bit_equal(one.dq, three.dq) && bit_equal(one.dk, three.dk) &&
              bit_equal(one.dv, three.dv));
}

TEST(Dropout, Errors) {
  Problem pr({.batch = 1, .seq_q = 4, .seq_kv = 4, .num_heads_q = 1, .num_heads_kv = 1,
              .head_dim = 4});
  auto message = [&](const AttentionParams& params) -> std::string {
    try {
      pr.run_with(params, false);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  for (float bad : {1.0f, -0.1f, std::nanf("")}) {
    EXPECT_NE(message(with_dropout(pr.params(), bad)).find("dropout_p: must be in [0, 1)"),
              std::string::npos);
  }
  AttentionParams chunked = with_dropout(pr.params(), 0.5f);
  chunked.kernel = Kernel::kChunked;
  EXPECT_NE(message(chunked).find("dropout_p: not available from the chunked kernel"),
            std::string::npos);
  // attention_block: positions would make a block's mask differ from the whole's.
  std::vector<float> q(16, 0.5f), out(16);
  const TensorView view = TensorView::contiguous(q.data(), DType::kF32, {1, 4, 1, 4});
  std::string block;
  try {
    attention_block(view, view, view,
                    {.out = TensorView::contiguous(out.data(), DType::kF32, {1, 4, 1, 4})},
                    with_dropout({}, 0.5f), {.seq_q = 4, .seq_kv = 4});
  } catch (const Error& e) {
    block = e.what();
  }
  EXPECT_NE(block.find("dropout_p: not available for a block"), std::string::npos) << block;
}

}  // namespace
}  // namespace qkv::testing
