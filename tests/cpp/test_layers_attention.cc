// MultiHeadAttention and KvCache against mha_ref (layers_reference.h): every QKV packing,
// GQA, cross-attention with Lq != Lk and kdim != vdim, masks, attention weights, and
// incremental decoding equal to a full causal forward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "core/float16.h"
#include "expect_error.h"
#include "kernels/product_path.h"
#include "layers_reference.h"
#include "qkv/layers/multi_head_attention.h"

namespace qkv::testing {
namespace {

constexpr double kTol = 3e-5;

// Random canonical weights for one config, and the three packings built from them.
struct Weights : MhaF32Weights {
  std::int64_t E, H, Hkv, hd, kvw, kdim, vdim;
  std::vector<float> blocks_w, blocks_b, per_head_w, per_head_b;

  Weights(std::int64_t e, std::int64_t h, std::int64_t hkv, std::int64_t kd, std::int64_t vd,
          std::uint64_t seed)
      : E(e), H(h), Hkv(hkv), hd(e / h), kvw(hkv * (e / h)), kdim(kd), vdim(vd) {
    q_w = random_floats(E * E, seed);
    q_b = random_floats(E, seed + 1);
    k_w = random_floats(kvw * kdim, seed + 2);
    k_b = random_floats(kvw, seed + 3);
    v_w = random_floats(kvw * vdim, seed + 4);
    v_b = random_floats(kvw, seed + 5);
    o_w = random_floats(E * E, seed + 6);
    o_b = random_floats(E, seed + 7);
    if (kdim != E || vdim != E) return;
    // [Wq; Wk; Wv] and the per-head interleave (H, 3 * hd): rows h*3hd + part*hd + d.
    for (const auto* part : {&q_w, &k_w, &v_w})
      blocks_w.insert(blocks_w.end(), part->begin(), part->end());
    for (const auto* part : {&q_b, &k_b, &v_b})
      blocks_b.insert(blocks_b.end(), part->begin(), part->end());
    if (Hkv != H) return;
    for (std::int64_t head = 0; head < H; ++head) {
      for (const auto& [w, b] :
           {std::pair{&q_w, &q_b}, std::pair{&k_w, &k_b}, std::pair{&v_w, &v_b}}) {
        per_head_w.insert(per_head_w.end(), w->begin() + head * hd * E,
                          w->begin() + (head + 1) * hd * E);
        per_head_b.insert(per_head_b.end(), b->begin() + head * hd, b->begin() + (head + 1) * hd);
      }
    }
  }

  MultiHeadAttentionConfig config() const {
    return {.embed_dim = E, .num_heads = H, .num_kv_heads = Hkv, .kdim = kdim, .vdim = vdim};
  }
  MultiHeadAttentionWeights packed(QkvPacking packing) const {
    if (packing == QkvPacking::kSeparate) return separate();
    MultiHeadAttentionWeights w{.packing = packing, .out_weight = o_w, .out_bias = o_b};
    if (packing == QkvPacking::kFusedBlocks) {
      w.qkv_weight = blocks_w, w.qkv_bias = blocks_b;
    } else {
      w.qkv_weight = per_head_w, w.qkv_bias = per_head_b;
    }
    return w;
  }
  MhaRefProblem problem(std::int64_t batch, std::int64_t seq_q, std::int64_t seq_kv) const {
    return {.batch = batch,
            .seq_q = seq_q,
            .seq_kv = seq_kv,
            .embed_dim = E,
            .num_heads = H,
            .num_kv_heads = Hkv,
            .kdim = kdim,
            .vdim = vdim};
  }
};

const char* packing_name(QkvPacking p) {
  return p == QkvPacking::kSeparate      ? "separate"
         : p == QkvPacking::kFusedBlocks ? "blocks"
                                         : "per_head";
}

TEST(LayersMha, SelfAttentionAllPackingsSweep) {
  struct Shape {
    std::int64_t E, H, Hkv;
  };
  for (Shape s :
       {Shape{5, 1, 1}, Shape{64, 4, 4}, Shape{96, 8, 8}, Shape{96, 8, 2}, Shape{64, 4, 1}}) {
    const Weights w(s.E, s.H, s.Hkv, s.E, s.E, 10 + s.E + s.Hkv);
    for (std::int64_t batch : {1, 2}) {
      for (std::int64_t seq : {1, 3, 17}) {
        const std::vector<float> x = random_floats(batch * seq * s.E, seq * 7 + batch);
        const auto ref =
            mha_ref(w.problem(batch, seq, seq), w.ref(), to_f64(x), to_f64(x), to_f64(x));
        for (QkvPacking packing :
             {QkvPacking::kSeparate, QkvPacking::kFusedBlocks, QkvPacking::kFusedPerHead}) {
          if (packing == QkvPacking::kFusedPerHead && s.Hkv != s.H) continue;
          MultiHeadAttention mha(w.config(), w.packed(packing));
          std::vector<float> out(batch * seq * s.E, 42.0f);
          mha.forward(x.data(), batch, seq, out.data());
          expect_close(out, ref.out, kTol,
                       std::string(packing_name(packing)) + " E=" + std::to_string(s.E) +
                           " H=" + std::to_string(s.H) + " Hkv=" + std::to_string(s.Hkv) +
                           " B=" + std::to_string(batch) + " L=" + std::to_string(seq));
        }
      }
    }
  }
}

TEST(LayersMha, PerHeadPackingEqualsBlocksWithPermutedRows) {
  // The same weights in both fused layouts (rows permuted accordingly) give the same result,
  // and a per-head weight read as blocks does not (the test can tell the layouts apart).
  const Weights w(24, 3, 3, 24, 24, 5);
  const std::vector<float> x = random_floats(2 * 5 * 24, 6);
  std::vector<float> a(x.size()), b(x.size()), wrong(x.size());
  MultiHeadAttention(w.config(), w.packed(QkvPacking::kFusedBlocks))
      .forward(x.data(), 2, 5, a.data());
  MultiHeadAttention(w.config(), w.packed(QkvPacking::kFusedPerHead))
      .forward(x.data(), 2, 5, b.data());
  for (std::size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << i;
  MultiHeadAttentionWeights mislabelled = w.packed(QkvPacking::kFusedPerHead);
  mislabelled.packing = QkvPacking::kFusedBlocks;
  MultiHeadAttention(w.config(), mislabelled).forward(x.data(), 2, 5, wrong.data());
  double diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    diff = std::max(diff, double(std::abs(a[i] - wrong[i])));
  EXPECT_GT(diff, 1e-2);
}

TEST(LayersMha, MasksCausalWindowKeyLengths) {
  const Weights w(32, 4, 2, 32, 32, 21);
  const std::int64_t batch = 3, seq = 17;
  const std::vector<float> x = random_floats(batch * seq * 32, 22);
  MultiHeadAttention mha(w.config(), w.packed(QkvPacking::kSeparate));
  const std::vector<std::int64_t> key_lengths = {17, 5, 0};
  struct Masks {
    bool causal;
    bool top_left;
    std::int64_t left, right;
    bool lengths;
  };
  for (Masks m : {Masks{true, false, -1, -1, false}, Masks{false, false, 3, 2, false},
                  Masks{false, false, -1, -1, true}, Masks{true, true, 4, -1, true}}) {
    auto p = w.problem(batch, seq, seq);
    p.causal = m.causal, p.top_left = m.top_left, p.window_left = m.left, p.window_right = m.right;
    MhaOptions o{.causal = m.causal,
                 .align = m.top_left ? Align::kTopLeft : Align::kBottomRight,
                 .window_left = m.left,
                 .window_right = m.right};
    if (m.lengths) p.key_lengths = key_lengths, o.key_lengths = key_lengths;
    const auto ref = mha_ref(p, w.ref(), to_f64(x), to_f64(x), to_f64(x));
    std::vector<float> out(x.size());
    mha.forward(x.data(), batch, seq, out.data(), o);
    expect_close(out, ref.out, kTol,
                 "causal=" + std::to_string(m.causal) + " window=" + std::to_string(m.left) + "," +
                     std::to_string(m.right) + " lengths=" + std::to_string(m.lengths));
  }
}

TEST(LayersMha, CrossAttentionLqNotLkAndKdimVdim) {
  const std::int64_t batch = 2, seq_q = 3, seq_kv = 17;
  // kdim != vdim: separate key and value memories.
  const Weights w(24, 4, 2, 5, 7, 31);
  const std::vector<float> query = random_floats(batch * seq_q * 24, 32);
  const std::vector<float> kmem = random_floats(batch * seq_kv * 5, 33);
  const std::vector<float> vmem = random_floats(batch * seq_kv * 7, 34);
  MultiHeadAttention mha(w.config(), w.packed(QkvPacking::kSeparate));
  for (bool causal : {false, true}) {
    auto p = w.problem(batch, seq_q, seq_kv);
    p.causal = causal;
    p.key_lengths = {17, 9};
    const auto ref = mha_ref(p, w.ref(), to_f64(query), to_f64(kmem), to_f64(vmem));
    std::vector<float> out(query.size());
    mha.forward_cross(query.data(), batch, seq_q, kmem.data(), vmem.data(), seq_kv, out.data(),
                      {.causal = causal, .key_lengths = p.key_lengths});
    expect_close(out, ref.out, kTol, "cross causal=" + std::to_string(causal));
  }
  expect_error(
      [&] {
        std::vector<float> out(query.size());
        mha.forward_cross(query.data(), batch, seq_q, kmem.data(), seq_kv, out.data());
      },
      "one memory needs kdim == vdim, got kdim = 5, vdim = 7");
  expect_error(
      [&] {
        std::vector<float> out(query.size());
        mha.forward(query.data(), batch, seq_q, out.data());
      },
      "self-attention needs kdim == vdim == embed_dim");

  // kdim == vdim == E with a fused weight: one memory for keys and values.
  const Weights f(16, 2, 2, 16, 16, 41);
  const std::vector<float> q2 = random_floats(batch * seq_q * 16, 42);
  const std::vector<float> mem = random_floats(batch * seq_kv * 16, 43);
  const auto ref =
      mha_ref(f.problem(batch, seq_q, seq_kv), f.ref(), to_f64(q2), to_f64(mem), to_f64(mem));
  for (QkvPacking packing : {QkvPacking::kFusedBlocks, QkvPacking::kFusedPerHead}) {
    MultiHeadAttention fused(f.config(), f.packed(packing));
    std::vector<float> out(q2.size());
    fused.forward_cross(q2.data(), batch, seq_q, mem.data(), seq_kv, out.data());
    expect_close(out, ref.out, kTol, std::string("cross ") + packing_name(packing));
  }
}

TEST(LayersMha, AttentionWeightsPerHeadAndAveraged) {
  const Weights w(32, 4, 2, 32, 32, 51);
  const std::int64_t batch = 2, seq = 7, H = 4;
  const std::vector<float> x = random_floats(batch * seq * 32, 52);
  MultiHeadAttention mha(w.config(), w.packed(QkvPacking::kFusedBlocks));
  auto p = w.problem(batch, seq, seq);
  p.causal = true;
  p.key_lengths = {7, 4};
  const auto ref = mha_ref(p, w.ref(), to_f64(x), to_f64(x), to_f64(x));
  std::vector<float> out(x.size()), weights(batch * H * seq * seq, 42.0f);
  mha.forward(x.data(), batch, seq, out.data(),
              {.causal = true, .key_lengths = p.key_lengths, .attn_weights = weights.data()});
  expect_close(out, ref.out, kTol, "out with weights");
  expect_close(weights, ref.probs, 1e-5, "per-head weights");

  Vec averaged(batch * seq * seq, 0.0);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t ij = 0; ij < seq * seq; ++ij)
        averaged[b * seq * seq + ij] += ref.probs[(b * H + h) * seq * seq + ij] / H;
  std::vector<float> avg(batch * seq * seq, 42.0f);
  mha.forward(x.data(), batch, seq, out.data(),
              {.causal = true,
               .key_lengths = p.key_lengths,
               .attn_weights = avg.data(),
               .average_weights = true});
  expect_close(avg, averaged, 1e-5, "averaged weights");
}

// Feeds x [B, seq, E] to forward_cached in pieces of the given token counts (summing to seq),
// checking the cache's size after each; returns the outputs put back together as [B, seq, E].
std::vector<float> decode_in_pieces(const MultiHeadAttention& mha, const std::vector<float>& x,
                                    std::int64_t batch, std::int64_t seq, std::int64_t E,
                                    KvCache& cache, std::span<const std::int64_t> pieces) {
  std::vector<float> got(x.size());
  std::int64_t pos = 0;
  for (std::int64_t n : pieces) {
    std::vector<float> xs(batch * n * E), os(batch * n * E);
    for (std::int64_t b = 0; b < batch; ++b)
      std::copy_n(x.data() + (b * seq + pos) * E, n * E, xs.data() + b * n * E);
    mha.forward_cached(xs.data(), batch, n, cache, os.data(), {.causal = true});
    for (std::int64_t b = 0; b < batch; ++b)
      std::copy_n(os.data() + b * n * E, n * E, got.data() + (b * seq + pos) * E);
    pos += n;
    EXPECT_EQ(cache.size(), pos);
  }
  EXPECT_EQ(pos, seq);
  return got;
}

TEST(LayersMha, KvCacheTokenByTokenEqualsFullCausal) {
  for (std::int64_t Hkv : {4, 1}) {
    const Weights w(32, 4, Hkv, 32, 32, 61 + Hkv);
    const std::int64_t batch = 2, seq = 17, E = 32;
    const std::vector<float> x = random_floats(batch * seq * E, 62);
    MultiHeadAttention mha(w.config(), w.packed(QkvPacking::kSeparate));
    std::vector<float> full(x.size());
    mha.forward(x.data(), batch, seq, full.data(), {.causal = true});
    auto p = w.problem(batch, seq, seq);
    p.causal = true;
    expect_close(full, mha_ref(p, w.ref(), to_f64(x), to_f64(x), to_f64(x)).out, kTol, "full");

    // Feed the sequence in pieces of 1, 3, 1, 5, ... tokens: [B, piece, E] each.
    for (std::int64_t max_seq : {0, 17}) {
      KvCache cache = mha.make_cache(batch, max_seq);
      const std::int64_t pieces[] = {1, 3, 1, 5, 1, 1, 5};
      const std::vector<float> got = decode_in_pieces(mha, x, batch, seq, E, cache, pieces);
      for (std::size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], full[i], 2e-5 * std::max(1.0f, std::abs(full[i])))
            << "Hkv=" << Hkv << " max_seq=" << max_seq << " i=" << i;
      }
      if (max_seq > 0) {
        std::vector<float> one(batch * E), out(batch * E);
        expect_error([&] { mha.forward_cached(one.data(), batch, 1, cache, out.data()); },
                     "17 cached + 1 new tokens exceed max_seq = 17");
        EXPECT_EQ(cache.size(), 17);
      }
    }
  }
}

// Multiples of 1/grid in [-1, 1]: with those weights and inputs every projection sum is exact
// in f32 whatever the order (oneDNN's or the reference's), so a bf16/f16 cache rounds the very
// values the float64 reference rounds.
std::vector<float> on_grid(std::vector<float> x, float grid) {
  for (float& e : x) e = std::round(e * grid) / grid;
  return x;
}

// max |actual - ref| / max(1, max |ref|): expect_close's measure.
double scaled_error(std::span<const float> actual, const Vec& ref) {
  double scale = 1.0, err = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    scale = std::max(scale, std::abs(ref[i]));
    err = std::max(err, std::abs(static_cast<double>(actual[i]) - ref[i]));
  }
  return err / scale;
}

// Every element of the bf16/f16 view `half` is the f32 view `full`'s, rounded (bit for bit).
void expect_rounded_copy(const TensorView& half, const TensorView& full, const std::string& what) {
  ASSERT_TRUE(half.dtype == DType::kBF16 || half.dtype == DType::kF16) << what;
  ASSERT_EQ(full.dtype, DType::kF32) << what;
  ASSERT_EQ(half.sizes, full.sizes) << what;
  for (std::int64_t b = 0; b < full.sizes[0]; ++b)
    for (std::int64_t t = 0; t < full.sizes[1]; ++t)
      for (std::int64_t h = 0; h < full.sizes[2]; ++h)
        for (std::int64_t d = 0; d < full.sizes[3]; ++d) {
          const float value = static_cast<const float*>(full.data)[full.offset(b, t, h, d)];
          ASSERT_EQ(static_cast<const std::uint16_t*>(half.data)[half.offset(b, t, h, d)],
                    f32_to_half_bits(half.dtype, value))
              << what << " b=" << b << " t=" << t << " head=" << h << " d=" << d;
        }
}

double round_bf16(double x) { return round_to_bf16(static_cast<float>(x)); }
double round_f16(double x) { return round_to_f16(static_cast<float>(x)); }

TEST(LayersMha, HalfKvCacheMatchesRoundedReference) {
  // A bf16/f16 cache: the appended k/v are the f32 cache's values rounded (bit for bit), and the
  // output is the float64 attention of q, k, v rounded to that dtype, within the tolerance of
  // that dtype's products: 2^-8 where they round the probabilities to bf16 (vdpbf16ps pairs,
  // AMX: up to 2^-9 each), else DESIGN.md's floor of 2e-5 (the f32 products of the rounded
  // values are exact; only the order of the sums differs).
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    const double rtol = rounds_probabilities(attention_flash_product_path(dtype)) ? 0x1p-8 : 2e-5;
    for (std::int64_t Hkv : {4, 2, 1}) {
      Weights w(64, 4, Hkv, 64, 64, 91 + Hkv);
      for (auto* part : {&w.q_w, &w.q_b, &w.k_w, &w.k_b, &w.v_w, &w.v_b, &w.o_w, &w.o_b}) {
        *part = on_grid(*part, 64);
      }
      const std::int64_t batch = 2, seq = 40, E = 64;
      const std::vector<float> x = on_grid(random_floats(batch * seq * E, 92), 8);
      MultiHeadAttention mha(w.config(), w.packed(QkvPacking::kSeparate));
      auto p = w.problem(batch, seq, seq);
      p.causal = true;
      p.round_qkv = dtype == DType::kBF16 ? round_bf16 : round_f16;
      const Vec ref = mha_ref(p, w.ref(), to_f64(x), to_f64(x), to_f64(x)).out;
      for (std::int64_t max_seq : {0, 40}) {
        const std::string what = std::string(dtype_name(dtype)) + " Hkv=" + std::to_string(Hkv) +
                                 " max_seq=" + std::to_string(max_seq);
        KvCache half = mha.make_cache(batch, max_seq, dtype), full = mha.make_cache(batch, max_seq);
        ASSERT_EQ(half.dtype(), dtype);
        const std::int64_t pieces[] = {1, 3, 1, 5, 1, 1, 5, 7, 16};
        const std::vector<float> got = decode_in_pieces(mha, x, batch, seq, E, half, pieces);
        decode_in_pieces(mha, x, batch, seq, E, full, pieces);
        expect_rounded_copy(half.keys(), full.keys(), what + " keys");
        expect_rounded_copy(half.values(), full.values(), what + " values");
        expect_close(got, ref, rtol, what);
        // The rounded reference is the one the output follows: the unrounded float64 attention
        // is farther from it.
        auto unrounded = p;
        unrounded.round_qkv = nullptr;
        const Vec exact = mha_ref(unrounded, w.ref(), to_f64(x), to_f64(x), to_f64(x)).out;
        const double err = scaled_error(got, ref), err_unrounded = scaled_error(got, exact);
        std::printf("%s: error / tolerance %.3f (against the unrounded attention %.3f)\n",
                    what.c_str(), err / rtol, err_unrounded / rtol);
        EXPECT_LT(err, err_unrounded) << what;
      }
    }
  }
}

// bf16 projections (matmul_dtype kBF16) hand the core q, k and v as bf16 and take its output as
// bf16: self-attention (fused and separate weights, GQA, causal, key lengths, attention
// weights), cross-attention and cached steps on a bf16 cache follow the float64 attention of the
// rounded q, k, v with the context rounded before the output projection. Weights and inputs on
// a grid make every projection exact, so those roundings are the only ones besides the core's:
// the tolerance is 2^-8 (the probabilities rounded to bf16 where the product path does; a
// context rounded the other way is one bf16 step). The unrounded attention is farther.
TEST(LayersMha, Bf16ProjectionsHandTheCoreBf16) {
  const double rtol = 0x1p-8;
  for (std::int64_t Hkv : {4, 1}) {
    Weights w(64, 4, Hkv, 64, 64, 95 + Hkv);
    for (auto* part : {&w.q_w, &w.q_b, &w.k_w, &w.k_b, &w.v_w, &w.v_b, &w.o_w, &w.o_b, &w.blocks_w,
                       &w.blocks_b}) {
      *part = on_grid(*part, 64);
    }
    MultiHeadAttentionConfig config = w.config();
    config.matmul_dtype = DType::kBF16;
    const std::int64_t batch = 2, seq = 70, E = 64;
    const std::vector<float> x = on_grid(random_floats(batch * seq * E, 96), 8);
    const std::vector<float> mem = on_grid(random_floats(batch * 33 * E, 97), 8);
    // err against the rounded reference, which must be within rtol and below the error against
    // the unrounded one.
    const auto check = [&](const std::vector<float>& got, MhaRefProblem p, const Vec& query,
                           const Vec& memory, const std::string& what) {
      p.round_qkv = round_bf16;
      p.round_ctx = round_bf16;
      const Vec ref = mha_ref(p, w.ref(), query, memory, memory).out;
      expect_close(got, ref, rtol, what);
      p.round_qkv = p.round_ctx = nullptr;
      const Vec exact = mha_ref(p, w.ref(), query, memory, memory).out;
      const double err = scaled_error(got, ref), err_unrounded = scaled_error(got, exact);
      std::printf("%s: error / tolerance %.3f (against the unrounded attention %.3f)\n",
                  what.c_str(), err / rtol, err_unrounded / rtol);
      EXPECT_LT(err, err_unrounded) << what;
    };
    const std::string heads = "Hkv=" + std::to_string(Hkv);
    for (QkvPacking packing : {QkvPacking::kSeparate, QkvPacking::kFusedBlocks}) {
      const MultiHeadAttention mha(config, w.packed(packing));
      for (bool causal : {false, true}) {
        auto p = w.problem(batch, seq, seq);
        p.causal = causal;
        p.key_lengths = {70, 41};
        std::vector<float> out(x.size(), 42.0f);
        mha.forward(x.data(), batch, seq, out.data(),
                    {.causal = causal, .key_lengths = p.key_lengths});
        check(out, p, to_f64(x), to_f64(x),
              heads + " " + packing_name(packing) + " causal=" + std::to_string(causal));
      }
    }
    const MultiHeadAttention mha(config, w.packed(QkvPacking::kSeparate));
    // Attention weights (the chunked kernel, on the same bf16 q, k, v).
    auto p = w.problem(batch, seq, seq);
    p.round_qkv = round_bf16;
    std::vector<float> out(x.size()), weights(batch * 4 * seq * seq);
    mha.forward(x.data(), batch, seq, out.data(), {.attn_weights = weights.data()});
    check(out, w.problem(batch, seq, seq), to_f64(x), to_f64(x), heads + " with weights");
    expect_close(weights, mha_ref(p, w.ref(), to_f64(x), to_f64(x), to_f64(x)).probs, 1e-5,
                 heads + " weights");
    // Cross-attention, Lq != Lk.
    std::vector<float> cross(x.size());
    mha.forward_cross(x.data(), batch, seq, mem.data(), 33, cross.data());
    check(cross, w.problem(batch, seq, 33), to_f64(x), to_f64(mem), heads + " cross");
    // Cached steps on a bf16 cache: the cache holds the projection's bf16 rows.
    KvCache cache = mha.make_cache(batch, 0, DType::kBF16);
    const std::int64_t pieces[] = {1, 3, 1, 5, 1, 1, 5, 7, 46};
    const std::vector<float> got = decode_in_pieces(mha, x, batch, seq, E, cache, pieces);
    auto causal = w.problem(batch, seq, seq);
    causal.causal = true;
    check(got, causal, to_f64(x), to_f64(x), heads + " bf16 cache");
  }
}

TEST(LayersMha, FailedCachedCallLeavesCacheUnchanged) {
  const Weights w(16, 2, 2, 16, 16, 71);
  MultiHeadAttention mha(w.config(), w.packed(QkvPacking::kSeparate));
  KvCache cache = mha.make_cache(1);
  std::vector<float> x(3 * 16, 0.5f), out(3 * 16);
  mha.forward_cached(x.data(), 1, 3, cache, out.data());
  const std::vector<std::int64_t> bad_lengths = {1, 2};  // B = 1: wrong size
  EXPECT_THROW(mha.forward_cached(x.data(), 1, 1, cache, out.data(), {.key_lengths = bad_lengths}),
               Error);
  EXPECT_EQ(cache.size(), 3);
  KvCache wrong(2, 2, 8);
  expect_error([&] { mha.forward_cached(x.data(), 1, 1, wrong, out.data()); },
               "cache is [B = 2, Hkv = 2, head_dim = 8], expected [B = 1, Hkv = 2, head_dim = 8]");
}

TEST(LayersMha, ValidationErrors) {
  const Weights w(16, 2, 2, 16, 16, 81);
  expect_error(
      [&] {
        MultiHeadAttention({.embed_dim = 16, .num_heads = 3}, w.packed(QkvPacking::kSeparate));
      },
      "embed_dim = 16 must be a positive multiple of num_heads = 3");
  expect_error(
      [&] {
        MultiHeadAttention({.embed_dim = 16, .num_heads = 2, .num_kv_heads = 3},
                           w.packed(QkvPacking::kSeparate));
      },
      "num_kv_heads = 3 must divide num_heads = 2");
  auto short_q = w.packed(QkvPacking::kSeparate);
  short_q.q_weight = short_q.q_weight.first(255);
  expect_error([&] { MultiHeadAttention(w.config(), short_q); },
               "q_weight has 255 elements, expected [16, 16] = 256");
  auto bad_bias = w.packed(QkvPacking::kFusedBlocks);
  bad_bias.qkv_bias = bad_bias.qkv_bias.first(47);
  expect_error([&] { MultiHeadAttention(w.config(), bad_bias); },
               "qkv_bias has 47 elements, expected [48] = 48");
  auto mixed = w.packed(QkvPacking::kFusedBlocks);
  mixed.q_weight = w.q_w;
  expect_error([&] { MultiHeadAttention(w.config(), mixed); },
               "q_weight must be empty with packing kFusedBlocks");
  expect_error(
      [&] {
        MultiHeadAttention({.embed_dim = 16, .num_heads = 2, .num_kv_heads = 1},
                           w.packed(QkvPacking::kFusedPerHead));
      },
      "kFusedPerHead needs num_kv_heads == num_heads");
  MultiHeadAttention mha(w.config(), w.packed(QkvPacking::kSeparate));
  std::vector<float> x(16), out(16);
  expect_error([&] { mha.forward(x.data(), 1, -1, out.data()); }, "must be >= 0");
  expect_error([&] { mha.forward(nullptr, 1, 1, out.data()); }, "null input or output");
}

}  // namespace
}  // namespace qkv::testing
