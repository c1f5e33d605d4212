// EncoderLayer's training half: backward's dx and every parameter gradient against central
// finite differences of a float64 reference layer (built from layers_reference.h's pieces) for
// L = sum(d_out * layer(x)), Post-LN and Pre-LN, GELU and ReLU, GQA, key lengths; the dropout
// masks of forward_train replayed by backward; parameters() / set_parameters().
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <vector>

#include "expect_error.h"
#include "layers_reference.h"
#include "qkv/layers/encoder_layer.h"

namespace qkv::testing {
namespace {

// The layer's parameters in float64, in EncoderLayerParams::tensors()'s order for kSeparate.
struct Params64 {
  Vec q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, g1, b1, f1_w, f1_b, f2_w, f2_b, g2, b2;
  std::vector<Vec*> all() {
    return {&q_w, &q_b, &k_w, &k_b, &v_w, &v_b, &o_w, &o_b,
            &g1,  &b1,  &f1_w, &f1_b, &f2_w, &f2_b, &g2, &b2};
  }
};

Vec layer_ref(const Params64& p, const EncoderLayerConfig& c, const Vec& x, std::int64_t batch,
              std::int64_t seq, const std::vector<std::int64_t>& key_lengths) {
  const std::int64_t E = c.embed_dim, rows = batch * seq;
  const MhaRefProblem problem{.batch = batch, .seq_q = seq, .seq_kv = seq, .embed_dim = E,
                              .num_heads = c.num_heads,
                              .num_kv_heads = c.num_kv_heads ? c.num_kv_heads : c.num_heads,
                              .kdim = E, .vdim = E, .key_lengths = key_lengths};
  const MhaRefWeights w{p.q_w, p.q_b, p.k_w, p.k_b, p.v_w, p.v_b, p.o_w, p.o_b};
  auto attn = [&](const Vec& in) { return mha_ref(problem, w, in, in, in).out; };
  auto ffn = [&](const Vec& in) {
    const Vec h = linear_ref(in, rows, E, p.f1_w, p.f1_b, c.d_ff, c.activation);
    return linear_ref(h, rows, c.d_ff, p.f2_w, p.f2_b, E);
  };
  auto ln = [&](const Vec& in, const Vec& res, const Vec& g, const Vec& b) {
    return layer_norm_ref(in, res, rows, E, g, b, c.eps);
  };
  auto add = [](Vec a, const Vec& b) {
    for (std::size_t i = 0; i < a.size(); ++i) a[i] += b[i];
    return a;
  };
  if (!c.norm_first) {
    const Vec y = ln(attn(x), x, p.g1, p.b1);
    return ln(ffn(y), y, p.g2, p.b2);
  }
  const Vec y = add(x, attn(ln(x, {}, p.g1, p.b1)));
  return add(y, ffn(ln(y, {}, p.g2, p.b2)));
}

TEST(EncoderBackward, MatchesFiniteDifferences) {
  const std::int64_t B = 2, L = 4;
  for (const bool norm_first : {false, true}) {
    for (const Activation act : {Activation::kGeluErf, Activation::kRelu}) {
      const EncoderLayerConfig c{.embed_dim = 8, .num_heads = 4, .num_kv_heads = 2, .d_ff = 12,
                                 .activation = act, .norm_first = norm_first};
      SCOPED_TRACE(std::string(norm_first ? "Pre-LN " : "Post-LN ") + activation_name(act));
      const EncoderLayerData d(c, 30);
      const EncoderLayer layer(c, d.weights());
      const std::vector<std::int64_t> key_lengths = {4, 3};
      const MhaOptions options{.key_lengths = key_lengths};
      const auto x = random_floats(B * L * 8, 31), d_out = random_floats(B * L * 8, 32);
      std::vector<float> y = x;
      EncoderLayerTape tape;
      layer.forward_train(y.data(), B, L, options, tape);
      std::vector<float> dx = d_out;
      EncoderLayerParams grads = layer.zero_grads();
      layer.backward(tape, dx.data(), grads);

      Params64 p{to_f64(d.q_w), to_f64(d.q_b), to_f64(d.k_w), to_f64(d.k_b), to_f64(d.v_w),
                 to_f64(d.v_b), to_f64(d.o_w), to_f64(d.o_b), to_f64(d.g1), to_f64(d.b1),
                 to_f64(d.f1_w), to_f64(d.f1_b), to_f64(d.f2_w), to_f64(d.f2_b), to_f64(d.g2),
                 to_f64(d.b2)};
      const Vec d64 = to_f64(d_out);
      expect_close(y, layer_ref(p, c, to_f64(x), B, L, key_lengths), 1e-5, "forward_train");
      expect_close(dx, finite_differences(to_f64(x), [&](const Vec& x64) {
                     return dot(d64, layer_ref(p, c, x64, B, L, key_lengths));
                   }), 2e-5, "dx");
      const std::vector<std::vector<float>*> got = grads.tensors();
      std::vector<Vec*> fields = p.all();
      ASSERT_EQ(got.size(), fields.size());
      for (std::size_t f = 0; f < fields.size(); ++f) {
        const Vec fd = finite_differences(*fields[f], [&](const Vec& value) {
          Params64 changed = p;
          *changed.all()[f] = value;
          return dot(d64, layer_ref(changed, c, to_f64(x), B, L, key_lengths));
        });
        expect_close(*got[f], fd, 2e-5, "parameter " + std::to_string(f));
      }
    }
  }
}

TEST(EncoderBackward, DropoutMasksAreTheForwards) {
  // Training mode: L(x) = sum(d_out * forward_train(x)) at one step is a fixed function of x
  // (every mask keyed by the seed and the step): backward's dx must match its finite
  // differences (float32, coarse).
  for (const bool norm_first : {false, true}) {
    const EncoderLayerConfig c{.embed_dim = 8, .num_heads = 2, .d_ff = 16,
                               .norm_first = norm_first, .dropout = 0.3f};
    const EncoderLayerData d(c, 40);
    EncoderLayer layer(c, d.weights());
    auto x = random_floats(2 * 5 * 8, 41);
    const auto d_out = random_floats(2 * 5 * 8, 42);
    auto loss = [&] {
      layer.set_training(true, 9);  // step 0 every time
      std::vector<float> y = x;
      EncoderLayerTape t;
      layer.forward_train(y.data(), 2, 5, {}, t);
      double s = 0;
      for (std::size_t i = 0; i < y.size(); ++i) s += static_cast<double>(d_out[i]) * y[i];
      return s;
    };
    layer.set_training(true, 9);
    std::vector<float> y = x, dx = d_out;
    EncoderLayerTape tape;
    layer.forward_train(y.data(), 2, 5, {}, tape);
    layer.set_training(true, 9);
    std::vector<float> plain = x;
    layer.forward(plain.data(), 2, 5);
    // forward() in training mode applies the same masks (its GELU is oneDNN's fused one:
    // rounding apart).
    expect_close(plain, to_f64(y), 1e-5, "forward == forward_train");
    EncoderLayerParams grads = layer.zero_grads();
    layer.backward(tape, dx.data(), grads);
    for (std::size_t i = 0; i < x.size(); i += 7) {
      const float keep = x[i], h = 1e-2f;
      x[i] = keep + h;
      const double up = loss();
      x[i] = keep - h;
      const double down = loss();
      x[i] = keep;
      EXPECT_NEAR(dx[i], (up - down) / (2 * h), 5e-3) << (norm_first ? "Pre-LN " : "Post-LN ") << i;
    }
  }
}

TEST(EncoderBackward, SetParametersRoundTrip) {
  const EncoderLayerConfig c{.embed_dim = 8, .num_heads = 2, .d_ff = 16};
  const EncoderLayerData d(c, 50);
  EncoderLayer layer(c, d.weights());
  EncoderLayerParams p = layer.parameters();
  EXPECT_EQ(p.ff1_weight, d.f1_w);
  EXPECT_EQ(p.norm2_gamma, d.g2);
  for (std::vector<float>* t : p.tensors()) {
    for (float& v : *t) v *= 0.75f;
  }
  layer.set_parameters(p);
  const EncoderLayer fresh(c, p.weights());
  auto x = random_floats(3 * 8, 51);
  std::vector<float> a = x, b = x;
  layer.forward(a.data(), 1, 3);
  fresh.forward(b.data(), 1, 3);
  EXPECT_EQ(a, b);
  p.ff2_bias.clear();
  expect_error([&] { layer.set_parameters(p); }, "EncoderLayer::set_parameters: ");
}

// The largest |a - b| over the largest |b| (at least 1): a relative distance.
double relative_distance(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, size = 1;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    size = std::max(size, std::abs(static_cast<double>(b[i])));
  }
  return diff / size;
}

// matmul_dtype bf16 (mixed precision): forward and forward_train close to f32 (the products'
// operands rounded to bf16), and so is every gradient of backward, which runs its products in
// bf16 too (Linear::backward, attention_backward on the rounded q, k, v): dx and each
// parameter's gradient within 5% of the f32 layer's (relative to its largest element; logged),
// and dx and every weight matrix's gradient not the f32 bits. The key bias's exact gradient is
// zero (the softmax ignores a shift shared by a query's keys): bf16 leaves rounding noise
// there, held small against the key weights' gradient. Post-LN and Pre-LN, GQA, causal.
TEST(EncoderBackward, Bf16MatmulsTrainCloseToF32) {
  for (const auto& [norm_first, dropout] : {std::pair{false, 0.0f}, {true, 0.0f}, {true, 0.1f}}) {
    SCOPED_TRACE(std::string(norm_first ? "Pre-LN" : "Post-LN") + " dropout " +
                 std::to_string(dropout));
    EncoderLayerConfig c{
        .embed_dim = 64, .num_heads = 4, .num_kv_heads = 2, .d_ff = 96, .norm_first = norm_first};
    const EncoderLayerData d(c, 60);
    c.dropout = dropout;
    EncoderLayer f32(c, d.weights());
    c.matmul_dtype = DType::kBF16;
    EncoderLayer bf16(c, d.weights());
    const std::int64_t B = 2, L = 37, n = B * L * c.embed_dim;
    const auto x = random_floats(n, 61), d_out = random_floats(n, 62);
    const MhaOptions options{.causal = true};
    std::vector<float> a = x, b = x, a_train = x, b_train = x;
    f32.forward(a.data(), B, L, options);
    bf16.forward(b.data(), B, L, options);
    EXPECT_GT(relative_distance(b, a), 0.0) << "bf16 products gave the f32 bits";
    EXPECT_LT(relative_distance(b, a), 2e-2);
    // (with dropout: the same masks in both, the bf16 hidden activations then stay f32)
    f32.set_training(dropout > 0.0f, 5);
    bf16.set_training(dropout > 0.0f, 5);
    EncoderLayerTape ta, tb;
    f32.forward_train(a_train.data(), B, L, options, ta);
    bf16.forward_train(b_train.data(), B, L, options, tb);
    EXPECT_EQ(tb.g_bf16.empty(), dropout > 0.0f) << "the hidden activations' hand-off";
    if (dropout == 0.0f) {
      EXPECT_LT(relative_distance(b_train, b), 2e-2) << "against forward";
    }
    EXPECT_LT(relative_distance(b_train, a_train), 2e-2);
    EncoderLayerParams ga = f32.zero_grads(), gb = bf16.zero_grads();
    std::vector<float> dxa = d_out, dxb = d_out;
    f32.backward(ta, dxa.data(), ga);
    bf16.backward(tb, dxb.data(), gb);
    EXPECT_LT(relative_distance(dxb, dxa), 5e-2) << "dx";
    EXPECT_GT(relative_distance(dxb, dxa), 0.0) << "dx";
    // tensors(): q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, g1, b1, f1_w, f1_b, f2_w, f2_b, g2, b2.
    const auto ta_list = ga.tensors(), tb_list = gb.tensors();
    ASSERT_EQ(ta_list.size(), 16u);
    constexpr std::size_t kKeyBias = 3;
    for (std::size_t i = 0; i < ta_list.size(); ++i) {
      const double distance = relative_distance(*tb_list[i], *ta_list[i]);
      std::printf("    %s parameter %2zu: bf16 / f32 distance %.2e (tolerance 5e-2)\n",
                  norm_first ? "Pre-LN " : "Post-LN", i, distance);
      if (i == kKeyBias) continue;
      EXPECT_LT(distance, 5e-2) << "parameter " << i;
      if (i % 2 == 0 && i != 8 && i != 14) {
        EXPECT_GT(distance, 0.0) << "weight " << i;
      }
    }
    double key_bias = 0, key_weight = 0;
    for (const float g : *tb_list[kKeyBias]) key_bias = std::max(key_bias, std::abs(double{g}));
    for (const float g : *ta_list[2]) key_weight = std::max(key_weight, std::abs(double{g}));
    EXPECT_LT(key_bias, 5e-2 * key_weight) << "the key bias's gradient";
  }
}

}  // namespace
}  // namespace qkv::testing
