// The linear-attention oracle: the quadratic form of the formula, written out literally per
// (batch, query head) in f64,
//   out_i = sum_{j in J(i)} (phi(q_i) . phi(k_j)) v_j / sum_{j in J(i)} phi(q_i) . phi(k_j),
// every key checked by its own predicate. It shares nothing with the fast kernel: no prefix
// sums, no chunks, no running stabiliser (here: one maximum over all allowed keys of the head,
// which cancels like any other). Nobody optimises this file.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/parallel.h"
#include "kernels/kernels.h"

namespace qkv {
namespace {

// The exponents w_r . x' - |x'|^2 / 2 of FAVOR+ for one row x (f64), x' = x * feature_scale.
void favor_exponents(const LinearKernelParams& p, const float* x, std::int64_t x_stride,
                     double* exponents) {
  double half_norm = 0.0;
  for (std::int64_t d = 0; d < p.head_dim; ++d) {
    const double xd = static_cast<double>(x[d * x_stride]) * p.feature_scale;
    half_norm += 0.5 * xd * xd;
  }
  for (std::int64_t r = 0; r < p.num_features; ++r) {
    double dot = 0.0;
    for (std::int64_t d = 0; d < p.head_dim; ++d) {
      dot += static_cast<double>(p.projection[r * p.head_dim + d]) *
             (static_cast<double>(x[d * x_stride]) * p.feature_scale);
    }
    exponents[r] = dot - half_norm;
  }
}

double elu_plus_one(double x) { return x > 0.0 ? x + 1.0 : std::exp(x); }

// A row's allowed keys are [0, key_end(i)): every key j is still checked one by one below.
bool key_allowed(const LinearKernelParams& p, std::int64_t b, std::int64_t i, std::int64_t j) {
  if (p.key_lengths != nullptr && j >= p.key_lengths[b]) return false;
  if (p.causal && j > i + p.diagonal_offset) return false;
  return true;
}

// One (b, h): phi of every allowed key (f64, [Lk][M]), then each query row's weighted sum.
void reference_one_head(const LinearKernelParams& p, std::int64_t b, std::int64_t h, double* phi_k,
                        double* phi_q, double* num) {
  const std::int64_t m = p.num_features;
  const std::int64_t kv_head = h / (p.num_heads_q / p.num_heads_kv);
  const double inv_sqrt_m = 1.0 / std::sqrt(static_cast<double>(m));
  const auto key_row = [&](std::int64_t j) {
    return p.k + b * p.k_stride[0] + j * p.k_stride[1] + kv_head * p.k_stride[2];
  };
  // A key is "used" when some query row may attend it; keys past key_lengths are never read.
  std::vector<bool> used(p.seq_kv, false);
  for (std::int64_t j = 0; j < p.seq_kv; ++j) {
    for (std::int64_t i = 0; i < p.seq_q && !used[j]; ++i) used[j] = key_allowed(p, b, i, j);
  }
  double key_max = -std::numeric_limits<double>::infinity();
  for (std::int64_t j = 0; j < p.seq_kv; ++j) {
    if (!used[j]) continue;
    double* row = phi_k + j * m;
    if (p.favor) {
      favor_exponents(p, key_row(j), p.k_stride[3], row);
      for (std::int64_t r = 0; r < m; ++r) key_max = std::max(key_max, row[r]);
    } else {
      for (std::int64_t d = 0; d < m; ++d) row[d] = elu_plus_one(key_row(j)[d * p.k_stride[3]]);
    }
  }
  if (p.favor) {
    for (std::int64_t j = 0; j < p.seq_kv; ++j) {
      if (!used[j]) continue;
      for (std::int64_t r = 0; r < m; ++r) {
        phi_k[j * m + r] = std::exp(phi_k[j * m + r] - key_max) * inv_sqrt_m;
      }
    }
  }

  for (std::int64_t i = 0; i < p.seq_q; ++i) {
    const float* q = p.q + b * p.q_stride[0] + i * p.q_stride[1] + h * p.q_stride[2];
    if (p.favor) {
      favor_exponents(p, q, p.q_stride[3], phi_q);
      const double row_max = *std::max_element(phi_q, phi_q + m);
      for (std::int64_t r = 0; r < m; ++r) phi_q[r] = std::exp(phi_q[r] - row_max) * inv_sqrt_m;
    } else {
      for (std::int64_t d = 0; d < m; ++d) phi_q[d] = elu_plus_one(q[d * p.q_stride[3]]);
    }
    double den = 0.0;
    std::fill(num, num + p.head_dim_v, 0.0);
    for (std::int64_t j = 0; j < p.seq_kv; ++j) {
      if (!key_allowed(p, b, i, j)) continue;
      double weight = 0.0;
      for (std::int64_t r = 0; r < m; ++r) weight += phi_q[r] * phi_k[j * m + r];
      den += weight;
      const float* v = p.v + b * p.v_stride[0] + j * p.v_stride[1] + kv_head * p.v_stride[2];
      for (std::int64_t e = 0; e < p.head_dim_v; ++e) num[e] += weight * v[e * p.v_stride[3]];
    }
    float* out = p.out + b * p.out_stride[0] + i * p.out_stride[1] + h * p.out_stride[2];
    for (std::int64_t e = 0; e < p.head_dim_v; ++e) {
      out[e * p.out_stride[3]] = den > 0.0 ? static_cast<float>(num[e] / den) : 0.0f;
    }
  }
}

}  // namespace

void linear_attention_reference(const LinearKernelParams& p) {
  // Per-thread scratch, sized once: phi(k) [Lk][M], phi(q) [M], a numerator row [Dv].
  const std::int64_t floats = p.seq_kv * p.num_features + p.num_features + p.head_dim_v;
  const std::int64_t num_tasks = p.batch * p.num_heads_q;
  const int num_threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, num_tasks));
  std::vector<double> scratch(static_cast<std::size_t>(floats * num_threads));
  parallel_for(num_tasks, num_threads, [&](std::int64_t task, int thread) {
    double* phi_k = scratch.data() + thread * floats;
    double* phi_q = phi_k + p.seq_kv * p.num_features;
    reference_one_head(p, task / p.num_heads_q, task % p.num_heads_q, phi_k, phi_q,
                       phi_q + p.num_features);
  });
}

}  // namespace qkv
