// f64 inputs (the gradient-check path, docs/training.md): qkv::attention and
// qkv::attention_backward on the reference kernel with f64 outputs and gradients. The gradients
// are checked against central differences of the f64 forward, to ~1e-9 of their spread (the
// f32 tests can only reach ~1e-4); the forward against the f32 reference on the same values;
// and the boundary against mixed dtypes and the fast kernels.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "attention_case.h"
#include "expect_error.h"
#include "qkv/attention.h"
#include "qkv/attention_backward.h"

namespace qkv::testing {
namespace {

std::vector<double> widened(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// `view` over other memory of the same shape and dtype.
TensorView like(TensorView view, void* data) {
  view.data = data;
  return view;
}

// q, k, v of a case as f64 (the same values), BSHD, and its forward and backward in f64.
struct F64Problem {
  explicit F64Problem(const Case& c) : pr(c) {
    q = widened(pr.q);
    k = widened(pr.k);
    v = widened(pr.v);
  }
  TensorView view(std::vector<double>& x, std::int64_t seq, std::int64_t heads,
                  std::int64_t dim) const {
    return TensorView::contiguous(x.data(), DType::kF64, {pr.spec().batch, seq, heads, dim});
  }
  TensorView q_view() { return view(q, pr.spec().seq_q, pr.spec().num_heads_q, pr.spec().head_dim); }
  TensorView k_view() { return view(k, pr.spec().seq_kv, pr.spec().num_heads_kv, pr.spec().head_dim); }
  TensorView v_view() { return view(v, pr.spec().seq_kv, pr.spec().num_heads_kv, pr.head_dim_v()); }
  std::size_t out_size() const {
    const Case& c = pr.spec();
    return static_cast<std::size_t>(c.batch * c.seq_q * c.num_heads_q * pr.head_dim_v());
  }

  // out and lse for the current q, k, v.
  void forward(const AttentionParams& params, std::vector<double>& out, std::vector<double>& lse) {
    const Case& c = pr.spec();
    out.assign(out_size(), 7.0);
    lse.assign(static_cast<std::size_t>(c.batch * c.num_heads_q * c.seq_q), 7.0);
    attention(q_view(), k_view(), v_view(),
              {.out = view(out, c.seq_q, c.num_heads_q, pr.head_dim_v()),
               .lse = TensorView::contiguous(lse.data(), DType::kF64,
                                             {c.batch, c.num_heads_q, c.seq_q, 1})},
              params);
  }
  double loss(const AttentionParams& params, const std::vector<double>& dout) {
    std::vector<double> out, lse;
    forward(params, out, lse);
    double sum = 0.0;
    for (std::size_t i = 0; i < out.size(); ++i) sum += out[i] * dout[i];
    return sum;
  }

  Problem pr;
  std::vector<double> q, k, v;
};

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isfinite(a[i]) && std::isfinite(b[i])) sum += a[i] * b[i];
  }
  return sum;
}

void check_gradients(const Case& c, bool dropout) {
  SCOPED_TRACE(c.name() + (dropout ? " dropout" : ""));
  F64Problem f(c);
  AttentionParams params = f.pr.params();
  params.kernel = Kernel::kAuto;  // f64: the reference
  if (dropout) {
    params.dropout_p = 0.25f;
    params.seed = 5;
  }
  const std::vector<double> dout = widened(normal_values(f.out_size(), 11));
  std::vector<double> out, lse;
  f.forward(params, out, lse);
  std::vector<double> dq(f.q.size(), 7.0), dk(f.k.size(), 7.0), dv(f.v.size(), 7.0);
  std::vector<double> dout_copy = dout;
  attention_backward(f.q_view(), f.k_view(), f.v_view(),
                     f.view(out, c.seq_q, c.num_heads_q, f.pr.head_dim_v()),
                     TensorView::contiguous(lse.data(), DType::kF64,
                                            {c.batch, c.num_heads_q, c.seq_q, 1}),
                     f.view(dout_copy, c.seq_q, c.num_heads_q, f.pr.head_dim_v()),
                     {.dq = like(f.q_view(), dq.data()),
                      .dk = like(f.k_view(), dk.data()),
                      .dv = like(f.v_view(), dv.data())},
                     params);
  std::uint64_t seed = 20;
  for (auto [x, grad, name] : {std::tuple{&f.q, &dq, "dq"}, std::tuple{&f.k, &dk, "dk"},
                               std::tuple{&f.v, &dv, "dv"}}) {
    for (double g : *grad) ASSERT_TRUE(std::isfinite(g)) << name;
    const std::vector<double> r = widened(normal_values(x->size(), seed++));
    const std::vector<double> saved = *x;
    const double eps = 1e-5;
    const auto at = [&](double t) {
      for (std::size_t i = 0; i < x->size(); ++i) {
        (*x)[i] = std::isfinite(saved[i]) ? saved[i] + t * r[i] : saved[i];
      }
      return f.loss(params, dout);
    };
    const double numeric = (at(eps) - at(-eps)) / (2 * eps);
    *x = saved;
    // f64 throughout: truncation ~eps^2 = 1e-10, rounding ~1e-16 / eps = 1e-11.
    const double scale = std::sqrt(dot(*grad, *grad)) + 1.0;
    EXPECT_NEAR(dot(*grad, r), numeric, 1e-8 * scale) << name;
  }
}

TEST(AttentionF64, GradientsMatchCentralDifferencesTightly) {
  check_gradients({.batch = 2, .seq_q = 7, .seq_kv = 9, .num_heads_q = 4, .num_heads_kv = 2,
                   .head_dim = 8, .head_dim_v = 5, .causal = true},
                  false);
  check_gradients({.batch = 3, .seq_q = 5, .seq_kv = 10, .num_heads_q = 2, .num_heads_kv = 1,
                   .head_dim = 8, .key_lengths = true, .nan_padding = true},
                  false);
  check_gradients({.batch = 1, .seq_q = 9, .seq_kv = 9, .num_heads_q = 2, .num_heads_kv = 2,
                   .head_dim = 4, .window_left = 2, .window_right = 1, .mask = MaskKind::kRandom,
                   .bias = BiasKind::kWithNegInf, .softcap = 2.0f, .input_scale = 3.0f},
                  false);
  check_gradients({.batch = 1, .seq_q = 6, .seq_kv = 8, .num_heads_q = 2, .num_heads_kv = 1,
                   .head_dim = 4, .align = Align::kTopLeft},
                  true);
}

// The f64 forward is the reference's f64 arithmetic without the final rounding to f32: it
// equals the f32 reference on the same values to f32's output rounding, and differs from it.
TEST(AttentionF64, ForwardIsTheReferenceWithoutTheF32Rounding) {
  const Case c{.batch = 2, .seq_q = 9, .seq_kv = 12, .num_heads_q = 3, .num_heads_kv = 1,
               .head_dim = 16, .causal = true, .bias = BiasKind::kRandom};
  F64Problem f(c);
  const Result ref32 = f.pr.run(Kernel::kReference, false);
  std::vector<double> out, lse;
  f.forward(f.pr.params(), out, lse);
  double max_diff = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    ASSERT_NEAR(out[i], ref32.out[i], 1e-7 * std::max(1.0, std::abs(out[i]))) << i;
    max_diff = std::max(max_diff, std::abs(out[i] - ref32.out[i]));
  }
  EXPECT_GT(max_diff, 0.0) << "the f64 outputs were rounded to f32";
  for (std::size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], ref32.lse[i], 1e-6) << i;
}

TEST(AttentionF64, BoundaryNamesTheDtypes) {
  const Case c{.seq_q = 3, .seq_kv = 4, .head_dim = 4};
  F64Problem f(c);
  std::vector<double> out(f.out_size(), 7.0);
  std::vector<float> out32(f.out_size(), 7.0f), k32(f.pr.k);
  const TensorView out_view = f.view(out, 3, 1, 4);
  AttentionParams params;
  expect_error([&] {
    attention(f.q_view(), TensorView::contiguous(k32.data(), DType::kF32, {1, 4, 1, 4}),
              f.v_view(), {.out = out_view}, params);
  }, "k: dtype f32 differs from q's f64");
  expect_error([&] {
    attention(f.q_view(), f.k_view(), f.v_view(),
              {.out = TensorView::contiguous(out32.data(), DType::kF32, {1, 3, 1, 4})}, params);
  }, "out: dtype f32");
  params.kernel = Kernel::kFlash;
  expect_error([&] { attention(f.q_view(), f.k_view(), f.v_view(), {.out = out_view}, params); },
               "kernel: f64 inputs run on the reference kernel only");
  for (double x : out) EXPECT_EQ(x, 7.0);
  // The backward: dout and the gradients in f64 too.
  params.kernel = Kernel::kAuto;
  std::vector<double> lse(3, 0.0), dq(f.q.size()), dk(f.k.size()), dv(f.v.size());
  f.forward(params, out, lse);
  std::vector<float> dout32(f.out_size(), 1.0f);
  const TensorView lse_view = TensorView::contiguous(lse.data(), DType::kF64, {1, 1, 3, 1});
  const AttentionGrads grads{.dq = like(f.q_view(), dq.data()),
                             .dk = like(f.k_view(), dk.data()),
                             .dv = like(f.v_view(), dv.data())};
  expect_error([&] {
    attention_backward(f.q_view(), f.k_view(), f.v_view(), out_view, lse_view,
                       TensorView::contiguous(dout32.data(), DType::kF32, {1, 3, 1, 4}), grads,
                       params);
  }, "dout: dtype f32");
}

}  // namespace
}  // namespace qkv::testing
