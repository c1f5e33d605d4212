// EncoderLayer / Encoder against a float64 composition of the references (Post-LN and Pre-LN,
// GELU / GELU-tanh / ReLU, GQA, key lengths), and dropout's contract.
#include <gtest/gtest.h>
#include <omp.h>

#include <vector>

#include "expect_error.h"
#include "layers_reference.h"
#include "qkv/layers/dropout.h"
#include "qkv/layers/encoder_layer.h"

namespace qkv::testing {
namespace {

TEST(LayersEncoder, PostAndPreLnActivationsGqaKeyLengths) {
  struct Case {
    bool norm_first;
    Activation act;
    std::int64_t heads, kv_heads, d_ff;
  };
  for (Case c :
       {Case{false, Activation::kGeluErf, 4, 0, 48}, Case{true, Activation::kGeluErf, 4, 0, 37},
        Case{false, Activation::kRelu, 4, 2, 64}, Case{true, Activation::kGeluTanh, 2, 1, 37}}) {
    const EncoderLayerData d({.embed_dim = 32,
                       .num_heads = c.heads,
                       .num_kv_heads = c.kv_heads,
                       .d_ff = c.d_ff,
                       .activation = c.act,
                       .norm_first = c.norm_first,
                       .eps = 1e-5f},
                      100 + c.d_ff);
    EncoderLayer layer(d.config, d.weights());
    for (std::int64_t seq : {1, 3, 17}) {
      const std::int64_t batch = 2;
      const std::vector<std::int64_t> key_lengths = {seq, (seq + 1) / 2};
      std::vector<float> x = random_floats(batch * seq * 32, seq, -2.0f, 2.0f);
      const Vec ref = d.reference(to_f64(x), batch, seq, key_lengths);
      layer.forward(x.data(), batch, seq, {.key_lengths = key_lengths});
      expect_close(x, ref, 5e-5,
                   std::string(c.norm_first ? "pre-LN " : "post-LN ") + activation_name(c.act) +
                       " L=" + std::to_string(seq));
    }
  }
}

TEST(LayersEncoder, StackWithFinalNormEqualsLayerByLayer) {
  EncoderLayerConfig c{.embed_dim = 16, .num_heads = 2, .d_ff = 24, .norm_first = true};
  const EncoderLayerData d0(c, 1), d1(c, 50);
  const std::vector<float> g = random_floats(16, 3, 0.5f, 1.5f), b = random_floats(16, 4);
  std::vector<EncoderLayer> layers;
  layers.emplace_back(c, d0.weights());
  layers.emplace_back(c, d1.weights());
  Encoder encoder(std::move(layers), LayerNorm(g, b, 16, c.eps));
  EXPECT_EQ(encoder.num_layers(), 2);
  std::vector<float> x = random_floats(2 * 5 * 16, 5);
  Vec ref = d1.reference(d0.reference(to_f64(x), 2, 5, {}), 2, 5, {});
  ref = layer_norm_ref(ref, {}, 10, 16, to_f64(g), to_f64(b), c.eps);
  encoder.forward(x.data(), 2, 5);
  expect_close(x, ref, 5e-5, "encoder");
}

TEST(LayersEncoder, ValidationErrorsNameTheField) {
  EncoderLayerConfig c{.embed_dim = 16, .num_heads = 2, .d_ff = 24};
  EncoderLayerData d(c, 1);
  auto w = d.weights();
  w.ff1_weight = w.ff1_weight.first(10);
  expect_error([&] { EncoderLayer(c, w); },
               "EncoderLayer: ff1: Linear: weight has 10 elements, expected 384");
  w = d.weights();
  w.norm2_beta = w.norm2_beta.first(3);
  expect_error([&] { EncoderLayer(c, w); }, "EncoderLayer: norm2: LayerNorm: beta has 3");
  c.dropout = 1.0f;
  expect_error([&] { EncoderLayer(c, d.weights()); }, "dropout = 1.000000 must be in [0, 1)");
}

// ---- dropout ----

TEST(LayersDropout, RateScaleReproducibleThreadIndependent) {
  const std::int64_t n = 200003;
  const float p = 0.3f;
  std::vector<float> ones(n, 1.0f);
  std::vector<float> a = ones;
  dropout(a.data(), n, p, 42, 7);
  std::int64_t zeros = 0;
  for (float v : a) {
    if (v == 0.0f) {
      ++zeros;
    } else {
      ASSERT_FLOAT_EQ(v, 1.0f / (1.0f - p));  // survivors scaled by 1 / (1 - p)
    }
  }
  // Binomial(n, 0.3): sd = sqrt(n p (1-p)) = 205; allow 5 sd.
  EXPECT_NEAR(static_cast<double>(zeros), p * n, 5 * 205.0);

  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    std::vector<float> b = ones;
    dropout(b.data(), n, p, 42, 7);
    EXPECT_EQ(a, b) << "threads=" << threads;  // same seed + stream -> same mask
  }
  omp_set_num_threads(saved);
  std::vector<float> other_stream = ones, other_seed = ones;
  dropout(other_stream.data(), n, p, 42, 8);
  dropout(other_seed.data(), n, p, 43, 7);
  EXPECT_NE(a, other_stream);
  EXPECT_NE(a, other_seed);
  std::vector<float> untouched = ones;
  dropout(untouched.data(), n, 0.0f, 42, 7);
  EXPECT_EQ(untouched, ones);
  expect_error([&] { dropout(untouched.data(), n, 1.0f, 1, 1); }, "p = 1.000000 must be in [0, 1)");
}

TEST(LayersDropout, EncoderTrainingModeOnlyAndSeeded) {
  EncoderLayerConfig c{.embed_dim = 16, .num_heads = 2, .d_ff = 24, .dropout = 0.25f};
  const EncoderLayerData d(c, 9);
  EncoderLayer layer(c, d.weights());
  const std::vector<float> x = random_floats(3 * 7 * 16, 10);
  auto run = [&](const EncoderLayer& l) {
    std::vector<float> y = x;
    l.forward(y.data(), 3, 7);
    return y;
  };
  // Inference: dropout is the identity, so the result is the reference's.
  expect_close(run(layer), d.reference(to_f64(x), 3, 7, {}), 5e-5, "inference");
  const std::vector<float> inference = run(layer);

  layer.set_training(true, 1234);
  EXPECT_TRUE(layer.training());
  const std::vector<float> step0 = run(layer), step1 = run(layer);
  EXPECT_NE(step0, inference);
  EXPECT_NE(step0, step1);         // each step draws a new mask
  layer.set_training(true, 1234);  // same seed, step reset: same masks, any thread count
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  EXPECT_EQ(run(layer), step0);
  omp_set_num_threads(saved);
  EXPECT_EQ(run(layer), step1);
  layer.set_training(false);
  EXPECT_EQ(run(layer), inference);
}

}  // namespace
}  // namespace qkv::testing
