// Plain float64 references for the layer tests (test_layers_*.cc): Linear, LayerNorm,
// activations, multi-head attention composed from them with an explicit softmax, and the
// encoder layer. Nothing here is optimised; each function is the textbook formula.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "qkv/layers/activation.h"
#include "qkv/layers/encoder_layer.h"
#include "qkv/layers/multi_head_attention.h"

namespace qkv::testing {

using Vec = std::vector<double>;

inline std::vector<float> random_floats(std::int64_t n, std::uint64_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

inline Vec to_f64(std::span<const float> x) { return Vec(x.begin(), x.end()); }

// d/dp_i of loss(p) for every i, by central differences in float64 (h = 1e-5 max(1, |p_i|)).
inline Vec finite_differences(Vec p, const std::function<double(const Vec&)>& loss) {
  Vec grad(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double keep = p[i], h = 1e-5 * std::max(1.0, std::abs(keep));
    p[i] = keep + h;
    const double up = loss(p);
    p[i] = keep - h;
    const double down = loss(p);
    p[i] = keep;
    grad[i] = (up - down) / (2 * h);
  }
  return grad;
}

inline double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}


inline double gelu_erf_ref(double x) { return 0.5 * x * std::erfc(-x / std::sqrt(2.0)); }
// 0.5 x (1 + tanh(u)) written as x / (1 + exp(-2u)): the same function, but float64's
// 1 + tanh(u) would round to 0 for u < -19 and make the reference itself wrong in the tail.
inline double gelu_tanh_ref(double x) {
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return x / (1.0 + std::exp(-2.0 * u));
}
inline double activation_ref(Activation act, double x) {
  switch (act) {
    case Activation::kNone:
      return x;
    case Activation::kGeluErf:
      return gelu_erf_ref(x);
    case Activation::kGeluTanh:
      return gelu_tanh_ref(x);
    case Activation::kRelu:
      return x > 0 ? x : 0.0;
  }
  return x;
}

// y[r, o] = act(sum_i x[r, i] W[o, i] + b[o]);  x: [rows, in] (row stride x_stride)
inline Vec linear_ref(const Vec& x, std::int64_t rows, std::int64_t in, const Vec& w, const Vec& b,
                      std::int64_t out, Activation act = Activation::kNone,
                      std::int64_t x_stride = 0) {
  if (x_stride == 0) x_stride = in;
  Vec y(static_cast<std::size_t>(rows * out));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t o = 0; o < out; ++o) {
      double s = b.empty() ? 0.0 : b[o];
      for (std::int64_t i = 0; i < in; ++i) s += x[r * x_stride + i] * w[o * in + i];
      y[r * out + o] = activation_ref(act, s);
    }
  }
  return y;
}

// y = LN(x + residual) * gamma + beta per row; residual may be empty.
inline Vec layer_norm_ref(const Vec& x, const Vec& residual, std::int64_t rows,
                          std::int64_t features, const Vec& gamma, const Vec& beta, double eps) {
  Vec y(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    Vec v(features);
    for (std::int64_t i = 0; i < features; ++i) {
      v[i] = x[r * features + i] + (residual.empty() ? 0.0 : residual[r * features + i]);
    }
    double mean = 0;
    for (double a : v) mean += a;
    mean /= features;
    double var = 0;
    for (double a : v) var += (a - mean) * (a - mean);
    var /= features;
    for (std::int64_t i = 0; i < features; ++i) {
      y[r * features + i] = (v[i] - mean) / std::sqrt(var + eps) * gamma[i] + beta[i];
    }
  }
  return y;
}

// Multi-head attention from the pieces above: projections, explicit masked softmax per
// (batch, head, query), weighted sum, output projection. Weights in torch [out, in] layout,
// canonical (separate) form; biases may be empty.
struct MhaRefWeights {
  Vec q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b;
};
// The same weights in f32, as the layers take them: separate() is the canonical packing for
// MultiHeadAttention, ref() the float64 copy for mha_ref.
struct MhaF32Weights {
  std::vector<float> q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b;

  MultiHeadAttentionWeights separate() const {
    MultiHeadAttentionWeights w{.out_weight = o_w, .out_bias = o_b};
    w.q_weight = q_w, w.q_bias = q_b, w.k_weight = k_w, w.k_bias = k_b;
    w.v_weight = v_w, w.v_bias = v_b;
    return w;
  }
  MhaRefWeights ref() const {
    return {to_f64(q_w), to_f64(q_b), to_f64(k_w), to_f64(k_b),
            to_f64(v_w), to_f64(v_b), to_f64(o_w), to_f64(o_b)};
  }
};
struct MhaRefProblem {
  std::int64_t batch = 1, seq_q = 1, seq_kv = 1, embed_dim = 8, num_heads = 2, num_kv_heads = 2;
  std::int64_t kdim = 8, vdim = 8;
  bool causal = false;
  bool top_left = false;  // causal/window alignment; default bottom-right
  std::int64_t window_left = -1, window_right = -1;
  std::vector<std::int64_t> key_lengths = {};  // empty = all
  // Applied to every element of the projected q, k and v (null: none): a bf16/f16 KV cache's
  // rounding.
  double (*round_qkv)(double) = nullptr;
  // Applied to the attention's output before the output projection (null: none): a bf16
  // projection's rounding of its input.
  double (*round_ctx)(double) = nullptr;
};
struct MhaRefResult {
  Vec out;    // [B, Lq, E]
  Vec probs;  // [B, H, Lq, Lk]
};
inline MhaRefResult mha_ref(const MhaRefProblem& p, const MhaRefWeights& w, const Vec& query,
                            const Vec& key_mem, const Vec& value_mem) {
  const std::int64_t E = p.embed_dim, H = p.num_heads, hd = E / H, kvw = p.num_kv_heads * hd;
  Vec q = linear_ref(query, p.batch * p.seq_q, E, w.q_w, w.q_b, E);
  Vec k = linear_ref(key_mem, p.batch * p.seq_kv, p.kdim, w.k_w, w.k_b, kvw);
  Vec v = linear_ref(value_mem, p.batch * p.seq_kv, p.vdim, w.v_w, w.v_b, kvw);
  if (p.round_qkv != nullptr) {
    for (Vec* x : {&q, &k, &v}) {
      for (double& e : *x) e = p.round_qkv(e);
    }
  }
  Vec ctx(p.batch * p.seq_q * E, 0.0);
  MhaRefResult r;
  r.probs.assign(p.batch * H * p.seq_q * p.seq_kv, 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::int64_t valid = p.key_lengths.empty() ? p.seq_kv : p.key_lengths[b];
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t hk = h / (H / p.num_kv_heads);
      for (std::int64_t i = 0; i < p.seq_q; ++i) {
        const std::int64_t ii = p.top_left ? i : i + p.seq_kv - p.seq_q;
        Vec s(p.seq_kv, -std::numeric_limits<double>::infinity());
        double mx = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < p.seq_kv; ++j) {
          bool allowed = j < valid;
          if (p.causal && j > ii) allowed = false;
          if (p.window_left >= 0 && j < ii - p.window_left) allowed = false;
          if (p.window_right >= 0 && j > ii + p.window_right) allowed = false;
          if (!allowed) continue;
          double dot = 0;
          for (std::int64_t d = 0; d < hd; ++d) {
            dot +=
                q[(b * p.seq_q + i) * E + h * hd + d] * k[(b * p.seq_kv + j) * kvw + hk * hd + d];
          }
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        if (mx == -std::numeric_limits<double>::infinity()) continue;  // no key: out row 0
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - mx));
        for (std::int64_t j = 0; j < p.seq_kv; ++j) {
          const double prob = s[j] / sum;
          r.probs[((b * H + h) * p.seq_q + i) * p.seq_kv + j] = prob;
          for (std::int64_t d = 0; d < hd; ++d) {
            ctx[(b * p.seq_q + i) * E + h * hd + d] +=
                prob * v[(b * p.seq_kv + j) * kvw + hk * hd + d];
          }
        }
      }
    }
  }
  if (p.round_ctx != nullptr) {
    for (double& e : ctx) e = p.round_ctx(e);
  }
  r.out = linear_ref(ctx, p.batch * p.seq_q, E, w.o_w, w.o_b, E);
  return r;
}

// Max |actual - ref| must be <= rtol * max(1, max |ref|) (DESIGN.md section 5's scale rule).
inline void expect_close(std::span<const float> actual, const Vec& ref, double rtol,
                         const std::string& what) {
  ASSERT_EQ(actual.size(), ref.size()) << what;
  double scale = 1.0, max_err = 0.0;
  std::size_t worst = 0;
  for (double r : ref) scale = std::max(scale, std::abs(r));
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double err = std::abs(static_cast<double>(actual[i]) - ref[i]);
    if (!(err <= max_err)) {  // also catches NaN
      max_err = std::isnan(err) ? std::numeric_limits<double>::infinity() : err;
      worst = i;
    }
  }
  EXPECT_LE(max_err, rtol * scale)
      << what << ": worst index " << worst << " got " << actual[worst] << " want " << ref[worst];
}

// Random weights of one EncoderLayer (uniform, fixed seed) and its float64 reference.
struct EncoderLayerData : MhaF32Weights {
  EncoderLayerConfig config;
  std::vector<float> g1, b1, f1_w, f1_b, f2_w, f2_b, g2, b2;

  EncoderLayerData(const EncoderLayerConfig& c, std::uint64_t seed) : config(c) {
    const std::int64_t E = c.embed_dim, F = c.d_ff;
    const std::int64_t kvw = (c.num_kv_heads ? c.num_kv_heads : c.num_heads) * (E / c.num_heads);
    auto r = [&](std::int64_t n, float lo = -0.5f, float hi = 0.5f) {
      return random_floats(n, seed++, lo, hi);
    };
    q_w = r(E * E), q_b = r(E), k_w = r(kvw * E), k_b = r(kvw), v_w = r(kvw * E), v_b = r(kvw);
    o_w = r(E * E), o_b = r(E), g1 = r(E, 0.5f, 1.5f), b1 = r(E), f1_w = r(F * E), f1_b = r(F);
    f2_w = r(E * F), f2_b = r(E), g2 = r(E, 0.5f, 1.5f), b2 = r(E);
  }
  EncoderLayerWeights weights() const {
    EncoderLayerWeights w{.attention = separate()};
    w.norm1_gamma = g1, w.norm1_beta = b1, w.ff1_weight = f1_w, w.ff1_bias = f1_b;
    w.ff2_weight = f2_w, w.ff2_bias = f2_b, w.norm2_gamma = g2, w.norm2_beta = b2;
    return w;
  }

  // float64 reference of one layer (inference: no dropout).
  Vec reference(const Vec& x, std::int64_t batch, std::int64_t seq,
                const std::vector<std::int64_t>& key_lengths) const {
    const auto& c = config;
    const std::int64_t E = c.embed_dim, rows = batch * seq;
    MhaRefProblem p{.batch = batch,
                    .seq_q = seq,
                    .seq_kv = seq,
                    .embed_dim = E,
                    .num_heads = c.num_heads,
                    .num_kv_heads = c.num_kv_heads ? c.num_kv_heads : c.num_heads,
                    .kdim = E,
                    .vdim = E,
                    .key_lengths = key_lengths};
    auto attn = [&](const Vec& in) { return mha_ref(p, ref(), in, in, in).out; };
    auto ffn = [&](const Vec& in) {
      const Vec h = linear_ref(in, rows, E, to_f64(f1_w), to_f64(f1_b), c.d_ff, c.activation);
      return linear_ref(h, rows, c.d_ff, to_f64(f2_w), to_f64(f2_b), E);
    };
    auto ln = [&](const Vec& in, const Vec& res, const std::vector<float>& g,
                  const std::vector<float>& b) {
      return layer_norm_ref(in, res, rows, E, to_f64(g), to_f64(b), c.eps);
    };
    auto add = [](Vec a, const Vec& b) {
      for (std::size_t i = 0; i < a.size(); ++i) a[i] += b[i];
      return a;
    };
    if (!c.norm_first) {
      const Vec y = ln(attn(x), x, g1, b1);
      return ln(ffn(y), y, g2, b2);
    }
    const Vec y = add(x, attn(ln(x, {}, g1, b1)));
    return add(y, ffn(ln(y, {}, g2, b2)));
  }
};

}  // namespace qkv::testing
