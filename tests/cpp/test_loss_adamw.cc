// cross_entropy against finite differences of its float64 formula (ignore_index, extreme
// logits, errors) and AdamW against torch.optim.AdamW's update written out in float64; then
// one training step of an EncoderLayer (backward + AdamW) against the same step in float64
// (finite-difference gradients of the float64 reference layer, the float64 update).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <string>
#include <vector>

#include "expect_error.h"
#include "layers_reference.h"
#include "qkv/layers/adamw.h"
#include "qkv/layers/encoder_layer.h"
#include "qkv/layers/loss.h"

namespace qkv::testing {
namespace {

double ce_ref(const Vec& logits, std::int64_t rows, std::int64_t classes,
              const std::vector<std::int32_t>& targets) {
  double total = 0;
  int count = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    if (targets[r] < 0) continue;
    double sum = 0;
    for (std::int64_t c = 0; c < classes; ++c) sum += std::exp(logits[r * classes + c]);
    total += std::log(sum) - logits[r * classes + targets[r]];
    ++count;
  }
  return total / count;
}

TEST(CrossEntropy, MatchesFiniteDifferences) {
  const std::int64_t rows = 6, classes = 7;
  const auto logits = random_floats(rows * classes, 60, -3.0f, 3.0f);
  const std::vector<std::int32_t> targets = {0, 6, -100, 3, 3, 1};
  std::vector<float> grad(rows * classes, 9.0f);
  const double loss = cross_entropy(logits.data(), rows, classes, targets.data(), grad.data());
  std::vector<std::int32_t> ref_targets = targets;
  EXPECT_NEAR(loss, ce_ref(to_f64(logits), rows, classes, ref_targets), 1e-12);
  Vec x = to_f64(logits), fd(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + 1e-6;
    const double up = ce_ref(x, rows, classes, ref_targets);
    x[i] = keep - 1e-6;
    const double down = ce_ref(x, rows, classes, ref_targets);
    x[i] = keep;
    fd[i] = (up - down) / 2e-6;
  }
  expect_close(grad, fd, 1e-6, "dlogits");
  for (std::int64_t c = 0; c < classes; ++c) EXPECT_EQ(grad[2 * classes + c], 0.0f);  // ignored
  // Huge logits stay finite; no target counted gives 0.
  const std::vector<float> huge = {1e30f, -1e30f, 0.0f};
  const std::int32_t one = 1, ignored = -100;
  EXPECT_NEAR(cross_entropy(huge.data(), 1, 3, &one, nullptr), 2e30, 1e24);
  EXPECT_EQ(cross_entropy(huge.data(), 1, 3, &ignored, nullptr), 0.0);
  const std::int32_t bad = 3;
  expect_error([&] { cross_entropy(huge.data(), 1, 3, &bad, nullptr); },
               "targets[0] = 3 is outside [0, 3)");
  const std::vector<float> nan = {NAN, 0.0f, 0.0f};
  expect_error([&] { cross_entropy(nan.data(), 1, 3, &one, nullptr); }, "is not finite");
}

TEST(AdamW, MatchesTorchsUpdateInFloat64) {
  const AdamWParams a{.lr = 0.01f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f,
                      .weight_decay = 0.1f};
  AdamW opt(a);
  std::vector<float> p1 = random_floats(5, 61), p2 = random_floats(3, 62);
  Vec r1 = to_f64(p1), r2 = to_f64(p2), m1(5), v1(5), m2(3), v2(3);
  for (int step = 1; step <= 4; ++step) {
    std::vector<float> g1 = random_floats(5, 70 + step), g2 = random_floats(3, 80 + step);
    std::vector<float>* params[] = {&p1, &p2};
    std::vector<float>* grads[] = {&g1, &g2};
    opt.step(params, grads);
    for (auto [p, m, v, g] : {std::tuple{&r1, &m1, &v1, &g1}, std::tuple{&r2, &m2, &v2, &g2}}) {
      for (std::size_t e = 0; e < p->size(); ++e) {
        const double lr = a.lr, b1 = a.beta1, b2 = a.beta2, grad = (*g)[e];
        (*p)[e] *= 1 - lr * a.weight_decay;
        (*m)[e] = b1 * (*m)[e] + (1 - b1) * grad;
        (*v)[e] = b2 * (*v)[e] + (1 - b2) * grad * grad;
        const double mhat = (*m)[e] / (1 - std::pow(b1, step));
        const double vhat = (*v)[e] / (1 - std::pow(b2, step));
        (*p)[e] -= lr * mhat / (std::sqrt(vhat) + a.eps);
      }
    }
  }
  EXPECT_EQ(opt.steps(), 4);
  expect_close(p1, r1, 1e-6, "p1");
  expect_close(p2, r2, 1e-6, "p2");
  // The list may not change.
  std::vector<float> g(5);
  std::vector<float>* one_param[] = {&p1};
  std::vector<float>* one_grad[] = {&g};
  expect_error([&] { opt.step(one_param, one_grad); }, "1 parameters; the first step had 2");
  expect_error([] { AdamW(AdamWParams{.beta1 = 1.0f}); }, "need lr >= 0, betas in [0, 1)");
}

TEST(AdamW, EverySizeAcrossVectorsAndChunksMatchesFloat64) {
  // Sizes that leave whole vectors, a partial one and none (4, 8 and 16 lanes), and tensors
  // that cross AdamW's chunks of 16384 elements; the same bits on any thread count.
  const AdamWParams a{
      .lr = 0.02f, .beta1 = 0.85f, .beta2 = 0.99f, .eps = 1e-7f, .weight_decay = 0.05f};
  const std::vector<std::int64_t> sizes{1, 3, 8, 15, 16, 17, 33, 100, 16384 + 17, 3 * 16384};
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    AdamW opt(a);
    std::vector<std::vector<float>> p, g(sizes.size());
    for (std::size_t t = 0; t < sizes.size(); ++t) p.push_back(random_floats(sizes[t], 100 + t));
    std::vector<std::vector<float>*> params, grads;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      params.push_back(&p[t]);
      grads.push_back(&g[t]);
    }
    for (int step = 1; step <= 3; ++step) {
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        g[t] = random_floats(sizes[t], 1000 * step + t, -2.0f, 2.0f);
      }
      opt.step(params, grads);
    }
    return p;
  };
  const int threads = omp_get_max_threads();
  const auto one = run(1), two = run(2);
  omp_set_num_threads(threads);
  EXPECT_EQ(one, two);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    Vec p = to_f64(random_floats(sizes[t], 100 + t)), m(p.size()), v(p.size());
    for (int step = 1; step <= 3; ++step) {
      const Vec g = to_f64(random_floats(sizes[t], 1000 * step + t, -2.0f, 2.0f));
      const double lr = a.lr, b1 = a.beta1, b2 = a.beta2;
      for (std::size_t e = 0; e < p.size(); ++e) {
        p[e] *= 1 - lr * a.weight_decay;
        m[e] = b1 * m[e] + (1 - b1) * g[e];
        v[e] = b2 * v[e] + (1 - b2) * g[e] * g[e];
        p[e] -= lr * (m[e] / (1 - std::pow(b1, step))) /
                (std::sqrt(v[e] / (1 - std::pow(b2, step))) + a.eps);
      }
    }
    // An update moves p by about lr: 1e-6 of the scale is 5e-5 of it.
    expect_close(one[t], p, 1e-6, "p of size " + std::to_string(sizes[t]));
  }
}

TEST(AdamW, OneEncoderLayerTrainingStepMatchesFloat64) {
  // backward + AdamW on a Post-LN layer against: finite-difference gradients of the float64
  // reference layer (EncoderLayerData::reference) and the float64 update.
  const EncoderLayerConfig c{.embed_dim = 8, .num_heads = 2, .d_ff = 12};
  EncoderLayerData d(c, 90);
  EncoderLayer layer(c, d.weights());
  const std::int64_t B = 1, L = 3;
  const auto x = random_floats(B * L * 8, 91), d_out = random_floats(B * L * 8, 92);
  std::vector<float> y = x, dx = d_out;
  EncoderLayerTape tape;
  layer.forward_train(y.data(), B, L, {}, tape);
  EncoderLayerParams grads = layer.zero_grads(), params = layer.parameters();
  layer.backward(tape, dx.data(), grads);
  const AdamWParams a{.lr = 0.05f, .weight_decay = 0.0f};
  AdamW opt(a);
  opt.step(params.tensors(), grads.tensors());
  layer.set_parameters(params);
  // float64: the gradient of ff2_weight by finite differences, then Adam's first step, which
  // moves every parameter by lr * g / (|g| + eps) (= lr sign(g) where |g| >> eps).
  const Vec d64 = to_f64(d_out);
  std::vector<float>& w = d.f2_w;
  const std::vector<float> before = w;
  for (std::size_t i = 0; i < w.size(); i += 5) {
    auto loss = [&](double value) {
      const float keep = w[i];
      EncoderLayerData changed = d;
      changed.f2_w[i] = static_cast<float>(value);
      const Vec out = changed.reference(to_f64(x), B, L, {});
      w[i] = keep;
      double s = 0;
      for (std::size_t e = 0; e < out.size(); ++e) s += d64[e] * out[e];
      return s;
    };
    const double g = (loss(before[i] + 1e-3) - loss(before[i] - 1e-3)) / 2e-3;
    const double want = before[i] - a.lr * g / (std::abs(g) + a.eps);
    EXPECT_NEAR(layer.parameters().ff2_weight[i], want, 1e-4) << i;
  }
}

}  // namespace
}  // namespace qkv::testing
