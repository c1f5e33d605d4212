// The oracle: DESIGN.md section 3 written out literally, one (batch, head) at a time, with f64
// accumulation and the whole Lq x Lk score matrix materialised. Nobody optimises this file;
// every fast kernel is tested against it. Pairs are checked one by one
// (kernels/reference/reference_scores.h, shared with the backward oracle only).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "core/aligned_buffer.h"
#include "core/float16.h"
#include "core/parallel.h"
#include "kernels/dropout_mask.h"
#include "kernels/kernels.h"
#include "kernels/reference/reference_scores.h"

namespace qkv {
namespace {

// Where out, lse and probs go: f32 (p.out, ...), or f64 for f64 inputs (p.out_f64, ...).
template <typename T>
struct Outputs {
  T* out;
  T* lse;
  T* probs;
};

// One (b, h): scores [Lq, Lk] in f64 scratch, then softmax and the weighted sum of v.
template <typename T>
void reference_one_head(const AttentionKernelParams& p, const Outputs<T>& o, std::int64_t b,
                        std::int64_t h, double* scores) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const std::int64_t kv_head = h / (p.num_heads_q / p.num_heads_kv);
  const std::int64_t lk = p.seq_kv;
  for (std::int64_t i = 0; i < p.seq_q; ++i) {
    double* row = scores + i * lk;
    for (std::int64_t j = 0; j < lk; ++j) {
      if (!reference::pair_allowed(p, b, h, i, j)) {
        row[j] = kNegInf;  // never read k_j: keys past key_lengths may be garbage
        continue;
      }
      double capped;
      row[j] = reference::score(p, b, h, i, j, &capped);
    }
  }
  for (std::int64_t i = 0; i < p.seq_q; ++i) {
    double* row = scores + i * lk;
    double max = kNegInf;
    for (std::int64_t j = 0; j < lk; ++j) max = std::fmax(max, row[j]);
    double sum = 0.0;
    if (max != kNegInf) {
      for (std::int64_t j = 0; j < lk; ++j) {
        row[j] = row[j] == kNegInf ? 0.0 : std::exp(row[j] - max);
        sum += row[j];
      }
    }
    // A row with no allowed key: out = 0, lse = -inf (sum stays 0, so every p below is 0).
    const double inv_sum = sum > 0.0 ? 1.0 / sum : 0.0;
    // Dropout scales the kept probabilities for the values only (lse and probs are P's).
    const std::uint64_t drop_row =
        p.dropout_p > 0.0f
            ? dropout_row(p.dropout_seed, p.dropout_offset, b, h, i, p.num_heads_q, p.seq_q)
            : 0;
    const std::int64_t out_row = b * p.out_stride[0] + i * p.out_stride[1] + h * p.out_stride[2];
    for (std::int64_t e = 0; e < p.head_dim_v; ++e) {
      double acc = 0.0;
      for (std::int64_t j = 0; j < lk; ++j) {
        if (max == kNegInf || row[j] == 0.0) continue;  // masked: v_j may be garbage
        double weight = row[j];
        if (p.dropout_p > 0.0f) {
          if (dropout_bits(drop_row, j) < p.dropout_threshold) continue;
          weight *= static_cast<double>(p.dropout_scale);
        }
        const std::int64_t v_row = b * p.v_stride[0] + j * p.v_stride[1] + kv_head * p.v_stride[2];
        acc += weight * load_element_f64(p.v, p.dtype, v_row + e * p.v_stride[3]);
      }
      const std::int64_t at = out_row + e * p.out_stride[3];
      if constexpr (std::is_same_v<T, float>) {
        if (p.out16 != nullptr) {  // out in the inputs' dtype: the f32 result, rounded
          p.out16[at] = f32_to_half_bits(p.dtype, static_cast<float>(acc * inv_sum));
          continue;
        }
      }
      o.out[at] = static_cast<T>(acc * inv_sum);
    }
    if (o.lse != nullptr) {
      o.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]] =
          sum > 0.0 ? static_cast<T>(max + std::log(sum)) : -std::numeric_limits<T>::infinity();
    }
    if (o.probs != nullptr) {
      T* probs = o.probs + b * p.probs_stride[0] + h * p.probs_stride[1] + i * p.probs_stride[2];
      for (std::int64_t j = 0; j < lk; ++j) {
        probs[j * p.probs_stride[3]] = max == kNegInf ? T{0} : static_cast<T>(row[j] * inv_sum);
      }
    }
  }
}

}  // namespace

void attention_reference(const AttentionKernelParams& p) {
  const std::int64_t num_tasks = p.batch * p.num_heads_q;
  const int num_threads = static_cast<int>(std::min<std::int64_t>(p.num_threads, num_tasks));
  // Scratch, sized once before the parallel loop: one f64 score matrix [Lq, Lk] per thread.
  AlignedBuffer scratch(static_cast<std::size_t>(num_threads) * p.seq_q * p.seq_kv *
                        sizeof(double));
  const Outputs<float> f32{p.out, p.lse, p.probs};
  const Outputs<double> f64{p.out_f64, p.lse_f64, p.probs_f64};
  parallel_for(num_tasks, num_threads, [&](std::int64_t task, int thread) {
    double* scores = scratch.as<double>() + static_cast<std::int64_t>(thread) * p.seq_q * p.seq_kv;
    const std::int64_t b = task / p.num_heads_q, h = task % p.num_heads_q;
    if (p.dtype == DType::kF64) {
      reference_one_head(p, f64, b, h, scores);
    } else {
      reference_one_head(p, f32, b, h, scores);
    }
  });
}

}  // namespace qkv
