// The backward oracle (qkv/attention_backward.h): the formulas written out literally in f64,
// one query row at a time, so that no Lq x Lk buffer is ever held. Per (batch, kv head) task:
// for each query head of the group and each query row, the scores and the softmax of the row
// (recomputed in f64 from q and k: the forward's out and lse are not used), the row's out and
// D_i = dout_i . out_i, then every allowed pair's contribution to dv_j, dq_i and dk_j. dk and
// dv accumulate in f64 over the group's query heads and rows in a fixed order and are written
// once; a task owns its dq rows and its dk/dv rows, so any thread count gives the same bits.
// dbias sums over the dimensions the bias broadcasts over, across tasks: with dbias the tasks
// run in order on one thread.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/parallel.h"
#include "kernels/dropout_mask.h"
#include "kernels/kernels.h"
#include "kernels/reference/reference_scores.h"

namespace qkv {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Scratch of one task, f64: the row's scores (then probabilities), their tanh, the dropout
// factors; the row's out, dq; the group's dk and dv.
struct Scratch {
  std::vector<double> s, capped, z, out, dq, dk, dv;
};

// dout read and dq, dk, dv written as T: f32 (g.dout, ...), or f64 for f64 inputs (g.dout_f64).
template <typename T>
struct Grads {
  const T* dout;
  T* dq;
  T* dk;
  T* dv;
};

template <typename T>
void backward_one_group(const AttentionBackwardKernelParams& g, const Grads<T>& o, std::int64_t b,
                        std::int64_t kv_head, Scratch& w, double* dbias_acc) {
  const AttentionKernelParams& p = g.forward;
  const std::int64_t lk = p.seq_kv, dim = p.head_dim, dim_v = p.head_dim_v;
  const std::int64_t group = p.num_heads_q / p.num_heads_kv;
  std::fill(w.dk.begin(), w.dk.end(), 0.0);
  std::fill(w.dv.begin(), w.dv.end(), 0.0);
  auto k_at = [&](std::int64_t j, std::int64_t d) {
    return load_element_f64(
        p.k, p.dtype, b * p.k_stride[0] + j * p.k_stride[1] + kv_head * p.k_stride[2] + d * p.k_stride[3]);
  };
  auto v_at = [&](std::int64_t j, std::int64_t e) {
    return load_element_f64(
        p.v, p.dtype, b * p.v_stride[0] + j * p.v_stride[1] + kv_head * p.v_stride[2] + e * p.v_stride[3]);
  };
  for (std::int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    for (std::int64_t i = 0; i < p.seq_q; ++i) {
      // The row's softmax.
      double max = kNegInf;
      for (std::int64_t j = 0; j < lk; ++j) {
        w.s[j] = reference::pair_allowed(p, b, h, i, j) ? reference::score(p, b, h, i, j, &w.capped[j])
                                                        : kNegInf;
        max = std::fmax(max, w.s[j]);
      }
      std::fill(w.dq.begin(), w.dq.end(), 0.0);
      T* dq = o.dq + b * g.dq_stride[0] + i * g.dq_stride[1] + h * g.dq_stride[2];
      if (max == kNegInf) {  // no allowed key: zero gradients (dq here, nothing for dk, dv)
        for (std::int64_t d = 0; d < dim; ++d) dq[d * g.dq_stride[3]] = T{0};
        continue;
      }
      double sum = 0.0;
      for (std::int64_t j = 0; j < lk; ++j) {
        w.s[j] = w.s[j] == kNegInf ? 0.0 : std::exp(w.s[j] - max);  // now unnormalised P
        sum += w.s[j];
      }
      for (std::int64_t j = 0; j < lk; ++j) w.s[j] /= sum;
      const T* dout = o.dout + b * g.dout_stride[0] + i * g.dout_stride[1] + h * g.dout_stride[2];
      auto dout_at = [&](std::int64_t e) { return static_cast<double>(dout[e * g.dout_stride[3]]); };
      // The dropout factor z_j: keep / (1 - p), or 1 without dropout.
      const std::uint64_t drop_row =
          p.dropout_p > 0.0f
              ? dropout_row(p.dropout_seed, p.dropout_offset, b, h, i, p.num_heads_q, p.seq_q)
              : 0;
      for (std::int64_t j = 0; j < lk; ++j) {
        w.z[j] = p.dropout_p == 0.0f                                       ? 1.0
                 : dropout_bits(drop_row, j) < p.dropout_threshold ? 0.0
                                                                   : static_cast<double>(p.dropout_scale);
      }
      // out_i (with dropout) and D_i = dout_i . out_i.
      std::fill(w.out.begin(), w.out.end(), 0.0);
      for (std::int64_t j = 0; j < lk; ++j) {
        if (w.s[j] == 0.0 || w.z[j] == 0.0) continue;  // masked: v_j may be garbage
        for (std::int64_t e = 0; e < dim_v; ++e) w.out[e] += w.s[j] * w.z[j] * v_at(j, e);
      }
      double delta = 0.0;
      for (std::int64_t e = 0; e < dim_v; ++e) delta += dout_at(e) * w.out[e];
      // Every pair with P > 0 (a pair with P = 0 contributes 0 to everything).
      const std::int64_t q_row = b * p.q_stride[0] + i * p.q_stride[1] + h * p.q_stride[2];
      for (std::int64_t j = 0; j < lk; ++j) {
        const double prob = w.s[j];
        if (prob == 0.0) continue;
        // dv_j += P z dout_i; dS = P (z dP - D_i).
        double dp = 0.0;
        for (std::int64_t e = 0; e < dim_v; ++e) {
          w.dv[j * dim_v + e] += prob * w.z[j] * dout_at(e);
          dp += dout_at(e) * v_at(j, e);
        }
        const double ds = prob * (w.z[j] * dp - delta);
        if (dbias_acc != nullptr) {
          const std::int64_t at[4] = {b, h, i, j};
          std::int64_t index = 0;
          for (int d = 0; d < 4; ++d) index = index * g.dbias_sizes[d] + (g.dbias_sizes[d] == 1 ? 0 : at[d]);
          dbias_acc[index] += ds;
        }
        const double du = (p.softcap > 0.0f ? ds * (1.0 - w.capped[j] * w.capped[j]) : ds) *
                          reference::scale(p);
        for (std::int64_t d = 0; d < dim; ++d) {
          w.dq[d] += du * k_at(j, d);
          w.dk[j * dim + d] += du * load_element_f64(p.q, p.dtype, q_row + d * p.q_stride[3]);
        }
      }
      for (std::int64_t d = 0; d < dim; ++d) dq[d * g.dq_stride[3]] = static_cast<T>(w.dq[d]);
    }
  }
  for (std::int64_t j = 0; j < lk; ++j) {
    T* dk = o.dk + b * g.dk_stride[0] + j * g.dk_stride[1] + kv_head * g.dk_stride[2];
    T* dv = o.dv + b * g.dv_stride[0] + j * g.dv_stride[1] + kv_head * g.dv_stride[2];
    for (std::int64_t d = 0; d < dim; ++d) dk[d * g.dk_stride[3]] = static_cast<T>(w.dk[j * dim + d]);
    for (std::int64_t e = 0; e < dim_v; ++e) dv[e * g.dv_stride[3]] = static_cast<T>(w.dv[j * dim_v + e]);
  }
}

}  // namespace

void attention_backward_reference(const AttentionBackwardKernelParams& g) {
  const AttentionKernelParams& p = g.forward;
  const std::int64_t num_tasks = p.batch * p.num_heads_kv;
  std::vector<double> dbias_acc;
  if (g.dbias != nullptr) {
    dbias_acc.assign(static_cast<std::size_t>(g.dbias_sizes[0] * g.dbias_sizes[1] *
                                              g.dbias_sizes[2] * g.dbias_sizes[3]),
                     0.0);
  }
  const int num_threads = g.dbias != nullptr
                              ? 1
                              : static_cast<int>(std::min<std::int64_t>(p.num_threads, num_tasks));
  std::vector<Scratch> scratch(static_cast<std::size_t>(num_threads));
  for (Scratch& w : scratch) {
    w.s.resize(p.seq_kv);
    w.capped.resize(p.seq_kv);
    w.z.resize(p.seq_kv);
    w.out.resize(p.head_dim_v);
    w.dq.resize(p.head_dim);
    w.dk.resize(p.seq_kv * p.head_dim);
    w.dv.resize(p.seq_kv * p.head_dim_v);
  }
  const Grads<float> f32{g.dout, g.dq, g.dk, g.dv};
  const Grads<double> f64{g.dout_f64, g.dq_f64, g.dk_f64, g.dv_f64};
  parallel_for(num_tasks, num_threads, [&](std::int64_t task, int thread) {
    const std::int64_t b = task / p.num_heads_kv, kv_head = task % p.num_heads_kv;
    double* acc = dbias_acc.empty() ? nullptr : dbias_acc.data();
    if (p.dtype == DType::kF64) {
      backward_one_group(g, f64, b, kv_head, scratch[thread], acc);
    } else {
      backward_one_group(g, f32, b, kv_head, scratch[thread], acc);
    }
  });
  if (g.dbias != nullptr) {
    std::int64_t index = 0;
    for (std::int64_t b = 0; b < g.dbias_sizes[0]; ++b)
      for (std::int64_t h = 0; h < g.dbias_sizes[1]; ++h)
        for (std::int64_t i = 0; i < g.dbias_sizes[2]; ++i)
          for (std::int64_t j = 0; j < g.dbias_sizes[3]; ++j) {
            g.dbias[b * g.dbias_stride[0] + h * g.dbias_stride[1] + i * g.dbias_stride[2] +
                    j * g.dbias_stride[3]] = static_cast<float>(dbias_acc[index++]);
          }
  }
}

}  // namespace qkv
