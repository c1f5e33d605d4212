// MultiHeadAttention: projections on oneDNN (Linear), qkv::attention for the core.
//
// Weights are canonicalised once at construction into q [E, E], k [Hkv*hd, kdim], v [Hkv*hd,
// vdim] (rows of the per-head packing are gathered), so every packing runs the same code. For
// self-attention (kdim == vdim == E) the three are concatenated into one [E + 2 Hkv hd, E]
// Linear: one GEMM, and its output rows [q | k | v] are read by qkv::attention through strided
// BSHD views with no copy:
//   qkv:  [B, L, F] (F = E + 2 Hkv hd)   q = qkv[..., 0:E] viewed [B, L, H, hd], strides
//         (L F, F, hd, 1);  k = qkv[..., E:E + Hkv hd] and v after it, viewed [B, L, Hkv, hd].
// Cross-attention uses separate q / k / v Linears built on first use. With bf16 projections the
// rows are bf16 (Linear::forward_to_bf16), the core takes them so and writes its output in bf16,
// which the output projection reads as it is (forward_from_bf16).
#include "qkv/layers/multi_head_attention.h"

#include <algorithm>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/parallel.h"
#include "layers/chunks.h"
#include "layers/multi_head_attention_impl.h"
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

// dst = src, copied over the threads (a training step hands every layer its weights anew).
void assign_floats(std::vector<float>& dst, std::span<const float> src) {
  dst.resize(src.size());
  layers::copy_floats(src.data(), dst.data(), static_cast<std::int64_t>(src.size()));
}

void check_empty(std::span<const float> span, const char* name, const char* packing) {
  if (!span.empty()) {
    throw Error(std::string("MultiHeadAttention: ") + name + " must be empty with packing " +
                packing);
  }
}

}  // namespace

void MultiHeadAttention::Impl::canonicalize(const MultiHeadAttentionWeights& weights) {
  Impl& m = *this;
  const std::int64_t E = embed_dim, H = num_heads, Hkv = num_kv_heads;
  const std::int64_t kvw = kv_width;
  packing = weights.packing;
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
      assign_floats(m.q_w, weights.q_weight);
      assign_floats(m.k_w, weights.k_weight);
      assign_floats(m.v_w, weights.v_weight);
      assign_floats(m.q_b, weights.q_bias);
      assign_floats(m.k_b, weights.k_bias);
      assign_floats(m.v_b, weights.v_bias);
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
      std::vector<float>* w_parts[3] = {&m.q_w, &m.k_w, &m.v_w};
      std::vector<float>* b_parts[3] = {&m.q_b, &m.k_b, &m.v_b};
      for (int part = 0; part < 3; ++part) {
        const std::int64_t rows = part == 0 ? E : kvw;
        w_parts[part]->resize(rows * E);
        b_parts[part]->resize(has_bias ? rows : 0);
      }
      // Canonical row c of [q; k; v] from its packed row, in blocks of rows over the threads.
      constexpr std::int64_t kRows = 64;
      parallel_for((F + kRows - 1) / kRows, resolve_num_threads(0), [&](std::int64_t t, int) {
        for (std::int64_t c = t * kRows; c < std::min(F, (t + 1) * kRows); ++c) {
          const auto [part, r] = canonical_part(c);
          const std::int64_t src = packed_row(part, r);
          std::copy_n(weights.qkv_weight.data() + src * E, E, w_parts[part]->data() + r * E);
          if (has_bias) (*b_parts[part])[r] = weights.qkv_bias[src];
        }
      });
      break;
    }
  }
  check_size(weights.out_weight, E, E, "out_weight", false);
  check_size(weights.out_bias, E, 1, "out_bias", true);
  assign_floats(out_w, weights.out_weight);
  assign_floats(out_b, weights.out_bias);
}

std::pair<std::vector<float>, std::vector<float>> MultiHeadAttention::Impl::fused_qkv() const {
  const std::int64_t E = embed_dim, F = E + 2 * kv_width;
  std::vector<float> w(F * E);
  std::int64_t at = 0;
  for (const auto* part : {&q_w, &k_w, &v_w}) {
    layers::copy_floats(part->data(), w.data() + at, static_cast<std::int64_t>(part->size()));
    at += static_cast<std::int64_t>(part->size());
  }
  std::vector<float> b;
  if (!q_b.empty() || !k_b.empty() || !v_b.empty()) {
    b.assign(F, 0.0f);
    std::copy(q_b.begin(), q_b.end(), b.begin());
    std::copy(k_b.begin(), k_b.end(), b.begin() + E);
    std::copy(v_b.begin(), v_b.end(), b.begin() + E + kv_width);
  }
  return {std::move(w), std::move(b)};
}

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
  const std::int64_t kvw = Hkv * m.head_dim;
  m.kv_width = kvw;
  m.matmul_dtype = config.matmul_dtype;

  m.canonicalize(weights);
  m.out_proj.emplace(LinearParams{.weight = m.out_w,
                                  .bias = m.out_b,
                                  .in_features = E,
                                  .out_features = E,
                                  .dtype = m.matmul_dtype});
  if (m.kdim == E && m.vdim == E) {  // self-attention: one GEMM for [Wq; Wk; Wv]
    const auto [w, b] = m.fused_qkv();
    m.qkv_proj.emplace(LinearParams{.weight = w,
                                    .bias = b,
                                    .in_features = E,
                                    .out_features = E + 2 * kvw,
                                    .dtype = m.matmul_dtype});
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
  const layers::ScratchPool::Lease scratch(*m.scratch);
  const layers::ProjectedRows qkv =
      Impl::project(*m.qkv_proj, x, batch, seq, scratch->qkv, m.core_dtype());
  m.attend_and_project(qkv.heads(0, m.num_heads, m.head_dim),
                       qkv.heads(m.embed_dim, m.num_kv_heads, m.head_dim),
                       qkv.heads(m.embed_dim + m.kv_width, m.num_kv_heads, m.head_dim), batch, seq,
                       seq, out, options);
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
  const DType core = m.core_dtype();
  const layers::ProjectedRows qp =
      Impl::project(*m.q_proj, query, batch, seq_q, scratch->qkv, core);
  const layers::ProjectedRows kp =
      Impl::project(*m.k_proj, key_memory, batch, seq_kv, scratch->k, core);
  const layers::ProjectedRows vp =
      Impl::project(*m.v_proj, value_memory, batch, seq_kv, scratch->v, core);
  m.attend_and_project(qp.heads(0, m.num_heads, m.head_dim),
                       kp.heads(0, m.num_kv_heads, m.head_dim),
                       vp.heads(0, m.num_kv_heads, m.head_dim), batch, seq_q, seq_kv, out, options);
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
  const layers::ScratchPool::Lease scratch(*m.scratch);
  // A bf16 cache with bf16 projections takes their bf16 rows as they are (the bits append would
  // round f32 rows to); any other cache f32 rows, which append rounds to its dtype (q too).
  const DType core = cache.dtype() == DType::kBF16 ? m.core_dtype() : DType::kF32;
  const layers::ProjectedRows qkv =
      Impl::project(*m.qkv_proj, x, batch, seq_new, scratch->qkv, core);
  const std::int64_t old_size = cache.size();
  cache.append(qkv.heads(m.embed_dim, m.num_kv_heads, m.head_dim),
               qkv.heads(m.embed_dim + m.kv_width, m.num_kv_heads, m.head_dim));
  TensorView q = qkv.heads(0, m.num_heads, m.head_dim);
  if (q.dtype != cache.dtype()) q = layers::half_copy(q, cache.dtype(), scratch->q_half);
  try {
    m.attend_and_project(q, cache.keys(), cache.values(), batch, seq_new, cache.size(), out,
                         options);
  } catch (...) {
    cache.truncate(old_size);  // a failed call leaves the cache as it was
    throw;
  }
}

KvCache MultiHeadAttention::make_cache(std::int64_t batch, std::int64_t max_seq,
                                       DType dtype) const {
  return KvCache(batch, impl_->num_kv_heads, impl_->head_dim, max_seq, dtype);
}

}  // namespace qkv
