#include "attention_case.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "core/float16.h"
#include "kernels/dropout_mask.h"
#include "qkv/attention_backward.h"

namespace qkv::testing {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::vector<float> normal(std::mt19937_64& rng, std::int64_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> data(static_cast<std::size_t>(n));
  for (float& x : data) x = dist(rng) * scale;
  return data;
}

}  // namespace

std::string Case::name() const {
  // Appended piecewise: GCC 12 warns (-Wrestrict, a false positive) on long "a" + b chains.
  std::string s;
  for (auto [tag, value] : {std::pair{"B", batch},
                            {"_Lq", seq_q},
                            {"_Lk", seq_kv},
                            {"_H", num_heads_q},
                            {"x", num_heads_kv},
                            {"_D", head_dim}}) {
    s += tag;
    s += std::to_string(value);
  }
  if (head_dim_v >= 0) s += "_Dv" + std::to_string(head_dim_v);
  if (causal) s += align == Align::kTopLeft ? "_causalTL" : "_causalBR";
  if (window_left >= 0 || window_right >= 0) {
    s += "_win" + std::to_string(window_left) + "," + std::to_string(window_right);
    if (!causal && align == Align::kTopLeft) s += "TL";
  }
  if (key_lengths) s += nan_padding ? "_keylenNaN" : "_keylen";
  if (mask != MaskKind::kNone) s += "_mask" + std::to_string(static_cast<int>(mask));
  if (bias != BiasKind::kNone) s += "_bias" + std::to_string(static_cast<int>(bias));
  if (softcap > 0) s += "_softcap";
  if (scale) s += "_scale";
  if (input_scale != 1.0f) s += "_big";
  if (bhsd) s += "_bhsd";
  if (dim_strided) s += "_dstrided";
  if (dtype != DType::kF32) s += std::string("_") + dtype_name(dtype);
  for (char& ch : s) {  // test names allow [A-Za-z0-9_] only
    if (ch == ',') ch = '_';
    if (ch == '-') ch = 'm';
  }
  return s;
}

Problem::Problem(const Case& c) : c_(c) {
  std::mt19937_64 rng(c.seed);
  const std::int64_t dv = head_dim_v();
  q = normal(rng, c.batch * c.seq_q * c.num_heads_q * c.head_dim, c.input_scale);
  k = normal(rng, c.batch * c.seq_kv * c.num_heads_kv * c.head_dim, c.input_scale);
  v = normal(rng, c.batch * c.seq_kv * c.num_heads_kv * dv, 1.0f);

  if (c.key_lengths) {
    std::uniform_int_distribution<std::int64_t> len(0, c.seq_kv);
    for (std::int64_t b = 0; b < c.batch; ++b) key_lengths.push_back(len(rng));
    if (c.batch > 1) key_lengths[1] = 0;  // a fully padded sequence
    key_lengths[0] = std::max<std::int64_t>(key_lengths[0], 1);
    if (c.nan_padding) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      TensorView kv_views[2] = {view(k, c.seq_kv, c.num_heads_kv, c.head_dim),
                                view(v, c.seq_kv, c.num_heads_kv, dv)};
      for (TensorView& t : kv_views) {
        float* data = static_cast<float*>(t.data);
        for (std::int64_t b = 0; b < c.batch; ++b)
          for (std::int64_t j = key_lengths[b]; j < c.seq_kv; ++j)
            for (std::int64_t h = 0; h < t.sizes[2]; ++h)
              for (std::int64_t d = 0; d < t.sizes[3]; ++d) data[t.offset(b, j, h, d)] = nan;
      }
    }
  }

  if (c.dtype != DType::kF32) {
    for (auto [values, bits] : {std::pair{&q, &q16}, {&k, &k16}, {&v, &v16}}) {
      *bits = to_half_bits(c.dtype, *values);
      for (std::size_t i = 0; i < bits->size(); ++i) {
        (*values)[i] = half_bits_to_f32(c.dtype, (*bits)[i]);
      }
    }
  }

  const std::int64_t B = c.batch, H = c.num_heads_q, Lq = c.seq_q, Lk = c.seq_kv;
  switch (c.mask) {
    case MaskKind::kNone:
      break;
    case MaskKind::kRandom:
      mask_sizes_ = {B, H, Lq, Lk};
      break;
    case MaskKind::kRowBroadcast:
      mask_sizes_ = {1, 1, Lq, Lk};
      break;
    case MaskKind::kKeyPadding:
      mask_sizes_ = {B, 1, 1, Lk};
      break;
  }
  if (c.mask != MaskKind::kNone) {
    std::bernoulli_distribution keep(0.7);
    mask.resize(static_cast<std::size_t>(mask_sizes_[0] * mask_sizes_[1] * mask_sizes_[2] *
                                         mask_sizes_[3]));
    for (auto& m : mask) m = keep(rng) ? 1 : 0;
    // A row with every key masked.
    if (c.mask != MaskKind::kKeyPadding && Lq > 1) std::fill(mask.begin(), mask.begin() + Lk, 0);
  }
  switch (c.bias) {
    case BiasKind::kNone:
      break;
    case BiasKind::kRandom:
    case BiasKind::kWithNegInf:
      bias_sizes_ = {B, H, Lq, Lk};
      break;
    case BiasKind::kPerHeadRow:
      bias_sizes_ = {1, H, Lq, 1};
      break;
    case BiasKind::kShared:
      bias_sizes_ = {1, 1, Lq, Lk};
      break;
    case BiasKind::kPerKey:
      bias_sizes_ = {B, 1, 1, Lk};
      break;
  }
  if (c.bias != BiasKind::kNone) {
    bias = normal(rng, bias_sizes_[0] * bias_sizes_[1] * bias_sizes_[2] * bias_sizes_[3], 2.0f);
    if (c.bias == BiasKind::kWithNegInf) {
      std::bernoulli_distribution neg_inf(0.2);
      for (float& x : bias) {
        if (neg_inf(rng)) x = kNegInf;
      }
      if (Lq > 2) std::fill(bias.begin() + 2 * Lk, bias.begin() + 3 * Lk, kNegInf);
    }
  }
}

TensorView Problem::view(std::vector<float>& data, std::int64_t seq, std::int64_t heads,
                         std::int64_t dim) const {
  if (c_.dim_strided) {
    return TensorView::contiguous(data.data(), DType::kF32, {c_.batch, seq, dim, heads})
        .permuted({0, 1, 3, 2});
  }
  if (!c_.bhsd)
    return TensorView::contiguous(data.data(), DType::kF32, {c_.batch, seq, heads, dim});
  return TensorView::contiguous(data.data(), DType::kF32, {c_.batch, heads, seq, dim})
      .permuted({0, 2, 1, 3});
}

AttentionParams Problem::params() const {
  AttentionParams p;
  p.scale = c_.scale;
  p.softcap = c_.softcap;
  p.causal = c_.causal;
  p.align = c_.align;
  p.window_left = c_.window_left;
  p.window_right = c_.window_right;
  p.key_lengths = key_lengths;
  if (!mask.empty()) {
    p.mask =
        TensorView::contiguous(const_cast<std::uint8_t*>(mask.data()), DType::kU8, mask_sizes_);
  }
  if (!bias.empty()) {
    p.bias = TensorView::contiguous(const_cast<float*>(bias.data()), DType::kF32, bias_sizes_);
  }
  return p;
}

Result Problem::run(Kernel kernel, bool with_probs, int num_threads,
                    std::int64_t chunk_size) const {
  AttentionParams p = params();
  p.kernel = kernel;
  p.num_threads = num_threads;
  p.chunk_size = chunk_size;
  return run_with(p, with_probs);
}

Problem::Call Problem::call(Result& r, bool with_probs) const {
  const Case& c = c_;
  auto& self = const_cast<Problem&>(*this);
  r.out.assign(static_cast<std::size_t>(c.batch * c.seq_q * c.num_heads_q * head_dim_v()), 7.0f);
  r.lse.assign(static_cast<std::size_t>(c.batch * c.num_heads_q * c.seq_q), 7.0f);
  Call call;
  call.outputs.out = view(r.out, c.seq_q, c.num_heads_q, head_dim_v());
  call.outputs.lse =
      TensorView::contiguous(r.lse.data(), DType::kF32, {c.batch, c.num_heads_q, c.seq_q, 1});
  if (with_probs) {
    r.probs.assign(static_cast<std::size_t>(c.batch * c.num_heads_q * c.seq_q * c.seq_kv), 7.0f);
    call.outputs.probs = TensorView::contiguous(r.probs.data(), DType::kF32,
                                                {c.batch, c.num_heads_q, c.seq_q, c.seq_kv});
  }
  call.q = view(self.q, c.seq_q, c.num_heads_q, c.head_dim);
  call.k = view(self.k, c.seq_kv, c.num_heads_kv, c.head_dim);
  call.v = view(self.v, c.seq_kv, c.num_heads_kv, head_dim_v());
  if (c.dtype != DType::kF32) {  // the same views over the bf16/f16 bits
    for (auto [view, bits] :
         {std::pair{&call.q, &self.q16}, {&call.k, &self.k16}, {&call.v, &self.v16}}) {
      view->data = bits->data();
      view->dtype = c.dtype;
    }
  }
  return call;
}

Result Problem::run_with(const AttentionParams& params, bool with_probs) const {
  Result r;
  const Call c = call(r, with_probs);
  attention(c.q, c.k, c.v, c.outputs, params);
  return r;
}

ProductPath Problem::flash_path() const {
  Result r;
  const Call c = call(r, false);
  AttentionParams p = params();
  p.kernel = Kernel::kFlash;
  const std::string name = resolved_product_path(c.q, c.k, c.v, c.outputs, p);
  for (ProductPath path : kProductPaths) {
    if (name == product_path_name(path)) return path;
  }
  ADD_FAILURE() << "unknown product path " << name;
  return WideningProductPath(c_.dtype);
}

Grads run_backward(Problem& pr, const AttentionParams& params, std::vector<float>& dout,
                   bool with_dbias, int num_threads, Kernel kernel) {
  const Case& c = pr.spec();
  const std::int64_t dv = pr.head_dim_v();
  AttentionParams p = params;
  p.kernel = Kernel::kReference;
  p.num_threads = num_threads;
  Result f = pr.run_with(p, false);
  p.kernel = kernel;
  Grads g;
  g.dq.assign(pr.q.size(), 7.0f);
  g.dk.assign(pr.k.size(), 7.0f);
  g.dv.assign(pr.v.size(), 7.0f);
  AttentionGrads grads{.dq = pr.view(g.dq, c.seq_q, c.num_heads_q, c.head_dim),
                       .dk = pr.view(g.dk, c.seq_kv, c.num_heads_kv, c.head_dim),
                       .dv = pr.view(g.dv, c.seq_kv, c.num_heads_kv, dv)};
  if (with_dbias) {
    g.dbias.assign(pr.bias.size(), 7.0f);
    grads.dbias = params.bias;
    grads.dbias.data = g.dbias.data();
  }
  TensorView q = pr.view(pr.q, c.seq_q, c.num_heads_q, c.head_dim);
  TensorView k = pr.view(pr.k, c.seq_kv, c.num_heads_kv, c.head_dim);
  TensorView v = pr.view(pr.v, c.seq_kv, c.num_heads_kv, dv);
  if (c.dtype != DType::kF32) {
    for (auto [view, bits] : {std::pair{&q, &pr.q16}, {&k, &pr.k16}, {&v, &pr.v16}}) {
      view->data = bits->data();
      view->dtype = c.dtype;
    }
  }
  attention_backward(
      q, k, v, pr.view(f.out, c.seq_q, c.num_heads_q, dv),
      TensorView::contiguous(f.lse.data(), DType::kF32, {c.batch, c.num_heads_q, c.seq_q, 1}),
      pr.view(dout, c.seq_q, c.num_heads_q, dv), grads, p);
  return g;
}

double reference_loss(const Problem& pr, const AttentionParams& params,
                      const std::vector<float>& dout) {
  AttentionParams p = params;
  p.kernel = Kernel::kReference;
  const Result r = pr.run_with(p, false);
  double sum = 0.0;
  for (std::size_t i = 0; i < dout.size(); ++i) sum += static_cast<double>(dout[i]) * r.out[i];
  return sum;
}

std::vector<float> normal_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& e : x) e = normal(rng);
  return x;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  // (Empty vectors may hold null data, which memcmp must not be given, even for 0 bytes.)
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

float Problem::row_scores(std::int64_t b, std::int64_t h, std::int64_t i, bool split,
                          const std::vector<std::uint8_t>* keep, float* s, float* cap) const {
  const Case& c = c_;
  auto& self = const_cast<Problem&>(*this);
  const TensorView qv = view(self.q, c.seq_q, c.num_heads_q, c.head_dim);
  const TensorView kv = view(self.k, c.seq_kv, c.num_heads_kv, c.head_dim);
  const float scale = c.scale.value_or(1.0f / std::sqrt(static_cast<float>(c.head_dim)));
  const std::int64_t offset = c.align == Align::kBottomRight ? c.seq_kv - c.seq_q : 0;
  const std::int64_t hk = h / (c.num_heads_q / c.num_heads_kv);
  const AttentionParams p = params();
  const auto lo = [](float x) { return x - round_to_bf16(x); };
  float max = kNegInf;
  for (std::int64_t j = 0; j < c.seq_kv; ++j) {
    const std::int64_t diag = i + offset;
    bool ok = !(c.causal && j > diag);
    ok = ok && !(c.window_left >= 0 && j < diag - c.window_left);
    ok = ok && !(c.window_right >= 0 && j > diag + c.window_right);
    ok = ok && (key_lengths.empty() || j < key_lengths[b]);
    ok = ok &&
         (keep == nullptr || (*keep)[((b * c.num_heads_q + h) * c.seq_q + i) * c.seq_kv + j] != 0);
    if (ok && !mask.empty()) {
      const auto& m = p.mask;
      ok =
          mask[(m.sizes[0] == 1 ? 0 : b) * m.strides[0] + (m.sizes[1] == 1 ? 0 : h) * m.strides[1] +
               (m.sizes[2] == 1 ? 0 : i) * m.strides[2] + j * m.strides[3]] != 0;
    }
    if (cap != nullptr) cap[j] = 1.0f;
    if (!ok) {
      s[j] = kNegInf;
      continue;
    }
    float dot = 0.0f;
    for (std::int64_t d = 0; d < c.head_dim; ++d) {
      const float qd = static_cast<float*>(qv.data)[qv.offset(b, i, h, d)];
      const float kd = static_cast<float*>(kv.data)[kv.offset(b, j, hk, d)];
      dot += split ? qd * kd - lo(qd) * lo(kd) : qd * kd;
    }
    float x = dot * scale;
    if (c.softcap > 0) {
      const float t = std::tanh(x / c.softcap);
      x = c.softcap * t;
      if (cap != nullptr) cap[j] = 1.0f - t * t;
    }
    if (!bias.empty()) x += bias[bias_offset(b, h, i, j)];
    s[j] = x;
    max = std::max(max, x);
  }
  return max;
}

std::int64_t Problem::bias_offset(std::int64_t b, std::int64_t h, std::int64_t i,
                                  std::int64_t j) const {
  const AttentionParams p = params();
  const auto& a = p.bias;
  return (a.sizes[0] == 1 ? 0 : b) * a.strides[0] + (a.sizes[1] == 1 ? 0 : h) * a.strides[1] +
         (a.sizes[2] == 1 ? 0 : i) * a.strides[2] + (a.sizes[3] == 1 ? 0 : j) * a.strides[3];
}

Result Problem::plain(ProductPath path, const std::vector<std::uint8_t>* keep) const {
  const Case& c = c_;
  auto& self = const_cast<Problem&>(*this);
  const TensorView vv = view(self.v, c.seq_kv, c.num_heads_kv, head_dim_v());
  Result r;
  r.out.assign(static_cast<std::size_t>(c.batch * c.seq_q * c.num_heads_q * head_dim_v()), 0.0f);
  r.lse.assign(static_cast<std::size_t>(c.batch * c.num_heads_q * c.seq_q), kNegInf);
  r.probs.assign(static_cast<std::size_t>(c.batch * c.num_heads_q * c.seq_q * c.seq_kv), 0.0f);
  const TensorView ov = view(r.out, c.seq_q, c.num_heads_q, head_dim_v());
  const bool round_probs = rounds_probabilities(path);
  // f16 on the AMX tiles splits each value into bf16 hi + lo (x = hi + lo, exact) and drops the
  // lo x lo products (docs/kernels.md, "f16 on the same tiles").
  const bool split = path == ProductPath::kF16Amx;
  std::vector<float> s(static_cast<std::size_t>(c.seq_kv));
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t h = 0; h < c.num_heads_q; ++h) {
      const std::int64_t hk = h / (c.num_heads_q / c.num_heads_kv);
      for (std::int64_t i = 0; i < c.seq_q; ++i) {
        const float max = row_scores(b, h, i, split, keep, s.data(), nullptr);
        if (max == kNegInf) continue;  // out stays 0
        float sum = 0.0f;
        for (std::int64_t j = 0; j < c.seq_kv; ++j) {
          s[j] = s[j] == kNegInf ? 0.0f : std::exp(s[j] - max);
          sum += s[j];
        }
        r.lse[static_cast<std::size_t>((b * c.num_heads_q + h) * c.seq_q + i)] =
            max + std::log(sum);
        // Where the path rounds the probabilities (to bf16, whatever the inputs' dtype: the f16
        // AMX path too), exp(s - max) is rounded before it weights v
        // and the f32 sum divides after (as the kernel's online softmax does); else p = e / sum.
        const float inv = round_probs ? 1.0f / sum : 1.0f;
        float* probs = r.probs.data() + ((b * c.num_heads_q + h) * c.seq_q + i) * c.seq_kv;
        for (std::int64_t j = 0; j < c.seq_kv; ++j) {
          probs[j] = s[j] / sum;  // the probabilities a kernel returns: never rounded
          s[j] = round_probs ? round_to_bf16(s[j]) : probs[j];
        }
        for (std::int64_t e = 0; e < head_dim_v(); ++e) {
          float acc = 0.0f;
          for (std::int64_t j = 0; j < c.seq_kv; ++j) {
            if (s[j] != 0.0f) acc += s[j] * static_cast<float*>(vv.data)[vv.offset(b, j, hk, e)];
          }
          static_cast<float*>(ov.data)[ov.offset(b, i, h, e)] = acc * inv;
        }
      }
    }
  }
  return r;
}

void expect_same_grads_on_any_thread_count(Problem& pr, const AttentionParams& params,
                                           std::vector<float>& dout,
                                           const std::vector<int>& threads) {
  const bool with_dbias = !pr.bias.empty();
  const Grads one = run_backward(pr, params, dout, with_dbias, 1, Kernel::kFlash);
  for (int n : threads) {
    const Grads many = run_backward(pr, params, dout, with_dbias, n, Kernel::kFlash);
    EXPECT_TRUE(bit_equal(one.dq, many.dq) && bit_equal(one.dk, many.dk) &&
                bit_equal(one.dv, many.dv) && bit_equal(one.dbias, many.dbias))
        << n << " threads";
  }
}

Grads plain_backward_bf16(Problem& pr, const AttentionParams& params,
                          const std::vector<float>& dout, bool with_dbias) {
  const Case& c = pr.spec();
  const std::int64_t dv = pr.head_dim_v();
  AttentionParams forward = params;
  forward.kernel = Kernel::kReference;
  const Result f = pr.run_with(forward, false);
  const std::uint32_t threshold = dropout_threshold(params.dropout_p);
  const float z_kept = params.dropout_p > 0.0f ? 1.0f / (1.0f - params.dropout_p) : 1.0f;
  auto& out = const_cast<std::vector<float>&>(f.out);
  auto& dout_values = const_cast<std::vector<float>&>(dout);
  const TensorView qv = pr.view(pr.q, c.seq_q, c.num_heads_q, c.head_dim);
  const TensorView kv = pr.view(pr.k, c.seq_kv, c.num_heads_kv, c.head_dim);
  const TensorView vv = pr.view(pr.v, c.seq_kv, c.num_heads_kv, dv);
  const TensorView ov = pr.view(out, c.seq_q, c.num_heads_q, dv);
  const TensorView gv = pr.view(dout_values, c.seq_q, c.num_heads_q, dv);
  Grads g;
  g.dq.assign(pr.q.size(), 0.0f);
  g.dk.assign(pr.k.size(), 0.0f);
  g.dv.assign(pr.v.size(), 0.0f);
  if (with_dbias) g.dbias.assign(pr.bias.size(), 0.0f);
  const TensorView dqv = pr.view(g.dq, c.seq_q, c.num_heads_q, c.head_dim);
  const TensorView dkv = pr.view(g.dk, c.seq_kv, c.num_heads_kv, c.head_dim);
  const TensorView dvv = pr.view(g.dv, c.seq_kv, c.num_heads_kv, dv);
  const float scale = c.scale.value_or(1.0f / std::sqrt(static_cast<float>(c.head_dim)));
  const auto at = [](const TensorView& t, std::int64_t b, std::int64_t i, std::int64_t h,
                     std::int64_t d) -> float& {
    return static_cast<float*>(t.data)[t.offset(b, i, h, d)];
  };
  std::vector<float> s(c.seq_kv), cap(c.seq_kv), dout_r(dv);
  for (std::int64_t b = 0; b < c.batch; ++b) {
    for (std::int64_t h = 0; h < c.num_heads_q; ++h) {
      const std::int64_t hk = h / (c.num_heads_q / c.num_heads_kv);
      for (std::int64_t i = 0; i < c.seq_q; ++i) {
        const float lse = f.lse[static_cast<std::size_t>((b * c.num_heads_q + h) * c.seq_q + i)];
        if (lse == kNegInf) continue;  // no allowed key: zero gradients
        pr.row_scores(b, h, i, false, nullptr, s.data(), cap.data());
        float delta = 0.0f;
        for (std::int64_t e = 0; e < dv; ++e) {
          delta += at(gv, b, i, h, e) * at(ov, b, i, h, e);
          dout_r[e] = round_to_bf16(at(gv, b, i, h, e));
        }
        const std::uint64_t row =
            dropout_row(params.seed, params.offset, b, h, i, c.num_heads_q, c.seq_q);
        for (std::int64_t j = 0; j < c.seq_kv; ++j) {
          if (s[j] == kNegInf) continue;
          const float p = std::exp(std::min(s[j] - lse, 0.0f));
          const float z =
              params.dropout_p > 0.0f ? (dropout_bits(row, j) >= threshold ? z_kept : 0.0f) : 1.0f;
          float dp = 0.0f;
          for (std::int64_t e = 0; e < dv; ++e) dp += dout_r[e] * at(vv, b, j, hk, e);
          const float ds = p * (z * dp - delta);
          if (with_dbias) g.dbias[pr.bias_offset(b, h, i, j)] += ds;
          const float du = round_to_bf16(ds * cap[j]);
          const float pb = round_to_bf16(p * z);
          for (std::int64_t e = 0; e < dv; ++e) at(dvv, b, j, hk, e) += pb * dout_r[e];
          for (std::int64_t d = 0; d < c.head_dim; ++d) {
            at(dkv, b, j, hk, d) += scale * du * at(qv, b, i, h, d);
            at(dqv, b, i, h, d) += scale * du * at(kv, b, j, hk, d);
          }
        }
      }
    }
  }
  return g;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return std::numeric_limits<double>::infinity();
    if (a[i] == b[i]) continue;  // also equal infinities
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return worst;
}

double max_abs(const std::vector<float>& a) {
  double m = 0.0;
  for (float x : a) {
    if (std::isfinite(x)) m = std::max(m, std::fabs(static_cast<double>(x)));
  }
  return m;
}

double tolerance(const std::vector<float>& reference, const std::vector<float>& plain) {
  return std::max(2e-5 * std::max(1.0, max_abs(reference)), 4.0 * max_abs_diff(reference, plain));
}

void expect_same_bits_on_any_thread_count(const Problem& problem, AttentionParams params) {
  params.num_threads = 1;
  const Result one = problem.run_with(params, /*with_probs=*/false);
  for (int threads : {2, 3, 5}) {
    params.num_threads = threads;
    const Result many = problem.run_with(params, /*with_probs=*/false);
    EXPECT_TRUE(bit_equal(one.out, many.out))
        << "out, kernel " << static_cast<int>(params.kernel) << ", threads " << threads;
    EXPECT_TRUE(bit_equal(one.lse, many.lse))
        << "lse, kernel " << static_cast<int>(params.kernel) << ", threads " << threads;
  }
}

}  // namespace qkv::testing
