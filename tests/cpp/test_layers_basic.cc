// Linear (oneDNN), LayerNorm and activations against the float64 references of
// layers_reference.h, over sizes that are not multiples of any vector width.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <iostream>
#include <limits>
#include <vector>

#include "core/float16.h"
#include "core/splitmix64.h"
#include "every_target.h"
#include "expect_error.h"
#include "layers/layer_kernels.h"
#include "layers_reference.h"
#include "qkv/layers/activation.h"
#include "qkv/layers/layer_norm.h"
#include "qkv/layers/linear.h"

namespace qkv::testing {
namespace {

constexpr Activation kAllActivations[] = {Activation::kNone, Activation::kGeluErf,
                                          Activation::kGeluTanh, Activation::kRelu};

// ---- activations ----

// Max relative error of apply_activation over x in [-limit, limit] (step 1e-4) against
// float64, where the float64 value is a normal float.
double max_relative_error(Activation act, float limit = 16.0f) {
  std::vector<float> x;
  const int steps = static_cast<int>(limit * 1e4f);
  for (int i = -steps; i <= steps; ++i) x.push_back(static_cast<float>(i) * 1e-4f);
  std::vector<float> y = x;
  apply_activation(act, y.data(), static_cast<std::int64_t>(y.size()));
  double worst = 0, worst_x = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double ref = activation_ref(act, x[i]);
    if (std::abs(ref) < FLT_MIN) {
      EXPECT_LE(std::abs(y[i]), FLT_MIN) << "x = " << x[i];
      continue;
    }
    const double rel = std::abs(y[i] - ref) / std::abs(ref);
    if (rel > worst) {
      worst = rel;
      worst_x = x[i];
    }
  }
  std::cout << activation_name(act) << ": max relative error over |x| <= " << limit << ": " << worst
            << " at x = " << worst_x << "\n";
  return worst;
}

TEST(LayersActivation, GeluErfRelativeError) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    // Evaluated in f64 lanes: Numerical Recipes' erfc fit (1.05e-7) plus one rounding to f32.
    EXPECT_LE(max_relative_error(Activation::kGeluErf, 4.0f), 2e-7);
    EXPECT_LE(max_relative_error(Activation::kGeluErf, 16.0f), 2e-7);
  });
}

// The hidden activations of mixed-precision training: act(x) in f32 lanes rounded to bf16
// (activation_to_bf16_kernel) against the float64 activation rounded once: never more than one
// bf16 step apart, and equal for nearly all (the f32 evaluation is within ~1e-6 of it; only
// values near a rounding boundary of bf16's 2^-9 can differ), down to magnitudes of 1e-30 (the
// GELUs' far negative tails, where both are that small and the f32 exp stops at FLT_MIN: GELU
// tanh of x < -10 flushes to -0 where float64 has 1e-38 .. 1e-45); every target, a vector's
// tail.
TEST(LayersActivation, ToBf16IsTheRoundedActivation) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    std::vector<float> x = random_floats(4000 + 7, 71, -12.0f, 12.0f);
    for (const float special : {0.0f, -0.0f, 1e-30f, -1e-30f, 30.0f, -30.0f}) x.push_back(special);
    const auto n = static_cast<std::int64_t>(x.size());
    for (const Activation act : kAllActivations) {
      std::vector<std::uint16_t> bits(x.size() + 1, 0xabcd);
      layers::activation_to_bf16_kernel(act, x.data(), bits.data(), n);
      std::int64_t differ = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const float want = static_cast<float>(activation_ref(act, static_cast<double>(x[i])));
        const std::uint16_t w = f32_to_bf16_bits(want);
        const int step = std::abs(static_cast<int>(bits[i]) - static_cast<int>(w));
        const bool tiny = std::abs(want) < 1e-30f && std::abs(bf16_bits_to_f32(bits[i])) < 1e-30f;
        ASSERT_TRUE(step <= 1 || tiny)
            << activation_name(act) << " x = " << x[i] << ": " << bits[i] << " vs " << w;
        differ += bits[i] != w && !tiny;
      }
      EXPECT_LE(differ, n / 100) << activation_name(act);
      EXPECT_EQ(bits[n], 0xabcd);  // nothing past n
    }
  });
}

// Out of place (training keeps the pre-activation): y gets the in-place bits, x is untouched,
// for every activation, on every target, with a vector's tail.
TEST(LayersActivation, OutOfPlaceGivesTheInPlaceBits) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    const std::vector<float> x = random_floats(1000 + 13, 70, -6.0f, 6.0f);
    for (const Activation act : kAllActivations) {
      std::vector<float> in_place = x, y(x.size(), 7.0f), source = x;
      apply_activation(act, in_place.data(), static_cast<std::int64_t>(x.size()));
      apply_activation(act, source.data(), y.data(), static_cast<std::int64_t>(x.size()));
      EXPECT_EQ(y, in_place) << activation_name(act);
      EXPECT_EQ(source, x) << activation_name(act);
    }
  });
}

TEST(LayersActivation, GeluTanhRelativeError) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    // Evaluated in f64 lanes and rounded once: within half an ulp (2^-24 = 6e-8) plus a little.
    EXPECT_LE(max_relative_error(Activation::kGeluTanh, 16.0f), 7e-8);
  });
}

TEST(LayersActivation, ReluExactAndNoneIdentity) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    EXPECT_EQ(max_relative_error(Activation::kRelu), 0.0);
    EXPECT_EQ(max_relative_error(Activation::kNone), 0.0);
  });
}

TEST(LayersActivation, OddLengthsTouchOnlyTheirElements) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    for (std::int64_t n : {1, 3, 7, 15, 16, 17, 31, 33, 100003}) {
      for (Activation act : kAllActivations) {
        std::vector<float> x = random_floats(n + 8, 100 + n, -4.0f, 4.0f);
        const std::vector<float> original = x;
        apply_activation(act, x.data(), n);
        for (std::int64_t i = 0; i < n; ++i) {
          const double ref = activation_ref(act, original[i]);
          ASSERT_NEAR(x[i], ref, 4e-7 * std::max(1.0, std::abs(ref)))
              << activation_name(act) << " n=" << n << " i=" << i;
        }
        for (std::int64_t i = n; i < n + 8; ++i) ASSERT_EQ(x[i], original[i]) << "past n";
      }
    }
  });
}

TEST(LayersActivation, SpecialValues) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<float> x = {0.0f, -0.0f, inf, -30.0f, 30.0f, 1e-30f, -1e-30f};
    apply_activation(Activation::kGeluErf, x.data(), static_cast<std::int64_t>(x.size()));
    EXPECT_EQ(x[0], 0.0f);
    EXPECT_EQ(x[1], 0.0f);
    EXPECT_EQ(x[2], inf);
    EXPECT_EQ(x[3], 0.0f);
    EXPECT_EQ(x[4], 30.0f);
    EXPECT_FLOAT_EQ(x[5], 0.5e-30f);
    EXPECT_FLOAT_EQ(x[6], -0.5e-30f);
    std::vector<float> nan = {std::nanf(""), -inf};
    apply_activation(Activation::kGeluErf, nan.data(), 2);
    EXPECT_TRUE(std::isnan(nan[0]));
    EXPECT_TRUE(std::isnan(nan[1]));  // -inf * 0, as 0.5 x (1 + erf(x / sqrt 2)) in float64
  });
}

// ---- Linear ----

struct LinearCase {
  std::int64_t rows, in, out;
  Activation act;
  bool bias;
  std::int64_t x_stride;  // 0 = in
};

void check_linear(const LinearCase& c) {
  const std::uint64_t seed = static_cast<std::uint64_t>(c.rows * 1000003 + c.in * 1009 + c.out);
  const std::int64_t stride = c.x_stride ? c.x_stride : c.in;
  const std::vector<float> w = random_floats(c.out * c.in, seed);
  const std::vector<float> b = c.bias ? random_floats(c.out, seed + 1) : std::vector<float>{};
  const std::vector<float> x = random_floats(c.rows * stride, seed + 2, -2.0f, 2.0f);
  Linear linear(
      {.weight = w, .bias = b, .in_features = c.in, .out_features = c.out, .activation = c.act});
  EXPECT_EQ(linear.in_features(), c.in);
  EXPECT_EQ(linear.out_features(), c.out);
  std::vector<float> y(c.rows * c.out, 42.0f);
  linear.forward(x.data(), c.rows, y.data(), c.x_stride);
  const Vec ref = linear_ref(to_f64(x), c.rows, c.in, to_f64(w), to_f64(b), c.out, c.act, stride);
  expect_close(y, ref, 2e-6 * std::sqrt(static_cast<double>(c.in)) + 1e-6,
               "rows=" + std::to_string(c.rows) + " in=" + std::to_string(c.in) +
                   " out=" + std::to_string(c.out) + " act=" + activation_name(c.act));
}

TEST(LayersLinear, SweepSizesAndActivations) {
  for (std::int64_t rows : {1, 3, 17}) {
    for (std::int64_t in : {1, 5, 64, 96}) {
      for (std::int64_t out : {1, 5, 64, 96}) {
        check_linear({rows, in, out, Activation::kNone, true, 0});
      }
    }
  }
  for (Activation act : kAllActivations) {
    for (bool bias : {false, true}) check_linear({17, 96, 65, act, bias, 0});
  }
}

TEST(LayersLinear, LargerShapesUseBlockedWeights) {
  check_linear({300, 384, 1536, Activation::kGeluErf, true, 0});
  check_linear({257, 1536, 384, Activation::kNone, true, 0});
}

TEST(LayersLinear, StridedInput) {
  check_linear({17, 5, 7, Activation::kNone, true, 9});
  check_linear({3, 64, 96, Activation::kRelu, false, 200});
}

TEST(LayersLinear, PrimitiveCachePerRowsCount) {
  // Alternate rows counts on one object: each call must use the primitive of its own shape.
  const std::int64_t in = 33, out = 20;
  const std::vector<float> w = random_floats(out * in, 7);
  const std::vector<float> b = random_floats(out, 8);
  Linear linear({.weight = w, .bias = b, .in_features = in, .out_features = out});
  for (int round = 0; round < 2; ++round) {
    for (std::int64_t rows : {1, 300, 2, 1}) {
      const std::vector<float> x = random_floats(rows * in, 9 + rows + round);
      std::vector<float> y(rows * out);
      linear.forward(x.data(), rows, y.data());
      expect_close(y, linear_ref(to_f64(x), rows, in, to_f64(w), to_f64(b), out), 2e-5,
                   "rows=" + std::to_string(rows));
    }
  }
  Linear moved = std::move(linear);
  const std::vector<float> x = random_floats(in, 77);
  std::vector<float> y(out);
  moved.forward(x.data(), 1, y.data());
  expect_close(y, linear_ref(to_f64(x), 1, in, to_f64(w), to_f64(b), out), 2e-5, "moved");
}

// dtype bf16: x and W rounded to bf16, products and sums in f32. Against the float64 product of
// the rounded operands: f32 accumulation error only. The f32 layer on the unrounded operands
// must be much farther from that (so the rounding really happened).
void check_linear_bf16(const LinearCase& c) {
  const std::int64_t stride = c.x_stride ? c.x_stride : c.in;
  const std::vector<float> w = random_floats(c.out * c.in, 31 + c.in);
  const std::vector<float> b = c.bias ? random_floats(c.out, 32) : std::vector<float>{};
  const std::vector<float> x = random_floats(c.rows * stride, 33 + c.rows, -2.0f, 2.0f);
  const auto rounded = [](std::vector<float> v) {
    for (float& e : v) e = round_to_bf16(e);
    return v;
  };
  const LinearParams params{
      .weight = w, .bias = b, .in_features = c.in, .out_features = c.out, .activation = c.act};
  LinearParams bf16_params = params;
  bf16_params.dtype = DType::kBF16;
  const Linear bf16(bf16_params), f32(params);
  EXPECT_EQ(bf16.dtype(), DType::kBF16);
  std::vector<float> y(c.rows * c.out, 42.0f), y32(c.rows * c.out);
  bf16.forward(x.data(), c.rows, y.data(), c.x_stride);
  f32.forward(x.data(), c.rows, y32.data(), c.x_stride);
  const Vec ref = linear_ref(to_f64(rounded(x)), c.rows, c.in, to_f64(rounded(w)), to_f64(b),
                             c.out, c.act, stride);
  const std::string what = "bf16 rows=" + std::to_string(c.rows) + " in=" + std::to_string(c.in) +
                           " out=" + std::to_string(c.out) + " act=" + activation_name(c.act);
  expect_close(y, ref, 2e-6 * std::sqrt(static_cast<double>(c.in)) + 1e-6, what);
  double f32_err = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) f32_err = std::max(f32_err, std::abs(y32[i] - ref[i]));
  EXPECT_GT(f32_err, 1e-4) << what << ": the f32 layer is as close to the rounded operands";
  // The weights read back are the bf16 values, as f32.
  EXPECT_EQ(bf16.weight(), rounded(w)) << what;
}

TEST(LayersLinear, Bf16ProductsOfTheRoundedOperands) {
  for (Activation act : kAllActivations) check_linear_bf16({17, 96, 65, act, true, 0});
  check_linear_bf16({1, 5, 7, Activation::kNone, false, 0});
  check_linear_bf16({300, 384, 1536, Activation::kGeluErf, true, 0});
  check_linear_bf16({17, 5, 7, Activation::kNone, true, 9});  // strided x
}

// The vectorised rounding Linear's bf16 products apply to their activations, bit for bit
// against the scalar f32_to_bf16_bits / round_to_bf16 over every 997th float bit pattern (NaNs
// of both signs, infinities, subnormals, ties among them), plus the ties to even and the
// largest finite values, at every length of a vector's tail.
TEST(LayersLinear, Bf16RoundingKernelMatchesTheScalarOne) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    std::vector<float> x;
    for (std::uint64_t b = 0; b <= 0xffffffffu; b += 997) {
      x.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(b)));
    }
    for (std::uint32_t b : {0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u,
                            0x00008000u, 0x80018000u, 0x7f800001u, 0xffc00000u, 0x7f800000u}) {
      x.push_back(std::bit_cast<float>(b));
    }
    for (std::size_t n : {x.size(), std::size_t{0}, std::size_t{1}, std::size_t{15},
                          std::size_t{17}, std::size_t{33}}) {
      std::vector<std::uint16_t> bits(n + 1, 0xabcd);
      std::vector<float> values(n + 1, 7.0f);
      const float* in = x.data() + (x.size() - n);  // the specials are at the end
      layers::round_to_bf16_kernel(in, static_cast<std::int64_t>(n), bits.data());
      layers::round_to_bf16_kernel(in, static_cast<std::int64_t>(n), values.data());
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_EQ(bits[i], f32_to_bf16_bits(in[i]))
            << std::hex << std::bit_cast<std::uint32_t>(in[i]);
        ASSERT_EQ(std::bit_cast<std::uint32_t>(values[i]),
                  std::bit_cast<std::uint32_t>(round_to_bf16(in[i])))
            << std::hex << std::bit_cast<std::uint32_t>(in[i]);
      }
      EXPECT_EQ(bits[n], 0xabcd);  // nothing past n
      EXPECT_EQ(values[n], 7.0f);
    }
  });
}

// A feed-forward's two bf16 Linears handing their hidden activations over as bf16 bits give the
// bits of the f32 hand-off (ff2 rounds its input to bf16 anyway): forward_to_bf16 is forward()
// rounded to nearest even, forward_from_bf16 is forward() on the widened bits; odd sizes, a
// strided input, every activation. Both refuse an f32 Linear.
TEST(LayersLinear, Bf16HandOffGivesTheBitsOfTheF32One) {
  SplitMix64 rng(23);
  const auto random = [&](std::size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = rng.uniform24() * 2.0f - 1.0f;
    return v;
  };
  for (Activation act : kAllActivations) {
    for (const auto [rows, in, hidden, out, stride] :
         {std::array<std::int64_t, 5>{17, 96, 65, 33, 0}, {300, 384, 1536, 384, 0},
          {5, 7, 9, 3, 11}}) {
      const std::vector<float> w1 = random(hidden * in), b1 = random(hidden);
      const std::vector<float> w2 = random(out * hidden), b2 = random(out);
      const std::vector<float> x = random(rows * std::max(in, stride));
      const Linear ff1({.weight = w1, .bias = b1, .in_features = in, .out_features = hidden,
                        .activation = act, .dtype = DType::kBF16});
      const Linear ff2({.weight = w2, .bias = b2, .in_features = hidden, .out_features = out,
                        .dtype = DType::kBF16});
      std::vector<float> h(rows * hidden), y(rows * out), y_handed(rows * out);
      std::vector<std::uint16_t> bits(rows * hidden);
      ff1.forward(x.data(), rows, h.data(), stride);
      ff2.forward(h.data(), rows, y.data());
      ff1.forward_to_bf16(x.data(), rows, bits.data(), stride);
      for (std::size_t i = 0; i < h.size(); ++i) ASSERT_EQ(bits[i], f32_to_bf16_bits(h[i])) << i;
      ff2.forward_from_bf16(bits.data(), rows, y_handed.data());
      for (std::size_t i = 0; i < y.size(); ++i) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(y_handed[i]), std::bit_cast<std::uint32_t>(y[i]))
            << i;
      }
    }
  }
  const std::vector<float> w(12, 0.5f), x(6, 1.0f);
  std::vector<float> y(8);
  std::vector<std::uint16_t> bits(8);
  const Linear f32({.weight = w, .in_features = 3, .out_features = 4});
  expect_error([&] { f32.forward_to_bf16(x.data(), 2, bits.data()); },
               "Linear::forward_to_bf16: needs a bf16 Linear, this one has dtype f32");
  expect_error([&] { f32.forward_from_bf16(bits.data(), 2, y.data()); },
               "Linear::forward_from_bf16: needs a bf16 Linear, this one has dtype f32");
}

// A bf16 Linear's backward (mixed-precision training) multiplies dy, W and x rounded to bf16
// (nearest even, as its forward rounds x and W) and accumulates in f32: dx and dweight against
// float64 products of the rounded operands, and further from the f32 layer's (so the rounding
// happened); dbias sums dy as given, the f32 layer's bits; odd sizes, a strided x, the weights
// of an optimizer's step (set_weights). f16 is no product type.
TEST(LayersLinear, Bf16BackwardMultipliesTheRoundedOperands) {
  const auto rounded = [](std::vector<float> v) {
    for (float& e : v) e = round_to_bf16(e);
    return v;
  };
  for (const auto [rows, in, out, x_stride] : {std::array<std::int64_t, 4>{37, 45, 29, 0},
                                               {300, 384, 1536, 0},
                                               {5, 7, 3, 11},
                                               {1, 5, 7, 0}}) {
    const std::int64_t stride = std::max(in, x_stride);
    std::vector<float> w = random_floats(out * in, 40);
    const auto b = random_floats(out, 41), x = random_floats(rows * stride, 42, -2.0f, 2.0f);
    const auto dy = random_floats(rows * out, 43);
    const std::string what = "rows=" + std::to_string(rows) + " in=" + std::to_string(in) +
                             " out=" + std::to_string(out) + " stride=" + std::to_string(stride);
    Linear bf16({.weight = random_floats(out * in, 44),
                 .bias = b,
                 .in_features = in,
                 .out_features = out,
                 .dtype = DType::kBF16});
    bf16.set_weights(w, b);  // (an optimizer's step: the backward takes these)
    const Linear f32({.weight = w, .bias = b, .in_features = in, .out_features = out});
    std::vector<float> dx(rows * in, 7.0f), dw(out * in, 0.5f), db(out, 0.5f);
    std::vector<float> dx32(rows * in), dw32(out * in, 0.5f), db32(out, 0.5f);
    bf16.backward(x.data(), rows, dy.data(), dx.data(), dw.data(), db.data(), x_stride);
    f32.backward(x.data(), rows, dy.data(), dx32.data(), dw32.data(), db32.data(), x_stride);
    const Vec rx = to_f64(rounded(x)), rw = to_f64(rounded(w)), rdy = to_f64(rounded(dy));
    Vec dx_ref(rows * in, 0.0), dw_ref(out * in, 0.5);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t j = 0; j < out; ++j) {
        for (std::int64_t i = 0; i < in; ++i) {
          dx_ref[r * in + i] += rdy[r * out + j] * rw[j * in + i];
          dw_ref[j * in + i] += rdy[r * out + j] * rx[r * stride + i];
        }
      }
    }
    expect_close(dx, dx_ref, 2e-6 * std::sqrt(static_cast<double>(out)) + 1e-6, "dx " + what);
    expect_close(dw, dw_ref, 2e-6 * std::sqrt(static_cast<double>(rows)) + 1e-6, "dw " + what);
    EXPECT_EQ(db, db32) << what;
    double f32_err = 0;
    for (std::size_t i = 0; i < dw_ref.size(); ++i) {
      f32_err = std::max(f32_err, std::abs(dw32[i] - dw_ref[i]));
    }
    EXPECT_GT(f32_err, 1e-4) << what << ": the f32 layer is as close to the rounded operands";
    // x handed over as bf16 bits (backward_from_bf16): the bits of backward() on x.
    if (x_stride == 0) {
      std::vector<std::uint16_t> x_bits(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) x_bits[i] = f32_to_bf16_bits(x[i]);
      std::vector<float> dx2(rows * in), dw2(out * in, 0.5f), db2(out, 0.5f);
      bf16.backward_from_bf16(x_bits.data(), rows, dy.data(), dx2.data(), dw2.data(), db2.data());
      EXPECT_EQ(dx2, dx) << what;
      EXPECT_EQ(dw2, dw) << what;
      EXPECT_EQ(db2, db) << what;
    }
  }
  const std::vector<float> w(12, 0.5f), dy(8, 1.0f);
  const std::vector<std::uint16_t> bits(6, 0x3f80);
  std::vector<float> dx(6), dw(12);
  const Linear f32({.weight = w, .in_features = 3, .out_features = 4});
  expect_error(
      [&] { f32.backward_from_bf16(bits.data(), 2, dy.data(), dx.data(), dw.data(), nullptr); },
      "Linear::backward_from_bf16: needs a bf16 Linear, this one has dtype f32");
  expect_error([&] { Linear({.weight = w, .in_features = 3, .out_features = 4, .dtype = DType::kF16}); },
               "dtype f16 is not a product type (f32 or bf16)");
}

TEST(LayersLinear, ValidationErrors) {
  const std::vector<float> w(12, 0.5f), b(4, 0.5f);
  expect_error([&] { Linear({.weight = w, .bias = {}, .in_features = 3, .out_features = 5}); },
               "weight has 12 elements, expected 15 for weight shape [out_features = 5, "
               "in_features = 3]");
  expect_error(
      [&] {
        Linear({.weight = w,
                .bias = std::span<const float>(b).first(3),
                .in_features = 3,
                .out_features = 4});
      },
      "bias has 3 elements, expected out_features = 4");
  expect_error([&] { Linear({.weight = w, .bias = {}, .in_features = 0, .out_features = 4}); },
               "must be > 0");
  Linear linear({.weight = w, .bias = b, .in_features = 3, .out_features = 4});
  std::vector<float> x(6), y(8, 42.0f);
  expect_error([&] { linear.forward(x.data(), 2, y.data(), 2); },
               "x_stride = 2 is smaller than in_features = 3");
  expect_error([&] { linear.forward(x.data(), -1, y.data()); }, "rows = -1 is negative");
  expect_error([&] { linear.forward(nullptr, 2, y.data()); }, "must not be null");
  for (float v : y) EXPECT_EQ(v, 42.0f);
}

// ---- LayerNorm ----

TEST(LayersLayerNorm, SweepWithAndWithoutResidual) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    for (std::int64_t rows : {1, 3, 17}) {
      // (Vector counts around the sums' four chains: whole rounds, rounds and single vectors,
      // rounds and a partial vector.)
      for (std::int64_t features : {1, 5, 64, 96, 100, 384, 1000}) {
        const std::uint64_t seed = rows * 131 + features;
        const std::vector<float> gamma = random_floats(features, seed, 0.5f, 1.5f);
        const std::vector<float> beta = random_floats(features, seed + 1);
        // A large common offset checks the two-pass variance (E[v^2] - E[v]^2 would cancel).
        const std::vector<float> x = random_floats(rows * features, seed + 2, 99.0f, 101.0f);
        const std::vector<float> r = random_floats(rows * features, seed + 3);
        const float eps = 1e-5f;
        LayerNorm norm(gamma, beta, features, eps);
        const std::string what = "rows=" + std::to_string(rows) + " F=" + std::to_string(features);

        std::vector<float> y(rows * features);
        norm.forward(x.data(), nullptr, rows, y.data());
        expect_close(
            y, layer_norm_ref(to_f64(x), {}, rows, features, to_f64(gamma), to_f64(beta), eps),
            3e-5, what + " no residual");

        const Vec ref_res =
            layer_norm_ref(to_f64(x), to_f64(r), rows, features, to_f64(gamma), to_f64(beta), eps);
        norm.forward(x.data(), r.data(), rows, y.data());
        expect_close(y, ref_res, 3e-5, what + " residual");
        std::vector<float> in_place = x;  // y aliases x
        norm.forward(in_place.data(), r.data(), rows, in_place.data());
        expect_close(in_place, ref_res, 3e-5, what + " y == x");
        std::vector<float> res_alias = r;  // y aliases residual
        norm.forward(x.data(), res_alias.data(), rows, res_alias.data());
        expect_close(res_alias, ref_res, 3e-5, what + " y == residual");
      }
    }
  });
}

TEST(LayersLayerNorm, ConstantRowGivesBeta) {
  for_each_target(layers::layer_kernels_target_name, [&](std::int64_t) {
    const std::vector<float> gamma(5, 2.0f), beta = {1, 2, 3, 4, 5};
    LayerNorm norm(gamma, beta, 5, 1e-12f);
    std::vector<float> x(5, 7.25f), y(5);
    norm.forward(x.data(), nullptr, 1, y.data());
    for (int i = 0; i < 5; ++i) EXPECT_EQ(y[i], beta[i]);
  });
}

TEST(LayersLayerNorm, ValidationErrors) {
  const std::vector<float> g(4, 1.0f), b(3, 0.0f);
  expect_error([&] { LayerNorm(g, b, 4, 1e-5f); }, "beta has 3 elements, expected features = 4");
  expect_error([&] { LayerNorm(b, g, 4, 1e-5f); }, "gamma has 3 elements, expected features = 4");
  expect_error([&] { LayerNorm(g, g, 4, 0.0f); }, "eps");
}

}  // namespace
}  // namespace qkv::testing
