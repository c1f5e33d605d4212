// Structure-aware: the input drives the choice of a small attention problem (sizes, dtype,
// strides and layout (BSHD, BHSD, or D strided), causal / alignment / window, key lengths, a
// broadcast mask and bias, softcap, sparsity) and the values in it; the flash and chunked kernels
// must agree with the reference kernel within DESIGN.md's tolerance (loosened for bf16/f16), give
// the same lse, never NaN, or all three must refuse the problem with the same qkv::Error; where the
// input asks, the flash kernel runs again on a head-major copy of K and V and must give the same
// bits. Then the backward of the same problem for a dout from the input: the flash backward
// (bf16 on AMX tiles or vdpbf16ps pairs where the CPU takes them) against the reference's,
// finite, within a bound from the problem's sizes, or both refuse it alike and leave the
// gradients untouched.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "core/float16.h"
#include "kernels/cpu/kv_head_major.h"
#include "qkv/attention.h"
#include "qkv/attention_backward.h"
#include "qkv/error.h"

namespace {

using namespace qkv;

// The largest Euclidean norm of x's rows of `width` elements.
double MaxRowNorm(const std::vector<float>& x, std::int64_t width) {
  double best = 0;
  for (std::size_t row = 0; row + static_cast<std::size_t>(width) <= x.size(); row += width) {
    double sum = 0;
    for (std::int64_t e = 0; e < width; ++e) sum += double{x[row + e]} * x[row + e];
    best = std::max(best, std::sqrt(sum));
  }
  return best;
}

struct Run {
  std::vector<float> out, lse;
  std::string error;
  bool split = false;  // ran on f16-amx-split
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const std::int64_t batch = in.ConsumeIntegralInRange<std::int64_t>(1, 2);
  const std::int64_t seq_q = in.ConsumeIntegralInRange<std::int64_t>(1, 70);
  const std::int64_t seq_kv = in.ConsumeIntegralInRange<std::int64_t>(1, 70);
  const std::int64_t heads_kv = in.ConsumeIntegralInRange<std::int64_t>(1, 2);
  const std::int64_t heads_q = heads_kv * in.ConsumeIntegralInRange<std::int64_t>(1, 3);
  const std::int64_t dim = in.ConsumeIntegralInRange<std::int64_t>(1, 40);
  const std::int64_t dim_v = in.ConsumeBool() ? dim : in.ConsumeIntegralInRange<std::int64_t>(1, 40);
  const DType dtype = in.PickValueInArray({DType::kF32, DType::kBF16, DType::kF16});
  // q, k, v, out (and the gradients) stored as [B, L, H, D], [B, H, L, D], or [B, L, D, H]
  // (elements along D H apart: the kernels' strided packings).
  const int layout = in.ConsumeIntegralInRange<int>(0, 2);

  // Values: mostly moderate, sometimes large (softmax saturation), from the input's bytes.
  const float scale_of_values = in.PickValueInArray({0.5f, 1.0f, 4.0f, 30.0f});
  auto values = [&](std::int64_t n) {
    std::vector<std::uint16_t> half(static_cast<std::size_t>(n));
    std::vector<float> f(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      const float x = (static_cast<float>(in.ConsumeIntegral<std::uint8_t>()) - 127.5f) / 128.0f;
      f[i] = x * scale_of_values;
      if (dtype == DType::kBF16) half[i] = f32_to_bf16_bits(f[i]), f[i] = bf16_bits_to_f32(half[i]);
      if (dtype == DType::kF16) half[i] = f32_to_f16_bits(f[i]), f[i] = f16_bits_to_f32(half[i]);
    }
    return std::make_pair(f, half);
  };
  auto [q32, q16] = values(batch * seq_q * heads_q * dim);
  auto [k32, k16] = values(batch * seq_kv * heads_kv * dim);
  auto [v32, v16] = values(batch * seq_kv * heads_kv * dim_v);

  AttentionParams params;
  params.num_threads = in.ConsumeIntegralInRange<int>(1, 2);
  params.causal = in.ConsumeBool();
  params.align = in.ConsumeBool() ? Align::kBottomRight : Align::kTopLeft;
  if (in.ConsumeBool()) {
    params.window_left = in.ConsumeIntegralInRange<std::int64_t>(-1, 80);
    params.window_right = in.ConsumeIntegralInRange<std::int64_t>(-1, 80);
    if (in.ConsumeBool()) params.window_left = std::numeric_limits<std::int64_t>::max();
  }
  if (in.ConsumeBool()) params.softcap = in.ConsumeFloatingPointInRange<float>(0.5f, 30.0f);
  if (in.ConsumeBool()) params.scale = in.ConsumeFloatingPointInRange<float>(0.01f, 2.0f);
  std::vector<std::int64_t> lengths;
  if (in.ConsumeBool()) {
    for (std::int64_t b = 0; b < batch; ++b) {
      lengths.push_back(in.ConsumeIntegralInRange<std::int64_t>(0, seq_kv));
    }
    params.key_lengths = lengths;
  }
  // Mask and bias broadcast over batch and heads ([1, 1, Lq, Lk]: stride-0 dims).
  std::vector<std::uint8_t> mask;
  std::vector<float> bias;
  if (in.ConsumeBool()) {
    for (std::int64_t i = 0; i < seq_q * seq_kv; ++i) mask.push_back(in.ConsumeBool());
    params.mask = TensorView::contiguous(mask.data(), DType::kU8, {1, 1, seq_q, seq_kv});
  }
  if (in.ConsumeBool()) {
    for (std::int64_t i = 0; i < seq_q * seq_kv; ++i) {
      bias.push_back(in.ConsumeIntegralInRange<int>(0, 9) == 0
                         ? -std::numeric_limits<float>::infinity()
                         : in.ConsumeFloatingPointInRange<float>(-4.0f, 4.0f));
    }
    params.bias = TensorView::contiguous(bias.data(), DType::kF32, {1, 1, seq_q, seq_kv});
  }
  std::vector<std::int64_t> global;
  switch (in.ConsumeIntegralInRange<int>(0, 2)) {
    case 1:
      global = {in.ConsumeIntegralInRange<std::int64_t>(0, seq_kv - 1)};
      params.sparsity = LongformerSparsity{.window = in.ConsumeIntegralInRange<std::int64_t>(0, 40),
                                           .dilation = in.ConsumeIntegralInRange<std::int64_t>(1, 3),
                                           // A span of `global` itself: `c ? global : {}`
                                           // would copy it into a temporary that dies here.
                                           .global = in.ConsumeBool()
                                                         ? std::span<const std::int64_t>(global)
                                                         : std::span<const std::int64_t>()};
      break;
    case 2:
      params.sparsity = BigBirdSparsity{.block = in.ConsumeIntegralInRange<std::int64_t>(1, 80),
                                        .num_random_blocks = in.ConsumeIntegralInRange<std::int64_t>(0, 3),
                                        .num_global_blocks = in.ConsumeIntegralInRange<std::int64_t>(0, 2),
                                        .seed = in.ConsumeIntegral<std::uint64_t>()};
      break;
    default:
      break;
  }

  // Views: BSHD contiguous, or BHSD / BSDH memory seen through permuted strides.
  auto view = [&](void* p, std::int64_t seq, std::int64_t heads, std::int64_t d, DType t) {
    if (layout == 1) {
      return TensorView::contiguous(p, t, {batch, heads, seq, d}).permuted({0, 2, 1, 3});
    }
    if (layout == 2) {
      return TensorView::contiguous(p, t, {batch, seq, d, heads}).permuted({0, 1, 3, 2});
    }
    return TensorView::contiguous(p, t, {batch, seq, heads, d});
  };
  const bool half = dtype != DType::kF32;
  const TensorView q = view(half ? static_cast<void*>(q16.data()) : q32.data(), seq_q, heads_q, dim, dtype);
  const TensorView k = view(half ? static_cast<void*>(k16.data()) : k32.data(), seq_kv, heads_kv, dim, dtype);
  const TensorView v = view(half ? static_cast<void*>(v16.data()) : v32.data(), seq_kv, heads_kv, dim_v, dtype);

  // The flash kernel forced onto a head-major copy of K and V where its walk allows one
  // (kernels/cpu/kv_head_major.h; taken by itself only at long sequences): the same bits.
  const bool copy_kv = in.ConsumeBool();

  auto run = [&](Kernel kernel) {
    Run r;
    r.out.assign(static_cast<std::size_t>(batch * seq_q * heads_q * dim_v), 7.0f);
    r.lse.assign(static_cast<std::size_t>(batch * heads_q * seq_q), 7.0f);
    AttentionParams p = params;
    p.kernel = kernel;
    try {
      const AttentionOutputs outputs{
          .out = view(r.out.data(), seq_q, heads_q, dim_v, DType::kF32),
          .lse = TensorView::contiguous(r.lse.data(), DType::kF32, {batch, heads_q, seq_q, 1})};
      attention(q, k, v, outputs, p);
      r.split = std::string(resolved_product_path(q, k, v, outputs, p)) == "f16-amx-split";
    } catch (const Error& e) {
      r.error = e.what();
      for (float x : r.out) {
        if (x != 7.0f) std::abort();  // an error must leave the output untouched
      }
    }
    return r;
  };
  // Tolerance from the problem's conditioning: an f32 dot product of length D is off by up to
  // ~D * 2^-24 * sum |q_d k_d| (times the scale); a score off by ds moves out by <= 2 ds max|v|.
  // bf16/f16 paths may round the probabilities to bf16 before P.V (2^-8 relative). DESIGN.md's
  // floor 2e-5 x max(1, max|out|) on top.
  const float scale = params.scale.value_or(1.0f / std::sqrt(static_cast<float>(dim)));
  // sum_d |q_d k_d| <= |q| |k| (Cauchy-Schwarz): the largest row norms bound every score.
  const double score_abs = scale * MaxRowNorm(q32, dim) * MaxRowNorm(k32, dim);
  double max_v = 0;
  for (float x : v32) max_v = std::max(max_v, static_cast<double>(std::abs(x)));
  const double score_error = 4.0 * static_cast<double>(dim) * 6e-8 * score_abs + 1e-6;
  const double out_tolerance = 2.0 * score_error * max_v + (half ? 8e-3 * max_v : 0.0);
  // f16 on the AMX tiles (f16-amx-split) splits each value into bf16 hi + lo (lo = x - hi, both
  // exact) and drops the lo x lo products (docs/kernels.md, "f16 on the same tiles"), so its
  // scores (and lse) may be off by up to scale * sum_d max_i |ql_id| * max_j |kl_jd| more
  // (|lo| <= 2^-8 |x|). Found by this fuzzer: D = 2, values near 30, lse off by 1.4e-3 where
  // the f32-level tolerance was 1.1e-3 (the widened f16 path: 7.6e-6).
  auto max_lo = [&](const std::vector<float>& x) {
    std::vector<double> best(static_cast<std::size_t>(dim), 0.0);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double lo = std::abs(double{x[i]} - round_to_bf16(x[i]));
      best[i % dim] = std::max(best[i % dim], lo);
    }
    return best;
  };
  double split_error = 0.0;
  if (dtype == DType::kF16) {
    const std::vector<double> q_lo = max_lo(q32), k_lo = max_lo(k32);
    for (std::int64_t d = 0; d < dim; ++d) split_error += q_lo[d] * k_lo[d];
    split_error *= scale;
  }

  const Run reference = run(Kernel::kReference);
  for (const Kernel kernel : {Kernel::kFlash, Kernel::kChunked}) {
    const Run r = run(kernel);
    if (r.error != reference.error) {
      std::fprintf(stderr, "kernel %d: error '%s', reference '%s'\n", static_cast<int>(kernel),
                   r.error.c_str(), reference.error.c_str());
      std::abort();
    }
    if (!r.error.empty()) continue;
    double max_ref = 1.0;
    for (float x : reference.out) max_ref = std::max(max_ref, static_cast<double>(std::abs(x)));
    const double tolerance = out_tolerance + 2e-5 * max_ref;
    for (std::size_t i = 0; i < r.out.size(); ++i) {
      if (std::isnan(r.out[i]) || std::abs(r.out[i] - reference.out[i]) > tolerance) {
        std::fprintf(stderr, "kernel %d: out[%zu] = %g, reference %g (tolerance %g)\n",
                     static_cast<int>(kernel), i, r.out[i], reference.out[i], tolerance);
        std::abort();
      }
    }
    for (std::size_t i = 0; i < r.lse.size(); ++i) {
      const float a = r.lse[i], b = reference.lse[i];
      const bool both_empty = std::isinf(a) && std::isinf(b) && a < 0 && b < 0;
      const double lse_tolerance =
          score_error + (r.split ? split_error : 0.0) + 1e-5 * std::max(1.0f, std::abs(b));
      if (!both_empty && !(std::abs(a - b) <= lse_tolerance)) {
        std::fprintf(stderr, "kernel %d: lse[%zu] = %g, reference %g (tolerance %g)\n",
                     static_cast<int>(kernel), i, a, b, lse_tolerance);
        std::abort();
      }
    }
    if (kernel == Kernel::kFlash && copy_kv) {
      force_kv_head_major(true);
      const Run c = run(kernel);
      force_kv_head_major(false);
      const auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
        return a.size() == b.size() &&
               std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
      };
      if (c.error != r.error || !same(c.out, r.out) || !same(c.lse, r.lse)) {
        std::fprintf(stderr, "flash over a head-major K/V copy: other bits than in place\n");
        std::abort();
      }
    }
  }
  if (!reference.error.empty()) return 0;

  // The backward, with the reference forward's out and lse.
  std::vector<float> dout(reference.out.size());
  for (float& x : dout)
    x = (static_cast<float>(in.ConsumeIntegral<std::uint8_t>()) - 127.5f) / 64.0f;
  std::vector<float> out = reference.out, lse = reference.lse;
  struct Grads {
    std::vector<float> dq, dk, dv, dbias;
    std::string error;
  };
  // (clang 14's lambdas cannot capture the structured bindings q32, k32, v32)
  const std::size_t q_size = q32.size(), k_size = k32.size(), v_size = v32.size();
  auto backward = [&](Kernel kernel) {
    Grads g;
    g.dq.assign(q_size, 7.0f);
    g.dk.assign(k_size, 7.0f);
    g.dv.assign(v_size, 7.0f);
    if (!bias.empty()) g.dbias.assign(bias.size(), 7.0f);
    AttentionParams p = params;
    p.kernel = kernel;
    try {
      AttentionGrads grads{.dq = view(g.dq.data(), seq_q, heads_q, dim, DType::kF32),
                           .dk = view(g.dk.data(), seq_kv, heads_kv, dim, DType::kF32),
                           .dv = view(g.dv.data(), seq_kv, heads_kv, dim_v, DType::kF32)};
      if (!bias.empty()) {
        grads.dbias = TensorView::contiguous(g.dbias.data(), DType::kF32, {1, 1, seq_q, seq_kv});
      }
      attention_backward(
          q, k, v, view(out.data(), seq_q, heads_q, dim_v, DType::kF32),
          TensorView::contiguous(lse.data(), DType::kF32, {batch, heads_q, seq_q, 1}),
          view(dout.data(), seq_q, heads_q, dim_v, DType::kF32), grads, p);
    } catch (const Error& e) {
      g.error = e.what();
      for (const auto* grad : {&g.dq, &g.dk, &g.dv, &g.dbias}) {
        for (float x : *grad) {
          if (x != 7.0f) std::abort();  // an error must leave the gradients untouched
        }
      }
    }
    return g;
  };
  const Grads ref_grads = backward(Kernel::kReference);
  const Grads flash_grads = backward(Kernel::kFlash);
  if (flash_grads.error != ref_grads.error) {
    std::fprintf(stderr, "backward: error '%s', reference '%s'\n", flash_grads.error.c_str(),
                 ref_grads.error.c_str());
    std::abort();
  }
  if (!ref_grads.error.empty()) return 0;
  // A bound on each gradient's error: a score off by score_error moves p by that much
  // relatively, and the bf16 AMX and vdpbf16ps paths round dout, p and du (2^-8 relative each). With
  // B = max|dout_i| |v_j| (row norms) bounding dp and D, |ds| <= 2 p B, so dq's error is at most
  // scale * max|k| * B * (4 score_error + 3 r) summed over p (1 per row), dk's the same with
  // max|q| over up to Lq rows, dv's Lq * max|dout| * (2 score_error + 2 r), r = 2^-8 on the
  // tiles and the pairs and 0 otherwise (f16 widens in the backward: no hi + lo split); times
  // 4, plus DESIGN.md's floor.
  const std::string path = backward_product_path(params, dtype);
  const double r = path == "bf16-amx" || path == "bf16-vdpbf16ps" ? 1.0 / 256.0 : 0.0;
  const double max_dout = MaxRowNorm(dout, dim_v), bound_dp = max_dout * MaxRowNorm(v32, dim_v);
  const double dq_bound = scale * MaxRowNorm(k32, dim) * bound_dp * (4 * score_error + 3 * r);
  const double dk_bound = static_cast<double>(seq_q) * heads_q / heads_kv * scale *
                          MaxRowNorm(q32, dim) * bound_dp * (4 * score_error + 3 * r);
  const double dv_bound =
      static_cast<double>(seq_q) * heads_q / heads_kv * max_dout * (2 * score_error + 2 * r);
  const double dbias_bound =
      static_cast<double>(batch) * heads_q * 2 * bound_dp * (4 * score_error + r);
  for (auto [name, a, b, bound] : {std::tuple{"dq", &flash_grads.dq, &ref_grads.dq, dq_bound},
                                   {"dk", &flash_grads.dk, &ref_grads.dk, dk_bound},
                                   {"dv", &flash_grads.dv, &ref_grads.dv, dv_bound},
                                   {"dbias", &flash_grads.dbias, &ref_grads.dbias, dbias_bound}}) {
    double max_ref = 1.0;
    for (float x : *b) max_ref = std::max(max_ref, static_cast<double>(std::abs(x)));
    const double tolerance = 4.0 * bound + 2e-5 * max_ref;
    for (std::size_t i = 0; i < a->size(); ++i) {
      if (!std::isfinite((*a)[i]) || std::abs((*a)[i] - (*b)[i]) > tolerance) {
        std::fprintf(stderr, "backward (%s): %s[%zu] = %g, reference %g (tolerance %g)\n",
                     path.c_str(), name, i, (*a)[i], (*b)[i], tolerance);
        std::abort();
      }
    }
  }
  return 0;
}
