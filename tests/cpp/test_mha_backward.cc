// MultiHeadAttention's training half: backward's dx and every parameter gradient against
// central finite differences of the float64 reference (layers_reference.h, mha_ref) for the
// loss L = sum(d_out * MHA(x)), for the separate and both fused packings, GQA, causal, key
// lengths; parameters() / set_parameters(); the attention dropout mask shared by forward_train
// and backward; bad arguments.
#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "expect_error.h"
#include "layers_reference.h"
#include "qkv/layers/multi_head_attention.h"

namespace qkv::testing {
namespace {

// Canonical [Wq; Wk; Wv] rows (and biases) as `packing` lays them out.
std::vector<float> pack(QkvPacking packing, const std::vector<float>& q, const std::vector<float>& k,
                        const std::vector<float>& v, std::int64_t E, std::int64_t hd,
                        std::int64_t cols) {
  std::vector<float> out;
  for (const auto* part : {&q, &k, &v}) out.insert(out.end(), part->begin(), part->end());
  if (packing != QkvPacking::kFusedPerHead) return out;
  std::vector<float> per_head(out.size());
  const std::vector<float>* parts[3] = {&q, &k, &v};
  for (int part = 0; part < 3; ++part)
    for (std::int64_t r = 0; r < E; ++r) {
      const std::int64_t dst = (r / hd) * 3 * hd + part * hd + r % hd;
      std::copy_n(parts[part]->data() + r * cols, cols, per_head.data() + dst * cols);
    }
  return per_head;
}

struct MhaCase {
  const char* name;
  QkvPacking packing;
  std::int64_t heads, kv_heads;
  bool causal = false;
  std::vector<std::int64_t> key_lengths = {};
};

TEST(MhaBackward, MatchesFiniteDifferences) {
  const std::int64_t B = 2, L = 5, E = 8;
  for (const MhaCase& c : {MhaCase{"separate", QkvPacking::kSeparate, 2, 2},
                           MhaCase{"separate GQA causal", QkvPacking::kSeparate, 4, 2, true},
                           MhaCase{"fused blocks GQA key lengths", QkvPacking::kFusedBlocks, 4, 1,
                                   false, {5, 3}},
                           MhaCase{"fused per head causal", QkvPacking::kFusedPerHead, 2, 2,
                                   true}}) {
    SCOPED_TRACE(c.name);
    const std::int64_t hd = E / c.heads, kvw = c.kv_heads * hd;
    MhaF32Weights w;
    w.q_w = random_floats(E * E, 1), w.q_b = random_floats(E, 2), w.k_w = random_floats(kvw * E, 3);
    w.k_b = random_floats(kvw, 4), w.v_w = random_floats(kvw * E, 5), w.v_b = random_floats(kvw, 6);
    w.o_w = random_floats(E * E, 7), w.o_b = random_floats(E, 8);
    std::vector<float> qkv_w, qkv_b;
    MultiHeadAttentionWeights weights = w.separate();
    if (c.packing != QkvPacking::kSeparate) {
      qkv_w = pack(c.packing, w.q_w, w.k_w, w.v_w, E, hd, E);
      qkv_b = pack(c.packing, w.q_b, w.k_b, w.v_b, E, hd, 1);
      weights = {.packing = c.packing, .qkv_weight = qkv_w, .qkv_bias = qkv_b,
                 .out_weight = w.o_w, .out_bias = w.o_b};
    }
    const MultiHeadAttention mha({.embed_dim = E, .num_heads = c.heads, .num_kv_heads = c.kv_heads},
                                 weights);
    const auto x = random_floats(B * L * E, 9), d_out = random_floats(B * L * E, 10);
    const MhaOptions options{.causal = c.causal, .key_lengths = c.key_lengths};
    MhaTape tape;
    std::vector<float> out(B * L * E), dx(B * L * E);
    mha.forward_train(x.data(), B, L, out.data(), options, tape);
    MultiHeadAttentionParams grads = mha.zero_grads();
    mha.backward(tape, x.data(), d_out.data(), dx.data(), grads);

    const MhaRefProblem p{.batch = B, .seq_q = L, .seq_kv = L, .embed_dim = E,
                          .num_heads = c.heads, .num_kv_heads = c.kv_heads, .kdim = E, .vdim = E,
                          .causal = c.causal, .key_lengths = c.key_lengths};
    const MhaRefWeights ref = w.ref();
    const Vec d64 = to_f64(d_out);
    expect_close(out, mha_ref(p, ref, to_f64(x), to_f64(x), to_f64(x)).out, 1e-5, "out");
    auto loss_x = [&](const Vec& x64) { return dot(d64, mha_ref(p, ref, x64, x64, x64).out); };
    expect_close(dx, finite_differences(to_f64(x), loss_x), 1e-5, "dx");
    // Each parameter: finite differences on the canonical weight, packed like the layer's.
    std::vector<std::vector<float>> canonical(8);
    Vec MhaRefWeights::* fields[8] = {&MhaRefWeights::q_w, &MhaRefWeights::q_b,
                                      &MhaRefWeights::k_w, &MhaRefWeights::k_b,
                                      &MhaRefWeights::v_w, &MhaRefWeights::v_b,
                                      &MhaRefWeights::o_w, &MhaRefWeights::o_b};
    for (int f = 0; f < 8; ++f) {
      const Vec fd = finite_differences(ref.*fields[f], [&](const Vec& value) {
        MhaRefWeights changed = ref;
        changed.*fields[f] = value;
        return dot(d64, mha_ref(p, changed, to_f64(x), to_f64(x), to_f64(x)).out);
      });
      canonical[f].assign(fd.begin(), fd.end());
    }
    expect_close(grads.out_weight, to_f64(canonical[6]), 1e-5, "out_weight");
    expect_close(grads.out_bias, to_f64(canonical[7]), 1e-5, "out_bias");
    if (c.packing == QkvPacking::kSeparate) {
      const char* names[6] = {"q_weight", "q_bias", "k_weight", "k_bias", "v_weight", "v_bias"};
      const std::vector<float>* got[6] = {&grads.q_weight, &grads.q_bias, &grads.k_weight,
                                          &grads.k_bias,   &grads.v_weight, &grads.v_bias};
      for (int f = 0; f < 6; ++f) expect_close(*got[f], to_f64(canonical[f]), 1e-5, names[f]);
      EXPECT_TRUE(grads.qkv_weight.empty());
    } else {
      expect_close(grads.qkv_weight,
                   to_f64(pack(c.packing, canonical[0], canonical[2], canonical[4], E, hd, E)),
                   1e-5, "qkv_weight");
      expect_close(grads.qkv_bias,
                   to_f64(pack(c.packing, canonical[1], canonical[3], canonical[5], E, hd, 1)),
                   1e-5, "qkv_bias");
    }
    // Gradients accumulate: a second backward doubles them, every tensor of every packing.
    MultiHeadAttentionParams once = grads;
    mha.backward(tape, x.data(), d_out.data(), dx.data(), grads);
    for (std::size_t i = 0; i < grads.out_weight.size(); ++i) {
      EXPECT_FLOAT_EQ(grads.out_weight[i], 2 * once.out_weight[i]);
    }
    const auto twice = grads.tensors(), first = once.tensors();
    ASSERT_EQ(twice.size(), first.size());
    for (std::size_t t = 0; t < twice.size(); ++t) {
      for (std::size_t i = 0; i < twice[t]->size(); ++i) {
        const float want = 2 * (*first[t])[i];
        EXPECT_NEAR((*twice[t])[i], want, 1e-5f * std::max(1.0f, std::abs(want)))
            << "tensor " << t << " element " << i;
      }
    }
  }
}

TEST(MhaBackward, SetParametersRoundTrip) {
  const std::int64_t E = 8, hd = 4;
  MhaF32Weights w;
  w.q_w = random_floats(E * E, 11), w.k_w = random_floats(E * E, 12), w.v_w = random_floats(E * E, 13);
  w.q_b = random_floats(E, 14), w.k_b = random_floats(E, 15), w.v_b = random_floats(E, 16);
  w.o_w = random_floats(E * E, 17), w.o_b = random_floats(E, 18);
  const auto qkv_w = pack(QkvPacking::kFusedPerHead, w.q_w, w.k_w, w.v_w, E, hd, E);
  const auto qkv_b = pack(QkvPacking::kFusedPerHead, w.q_b, w.k_b, w.v_b, E, hd, 1);
  MultiHeadAttention mha({.embed_dim = E, .num_heads = 2},
                         {.packing = QkvPacking::kFusedPerHead, .qkv_weight = qkv_w,
                          .qkv_bias = qkv_b, .out_weight = w.o_w, .out_bias = w.o_b});
  MultiHeadAttentionParams params = mha.parameters();
  EXPECT_EQ(params.qkv_weight, qkv_w);
  EXPECT_EQ(params.qkv_bias, qkv_b);
  EXPECT_EQ(params.out_weight, w.o_w);
  // A new set of weights: forward must follow it.
  for (std::vector<float>* t : params.tensors()) {
    for (float& value : *t) value = -value * 0.5f;
  }
  mha.set_parameters(params);
  EXPECT_EQ(mha.parameters().qkv_weight, params.qkv_weight);
  const MultiHeadAttention fresh({.embed_dim = E, .num_heads = 2}, params.weights());
  const auto x = random_floats(3 * E, 19);
  std::vector<float> a(3 * E), b(3 * E);
  mha.forward(x.data(), 1, 3, a.data());
  fresh.forward(x.data(), 1, 3, b.data());
  EXPECT_EQ(a, b);
  params.out_bias.pop_back();
  expect_error([&] { mha.set_parameters(params); }, "out_bias has 7 elements, the layer's has 8");
  MhaTape tape;
  std::vector<float> out(3 * E);
  std::vector<float> weights(2 * 3 * 3);
  expect_error(
      [&] {
        mha.forward_train(x.data(), 1, 3, out.data(), {.attn_weights = weights.data()}, tape);
      },
      "not available in training");
}

// set_parameters in the other two packings: [Wq; Wk; Wv] blocks (handed to the fused projection
// as given) and separate weights with the key bias missing (GQA); each must give a fresh layer's
// outputs and name a tensor of the wrong size.
TEST(MhaBackward, SetParametersFollowsEveryPacking) {
  const std::int64_t E = 8, hd = 4, kvw = 4;  // 2 query heads over 1 kv head
  MhaF32Weights w;
  w.q_w = random_floats(E * E, 21), w.k_w = random_floats(kvw * E, 22);
  w.v_w = random_floats(kvw * E, 23);
  w.q_b = random_floats(E, 24), w.k_b = random_floats(kvw, 25), w.v_b = random_floats(kvw, 26);
  w.o_w = random_floats(E * E, 27), w.o_b = random_floats(E, 28);
  const MultiHeadAttentionConfig config{.embed_dim = E, .num_heads = 2, .num_kv_heads = 1};
  const auto x = random_floats(3 * E, 29);
  for (const QkvPacking packing : {QkvPacking::kFusedBlocks, QkvPacking::kSeparate}) {
    SCOPED_TRACE(packing == QkvPacking::kSeparate ? "separate" : "fused blocks");
    const bool fused = packing == QkvPacking::kFusedBlocks;
    const auto qkv_w = fused ? pack(packing, w.q_w, w.k_w, w.v_w, E, hd, E) : std::vector<float>{};
    const auto qkv_b = fused ? pack(packing, w.q_b, w.k_b, w.v_b, E, hd, 1) : std::vector<float>{};
    const std::vector<float> no_bias;
    MultiHeadAttentionWeights given{.packing = packing, .out_weight = w.o_w, .out_bias = w.o_b};
    if (fused) {
      given.qkv_weight = qkv_w, given.qkv_bias = qkv_b;
    } else {
      given.q_weight = w.q_w, given.k_weight = w.k_w, given.v_weight = w.v_w;
      given.q_bias = w.q_b, given.v_bias = w.v_b;  // no key bias
    }
    MultiHeadAttention mha(config, given);
    MultiHeadAttentionParams params = mha.parameters();
    EXPECT_EQ(params.k_bias.size(), 0u);
    for (std::vector<float>* t : params.tensors()) {
      for (float& value : *t) value = value * -0.75f + 0.125f;
    }
    mha.set_parameters(params);
    const MultiHeadAttention fresh(config, params.weights());
    std::vector<float> a(3 * E), b(3 * E);
    mha.forward(x.data(), 1, 3, a.data());
    fresh.forward(x.data(), 1, 3, b.data());
    EXPECT_EQ(a, b);
    EXPECT_NE(a, std::vector<float>(3 * E, 0.0f));
    std::vector<float>& wrong = fused ? params.qkv_weight : params.k_weight;
    wrong.push_back(1.0f);
    expect_error([&] { mha.set_parameters(params); },
                 fused ? "qkv_weight has 129 elements, the layer's has 128"
                       : "k_weight has 33 elements, the layer's has 32");
    wrong.pop_back();
    params.k_bias.assign(kvw, 0.0f);  // a bias the layer does not have
    expect_error([&] { mha.set_parameters(params); }, "k_bias has 4 elements, the layer's has 0");
  }
}

TEST(MhaBackward, DropoutMaskIsTheForwards) {
  // With dropout on the probabilities, L = sum(d_out * forward_train(x)) under one seed is a
  // fixed smooth function: backward's dx must match its (float32) finite differences.
  const std::int64_t B = 1, L = 6, E = 8;
  const auto wq = random_floats(E * E, 20), wk = random_floats(E * E, 21);
  const auto wv = random_floats(E * E, 22), wo = random_floats(E * E, 23);
  const MultiHeadAttention mha({.embed_dim = E, .num_heads = 2},
                               {.q_weight = wq, .k_weight = wk, .v_weight = wv, .out_weight = wo, .out_bias = {}});
  const MhaOptions options{.causal = true, .dropout_p = 0.4f, .dropout_seed = 5, .dropout_offset = 1};
  auto x = random_floats(B * L * E, 24);
  const auto d_out = random_floats(B * L * E, 25);
  MhaTape tape;
  std::vector<float> out(B * L * E), dx(B * L * E), no_dropout(B * L * E);
  mha.forward_train(x.data(), B, L, out.data(), options, tape);
  mha.forward(x.data(), B, L, no_dropout.data(), {.causal = true});
  EXPECT_NE(out, no_dropout);  // the mask did something
  MultiHeadAttentionParams grads = mha.zero_grads();
  mha.backward(tape, x.data(), d_out.data(), dx.data(), grads);
  auto loss = [&]() {
    MhaTape t;
    std::vector<float> y(B * L * E);
    mha.forward_train(x.data(), B, L, y.data(), options, t);
    double s = 0;
    for (std::size_t i = 0; i < y.size(); ++i) s += static_cast<double>(d_out[i]) * y[i];
    return s;
  };
  for (std::size_t i = 0; i < x.size(); i += 5) {
    const float keep = x[i], h = 1e-2f;
    x[i] = keep + h;
    const double up = loss();
    x[i] = keep - h;
    const double down = loss();
    x[i] = keep;
    EXPECT_NEAR(dx[i], (up - down) / (2 * h), 2e-3) << i;
  }
}

}  // namespace
}  // namespace qkv::testing
