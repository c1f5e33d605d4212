// qkv::linear_attention: validate at the boundary, draw the FAVOR+ features, fill one
// LinearKernelParams, call one kernel once (the same recipe as ops/attention.cc).
#include "qkv/linear_attention.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <utility>

#include "core/parallel.h"
#include "kernels/kernels.h"
#include "qkv/error.h"

namespace qkv {
namespace {

constexpr std::int64_t kMaxFeatures = 65536;
constexpr std::int64_t kMaxChunk = 4096;

std::string describe(const char* name, const TensorView& view) {
  return std::string(name) + ": shape " + shape_string(view.sizes);
}

void require_operand(const char* name, const TensorView& view) {
  if (view.data == nullptr) throw Error(std::string(name) + ": data pointer is null");
  if (view.dtype != DType::kF32) {
    throw Error(std::string(name) + ": dtype " + dtype_name(view.dtype) +
                " is not supported (linear attention computes f32)");
  }
  for (int d = 0; d < 4; ++d) {
    if (view.sizes[d] < 1) {
      throw Error(describe(name, view) + " has size " + std::to_string(view.sizes[d]) + " in dim " +
                  std::to_string(d) + "; every size must be >= 1");
    }
  }
}

void require_same(const char* name_a, const TensorView& a, int dim_a, const char* name_b,
                  const TensorView& b, int dim_b, const char* what) {
  if (a.sizes[dim_a] != b.sizes[dim_b]) {
    throw Error(describe(name_a, a) + " does not match " + describe(name_b, b) + ": " + what +
                " differs (" + std::to_string(a.sizes[dim_a]) + " vs " +
                std::to_string(b.sizes[dim_b]) + ")");
  }
}

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

// splitmix64 (Steele, Lea, Flood 2014): 64 random bits per step from a 64-bit state.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Standard normal by Box-Muller: each pair of uniforms (u1, u2) gives r cos(2 pi u2), then
  // r sin(2 pi u2), with r = sqrt(-2 log(1 - u1)) (1 - u1 is in (0, 1]: no log(0)).
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double u1 = uniform(), u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(1.0 - u1));
    spare_ = r * std::sin(2.0 * std::numbers::pi * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::uint64_t state_;
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
  SplitMix64 rng(seed);
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
  const std::pair<const char*, const TensorView*> operands[] = {
      {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}};
  for (const auto& [name, view] : operands) require_operand(name, *view);
  require_same("q", q, 0, "k", k, 0, "batch (dim 0)");
  require_same("k", k, 0, "v", v, 0, "batch (dim 0)");
  require_same("k", k, 1, "v", v, 1, "seq_kv (dim 1)");
  require_same("k", k, 2, "v", v, 2, "num_heads_kv (dim 2)");
  require_same("q", q, 3, "k", k, 3, "head_dim (dim 3)");
  const std::int64_t batch = q.sizes[0], seq_q = q.sizes[1], num_heads_q = q.sizes[2];
  const std::int64_t head_dim = q.sizes[3], seq_kv = k.sizes[1], num_heads_kv = k.sizes[2];
  const std::int64_t head_dim_v = v.sizes[3];
  if (num_heads_q % num_heads_kv != 0) {
    throw Error(describe("q", q) + " has " + std::to_string(num_heads_q) +
                " heads, not a multiple of the " + std::to_string(num_heads_kv) + " heads of " +
                describe("k", k) + " (num_heads_q % num_heads_kv must be 0)");
  }
  const std::array<std::int64_t, 4> out_shape = {batch, seq_q, num_heads_q, head_dim_v};
  if (out.sizes != out_shape) {
    throw Error(describe("out", out) + " must be " + shape_string(out_shape) + " (B, Lq, Hq, Dv)");
  }
  for (int d = 0; d < 4; ++d) {
    // Threads write different rows: a zero stride on a dim of size > 1 would make them race.
    if (out.sizes[d] > 1 && out.strides[d] == 0) {
      throw Error("out: stride 0 in dim " + std::to_string(d) + " of an output with size " +
                  std::to_string(out.sizes[d]));
    }
  }
  if (!outputs.lse.empty()) {
    throw Error("lse: linear attention has no softmax normaliser to report; leave lse empty");
  }
  if (!outputs.probs.empty()) {
    throw Error(
        "probs: linear attention never forms the attention matrix; leave probs empty (the "
        "reference attention kernel can return softmax probabilities)");
  }
  reject_exact_only_options(params);

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
  if (!params.key_lengths.empty()) {
    if (static_cast<std::int64_t>(params.key_lengths.size()) != batch) {
      throw Error("key_lengths: has " + std::to_string(params.key_lengths.size()) +
                  " entries, expected batch = " + std::to_string(batch) + " (q: shape " +
                  shape_string(q.sizes) + ")");
    }
    for (std::size_t b = 0; b < params.key_lengths.size(); ++b) {
      const std::int64_t length = params.key_lengths[b];
      if (length < 0 || length > seq_kv) {
        throw Error("key_lengths: entry " + std::to_string(b) + " is " + std::to_string(length) +
                    ", outside [0, seq_kv = " + std::to_string(seq_kv) + "] (k: shape " +
                    shape_string(k.sizes) + ")");
      }
    }
  }
  if (params.num_threads < 0) {
    throw Error("num_threads: must be >= 0 (0 = default), got " +
                std::to_string(params.num_threads));
  }
  if (params.chunk_size < 1 || params.chunk_size > kMaxChunk) {
    throw Error("chunk_size: must be in [1, " + std::to_string(kMaxChunk) + "], got " +
                std::to_string(params.chunk_size));
  }

  const std::vector<float> projection =
      favor ? favor_projection(head_dim, params.nb_features, params.seed) : std::vector<float>();
  LinearKernelParams p{};
  p.batch = batch;
  p.seq_q = seq_q;
  p.seq_kv = seq_kv;
  p.num_heads_q = num_heads_q;
  p.num_heads_kv = num_heads_kv;
  p.head_dim = head_dim;
  p.head_dim_v = head_dim_v;
  p.num_features = favor ? params.nb_features : head_dim;
  p.q = static_cast<const float*>(q.data);
  p.k = static_cast<const float*>(k.data);
  p.v = static_cast<const float*>(v.data);
  p.out = static_cast<float*>(out.data);
  for (int d = 0; d < 4; ++d) {
    p.q_stride[d] = q.strides[d];
    p.k_stride[d] = k.strides[d];
    p.v_stride[d] = v.strides[d];
    p.out_stride[d] = out.strides[d];
  }
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
