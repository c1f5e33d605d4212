// qkv::linear_attention: validate at the boundary, draw the FAVOR+ features, fill one
// LinearKernelParams, call one kernel once (the same recipe as ops/attention.cc).
#include "qkv/linear_attention.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <utility>

#include "core/parallel.h"
#include "core/splitmix64.h"
#include "kernels/kernels.h"
#include "ops/validate.h"
#include "qkv/error.h"

namespace qkv {
namespace {

constexpr std::int64_t kMaxFeatures = 65536;
constexpr std::int64_t kMaxChunk = 4096;

// The options of AttentionParams that phi(q).phi(k) cannot express.
void reject_exact_only_options(const LinearAttentionParams& params) {
  const char* why = "linear attention cannot express it (phi(q).phi(k) has no per-pair score";
  if (params.softcap != 0.0f) {
    throw Error("softcap: " + std::to_string(params.softcap) + " given, but " + why +
                " to cap); use qkv::attention");
  }
  if (params.window_left != -1 || params.window_right != -1) {
    throw Error("window: (" + std::to_string(params.window_left) + ", " +
                std::to_string(params.window_right) + ") given, but " + why +
                " and only prefix key sets have running sums); use qkv::attention or causal");
  }
  if (!params.mask.empty()) {
    throw Error(std::string("mask: given, but ") + why + " to mask); use key_lengths or causal");
  }
  if (!params.bias.empty()) {
    throw Error(std::string("bias: given, but ") + why + " to add it to); use qkv::attention");
  }
}

// Standard normal draws by Box-Muller on splitmix64 uniforms: each pair (u1, u2) gives
// r cos(2 pi u2), then r sin(2 pi u2), with r = sqrt(-2 log(1 - u1)) (1 - u1 is in (0, 1]: no
// log(0)).
class NormalDraws {
 public:
  explicit NormalDraws(std::uint64_t seed) : rng_(seed) {}
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = rng_.uniform53(), u2 = rng_.uniform53();
    const double r = std::sqrt(-2.0 * std::log(1.0 - u1));
    spare_ = r * std::sin(2.0 * std::numbers::pi * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  SplitMix64 rng_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

}  // namespace

std::vector<float> favor_projection(std::int64_t head_dim, std::int64_t nb_features,
                                    std::uint64_t seed) {
  if (head_dim < 1) throw Error("head_dim: must be >= 1, got " + std::to_string(head_dim));
  if (nb_features < 1 || nb_features > kMaxFeatures) {
    throw Error("nb_features: must be in [1, " + std::to_string(kMaxFeatures) + "], got " +
                std::to_string(nb_features));
  }
  const std::int64_t d = head_dim, m = nb_features;
  NormalDraws rng(seed);
  // Directions: ceil(M / D) blocks, each D x D Gaussian (row-major draw) orthonormalised row by
  // row with modified Gram-Schmidt in f64; the last block keeps its first M mod D rows.
  std::vector<double> directions(static_cast<std::size_t>(m * d));
  std::vector<double> block(static_cast<std::size_t>(d * d));
  for (std::int64_t first = 0; first < m; first += d) {
    for (double& x : block) x = rng.normal();
    for (std::int64_t r = 0; r < d; ++r) {
      double* row = block.data() + r * d;
      for (std::int64_t s = 0; s < r; ++s) {
        const double* prev = block.data() + s * d;
        double dot = 0.0;
        for (std::int64_t e = 0; e < d; ++e) dot += row[e] * prev[e];
        for (std::int64_t e = 0; e < d; ++e) row[e] -= dot * prev[e];
      }
      double norm = 0.0;
      for (std::int64_t e = 0; e < d; ++e) norm += row[e] * row[e];
      norm = std::sqrt(norm);
      // A Gaussian row in the span of the previous ones has probability 0; if rounding ever
      // produced one, a zero direction (feature exp(-|x'|^2/2)) is still a valid feature.
      for (std::int64_t e = 0; e < d; ++e) row[e] = norm > 0.0 ? row[e] / norm : 0.0;
    }
    const std::int64_t rows = std::min(d, m - first);
    std::copy(block.begin(), block.begin() + rows * d, directions.begin() + first * d);
  }
  // Lengths: row r is rescaled to the norm of its own fresh Gaussian D-vector (chi(D)), drawn
  // after all blocks, so that each w_r is marginally N(0, I_D) as FAVOR+'s estimator needs.
  std::vector<float> projection(static_cast<std::size_t>(m * d));
  for (std::int64_t r = 0; r < m; ++r) {
    double sum = 0.0;
    for (std::int64_t e = 0; e < d; ++e) {
      const double x = rng.normal();
      sum += x * x;
    }
    const double length = std::sqrt(sum);
    for (std::int64_t e = 0; e < d; ++e) {
      projection[r * d + e] = static_cast<float>(length * directions[r * d + e]);
    }
  }
  return projection;
}

void linear_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                      const AttentionOutputs& outputs, const LinearAttentionParams& params) {
  // q: [B, Lq, Hq, D]  k: [B, Lk, Hkv, D]  v: [B, Lk, Hkv, Dv]  out: [B, Lq, Hq, Dv]
  const TensorView& out = outputs.out;
  const ops::AttentionShape shape =
      ops::validate_operands(q, k, v, out, /*half_inputs=*/false, "linear attention computes f32");
  const std::int64_t seq_q = shape.seq_q, head_dim = shape.head_dim, seq_kv = shape.seq_kv;
  if (!outputs.lse.empty()) {
    throw Error("lse: linear attention has no softmax normaliser to report; leave lse empty");
  }
  if (!outputs.probs.empty()) {
    throw Error(
        "probs: linear attention never forms the attention matrix; leave probs empty (the "
        "reference attention kernel can return softmax probabilities)");
  }
  reject_exact_only_options(params);
  const ops::NamedView written[] = {{"out", &out}};
  const ops::NamedView read[] = {{"q", &q}, {"k", &k}, {"v", &v}};
  ops::require_no_overlap(written, read);

  const bool favor = params.feature_map == FeatureMap::kFavorPositive;
  float scale = 1.0f;
  if (favor) {
    scale = params.scale.value_or(1.0f / std::sqrt(static_cast<float>(head_dim)));
    if (!(scale > 0.0f) || !std::isfinite(scale)) {
      throw Error("scale: must be finite and > 0, got " + std::to_string(scale));
    }
    if (params.nb_features < 1 || params.nb_features > kMaxFeatures) {
      throw Error("nb_features: must be in [1, " + std::to_string(kMaxFeatures) + "], got " +
                  std::to_string(params.nb_features));
    }
  } else if (params.scale) {
    throw Error("scale: " + std::to_string(*params.scale) +
                " given, but the elu+1 feature map has no score scale (phi(q).phi(k) is used as "
                "is); leave it unset, or use FAVOR+, where scale sets exp(scale * q.k)");
  }
  ops::validate_key_lengths(params.key_lengths, q, k, k.sizes[1]);
  ops::validate_num_threads(params.num_threads);
  if (params.chunk_size < 1 || params.chunk_size > kMaxChunk) {
    throw Error("chunk_size: must be in [1, " + std::to_string(kMaxChunk) + "], got " +
                std::to_string(params.chunk_size));
  }

  const std::vector<float> projection =
      favor ? favor_projection(head_dim, params.nb_features, params.seed) : std::vector<float>();
  LinearKernelParams p{};
  ops::set_operands(p, shape, q, k, v, out);
  p.num_features = favor ? params.nb_features : head_dim;
  p.favor = favor;
  p.projection = favor ? projection.data() : nullptr;
  p.feature_scale = std::sqrt(scale);
  p.causal = params.causal;
  p.diagonal_offset = params.align == Align::kBottomRight ? seq_kv - seq_q : 0;
  p.key_lengths = params.key_lengths.empty() ? nullptr : params.key_lengths.data();
  p.num_threads = resolve_num_threads(params.num_threads);
  p.chunk_size = params.chunk_size;

  if (params.kernel == LinearKernel::kReference) {
    linear_attention_reference(p);
  } else {
    linear_attention_cpu(p);
  }
}

double linear_attention_flops(std::int64_t batch, std::int64_t num_heads_q,
                              std::int64_t num_heads_kv, std::int64_t seq_q, std::int64_t seq_kv,
                              std::int64_t head_dim, std::int64_t head_dim_v,
                              const LinearAttentionParams& params) {
  const bool favor = params.feature_map == FeatureMap::kFavorPositive;
  const double m = static_cast<double>(favor ? params.nb_features : head_dim);
  const double projection = favor ? static_cast<double>(head_dim) : 0.0;
  const double rows =
      static_cast<double>(batch) * static_cast<double>(num_heads_kv) * static_cast<double>(seq_kv) +
      static_cast<double>(batch) * static_cast<double>(num_heads_q) * static_cast<double>(seq_q);
  return 2.0 * m * (projection + static_cast<double>(head_dim_v) + 1.0) * rows;
}

}  // namespace qkv
