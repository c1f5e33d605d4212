// Causal attention on a BHSD buffer (PyTorch SDPA's order), without copying it to BSHD, checked
// against a plain double-precision loop. Links only qkv::attention.
//
//   q, k, v, out: [B, H, L, D] contiguous; the views permute them to qkv's logical BSHD order.
//
// Prints the largest difference from the plain loop and exits 1 if it is above 1e-5.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "qkv/attention.h"
#include "qkv/error.h"

namespace {

constexpr std::int64_t kBatch = 2, kHeads = 8, kSeq = 77, kHeadDim = 64;

// out[b, h, i, :] = sum_j softmax_j(q_i . k_j / sqrt(D), j <= i) v_j, in double.
std::vector<double> plain_causal_attention(const std::vector<float>& q, const std::vector<float>& k,
                                           const std::vector<float>& v) {
  std::vector<double> out(q.size(), 0.0);
  const double scale = 1.0 / std::sqrt(double(kHeadDim));
  std::vector<double> scores(kSeq);
  for (std::int64_t bh = 0; bh < kBatch * kHeads; ++bh) {
    const std::int64_t base = bh * kSeq * kHeadDim;
    for (std::int64_t i = 0; i < kSeq; ++i) {
      double max_score = -INFINITY;
      for (std::int64_t j = 0; j <= i; ++j) {
        double s = 0;
        for (std::int64_t d = 0; d < kHeadDim; ++d) {
          s += double(q[base + i * kHeadDim + d]) * k[base + j * kHeadDim + d];
        }
        scores[j] = s * scale;
        max_score = std::max(max_score, scores[j]);
      }
      double sum = 0;
      for (std::int64_t j = 0; j <= i; ++j) sum += scores[j] = std::exp(scores[j] - max_score);
      for (std::int64_t j = 0; j <= i; ++j) {
        for (std::int64_t d = 0; d < kHeadDim; ++d) {
          out[base + i * kHeadDim + d] += scores[j] / sum * v[base + j * kHeadDim + d];
        }
      }
    }
  }
  return out;
}

}  // namespace

int main() {
  const std::int64_t n = kBatch * kHeads * kSeq * kHeadDim;
  std::vector<float> q(n), k(n), v(n), out(n);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (auto* buffer : {&q, &k, &v}) {
    for (float& x : *buffer) x = normal(rng);
  }

  // A contiguous [B, H, L, D] buffer is the BSHD view with dims 1 and 2 swapped.
  auto bhsd = [](std::vector<float>& data) {
    return qkv::TensorView::contiguous(data.data(), qkv::DType::kF32,
                                       {kBatch, kHeads, kSeq, kHeadDim})
        .permuted({0, 2, 1, 3});
  };
  try {
    qkv::attention(bhsd(q), bhsd(k), bhsd(v), {.out = bhsd(out)}, {.causal = true});
  } catch (const qkv::Error& error) {
    std::fprintf(stderr, "attention_bhsd: %s\n", error.what());
    return 1;
  }

  const std::vector<double> expected = plain_causal_attention(q, k, v);
  double max_error = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    max_error = std::max(max_error, std::abs(out[i] - expected[i]));
  }
  std::printf(
      "attention_bhsd: B=%lld H=%lld L=%lld D=%lld causal, kernel %s: max |qkv - f64| = %.3g\n",
      (long long)kBatch, (long long)kHeads, (long long)kSeq, (long long)kHeadDim,
      qkv::resolved_kernel_name({.causal = true}, {.out = bhsd(out)}), max_error);
  return max_error <= 1e-5 ? 0 : 1;
}
