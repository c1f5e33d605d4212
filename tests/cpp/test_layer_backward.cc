// The layers' backward (training): Linear::backward, LayerNorm::backward, activation_backward
// and dropout's (dropout of dy), each against central finite differences of the float64
// reference forward (layers_reference.h) for the loss L = sum(dy * f(x)), on odd sizes; the
// parameter gradients accumulate; the same bits on any thread count; bad arguments.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <functional>
#include <vector>

#include "every_target.h"
#include "expect_error.h"
#include "layers/layer_kernels.h"
#include "layers_reference.h"
#include "qkv/layers/activation.h"
#include "qkv/layers/dropout.h"
#include "qkv/layers/layer_norm.h"
#include "qkv/layers/linear.h"

namespace qkv::testing {
namespace {

TEST(LayerBackward, LinearMatchesFiniteDifferences) {
  for (const bool with_bias : {true, false}) {
    const std::int64_t rows = 7, in = 13, out = 5, stride = 16;  // x rows padded to 16
    const auto w = random_floats(out * in, 1), b = random_floats(out, 2);
    const auto x = random_floats(rows * stride, 3), dy = random_floats(rows * out, 4);
    const Linear linear({.weight = w,
                         .bias = with_bias ? std::span<const float>(b) : std::span<const float>(),
                         .in_features = in,
                         .out_features = out});
    const Vec dy64 = to_f64(dy), b64 = with_bias ? to_f64(b) : Vec(out, 0.0);
    auto loss = [&](const Vec& x64, const Vec& w64, const Vec& bias64) {
      return dot(dy64, linear_ref(x64, rows, in, w64, bias64, out, Activation::kNone, stride));
    };
    // Parameter gradients accumulate: start them at 0.5 and subtract it again.
    std::vector<float> dx(rows * in, 7.0f), dw(out * in, 0.5f), db(out, 0.5f);
    linear.backward(x.data(), rows, dy.data(), dx.data(), dw.data(),
                    with_bias ? db.data() : nullptr, stride);
    for (float& g : dw) g -= 0.5f;
    for (float& g : db) g -= 0.5f;
    const Vec fd_x = finite_differences(to_f64(x), [&](const Vec& p) { return loss(p, to_f64(w), b64); });
    const Vec fd_w = finite_differences(to_f64(w), [&](const Vec& p) { return loss(to_f64(x), p, b64); });
    // dx is [rows, in]; the padding columns of x get no gradient.
    Vec fd_dx(rows * in);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t i = 0; i < in; ++i) fd_dx[r * in + i] = fd_x[r * stride + i];
    expect_close(dx, fd_dx, 1e-5, "dx");
    expect_close(dw, fd_w, 1e-5, "dweight");
    if (with_bias) {
      const Vec fd_b = finite_differences(b64, [&](const Vec& p) { return loss(to_f64(x), to_f64(w), p); });
      expect_close(db, fd_b, 1e-5, "dbias");
    }
  }
}

// dbias is each column of dy summed in f64 in row order and added once as f32 (the vectorised
// column sums: 64 columns per task, blocks of vectors, a scalar tail): bit for bit.
TEST(LayerBackward, LinearDbiasIsTheRowOrderColumnSum) {
  const std::int64_t rows = 37, in = 3;
  for (const std::int64_t out : {1, 31, 64, 133}) {
    const auto w = random_floats(out * in, 30), b = random_floats(out, 31);
    const auto x = random_floats(rows * in, 32), dy = random_floats(rows * out, 33);
    const Linear linear({.weight = w, .bias = b, .in_features = in, .out_features = out});
    std::vector<float> dw(out * in), db(out, 0.5f), want(out);
    linear.backward(x.data(), rows, dy.data(), nullptr, dw.data(), db.data());
    for (std::int64_t j = 0; j < out; ++j) {
      double sum = 0.0;
      for (std::int64_t r = 0; r < rows; ++r) sum += dy[r * out + j];
      want[j] = 0.5f + static_cast<float>(sum);
    }
    EXPECT_EQ(db, want) << "out = " << out;
  }
}

TEST(LayerBackward, LinearSetWeightsAndWeightRoundTrip) {
  const std::int64_t in = 9, out = 6, rows = 3;
  const auto w = random_floats(out * in, 5), b = random_floats(out, 6);
  Linear linear({.weight = w, .bias = b, .in_features = in, .out_features = out});
  EXPECT_EQ(linear.weight(), w);
  EXPECT_EQ(linear.bias(), b);
  const auto w2 = random_floats(out * in, 7), b2 = random_floats(out, 8);
  const auto x = random_floats(rows * in, 9);
  std::vector<float> y(rows * out);
  linear.forward(x.data(), rows, y.data());  // a cached primitive from before the update
  linear.set_weights(w2, b2);
  EXPECT_EQ(linear.weight(), w2);
  linear.forward(x.data(), rows, y.data());
  expect_close(y, linear_ref(to_f64(x), rows, in, to_f64(w2), to_f64(b2), out), 1e-5,
               "forward after set_weights");
  expect_error([&] { linear.set_weights(std::vector<float>(3), b2); }, "weight has 3 elements");
  expect_error([&] { linear.set_weights(w2, {}); }, "bias has 0 elements, the layer's has 6");
  // A fused activation: forward_linear gives the pre-activation, forward applies GELU to it.
  const Linear gelu({.weight = w, .bias = b, .in_features = in, .out_features = out,
                     .activation = Activation::kGeluErf});
  std::vector<float> pre(rows * out), fused(rows * out);
  gelu.forward_linear(x.data(), rows, pre.data());
  gelu.forward(x.data(), rows, fused.data());
  expect_close(pre, linear_ref(to_f64(x), rows, in, to_f64(w), to_f64(b), out), 1e-5,
               "forward_linear");
  apply_activation(Activation::kGeluErf, pre.data(), rows * out);
  expect_close(fused, to_f64(pre), 1e-5, "forward = activation(forward_linear)");
  std::vector<float> dw(out * in);
  expect_error([&] { gelu.backward(x.data(), rows, y.data(), nullptr, nullptr, nullptr); },
               "dweight must not be null");
  const Linear no_bias({.weight = w, .in_features = in, .out_features = out});
  expect_error([&] { no_bias.backward(x.data(), rows, y.data(), nullptr, dw.data(), dw.data()); },
               "the layer has no bias");
}

// On every Highway target (the f64-lane kernels of layer_kernels.cc), f = 11 and 70 (tails
// of a vector and of a 64-column task).
TEST(LayerBackward, LayerNormMatchesFiniteDifferences) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    for (const std::int64_t f : {11, 70})
      for (const bool with_residual : {true, false}) {
        const std::int64_t rows = 5;
        const auto gamma = random_floats(f, 10, 0.5f, 1.5f), beta = random_floats(f, 11);
        const auto x = random_floats(rows * f, 12, -2.0f, 2.0f), res = random_floats(rows * f, 13);
        const auto dy = random_floats(rows * f, 14);
        const LayerNorm ln(gamma, beta, f, 1e-5f);
        const Vec dy64 = to_f64(dy), res64 = with_residual ? to_f64(res) : Vec();
        auto loss = [&](const Vec& x64, const Vec& g64, const Vec& b64) {
          return dot(dy64, layer_norm_ref(x64, res64, rows, f, g64, b64, 1e-5));
        };
        std::vector<float> dz(rows * f), dgamma(f, 0.25f), dbeta(f, 0.25f);
        ln.backward(x.data(), with_residual ? res.data() : nullptr, rows, dy.data(), dz.data(),
                    dgamma.data(), dbeta.data());
        for (float& g : dgamma) g -= 0.25f;
        for (float& g : dbeta) g -= 0.25f;
        expect_close(
            dz,
            finite_differences(to_f64(x),
                               [&](const Vec& p) { return loss(p, to_f64(gamma), to_f64(beta)); }),
            1e-5, "dz");
        expect_close(
            dgamma,
            finite_differences(to_f64(gamma),
                               [&](const Vec& p) { return loss(to_f64(x), p, to_f64(beta)); }),
            1e-5, "dgamma");
        expect_close(
            dbeta,
            finite_differences(to_f64(beta),
                               [&](const Vec& p) { return loss(to_f64(x), to_f64(gamma), p); }),
            1e-5, "dbeta");
        // In place (dz aliasing dy) gives the same.
        std::vector<float> in_place = dy;
        ln.backward(x.data(), with_residual ? res.data() : nullptr, rows, in_place.data(),
                    in_place.data(), nullptr, nullptr);
        EXPECT_EQ(in_place, dz);
        // ... and with dgamma and dbeta (taken before dz overwrites dy).
        std::vector<float> in_place2 = dy, dgamma2(f, 0.25f), dbeta2(f, 0.25f);
        ln.backward(x.data(), with_residual ? res.data() : nullptr, rows, in_place2.data(),
                    in_place2.data(), dgamma2.data(), dbeta2.data());
        for (float& g : dgamma2) g -= 0.25f;
        for (float& g : dbeta2) g -= 0.25f;
        EXPECT_EQ(in_place2, dz);
        EXPECT_EQ(dgamma2, dgamma);
        EXPECT_EQ(dbeta2, dbeta);
      }
  });
  const LayerNorm ln(std::vector<float>(4, 1.0f), std::vector<float>(4, 0.0f), 4, 1e-5f);
  std::vector<float> buffer(4);
  expect_error([&] { ln.backward(nullptr, nullptr, 1, buffer.data(), buffer.data(), nullptr, nullptr); },
               "must not be null");
}

// Every Highway target the CPU has (layer_kernels.cc's activation_backward_kernel), in place
// too (dx aliasing dy, as the encoder calls it).
TEST(LayerBackward, ActivationsMatchFiniteDifferences) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    // A grid over [-8, 8] (GELU's tails included), 0, and past the clamp at |x| = 30.
    Vec x64;
    for (int i = -64; i <= 64; ++i) x64.push_back(i / 8.0 + 0.01);
    for (const double far : {0.0, -31.0, 40.0}) x64.push_back(far);
    std::vector<float> x(x64.begin(), x64.end());
    x64.assign(x.begin(), x.end());  // the float inputs exactly
    const auto dy = random_floats(static_cast<std::int64_t>(x.size()), 15);
    for (const Activation act :
         {Activation::kNone, Activation::kGeluErf, Activation::kGeluTanh, Activation::kRelu}) {
      SCOPED_TRACE(activation_name(act));
      std::vector<float> dx(x.size());
      activation_backward(act, x.data(), dy.data(), dx.data(), static_cast<std::int64_t>(x.size()));
      Vec want(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        const double h = 1e-6;
        want[i] =
            dy[i] * (activation_ref(act, x64[i] + h) - activation_ref(act, x64[i] - h)) / (2 * h);
        if (act == Activation::kRelu && x64[i] == 0.0) want[i] = 0.0;  // the kink: torch's 0
      }
      expect_close(dx, want, 1e-6, "dx");
      std::vector<float> in_place = dy;
      activation_backward(act, x.data(), in_place.data(), in_place.data(),
                          static_cast<std::int64_t>(x.size()));
      EXPECT_EQ(in_place, dx);
    }
  });
}

TEST(LayerBackward, DropoutsGradientIsDropoutOfDy) {
  const std::int64_t n = 1001;
  const auto x = random_floats(n, 16), dy = random_floats(n, 17);
  std::vector<float> y = x, dx = dy;
  dropout(y.data(), n, 0.3f, 42, 7);
  dropout(dx.data(), n, 0.3f, 42, 7);
  // L = sum(dy * dropout(x)) is linear in x: dL/dx_i = dy_i * y_i / x_i (0 where dropped).
  for (std::int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(dx[i], dy[i] * (y[i] / x[i]), 1e-5) << i;
  }
}

TEST(LayerBackward, SameBitsOnAnyThreadCount) {
  const std::int64_t rows = 300, in = 64, out = 48;
  const auto w = random_floats(out * in, 18), b = random_floats(out, 19);
  const auto x = random_floats(rows * in, 20), dy = random_floats(rows * out, 21);
  const Linear linear({.weight = w, .bias = b, .in_features = in, .out_features = out});
  const LayerNorm ln(random_floats(in, 22), random_floats(in, 23), in, 1e-5f);
  const auto dy_in = random_floats(rows * in, 24);
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    std::vector<float> dx(rows * in), dw(out * in), db(out), dz(rows * in), dg(in), dbeta(in);
    linear.backward(x.data(), rows, dy.data(), dx.data(), dw.data(), db.data());
    ln.backward(x.data(), nullptr, rows, dy_in.data(), dz.data(), dg.data(), dbeta.data());
    return std::vector<std::vector<float>>{db, dz, dg, dbeta};
  };
  const int threads = omp_get_max_threads();
  const auto one = run(1), two = run(2), five = run(5);
  omp_set_num_threads(threads);
  EXPECT_EQ(one, two);
  EXPECT_EQ(one, five);
}

}  // namespace
}  // namespace qkv::testing
