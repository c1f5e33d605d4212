// MultiHeadAttention: projections on oneDNN (Linear), qkv::attention for the core.
//
// Weights are canonicalised once at construction into q [E, E], k [Hkv*hd, kdim], v [Hkv*hd,
// vdim] (rows of the per-head packing are gathered), so every packing runs the same code. For
// self-attention (kdim == vdim == E) the three are concatenated into one [E + 2 Hkv hd, E]
// Linear: one GEMM, and its output rows [q | k | v] are read by qkv::attention through strided
// BSHD views with no copy:
//   qkv:  [B, L, F] (F = E + 2 Hkv hd)   q = qkv[..., 0:E] viewed [B, L, H, hd], strides
//         (L F, F, hd, 1);  k = qkv[..., E:E + Hkv hd] and v after it, viewed [B, L, Hkv, hd].
// Cross-attention uses separate q / k / v Linears built on first use.
#include "qkv/layers/multi_head_attention.h"

#include <algorithm>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "layers/scratch.h"
#include "qkv/error.h"
#include "qkv/layers/linear.h"

namespace qkv {
namespace {

std::string n2s(std::int64_t v) { return std::to_string(v); }

void check_size(std::span<const float> span, std::int64_t rows, std::int64_t cols, const char* name,
                bool optional) {
  if (optional && span.empty()) return;
  const std::int64_t expected = rows * cols;
  if (static_cast<std::int64_t>(span.size()) != expected) {
    // Appended piecewise: GCC 12 gives a false -Wrestrict on chained string operator+.
    std::string message = "MultiHeadAttention: ";
    message += name;
    message += " has " + n2s(static_cast<std::int64_t>(span.size())) + " elements, expected [";
    message += n2s(rows);
    if (cols != 1) message += ", " + n2s(cols);
    message += "] = " + n2s(expected);
    throw Error(message);
  }
}

void check_empty(std::span<const float> span, const char* name, const char* packing) {
  if (!span.empty()) {
    throw Error(std::string("MultiHeadAttention: ") + name + " must be empty with packing " +
                packing);
  }
}

// A BSHD f32 view of `data` laid out [B, L, row_stride] with heads of head_dim floats.
TensorView bshd_view(const float* data, std::int64_t batch, std::int64_t seq, std::int64_t heads,
                     std::int64_t head_dim, std::int64_t row_stride) {
  TensorView view;
  view.data = const_cast<float*>(data);
  view.dtype = DType::kF32;
  view.sizes = {batch, seq, heads, head_dim};
  view.strides = {seq * row_stride, row_stride, head_dim, 1};
  return view;
}

}  // namespace

struct MultiHeadAttention::Impl {
  std::int64_t embed_dim = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, kdim = 0, vdim = 0;
  std::int64_t kv_width = 0;  // Hkv * head_dim

  // Canonical weights (torch [out, in] layout); biases are empty or full.
  std::vector<float> q_w, q_b, k_w, k_b, v_w, v_b;
  std::optional<Linear> qkv_proj;                // self-attention: [E + 2 kv_width, E]
  std::optional<Linear> q_proj, k_proj, v_proj;  // cross-attention, built on first use
  std::optional<Linear> out_proj;                // [E, E]

  // Scratch (grow-only, a set per concurrent call): projections, attention output,
  // averaged-weights staging.
  std::shared_ptr<layers::ScratchPool> scratch = layers::make_scratch_pool();
  std::once_flag cross_built;  // the cross projections are built by the first forward_cross

  void ensure_cross() {
    std::call_once(cross_built, [this] { build_cross(); });
  }
  void build_cross() {
    q_proj.emplace(LinearParams{
        .weight = q_w, .bias = q_b, .in_features = embed_dim, .out_features = embed_dim});
    k_proj.emplace(
        LinearParams{.weight = k_w, .bias = k_b, .in_features = kdim, .out_features = kv_width});
    v_proj.emplace(
        LinearParams{.weight = v_w, .bias = v_b, .in_features = vdim, .out_features = kv_width});
  }

  // Runs the core on q [B, Lq, H, hd], k/v [B, Lk, Hkv, hd] into ctx [B, Lq, E], then the
  // output projection into out [B, Lq, E].
  void attend_and_project(const TensorView& q, const TensorView& k, const TensorView& v,
                          std::int64_t batch, std::int64_t seq_q, std::int64_t seq_kv, float* out,
                          const MhaOptions& options) {
    const layers::ScratchPool::Lease scratch(*this->scratch);
    AttentionParams params;
    params.causal = options.causal;
    params.align = options.align;
    params.window_left = options.window_left;
    params.window_right = options.window_right;
    params.key_lengths = options.key_lengths;
    params.mask = options.mask;
    params.bias = options.bias;
    params.num_threads = options.num_threads;

    float* ctx = layers::scratch_floats(scratch->ctx, batch * seq_q * embed_dim);
    AttentionOutputs outputs;
    outputs.out = TensorView::contiguous(ctx, DType::kF32, {batch, seq_q, num_heads, head_dim});
    const std::array<std::int64_t, 4> probs_shape = {batch, num_heads, seq_q, seq_kv};
    if (options.attn_weights != nullptr) {
      // Per head: written straight into the caller's array. Averaged: staged, then reduced.
      float* probs = options.average_weights
                         ? layers::scratch_floats(scratch->probs, batch * num_heads * seq_q * seq_kv)
                         : options.attn_weights;
      outputs.probs = TensorView::contiguous(probs, DType::kF32, probs_shape);
    }
    attention(q, k, v, outputs, params);
    if (options.attn_weights != nullptr && options.average_weights) {
      // attn_weights[b, i, j] = mean over heads of probs[b, h, i, j]; heads summed in order.
      const float* probs = scratch->probs.as<float>();
      const std::int64_t plane = seq_q * seq_kv;
      const float inv_heads = 1.0f / static_cast<float>(num_heads);
      for (std::int64_t b = 0; b < batch; ++b) {
        float* dst = options.attn_weights + b * plane;
        std::fill(dst, dst + plane, 0.0f);
        for (std::int64_t h = 0; h < num_heads; ++h) {
          const float* src = probs + (b * num_heads + h) * plane;
          for (std::int64_t i = 0; i < plane; ++i) dst[i] += src[i];
        }
        for (std::int64_t i = 0; i < plane; ++i) dst[i] *= inv_heads;
      }
    }
    out_proj->forward(ctx, batch * seq_q, out);
  }

  void check_call(const char* where, const void* a, const void* b, std::int64_t batch,
                  std::int64_t seq) const {
    if (batch < 0 || seq < 0) {
      throw Error(std::string("MultiHeadAttention::") + where + ": batch = " + n2s(batch) +
                  " and seq = " + n2s(seq) + " must be >= 0");
    }
    if (batch * seq > 0 && (a == nullptr || b == nullptr)) {
      throw Error(std::string("MultiHeadAttention::") + where + ": null input or output");
    }
  }

  void check_self(const char* where) const {
    if (!qkv_proj) {
      throw Error(std::string("MultiHeadAttention::") + where +
                  ": self-attention needs kdim == vdim == embed_dim, got kdim = " + n2s(kdim) +
                  ", vdim = " + n2s(vdim) + ", embed_dim = " + n2s(embed_dim));
    }
  }
};

MultiHeadAttention::MultiHeadAttention(const MultiHeadAttentionConfig& config,
                                       const MultiHeadAttentionWeights& weights)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  const std::int64_t E = config.embed_dim, H = config.num_heads;
  const std::int64_t Hkv = config.num_kv_heads ? config.num_kv_heads : H;
  if (E <= 0 || H <= 0 || E % H != 0) {
    throw Error("MultiHeadAttention: embed_dim = " + n2s(E) +
                " must be a positive multiple of num_heads = " + n2s(H));
  }
  if (Hkv <= 0 || H % Hkv != 0) {
    throw Error("MultiHeadAttention: num_kv_heads = " + n2s(Hkv) +
                " must divide num_heads = " + n2s(H));
  }
  m.embed_dim = E;
  m.num_heads = H;
  m.num_kv_heads = Hkv;
  m.head_dim = E / H;
  m.kdim = config.kdim ? config.kdim : E;
  m.vdim = config.vdim ? config.vdim : E;
  if (m.kdim < 0 || m.vdim < 0) throw Error("MultiHeadAttention: kdim and vdim must be >= 0");
  const std::int64_t hd = m.head_dim, kvw = Hkv * hd;
  m.kv_width = kvw;

  switch (weights.packing) {
    case QkvPacking::kSeparate:
      check_empty(weights.qkv_weight, "qkv_weight", "kSeparate");
      check_empty(weights.qkv_bias, "qkv_bias", "kSeparate");
      check_size(weights.q_weight, E, E, "q_weight", false);
      check_size(weights.k_weight, kvw, m.kdim, "k_weight", false);
      check_size(weights.v_weight, kvw, m.vdim, "v_weight", false);
      check_size(weights.q_bias, E, 1, "q_bias", true);
      check_size(weights.k_bias, kvw, 1, "k_bias", true);
      check_size(weights.v_bias, kvw, 1, "v_bias", true);
      m.q_w.assign(weights.q_weight.begin(), weights.q_weight.end());
      m.k_w.assign(weights.k_weight.begin(), weights.k_weight.end());
      m.v_w.assign(weights.v_weight.begin(), weights.v_weight.end());
      m.q_b.assign(weights.q_bias.begin(), weights.q_bias.end());
      m.k_b.assign(weights.k_bias.begin(), weights.k_bias.end());
      m.v_b.assign(weights.v_bias.begin(), weights.v_bias.end());
      break;
    case QkvPacking::kFusedBlocks:
    case QkvPacking::kFusedPerHead: {
      const bool per_head = weights.packing == QkvPacking::kFusedPerHead;
      const char* name = per_head ? "kFusedPerHead" : "kFusedBlocks";
      for (auto [span, field] :
           {std::pair{weights.q_weight, "q_weight"}, std::pair{weights.k_weight, "k_weight"},
            std::pair{weights.v_weight, "v_weight"}, std::pair{weights.q_bias, "q_bias"},
            std::pair{weights.k_bias, "k_bias"}, std::pair{weights.v_bias, "v_bias"}}) {
        check_empty(span, field, name);
      }
      if (m.kdim != E || m.vdim != E) {
        throw Error(std::string("MultiHeadAttention: packing ") + name +
                    " needs kdim == vdim == embed_dim, got kdim = " + n2s(m.kdim) +
                    ", vdim = " + n2s(m.vdim) + ", embed_dim = " + n2s(E));
      }
      if (per_head && Hkv != H) {
        throw Error(
            "MultiHeadAttention: packing kFusedPerHead needs num_kv_heads == num_heads, "
            "got num_kv_heads = " +
            n2s(Hkv) + ", num_heads = " + n2s(H));
      }
      const std::int64_t F = E + 2 * kvw;
      check_size(weights.qkv_weight, F, E, "qkv_weight", false);
      check_size(weights.qkv_bias, F, 1, "qkv_bias", true);
      const bool has_bias = !weights.qkv_bias.empty();
      // Source row of canonical row r of part p (0 = q, 1 = k, 2 = v).
      auto source_row = [&](int part, std::int64_t r) -> std::int64_t {
        if (per_head) return (r / hd) * 3 * hd + part * hd + r % hd;  // (H, 3 hd) per head
        return part == 0 ? r : E + (part - 1) * kvw + r;              // [Wq; Wk; Wv]
      };
      std::vector<float>* w_parts[3] = {&m.q_w, &m.k_w, &m.v_w};
      std::vector<float>* b_parts[3] = {&m.q_b, &m.k_b, &m.v_b};
      for (int part = 0; part < 3; ++part) {
        const std::int64_t rows = part == 0 ? E : kvw;
        w_parts[part]->resize(rows * E);
        if (has_bias) b_parts[part]->resize(rows);
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t src = source_row(part, r);
          std::copy_n(weights.qkv_weight.data() + src * E, E, w_parts[part]->data() + r * E);
          if (has_bias) (*b_parts[part])[r] = weights.qkv_bias[src];
        }
      }
      break;
    }
  }
  check_size(weights.out_weight, E, E, "out_weight", false);
  check_size(weights.out_bias, E, 1, "out_bias", true);
  m.out_proj.emplace(LinearParams{
      .weight = weights.out_weight, .bias = weights.out_bias, .in_features = E, .out_features = E});

  if (m.kdim == E && m.vdim == E) {
    // Self-attention: one GEMM for [Wq; Wk; Wv]. A missing bias part becomes zeros.
    const std::int64_t F = E + 2 * kvw;
    std::vector<float> w;
    w.reserve(F * E);
    for (const auto* part : {&m.q_w, &m.k_w, &m.v_w}) w.insert(w.end(), part->begin(), part->end());
    std::vector<float> b;
    if (!m.q_b.empty() || !m.k_b.empty() || !m.v_b.empty()) {
      b.assign(F, 0.0f);
      std::copy(m.q_b.begin(), m.q_b.end(), b.begin());
      std::copy(m.k_b.begin(), m.k_b.end(), b.begin() + E);
      std::copy(m.v_b.begin(), m.v_b.end(), b.begin() + E + kvw);
    }
    m.qkv_proj.emplace(LinearParams{.weight = w, .bias = b, .in_features = E, .out_features = F});
  }
}

MultiHeadAttention::~MultiHeadAttention() = default;
MultiHeadAttention::MultiHeadAttention(MultiHeadAttention&&) noexcept = default;
MultiHeadAttention& MultiHeadAttention::operator=(MultiHeadAttention&&) noexcept = default;

std::int64_t MultiHeadAttention::embed_dim() const { return impl_->embed_dim; }

void MultiHeadAttention::share_scratch_with(const MultiHeadAttention& other) {
  impl_->scratch = other.impl_->scratch;
}
std::int64_t MultiHeadAttention::num_heads() const { return impl_->num_heads; }
std::int64_t MultiHeadAttention::num_kv_heads() const { return impl_->num_kv_heads; }
std::int64_t MultiHeadAttention::head_dim() const { return impl_->head_dim; }
std::int64_t MultiHeadAttention::kdim() const { return impl_->kdim; }
std::int64_t MultiHeadAttention::vdim() const { return impl_->vdim; }

void MultiHeadAttention::forward(const float* x, std::int64_t batch, std::int64_t seq, float* out,
                                 const MhaOptions& options) const {
  // x: [B, L, E] -> qkv: [B, L, E + 2 Hkv hd] -> ctx: [B, L, H, hd] -> out: [B, L, E]
  Impl& m = *impl_;
  m.check_self("forward");
  m.check_call("forward", x, out, batch, seq);
  if (batch * seq == 0) return;
  const std::int64_t F = m.embed_dim + 2 * m.kv_width;
  const layers::ScratchPool::Lease scratch(*m.scratch);
  float* qkv = layers::scratch_floats(scratch->qkv, batch * seq * F);
  m.qkv_proj->forward(x, batch * seq, qkv);
  const TensorView q = bshd_view(qkv, batch, seq, m.num_heads, m.head_dim, F);
  const TensorView k = bshd_view(qkv + m.embed_dim, batch, seq, m.num_kv_heads, m.head_dim, F);
  const TensorView v =
      bshd_view(qkv + m.embed_dim + m.kv_width, batch, seq, m.num_kv_heads, m.head_dim, F);
  m.attend_and_project(q, k, v, batch, seq, seq, out, options);
}

void MultiHeadAttention::forward_cross(const float* query, std::int64_t batch, std::int64_t seq_q,
                                       const float* memory, std::int64_t seq_kv, float* out,
                                       const MhaOptions& options) const {
  if (impl_->kdim != impl_->vdim) {
    throw Error("MultiHeadAttention::forward_cross: one memory needs kdim == vdim, got kdim = " +
                n2s(impl_->kdim) + ", vdim = " + n2s(impl_->vdim) +
                "; pass key_memory and value_memory separately");
  }
  forward_cross(query, batch, seq_q, memory, memory, seq_kv, out, options);
}

void MultiHeadAttention::forward_cross(const float* query, std::int64_t batch, std::int64_t seq_q,
                                       const float* key_memory, const float* value_memory,
                                       std::int64_t seq_kv, float* out,
                                       const MhaOptions& options) const {
  // query: [B, Lq, E], key_memory: [B, Lk, kdim], value_memory: [B, Lk, vdim] -> out: [B, Lq, E]
  Impl& m = *impl_;
  m.check_call("forward_cross", query, out, batch, seq_q);
  m.check_call("forward_cross", key_memory, value_memory, batch, seq_kv);
  if (batch * seq_q == 0) return;
  m.ensure_cross();
  const layers::ScratchPool::Lease scratch(*m.scratch);
  float* qp = layers::scratch_floats(scratch->qkv, batch * seq_q * m.embed_dim);
  float* kp = layers::scratch_floats(scratch->k, batch * seq_kv * m.kv_width);
  float* vp = layers::scratch_floats(scratch->v, batch * seq_kv * m.kv_width);
  m.q_proj->forward(query, batch * seq_q, qp);
  m.k_proj->forward(key_memory, batch * seq_kv, kp);
  m.v_proj->forward(value_memory, batch * seq_kv, vp);
  m.attend_and_project(bshd_view(qp, batch, seq_q, m.num_heads, m.head_dim, m.embed_dim),
                       bshd_view(kp, batch, seq_kv, m.num_kv_heads, m.head_dim, m.kv_width),
                       bshd_view(vp, batch, seq_kv, m.num_kv_heads, m.head_dim, m.kv_width), batch,
                       seq_q, seq_kv, out, options);
}

void MultiHeadAttention::forward_cached(const float* x, std::int64_t batch, std::int64_t seq_new,
                                        KvCache& cache, float* out,
                                        const MhaOptions& options) const {
  // x: [B, Lnew, E]; cache: [B, Lcached, Hkv, hd] -> [B, Lcached + Lnew, Hkv, hd];
  // out: [B, Lnew, E]
  Impl& m = *impl_;
  m.check_self("forward_cached");
  m.check_call("forward_cached", x, out, batch, seq_new);
  if (cache.batch() != batch || cache.num_kv_heads() != m.num_kv_heads ||
      cache.head_dim() != m.head_dim) {
    throw Error("MultiHeadAttention::forward_cached: cache is [B = " + n2s(cache.batch()) +
                ", Hkv = " + n2s(cache.num_kv_heads()) + ", head_dim = " + n2s(cache.head_dim()) +
                "], expected [B = " + n2s(batch) + ", Hkv = " + n2s(m.num_kv_heads) +
                ", head_dim = " + n2s(m.head_dim) + "]");
  }
  if (seq_new == 0) return;
  const std::int64_t F = m.embed_dim + 2 * m.kv_width;
  const layers::ScratchPool::Lease scratch(*m.scratch);
  float* qkv = layers::scratch_floats(scratch->qkv, batch * seq_new * F);
  m.qkv_proj->forward(x, batch * seq_new, qkv);
  const std::int64_t old_size = cache.size();
  cache.append(
      bshd_view(qkv + m.embed_dim, batch, seq_new, m.num_kv_heads, m.head_dim, F),
      bshd_view(qkv + m.embed_dim + m.kv_width, batch, seq_new, m.num_kv_heads, m.head_dim, F));
  try {
    m.attend_and_project(bshd_view(qkv, batch, seq_new, m.num_heads, m.head_dim, F), cache.keys(),
                         cache.values(), batch, seq_new, cache.size(), out, options);
  } catch (...) {
    cache.truncate(old_size);  // a failed call leaves the cache as it was
    throw;
  }
}

KvCache MultiHeadAttention::make_cache(std::int64_t batch, std::int64_t max_seq) const {
  return KvCache(batch, impl_->num_kv_heads, impl_->head_dim, max_seq);
}

}  // namespace qkv
