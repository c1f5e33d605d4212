// qkv::attention_backward (qkv/attention_backward.h) against central finite differences of the
// forward: for random directions r, (L(x + e r) - L(x - e r)) / 2e must equal <dL/dx, r> for
// x = q, k, v and the bias, with L = sum(dout * out) and the forward's f64 oracle. Over the
// case table's masks (causal both ways, windows, key lengths with NaN padding, mask, bias with
// -inf, softcap, GQA, Lq != Lk, Dv != D, BHSD strides, sparsity); plus zero gradients for rows
// with no key, the same bits on any thread count, bf16 storage, and the boundary's errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "attention_case.h"
#include "every_target.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/bf16_dot.h"
#include "kernels/kernels.h"
#include "qkv/attention_backward.h"
#include "qkv/error.h"

namespace qkv::testing {
namespace {

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isfinite(a[i]) && std::isfinite(b[i])) sum += static_cast<double>(a[i]) * b[i];
  }
  return sum;
}

// <grad, r> against the central difference of the loss along r in `x` (a member of pr).
void expect_directional(Problem& pr, const AttentionParams& params, const std::vector<float>& dout,
                        std::vector<float>& x, const std::vector<float>& grad, const char* name,
                        std::uint64_t seed) {
  const std::vector<float> r = normal_values(x.size(), seed);
  const std::vector<float> saved = x;
  const double eps = 1e-3;
  auto at = [&](double t) {
    for (std::size_t i = 0; i < x.size(); ++i) {
      // -inf bias entries and NaN padding stay what they are.
      x[i] = std::isfinite(saved[i]) ? static_cast<float>(saved[i] + t * r[i]) : saved[i];
    }
    return reference_loss(pr, params, dout);
  };
  const double numeric = (at(eps) - at(-eps)) / (2 * eps);
  x = saved;
  // f32 inputs: x + eps r is rounded to f32 and the forward's outputs are f32, so the
  // difference carries ~1e-5 of noise; eps^2 truncation is ~1e-6. 1e-4 of the spread of
  // <grad, r> (|grad|) is a tight bound that a wrong factor anywhere breaks by orders.
  const double analytic = dot(grad, r);
  const double scale = std::sqrt(dot(grad, grad)) + 1.0;  // the spread of <grad, r>
  EXPECT_NEAR(analytic, numeric, 1e-4 * scale) << name;
}

std::vector<Case> cases() {
  std::vector<Case> cases;
  cases.push_back({.batch = 2, .seq_q = 7, .seq_kv = 9, .num_heads_q = 2, .num_heads_kv = 1,
                   .head_dim = 8});
  for (Align align : {Align::kBottomRight, Align::kTopLeft}) {
    cases.push_back({.batch = 1, .seq_q = 6, .seq_kv = 11, .num_heads_q = 3, .num_heads_kv = 3,
                     .head_dim = 5, .head_dim_v = 7, .causal = true, .align = align});
    cases.push_back({.batch = 1, .seq_q = 11, .seq_kv = 6, .num_heads_q = 2, .num_heads_kv = 1,
                     .head_dim = 4, .causal = true, .align = align});
  }
  cases.push_back({.batch = 1, .seq_q = 13, .seq_kv = 13, .num_heads_q = 2, .num_heads_kv = 2,
                   .head_dim = 6, .window_left = 3, .window_right = 1});
  cases.push_back({.batch = 3, .seq_q = 5, .seq_kv = 10, .num_heads_q = 4, .num_heads_kv = 2,
                   .head_dim = 8, .key_lengths = true, .nan_padding = true});
  cases.push_back({.batch = 2, .seq_q = 6, .seq_kv = 8, .num_heads_q = 2, .num_heads_kv = 2,
                   .head_dim = 4, .mask = MaskKind::kRandom});
  cases.push_back({.batch = 2, .seq_q = 6, .seq_kv = 8, .num_heads_q = 2, .num_heads_kv = 1,
                   .head_dim = 4, .bias = BiasKind::kRandom, .bhsd = true});
  cases.push_back({.batch = 1, .seq_q = 7, .seq_kv = 7, .num_heads_q = 2, .num_heads_kv = 2,
                   .head_dim = 4, .causal = true, .bias = BiasKind::kWithNegInf});
  cases.push_back({.batch = 2, .seq_q = 5, .seq_kv = 6, .num_heads_q = 2, .num_heads_kv = 2,
                   .head_dim = 4, .bias = BiasKind::kPerHeadRow});
  cases.push_back({.batch = 1, .seq_q = 9, .seq_kv = 9, .num_heads_q = 2, .num_heads_kv = 1,
                   .head_dim = 8, .softcap = 2.0f, .input_scale = 3.0f});
  return cases;
}

class AttentionBackward : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionBackward, MatchesFiniteDifferences) {
  Problem pr(GetParam());
  const AttentionParams params = pr.params();
  const Case& c = pr.spec();
  std::vector<float> dout = normal_values(
      static_cast<std::size_t>(c.batch * c.seq_q * c.num_heads_q * pr.head_dim_v()), 99);
  const bool with_dbias = !pr.bias.empty();
  const Grads g = run_backward(pr, params, dout, with_dbias);
  for (const std::vector<float>* grad : {&g.dq, &g.dk, &g.dv, &g.dbias}) {
    for (float x : *grad) ASSERT_TRUE(std::isfinite(x));
  }
  for (std::uint64_t seed : {1, 2}) {
    expect_directional(pr, params, dout, pr.q, g.dq, "dq", seed);
    expect_directional(pr, params, dout, pr.k, g.dk, "dk", seed + 10);
    expect_directional(pr, params, dout, pr.v, g.dv, "dv", seed + 20);
    if (with_dbias) {
      // params.bias views pr.bias: the perturbation reaches the forward.
      expect_directional(pr, params, dout, pr.bias, g.dbias, "dbias", seed + 30);
    }
  }
}

TEST_P(AttentionBackward, SameBitsOnAnyThreadCount) {
  Problem pr(GetParam());
  const AttentionParams params = pr.params();
  std::vector<float> dout =
      normal_values(pr.q.size() / pr.spec().head_dim * pr.head_dim_v(), 5);
  const Grads one = run_backward(pr, params, dout, !pr.bias.empty(), 1);
  for (int threads : {2, 3}) {
    const Grads many = run_backward(pr, params, dout, !pr.bias.empty(), threads);
    EXPECT_TRUE(bit_equal(one.dq, many.dq) && bit_equal(one.dk, many.dk) &&
                bit_equal(one.dv, many.dv) && bit_equal(one.dbias, many.dbias))
        << threads << " threads";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, AttentionBackward, ::testing::ValuesIn(cases()),
                         [](const auto& info) {
                           std::string name = info.param.name();
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name + "_" + std::to_string(info.index);
                         });

// The flash backward against the oracle: several row and key tiles (ordered dq turns), every
// mask, every compiled target this CPU has; bf16/f16 storage; the same bits on any thread count.
std::vector<Case> flash_cases() {
  std::vector<Case> cases = ::qkv::testing::cases();
  // d(bias) over several row and key tiles, for each way a bias broadcasts (the flash kernel's
  // own pass: summed over batch entries and heads in order).
  cases.push_back({.batch = 2, .seq_q = 131, .seq_kv = 77, .num_heads_q = 4, .num_heads_kv = 2,
                   .head_dim = 16, .bias = BiasKind::kShared});
  cases.push_back({.batch = 3, .seq_q = 70, .seq_kv = 90, .num_heads_q = 2, .num_heads_kv = 2,
                   .head_dim = 8, .key_lengths = true, .bias = BiasKind::kPerKey});
  cases.push_back({.batch = 2, .seq_q = 100, .seq_kv = 100, .num_heads_q = 2, .num_heads_kv = 1,
                   .head_dim = 8, .causal = true, .bias = BiasKind::kPerHeadRow,
                   .softcap = 2.5f});
  cases.push_back({.batch = 1, .seq_q = 66, .seq_kv = 40, .num_heads_q = 2, .num_heads_kv = 2,
                   .head_dim = 8, .bias = BiasKind::kWithNegInf});
  // Elements along D H apart: every packing's strided branch (q, dout, K, V, dq, dk, dv); 290
  // keys: row tiles summed by one key group of 256 keys and by two (dq's last group writing
  // strided rows).
  cases.push_back({.batch = 2,
                   .seq_q = 130,
                   .seq_kv = 290,
                   .num_heads_q = 4,
                   .num_heads_kv = 2,
                   .head_dim = 40,
                   .causal = true,
                   .dim_strided = true});
  cases.push_back({.batch = 2, .seq_q = 150, .seq_kv = 203, .num_heads_q = 4, .num_heads_kv = 2,
                   .head_dim = 40});
  cases.push_back({.batch = 1, .seq_q = 200, .seq_kv = 200, .num_heads_q = 2, .num_heads_kv = 1,
                   .head_dim = 64, .causal = true});
  cases.push_back({.batch = 1, .seq_q = 70, .seq_kv = 300, .num_heads_q = 2, .num_heads_kv = 2,
                   .head_dim = 130, .head_dim_v = 24, .causal = true, .align = Align::kTopLeft});
  cases.push_back({.batch = 1, .seq_q = 257, .seq_kv = 257, .num_heads_q = 2, .num_heads_kv = 2,
                   .head_dim = 32, .window_left = 70, .window_right = 5, .softcap = 3.0f});
  cases.push_back({.batch = 3, .seq_q = 90, .seq_kv = 180, .num_heads_q = 2, .num_heads_kv = 1,
                   .head_dim = 16, .key_lengths = true, .nan_padding = true,
                   .mask = MaskKind::kKeyPadding, .bhsd = true});
  cases.push_back({.batch = 1, .seq_q = 1, .seq_kv = 333, .num_heads_q = 8, .num_heads_kv = 2,
                   .head_dim = 64, .causal = true});
  return cases;
}

void expect_flash_matches_reference(const Case& c) {
  SCOPED_TRACE(c.name());
  Problem pr(c);
  const AttentionParams params = pr.params();
  std::vector<float> dout = normal_values(pr.q.size() / c.head_dim * pr.head_dim_v(), 8);
  const bool with_dbias = !pr.bias.empty();
  const Grads ref = run_backward(pr, params, dout, with_dbias, 0, Kernel::kReference);
  const Grads flash = run_backward(pr, params, dout, with_dbias, 0, Kernel::kFlash);
  for (auto [name, a, b] : {std::tuple{"dq", &flash.dq, &ref.dq}, {"dk", &flash.dk, &ref.dk},
                            {"dv", &flash.dv, &ref.dv}, {"dbias", &flash.dbias, &ref.dbias}}) {
    // f32 accumulation over up to Lq (dk, dv) or Lk (dq) terms against f64.
    EXPECT_LE(max_abs_diff(*a, *b), 2e-5 * std::max(1.0, max_abs(*b))) << name;
  }
}

TEST(AttentionBackwardFlash, MatchesReferenceOnEveryTarget) {
  const std::vector<Case> cases = flash_cases();
  for_each_target(attention_cpu_target_name, [&](std::int64_t) {
    for (const Case& c : cases) expect_flash_matches_reference(c);
    // bf16 and f16 widened to f32 (bf16 on the AMX tiles and the vdpbf16ps pairs:
    // test_backward_amx.cc).
    amx::set_enabled(false);
    bf16dot::set_enabled(false);
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      Case c = cases[cases.size() - 5];
      c.dtype = dtype;
      expect_flash_matches_reference(c);
    }
    amx::set_enabled(true);
    bf16dot::set_enabled(true);
  });
}

TEST(AttentionBackwardFlash, SameBitsOnAnyThreadCount) {
  for (const Case& c : flash_cases()) {
    SCOPED_TRACE(c.name());
    Problem pr(c);
    const AttentionParams params = pr.params();
    std::vector<float> dout = normal_values(pr.q.size() / c.head_dim * pr.head_dim_v(), 9);
    expect_same_grads_on_any_thread_count(pr, params, dout, {2, 3, 5});
  }
}

TEST(AttentionBackwardFlash, SparsityMatchesReference) {
  Problem pr({.batch = 1, .seq_q = 150, .seq_kv = 150, .num_heads_q = 2, .num_heads_kv = 2,
              .head_dim = 16});
  const std::vector<std::int64_t> global = {3, 77};
  for (const Sparsity& sparsity :
       {Sparsity{LongformerSparsity{.window = 9, .dilation = 2, .global = global}},
        Sparsity{BigBirdSparsity{.block = 16, .num_random_blocks = 2, .num_global_blocks = 1}}}) {
    AttentionParams params = pr.params();
    params.sparsity = sparsity;
    std::vector<float> dout = normal_values(pr.q.size(), 10);
    const Grads ref = run_backward(pr, params, dout, false, 0, Kernel::kReference);
    const Grads flash = run_backward(pr, params, dout, false, 0, Kernel::kFlash);
    EXPECT_LE(max_abs_diff(flash.dq, ref.dq), 2e-5 * std::max(1.0, max_abs(ref.dq)));
    EXPECT_LE(max_abs_diff(flash.dk, ref.dk), 2e-5 * std::max(1.0, max_abs(ref.dk)));
    EXPECT_LE(max_abs_diff(flash.dv, ref.dv), 2e-5 * std::max(1.0, max_abs(ref.dv)));
  }
}

TEST(AttentionBackwardSparse, LongformerMatchesFiniteDifferences) {
  Problem pr({.batch = 1, .seq_q = 12, .seq_kv = 12, .num_heads_q = 2, .num_heads_kv = 2,
              .head_dim = 4});
  const std::vector<std::int64_t> global = {5};
  AttentionParams params = pr.params();
  params.sparsity = LongformerSparsity{.window = 2, .dilation = 1, .global = global};
  std::vector<float> dout = normal_values(pr.q.size(), 3);
  const Grads g = run_backward(pr, params, dout, false);
  expect_directional(pr, params, dout, pr.q, g.dq, "dq", 1);
  expect_directional(pr, params, dout, pr.k, g.dk, "dk", 2);
  expect_directional(pr, params, dout, pr.v, g.dv, "dv", 3);
}

TEST(AttentionBackwardRows, NoAllowedKeyGivesZeroGradients) {
  // Key lengths 0 for one batch entry: its rows have no key; its dk/dv rows are never read.
  Problem pr({.batch = 3, .seq_q = 4, .seq_kv = 6, .num_heads_q = 2, .num_heads_kv = 1,
              .head_dim = 4, .key_lengths = true, .nan_padding = true});
  std::vector<float> dout = normal_values(pr.q.size(), 4);
  const Grads g = run_backward(pr, pr.params(), dout, false);
  const Case& c = pr.spec();
  for (std::int64_t b = 0; b < c.batch; ++b) {
    const std::int64_t length = pr.key_lengths[b];
    for (std::int64_t j = 0; j < c.seq_kv; ++j) {
      for (std::int64_t d = 0; d < c.head_dim; ++d) {
        const float x = g.dk[((b * c.seq_kv + j) * c.num_heads_kv) * c.head_dim + d];
        ASSERT_TRUE(std::isfinite(x));
        if (j >= length) {
          EXPECT_EQ(x, 0.0f) << "b " << b << " j " << j;
        }
      }
    }
    if (length == 0) {
      for (std::int64_t i = 0; i < c.seq_q * c.num_heads_q * c.head_dim; ++i) {
        EXPECT_EQ(g.dq[b * c.seq_q * c.num_heads_q * c.head_dim + i], 0.0f);
      }
    }
  }
}

TEST(AttentionBackwardDtype, Bf16StorageEqualsF32OfTheSameValues) {
  const Case bf{.batch = 1, .seq_q = 6, .seq_kv = 8, .num_heads_q = 2, .num_heads_kv = 1,
                .head_dim = 8, .causal = true, .dtype = DType::kBF16};
  Problem half(bf);
  Case f32 = bf;
  f32.dtype = DType::kF32;
  Problem as_f32(f32);
  as_f32.q = half.q;  // the bf16 values, widened exactly
  as_f32.k = half.k;
  as_f32.v = half.v;
  std::vector<float> dout = normal_values(half.q.size(), 6);
  const Grads a = run_backward(half, half.params(), dout, false);
  const Grads b = run_backward(as_f32, as_f32.params(), dout, false);
  EXPECT_LE(max_abs_diff(a.dq, b.dq), 1e-6);
  EXPECT_LE(max_abs_diff(a.dk, b.dk), 1e-6);
  EXPECT_LE(max_abs_diff(a.dv, b.dv), 1e-6);
}

TEST(AttentionBackwardErrors, NamesTheArgumentAndWritesNothing) {
  Problem pr({.batch = 2, .seq_q = 5, .seq_kv = 6, .num_heads_q = 2, .num_heads_kv = 1,
              .head_dim = 4});
  const Case& c = pr.spec();
  Result f = pr.run(Kernel::kReference, false);
  std::vector<float> dout(f.out.size(), 1.0f), dq(pr.q.size(), 7.0f), dk(pr.k.size(), 7.0f),
      dv(pr.v.size(), 7.0f), small(4, 7.0f);
  const TensorView q = pr.view(pr.q, c.seq_q, c.num_heads_q, c.head_dim);
  const TensorView k = pr.view(pr.k, c.seq_kv, c.num_heads_kv, c.head_dim);
  const TensorView v = pr.view(pr.v, c.seq_kv, c.num_heads_kv, c.head_dim);
  const TensorView out = pr.view(f.out, c.seq_q, c.num_heads_q, c.head_dim);
  const TensorView lse =
      TensorView::contiguous(f.lse.data(), DType::kF32, {c.batch, c.num_heads_q, c.seq_q, 1});
  const TensorView dout_view = pr.view(dout, c.seq_q, c.num_heads_q, c.head_dim);
  const AttentionGrads good{.dq = pr.view(dq, c.seq_q, c.num_heads_q, c.head_dim),
                            .dk = pr.view(dk, c.seq_kv, c.num_heads_kv, c.head_dim),
                            .dv = pr.view(dv, c.seq_kv, c.num_heads_kv, c.head_dim)};
  auto error = [&](auto&& call) -> std::string {
    try {
      call();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  auto expect = [&](const std::string& message, const std::string& want) {
    EXPECT_NE(message.find(want), std::string::npos) << message;
  };
  AttentionGrads bad = good;
  bad.dk = pr.view(dk, c.seq_kv, c.num_heads_q, c.head_dim / 2);  // wrong heads and D
  expect(error([&] { attention_backward(q, k, v, out, lse, dout_view, bad, {}); }),
         "dk: shape (2, 6, 2, 2)");
  expect(error([&] {
           attention_backward(q, k, v, out, lse,
                              TensorView::contiguous(small.data(), DType::kF32, {1, 1, 1, 4}),
                              good, {});
         }),
         "dout: shape (1, 1, 1, 4)");
  bad = good;
  bad.dbias = TensorView::contiguous(small.data(), DType::kF32, {1, 1, 1, 4});
  expect(error([&] { attention_backward(q, k, v, out, lse, dout_view, bad, {}); }),
         "dbias: needs a bias");
  bad = good;
  bad.dv = good.dq;  // two gradients in one buffer
  bad.dv.sizes = {c.batch, c.seq_kv, c.num_heads_kv, c.head_dim};
  expect(error([&] { attention_backward(q, k, v, out, lse, dout_view, bad, {}); }), "overlaps");
  expect(error([&] { attention_backward(q, k, v, out, {}, dout_view, good, {}); }),
         "lse: required");
  expect(error([&] {
           attention_backward(q, k, v, out, lse, dout_view, good, {.kernel = Kernel::kChunked});
         }),
         "kernel: the backward has no chunked kernel");
  for (const std::vector<float>* g : {&dq, &dk, &dv}) {
    for (float x : *g) ASSERT_EQ(x, 7.0f);  // nothing written
  }
}

// dq, dk and dv as column ranges of one [dq | dk | dv] row buffer (a fused QKV projection's
// gradient rows, as MultiHeadAttention passes them): accepted, and the same bits as in buffers
// of their own, on every target; ranges one element into each other are refused, and nothing is
// written then.
TEST(AttentionBackwardPacked, GradientsInOneRowBufferEqualSeparateOnes) {
  const Case c{.batch = 2,
               .seq_q = 37,
               .seq_kv = 37,
               .num_heads_q = 4,
               .num_heads_kv = 2,
               .head_dim = 16,
               .causal = true};
  Problem pr(c);
  AttentionParams params = pr.params();
  std::vector<float> dout = normal_values(pr.q.size(), 3);
  params.kernel = Kernel::kReference;
  const Result f = pr.run_with(params, false);
  params.kernel = Kernel::kFlash;
  const std::int64_t L = c.seq_q, D = c.head_dim, E = c.num_heads_q * D;
  const std::int64_t kvw = c.num_heads_kv * D, F = E + 2 * kvw;
  std::vector<float> rows(c.batch * L * F);
  auto range = [&](std::int64_t col, std::int64_t heads) {
    return TensorView{
        .data = rows.data() + col, .sizes = {c.batch, L, heads, D}, .strides = {L * F, F, D, 1}};
  };
  auto backward = [&](const AttentionGrads& grads) {
    attention_backward(pr.view(pr.q, L, c.num_heads_q, D), pr.view(pr.k, L, c.num_heads_kv, D),
                       pr.view(pr.v, L, c.num_heads_kv, D),
                       pr.view(const_cast<std::vector<float>&>(f.out), L, c.num_heads_q, D),
                       TensorView::contiguous(const_cast<float*>(f.lse.data()), DType::kF32,
                                              {c.batch, c.num_heads_q, L, 1}),
                       pr.view(dout, L, c.num_heads_q, D), grads, params);
  };
  for_each_target(attention_cpu_target_name, [&](std::int64_t) {
    const Grads separate = run_backward(pr, params, dout, false, 0, Kernel::kFlash);
    std::fill(rows.begin(), rows.end(), 7.0f);
    backward({.dq = range(0, c.num_heads_q),
              .dk = range(E, c.num_heads_kv),
              .dv = range(E + kvw, c.num_heads_kv)});
    for (std::int64_t r = 0; r < c.batch * L; ++r) {
      for (auto [part, col, width] : {std::tuple{&separate.dq, 0L, E},
                                      {&separate.dk, E, kvw},
                                      {&separate.dv, E + kvw, kvw}}) {
        for (std::int64_t i = 0; i < width; ++i) {
          ASSERT_EQ(std::bit_cast<std::uint32_t>(rows[r * F + col + i]),
                    std::bit_cast<std::uint32_t>((*part)[r * width + i]))
              << "row " << r << ", column " << col + i;
        }
      }
    }
  });
  std::fill(rows.begin(), rows.end(), 7.0f);
  for (auto [dk_col, dv_col, message] : {std::tuple{E - 1, E + kvw, "dq: its memory overlaps dk's"},
                                         {E, E + kvw - 1, "dk: its memory overlaps dv's"}}) {
    try {
      backward({.dq = range(0, c.num_heads_q),
                .dk = range(dk_col, c.num_heads_kv),
                .dv = range(dv_col, c.num_heads_kv)});
      ADD_FAILURE() << "no error; expected '" << message << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  for (float x : rows) ASSERT_EQ(x, 7.0f);
}

}  // namespace
}  // namespace qkv::testing
