// Linear attention (elu+1 and FAVOR+): the chunk-wise Highway kernel against the f64 quadratic
// oracle over one table of odd sizes (GQA, Lq != Lk, Dv != D, key lengths with NaN padding,
// causal across chunk boundaries, BHSD strides) on every compiled target; identical bits for
// any thread count; causal rows equal to the non-causal formula on their key prefix; FAVOR+'s
// error against exact softmax attention falling as features grow; the feature draw; errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "every_target.h"
#include "expect_error.h"
#include "kernels/kernels.h"
#include "qkv/attention.h"
#include "qkv/linear_attention.h"

namespace qkv::testing {
namespace {

struct LinearCase {
  std::int64_t batch = 1, seq_q = 7, seq_kv = 7, num_heads_q = 1, num_heads_kv = 1;
  std::int64_t head_dim = 16, head_dim_v = -1;  // -1: = head_dim
  bool causal = false;
  Align align = Align::kBottomRight;
  bool key_lengths = false;  // random lengths in [0, Lk]; batch 1 (when B > 1) gets 0
  bool bhsd = false;         // q/k/v/out stored (B, H, L, D)
  float input_scale = 1.0f;  // multiplies q and k
  std::uint64_t seed = 1;

  std::int64_t dv() const { return head_dim_v < 0 ? head_dim : head_dim_v; }
  std::string name() const {
    std::string s = "B" + std::to_string(batch) + "_Lq" + std::to_string(seq_q) + "_Lk" +
                    std::to_string(seq_kv) + "_H" + std::to_string(num_heads_q) + "x" +
                    std::to_string(num_heads_kv) + "_D" + std::to_string(head_dim) + "_Dv" +
                    std::to_string(dv());
    if (causal) s += align == Align::kBottomRight ? "_causal" : "_causalTL";
    if (key_lengths) s += "_kl";
    if (bhsd) s += "_bhsd";
    return s + "_seed" + std::to_string(seed);
  }
};

void PrintTo(const LinearCase& c, std::ostream* os) { *os << c.name(); }

// Random data for a case; runs linear_attention (or exact attention) on it. Keys and values
// past key_lengths are NaN: they must never be read.
class LinearProblem {
 public:
  explicit LinearProblem(const LinearCase& c) : c_(c) {
    std::mt19937_64 rng(c.seed);
    std::normal_distribution<float> normal;
    q.resize(c.batch * c.seq_q * c.num_heads_q * c.head_dim);
    k.resize(c.batch * c.seq_kv * c.num_heads_kv * c.head_dim);
    v.resize(c.batch * c.seq_kv * c.num_heads_kv * c.dv());
    for (float& x : q) x = normal(rng) * c.input_scale;
    for (float& x : k) x = normal(rng) * c.input_scale;
    for (float& x : v) x = normal(rng);
    if (c.key_lengths) {
      std::uniform_int_distribution<std::int64_t> length(0, c.seq_kv);
      for (std::int64_t b = 0; b < c.batch; ++b) key_lengths.push_back(b == 1 ? 0 : length(rng));
      if (c.batch == 1) key_lengths[0] = std::max<std::int64_t>(1, key_lengths[0]);
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (std::int64_t b = 0; b < c.batch; ++b) {
        for (std::int64_t j = key_lengths[b]; j < c.seq_kv; ++j) {
          for (std::int64_t h = 0; h < c.num_heads_kv; ++h) {
            for (std::int64_t d = 0; d < c.head_dim; ++d)
              k[at(b, j, h, d, c.seq_kv, c.num_heads_kv, c.head_dim)] = nan;
            for (std::int64_t d = 0; d < c.dv(); ++d)
              v[at(b, j, h, d, c.seq_kv, c.num_heads_kv, c.dv())] = nan;
          }
        }
      }
    }
  }

  // Index of logical (b, s, h, d) in storage (BSHD, or BHSD when c.bhsd).
  std::int64_t at(std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d, std::int64_t seq,
                  std::int64_t heads, std::int64_t dim) const {
    return c_.bhsd ? ((b * heads + h) * seq + s) * dim + d : ((b * seq + s) * heads + h) * dim + d;
  }

  TensorView view(float* data, std::int64_t seq, std::int64_t heads, std::int64_t dim) const {
    if (!c_.bhsd) return TensorView::contiguous(data, DType::kF32, {c_.batch, seq, heads, dim});
    return TensorView::contiguous(data, DType::kF32, {c_.batch, heads, seq, dim})
        .permuted({0, 2, 1, 3});
  }

  LinearAttentionParams params(FeatureMap map) const {
    LinearAttentionParams p;
    p.feature_map = map;
    p.causal = c_.causal;
    p.align = c_.align;
    p.key_lengths = key_lengths;
    return p;
  }

  std::vector<float> run(LinearAttentionParams p) const {
    std::vector<float> out(c_.batch * c_.seq_q * c_.num_heads_q * c_.dv(), -7.0f);
    auto qq = q, kk = k, vv = v;
    AttentionOutputs outputs;
    outputs.out = view(out.data(), c_.seq_q, c_.num_heads_q, c_.dv());
    linear_attention(view(qq.data(), c_.seq_q, c_.num_heads_q, c_.head_dim),
                     view(kk.data(), c_.seq_kv, c_.num_heads_kv, c_.head_dim),
                     view(vv.data(), c_.seq_kv, c_.num_heads_kv, c_.dv()), outputs, p);
    return out;
  }

  // Exact softmax attention (reference kernel) with the same causal rule and key lengths.
  std::vector<float> exact() const {
    std::vector<float> out(c_.batch * c_.seq_q * c_.num_heads_q * c_.dv());
    auto qq = q, kk = k, vv = v;
    AttentionOutputs outputs;
    outputs.out = view(out.data(), c_.seq_q, c_.num_heads_q, c_.dv());
    AttentionParams p;
    p.causal = c_.causal;
    p.align = c_.align;
    p.key_lengths = key_lengths;
    p.kernel = Kernel::kReference;
    attention(view(qq.data(), c_.seq_q, c_.num_heads_q, c_.head_dim),
              view(kk.data(), c_.seq_kv, c_.num_heads_kv, c_.head_dim),
              view(vv.data(), c_.seq_kv, c_.num_heads_kv, c_.dv()), outputs, p);
    return out;
  }

  std::vector<float> q, k, v;
  std::vector<std::int64_t> key_lengths;

 private:
  LinearCase c_;
};

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    err = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(err, d);
  }
  return err;
}

double mean_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double sum = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) sum += std::fabs(static_cast<double>(a[i]) - b[i]);
  return sum / static_cast<double>(a.size());
}

std::vector<LinearCase> linear_cases() {
  std::vector<LinearCase> cases;
  std::uint64_t seed = 500;
  const auto add = [&](LinearCase c) {
    c.seed = seed++;
    cases.push_back(c);
  };
  for (std::int64_t l : {1, 7, 63, 65, 200, 517}) {
    for (bool causal : {false, true}) add({.seq_q = l, .seq_kv = l, .causal = causal});
  }
  for (std::int64_t d : {1, 16, 64, 80}) {
    for (std::int64_t dv :
         {std::int64_t{-1}, std::int64_t{1}, std::int64_t{24}, std::int64_t{65}}) {
      add({.seq_q = 33, .seq_kv = 70, .head_dim = d, .head_dim_v = dv, .causal = dv == 24});
    }
  }
  // GQA / MQA, batches, key lengths, BHSD.
  for (auto [hq, hkv] : {std::pair{4, 2}, {6, 1}, {3, 3}}) {
    for (bool causal : {false, true}) {
      LinearCase c{.batch = 3, .seq_q = 70, .seq_kv = 131, .head_dim = 24, .head_dim_v = 20};
      c.num_heads_q = hq;
      c.num_heads_kv = hkv;
      c.causal = causal;
      c.key_lengths = true;
      c.bhsd = hq == 6;
      add(c);
    }
  }
  // Causal with Lq != Lk in both alignments: rows without keys, prefixes, many chunks.
  for (Align align : {Align::kBottomRight, Align::kTopLeft}) {
    for (auto [lq, lk] : {std::pair{65, 200}, {200, 65}, {1, 300}, {517, 130}, {130, 517}}) {
      LinearCase c{.seq_q = lq, .seq_kv = lk, .num_heads_q = 2, .head_dim = 32, .causal = true};
      c.align = align;
      c.key_lengths = lq == 130;
      add(c);
    }
  }
  return cases;
}

// The fast kernel against the oracle, with DESIGN.md section 5's bound 2e-5 * max(1, max|ref|):
// the outputs are convex combinations of v, and the f32 prefix sums, the chunk order and
// Highway's exp (1 ulp) stay well inside it (measured over this table: elu+1 <= 4e-7,
// FAVOR+ <= 3e-6 at max|ref| ~ 3).
void check_fast_against_reference(const LinearProblem& problem, FeatureMap map,
                                  std::int64_t chunk) {
  LinearAttentionParams p = problem.params(map);
  p.kernel = LinearKernel::kReference;
  const std::vector<float> ref = problem.run(p);
  double scale = 1.0;
  for (float x : ref) {
    ASSERT_FALSE(std::isnan(x));
    scale = std::max(scale, std::fabs(static_cast<double>(x)));
  }
  p.kernel = LinearKernel::kCpu;
  p.chunk_size = chunk;
  const std::vector<float> fast = problem.run(p);
  const double tol = 2e-5 * scale;
  EXPECT_LE(max_abs_diff(fast, ref), tol)
      << (map == FeatureMap::kFavorPositive ? "favor" : "elu") << " chunk " << chunk;
}

class LinearSweep : public ::testing::TestWithParam<LinearCase> {};

TEST_P(LinearSweep, FastMatchesReference) {
  const LinearProblem problem(GetParam());
  for (FeatureMap map : {FeatureMap::kEluPlusOne, FeatureMap::kFavorPositive}) {
    for (std::int64_t chunk : {64, 13}) check_fast_against_reference(problem, map, chunk);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, LinearSweep, ::testing::ValuesIn(linear_cases()),
                         [](const auto& info) { return info.param.name(); });

TEST(LinearTargets, EveryTargetMatchesReference) {
  const std::vector<LinearCase> cases = linear_cases();
  for_each_target(linear_attention_cpu_target_name, [&](std::int64_t) {
    for (std::size_t i = 0; i < cases.size(); i += 4) {
      SCOPED_TRACE(cases[i].name());
      const LinearProblem problem(cases[i]);
      for (FeatureMap map : {FeatureMap::kEluPlusOne, FeatureMap::kFavorPositive}) {
        check_fast_against_reference(problem, map, 16);
      }
    }
  });
}

// Few (batch, kv head) pairs split the sequence into segments (merged in a fixed order); the
// result must not depend on how many threads run them.
TEST(LinearThreads, BitIdenticalWhateverTheThreadCount) {
  for (bool causal : {false, true}) {
    const LinearCase c{
        .seq_q = 700, .seq_kv = 650, .num_heads_q = 2, .head_dim = 32, .causal = causal};
    const LinearProblem problem(c);
    for (FeatureMap map : {FeatureMap::kEluPlusOne, FeatureMap::kFavorPositive}) {
      LinearAttentionParams p = problem.params(map);
      p.chunk_size = 32;
      p.num_threads = 1;
      const std::vector<float> one = problem.run(p);
      for (int threads : {2, 3, 5}) {
        p.num_threads = threads;
        const std::vector<float> many = problem.run(p);
        ASSERT_EQ(0, std::memcmp(one.data(), many.data(), one.size() * sizeof(float)))
            << "causal " << causal << " map " << static_cast<int>(map) << " threads " << threads;
      }
    }
  }
}

// Row i of a causal run equals the non-causal formula over keys [0, i'] alone (i' = i + Lk - Lq
// bottom-right, i top-left): the prefix definition, checked at rows around chunk boundaries.
TEST(LinearCausal, RowEqualsNonCausalOnItsKeyPrefix) {
  for (Align align : {Align::kBottomRight, Align::kTopLeft}) {
    LinearCase c{.seq_q = 150, .seq_kv = 170, .num_heads_q = 2, .head_dim = 16, .head_dim_v = 8};
    c.causal = true;
    c.align = align;
    const LinearProblem problem(c);
    const std::int64_t offset = align == Align::kBottomRight ? c.seq_kv - c.seq_q : 0;
    for (FeatureMap map : {FeatureMap::kEluPlusOne, FeatureMap::kFavorPositive}) {
      LinearAttentionParams p = problem.params(map);
      p.chunk_size = 32;
      const std::vector<float> causal = problem.run(p);
      for (std::int64_t i : {0, 1, 31, 32, 33, 63, 64, 100, 149}) {
        const std::int64_t keys = i + offset + 1;
        // One query row against the first `keys` keys, non-causal.
        LinearCase row = c;
        row.seq_q = 1;
        row.seq_kv = keys;
        row.causal = false;
        LinearProblem prefix(row);
        for (std::int64_t h = 0; h < c.num_heads_q; ++h) {
          std::copy_n(problem.q.begin() + (i * c.num_heads_q + h) * c.head_dim, c.head_dim,
                      prefix.q.begin() + h * c.head_dim);
        }
        std::copy_n(problem.k.begin(), keys * c.head_dim, prefix.k.begin());
        std::copy_n(problem.v.begin(), keys * c.dv(), prefix.v.begin());
        LinearAttentionParams pp = prefix.params(map);
        const std::vector<float> want = prefix.run(pp);
        const std::vector<float> got(causal.begin() + i * c.num_heads_q * c.dv(),
                                     causal.begin() + (i + 1) * c.num_heads_q * c.dv());
        EXPECT_LE(max_abs_diff(got, want), 2e-5 * 5)
            << "row " << i << " map " << static_cast<int>(map);
      }
    }
  }
}

// Rows with no allowed key (key length 0; bottom-right causal with Lq > Lk) give exactly 0,
// never NaN, though the padded keys are NaN.
TEST(LinearEdges, RowsWithoutKeysAreZero) {
  LinearCase c{.batch = 2, .seq_q = 10, .seq_kv = 4, .causal = true};
  c.key_lengths = true;  // batch 1 has no keys
  const LinearProblem problem(c);
  for (FeatureMap map : {FeatureMap::kEluPlusOne, FeatureMap::kFavorPositive}) {
    for (LinearKernel kernel : {LinearKernel::kReference, LinearKernel::kCpu}) {
      LinearAttentionParams p = problem.params(map);
      p.kernel = kernel;
      const std::vector<float> out = problem.run(p);
      for (float x : out) ASSERT_FALSE(std::isnan(x));
      for (std::int64_t b = 0; b < 2; ++b) {
        const std::int64_t keys = problem.key_lengths[b];
        for (std::int64_t i = 0; i < c.seq_q; ++i) {
          const bool empty = std::min(i + c.seq_kv - c.seq_q + 1, keys) <= 0;
          const float* row = out.data() + (b * c.seq_q + i) * c.head_dim;
          bool zero = true;
          for (std::int64_t e = 0; e < c.head_dim; ++e) zero = zero && row[e] == 0.0f;
          EXPECT_EQ(zero, empty) << "b " << b << " row " << i;
        }
      }
    }
  }
}

// Large logits: the stabilisers keep every exp <= 1, so FAVOR+ stays finite where a naive
// exp(w.x') would overflow (|x'|^2 / 2 alone is ~ 1e3 here).
TEST(LinearEdges, HugeInputsStayFinite) {
  LinearCase c;
  c.seq_q = c.seq_kv = 200;
  c.head_dim = 64;
  c.causal = true;
  c.input_scale = 30.0f;
  const LinearProblem problem(c);
  const std::vector<float> out = problem.run(problem.params(FeatureMap::kFavorPositive));
  for (float x : out) ASSERT_TRUE(std::isfinite(x));
}

// FAVOR+ estimates softmax attention with error ~ 1/sqrt(M): the mean abs error against exact
// attention falls at every step 16 -> 64 -> 256 -> 1024 (averaged over 3 feature seeds).
TEST(LinearFavor, ErrorAgainstSoftmaxFallsAsFeaturesGrow) {
  for (bool causal : {false, true}) {
    LinearCase c;
    c.seq_q = c.seq_kv = 128;
    c.num_heads_q = 2;
    c.head_dim = 16;
    c.causal = causal;
    // Positive random features' variance grows like exp(|q' + k'|^2): at input_scale 0.8 the
    // trend is buried in noise until M ~ 4096; at 0.5 every 4x step cuts the error ~ in half.
    c.input_scale = 0.5f;
    const LinearProblem problem(c);
    const std::vector<float> exact = problem.exact();
    std::vector<double> errors;
    for (std::int64_t m : {16, 64, 256, 1024}) {
      double err = 0.0;
      for (std::uint64_t seed : {1, 2, 3}) {
        LinearAttentionParams p = problem.params(FeatureMap::kFavorPositive);
        p.nb_features = m;
        p.seed = seed;
        err += mean_abs_diff(problem.run(p), exact) / 3.0;
      }
      errors.push_back(err);
    }
    for (std::size_t i = 1; i < errors.size(); ++i) {
      EXPECT_LT(errors[i], 0.8 * errors[i - 1])
          << "causal " << causal << ": M = " << (16 << (2 * i)) << " error " << errors[i] << " vs "
          << errors[i - 1];
    }
    EXPECT_LT(errors.back(), 0.01);
  }
}

TEST(LinearFavor, SameSeedSameResultNewSeedRedraws) {
  LinearCase c;
  c.seq_q = c.seq_kv = 50;
  const LinearProblem problem(c);
  LinearAttentionParams p = problem.params(FeatureMap::kFavorPositive);
  p.nb_features = 32;
  const std::vector<float> first = problem.run(p);
  const std::vector<float> again = problem.run(p);
  ASSERT_EQ(0, std::memcmp(first.data(), again.data(), first.size() * sizeof(float)));
  p.seed = 2;
  EXPECT_GT(max_abs_diff(problem.run(p), first), 1e-3);
  EXPECT_EQ(favor_projection(16, 32, 7), favor_projection(16, 32, 7));
  EXPECT_NE(favor_projection(16, 32, 7), favor_projection(16, 32, 8));
}

// The draw: blocks of D mutually orthogonal rows; row lengths chi(D) (mean ~ sqrt(D)); and the
// estimator is unbiased: over many seeds, mean phi(q).phi(k) -> exp(q.k / sqrt(D)).
TEST(LinearFavor, ProjectionIsOrthogonalBlocksWithChiNorms) {
  const std::int64_t d = 8, m = 20;  // blocks of 8, 8, 4 rows
  const std::vector<float> w = favor_projection(d, m, 3);
  ASSERT_EQ(w.size(), static_cast<std::size_t>(m * d));
  const auto dot = [&](std::int64_t a, std::int64_t b) {
    double s = 0.0;
    for (std::int64_t e = 0; e < d; ++e) s += static_cast<double>(w[a * d + e]) * w[b * d + e];
    return s;
  };
  for (std::int64_t a = 0; a < m; ++a) {
    for (std::int64_t b = a + 1; b < m && b / d == a / d; ++b) {
      EXPECT_NEAR(dot(a, b) / std::sqrt(dot(a, a) * dot(b, b)), 0.0, 1e-6) << a << ", " << b;
    }
  }
  // Rows of different blocks are independent, not orthogonal.
  EXPECT_GT(std::fabs(dot(0, 8)) / std::sqrt(dot(0, 0) * dot(8, 8)), 1e-3);

  double mean_norm = 0.0, estimate = 0.0;
  const std::vector<double> q = {0.3, -0.2, 0.5, 0.1, -0.4, 0.2, 0.0, 0.6};
  const std::vector<double> k = {0.1, 0.4, -0.3, 0.2, 0.5, -0.1, 0.3, 0.2};
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const int seeds = 400;
  for (int seed = 1; seed <= seeds; ++seed) {
    const std::vector<float> ws = favor_projection(d, d, seed);
    double qn = 0.0, kn = 0.0;
    for (std::int64_t e = 0; e < d; ++e) {
      qn += q[e] * q[e] * scale / 2;
      kn += k[e] * k[e] * scale / 2;
    }
    for (std::int64_t r = 0; r < d; ++r) {
      double wq = 0.0, wk = 0.0, norm = 0.0;
      for (std::int64_t e = 0; e < d; ++e) {
        wq += ws[r * d + e] * q[e] * std::sqrt(scale);
        wk += ws[r * d + e] * k[e] * std::sqrt(scale);
        norm += static_cast<double>(ws[r * d + e]) * ws[r * d + e];
      }
      mean_norm += std::sqrt(norm) / (d * seeds);
      estimate += std::exp(wq - qn) * std::exp(wk - kn) / (d * seeds);
    }
  }
  // E[chi(8)] = sqrt(2) Gamma(4.5) / Gamma(4) = 2.7436.
  EXPECT_NEAR(mean_norm, 2.7436, 0.05);
  double qk = 0.0;
  for (std::int64_t e = 0; e < d; ++e) qk += q[e] * k[e];
  EXPECT_NEAR(estimate, std::exp(qk * scale), 0.02);
}

TEST(LinearValidation, RejectsWhatLinearAttentionCannotExpress) {
  LinearCase c;
  LinearProblem problem(c);
  using Params = LinearAttentionParams;
  const Params elu = problem.params(FeatureMap::kEluPlusOne);
  const Params favor = problem.params(FeatureMap::kFavorPositive);
  // `base` with `change` applied must fail naming the argument.
  const auto fails = [&](Params base, const std::string& expected, auto change) {
    change(base);
    expect_error([&] { problem.run(base); }, expected);
  };
  fails(elu, "softcap:", [](Params& p) { p.softcap = 5.0f; });
  fails(elu, "window: (3, -1)", [](Params& p) { p.window_left = 3; });
  std::uint8_t mask = 1;
  fails(elu, "mask:", [&](Params& p) {
    p.mask = TensorView::contiguous(&mask, DType::kBool, {1, 1, 1, 1});
  });
  float bias = 0.0f;
  fails(elu, "bias:", [&](Params& p) {
    p.bias = TensorView::contiguous(&bias, DType::kF32, {1, 1, 1, 1});
  });
  fails(elu, "scale: 0.5", [](Params& p) { p.scale = 0.5f; });
  fails(favor, "scale: must be finite and > 0", [](Params& p) { p.scale = -1.0f; });
  fails(favor, "nb_features: must be in [1, 65536], got 0", [](Params& p) { p.nb_features = 0; });
  fails(favor, "chunk_size:", [](Params& p) { p.chunk_size = 0; });
  const std::vector<std::int64_t> lengths = {8};
  fails(favor, "key_lengths: entry 0 is 8, outside [0, seq_kv = 7]",
        [&](Params& p) { p.key_lengths = lengths; });

  std::vector<float> out(7 * 16), lse(7);
  const TensorView q = problem.view(problem.q.data(), 7, 1, 16);
  const TensorView k = problem.view(problem.k.data(), 7, 1, 16);
  const TensorView v = problem.view(problem.v.data(), 7, 1, 16);
  const TensorView o = problem.view(out.data(), 7, 1, 16);
  AttentionOutputs outputs;
  outputs.out = o;
  outputs.lse = TensorView::contiguous(lse.data(), DType::kF32, {1, 1, 7, 1});
  expect_error([&] { linear_attention(q, k, v, outputs, elu); }, "lse:");
  outputs.lse = TensorView();
  outputs.probs = o;
  expect_error([&] { linear_attention(q, k, v, outputs, elu); }, "probs:");
  outputs.probs = TensorView();
  const TensorView short_v = problem.view(problem.v.data(), 6, 1, 16);
  expect_error([&] { linear_attention(q, k, short_v, outputs, elu); },
               "k: shape (1, 7, 1, 16) does not match v: shape (1, 6, 1, 16)");
  expect_error([&] { favor_projection(0, 4, 1); }, "head_dim:");
}

}  // namespace
}  // namespace qkv::testing
