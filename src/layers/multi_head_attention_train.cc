// MultiHeadAttention's training half (qkv/layers/multi_head_attention.h): forward_train keeps
// the projections and the attention's out and lse; backward runs
//   out_proj.backward  ->  attention_backward (qkv/attention_backward.h)  ->  qkv_proj.backward
// on the canonical [Wq; Wk; Wv] projection that every packing runs (multi_head_attention.cc),
// and scatters its weight gradient back into the packing's layout.
#include <algorithm>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "layers/chunks.h"
#include "layers/multi_head_attention_impl.h"
#include "qkv/attention_backward.h"
#include "qkv/error.h"
#include "qkv/layers/multi_head_attention.h"

namespace qkv {
namespace {

std::span<const float> span_of(const std::vector<float>& v) { return {v.data(), v.size()}; }

// The tape's projection rows [B * L, width] as the attention core takes them: f32, or the bf16
// bits the bf16 projection wrote (the bits the inference forward hands its core).
layers::ProjectedRows core_rows(const MhaTape& tape, std::int64_t width) {
  const bool bf16 = !tape.qkv_bf16.empty();
  return {.data = bf16 ? static_cast<const void*>(tape.qkv_bf16.data())
                       : static_cast<const void*>(tape.qkv.data()),
          .dtype = bf16 ? DType::kBF16 : DType::kF32,
          .batch = tape.batch,
          .seq = tape.seq,
          .row_stride = width};
}

}  // namespace

MultiHeadAttentionWeights MultiHeadAttentionParams::weights() const {
  return {.packing = packing,
          .qkv_weight = span_of(qkv_weight),
          .qkv_bias = span_of(qkv_bias),
          .q_weight = span_of(q_weight),
          .q_bias = span_of(q_bias),
          .k_weight = span_of(k_weight),
          .k_bias = span_of(k_bias),
          .v_weight = span_of(v_weight),
          .v_bias = span_of(v_bias),
          .out_weight = span_of(out_weight),
          .out_bias = span_of(out_bias)};
}

std::vector<std::vector<float>*> MultiHeadAttentionParams::tensors() {
  std::vector<std::vector<float>*> all;
  for (std::vector<float>* t : {&qkv_weight, &qkv_bias, &q_weight, &q_bias, &k_weight, &k_bias,
                                &v_weight, &v_bias, &out_weight, &out_bias}) {
    if (!t->empty()) all.push_back(t);
  }
  return all;
}

MultiHeadAttentionParams MultiHeadAttention::parameters() const {
  const Impl& m = *impl_;
  MultiHeadAttentionParams p{.packing = m.packing, .out_weight = m.out_w, .out_bias = m.out_b};
  if (m.packing == QkvPacking::kSeparate) {
    p.q_weight = m.q_w, p.q_bias = m.q_b, p.k_weight = m.k_w, p.k_bias = m.k_b;
    p.v_weight = m.v_w, p.v_bias = m.v_b;
    return p;
  }
  // Fused: canonical row r of each part goes to its packed row.
  const std::int64_t E = m.embed_dim, F = E + 2 * m.kv_width;
  const bool has_bias = !m.q_b.empty();
  p.qkv_weight.resize(F * E);
  if (has_bias) p.qkv_bias.resize(F);
  const std::vector<float>* w_parts[3] = {&m.q_w, &m.k_w, &m.v_w};
  const std::vector<float>* b_parts[3] = {&m.q_b, &m.k_b, &m.v_b};
  for (int part = 0; part < 3; ++part) {
    const std::int64_t rows = part == 0 ? E : m.kv_width;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t dst = m.packed_row(part, r);
      std::copy_n(w_parts[part]->data() + r * E, E, p.qkv_weight.data() + dst * E);
      if (has_bias) p.qkv_bias[dst] = (*b_parts[part])[r];
    }
  }
  return p;
}

MultiHeadAttentionParams MultiHeadAttention::zero_grads() const {
  MultiHeadAttentionParams p = parameters();
  for (std::vector<float>* t : p.tensors()) std::fill(t->begin(), t->end(), 0.0f);
  return p;
}

void MultiHeadAttention::set_parameters(const MultiHeadAttentionParams& params) {
  Impl& m = *impl_;
  if (params.packing != m.packing) {
    throw Error("MultiHeadAttention::set_parameters: the parameters are of another packing than "
                "the layer's");
  }
  // The sizes parameters() returns, without building it.
  const bool fused = m.packing != QkvPacking::kSeparate;
  const std::size_t F = static_cast<std::size_t>(m.embed_dim + 2 * m.kv_width);
  const std::size_t E = static_cast<std::size_t>(m.embed_dim);
  const std::size_t bias = m.q_b.empty() ? 0 : 1;  // fused: one bias for q, k, v, or none
  const std::pair<const std::vector<float>*, std::size_t> checks[] = {
      {&params.qkv_weight, fused ? F * E : 0},      {&params.qkv_bias, fused ? bias * F : 0},
      {&params.q_weight, fused ? 0 : m.q_w.size()}, {&params.q_bias, fused ? 0 : m.q_b.size()},
      {&params.k_weight, fused ? 0 : m.k_w.size()}, {&params.k_bias, fused ? 0 : m.k_b.size()},
      {&params.v_weight, fused ? 0 : m.v_w.size()}, {&params.v_bias, fused ? 0 : m.v_b.size()},
      {&params.out_weight, m.out_w.size()},         {&params.out_bias, m.out_b.size()}};
  const char* names[] = {"qkv_weight", "qkv_bias", "q_weight", "q_bias",     "k_weight",
                         "k_bias",     "v_weight", "v_bias",   "out_weight", "out_bias"};
  for (int i = 0; i < 10; ++i) {
    if (checks[i].first->size() != checks[i].second) {
      throw Error(std::string("MultiHeadAttention::set_parameters: ") + names[i] + " has " +
                  std::to_string(checks[i].first->size()) + " elements, the layer's has " +
                  std::to_string(checks[i].second));
    }
  }
  m.canonicalize(params.weights());
  m.out_proj->set_weights(m.out_w, m.out_b);
  if (m.qkv_proj) {
    if (m.packing == QkvPacking::kFusedBlocks) {
      m.qkv_proj->set_weights(params.qkv_weight, params.qkv_bias);  // already [Wq; Wk; Wv]
    } else {
      const auto [w, b] = m.fused_qkv();
      m.qkv_proj->set_weights(w, b);
    }
  }
  if (m.q_proj) {  // the cross-attention projections, once built
    m.q_proj->set_weights(m.q_w, m.q_b);
    m.k_proj->set_weights(m.k_w, m.k_b);
    m.v_proj->set_weights(m.v_w, m.v_b);
  }
}

void MultiHeadAttention::forward_train(const float* x, std::int64_t batch, std::int64_t seq,
                                       float* out, const MhaOptions& options,
                                       MhaTape& tape) const {
  // x: [B, L, E] -> tape.qkv: [B, L, F] -> tape.ctx: [B, L, H, hd], tape.lse: [B, H, L]
  Impl& m = *impl_;
  m.check_self("forward_train");
  m.check_call("forward_train", x, out, batch, seq);
  if (options.attn_weights != nullptr || !options.mask.empty() || !options.bias.empty()) {
    throw Error("MultiHeadAttention::forward_train: attn_weights, mask and bias are not "
                "available in training (causal, window and key_lengths are)");
  }
  const std::int64_t F = m.embed_dim + 2 * m.kv_width, rows = batch * seq;
  tape.batch = batch;
  tape.seq = seq;
  tape.options = options;
  tape.key_lengths.assign(options.key_lengths.begin(), options.key_lengths.end());
  tape.options.key_lengths = tape.key_lengths;
  const bool bf16 = m.core_dtype() == DType::kBF16;
  tape.qkv.resize(bf16 ? 0 : static_cast<std::size_t>(rows * F));
  tape.qkv_bf16.resize(bf16 ? static_cast<std::size_t>(rows * F) : 0);
  tape.ctx.resize(static_cast<std::size_t>(rows * m.embed_dim));
  tape.lse.resize(static_cast<std::size_t>(batch * m.num_heads * seq));
  if (rows == 0) return;
  if (bf16) {
    m.qkv_proj->forward_to_bf16(x, rows, tape.qkv_bf16.data());
  } else {
    m.qkv_proj->forward(x, rows, tape.qkv.data());
  }
  const layers::ProjectedRows qkv = core_rows(tape, F);
  const AttentionParams params = layers::core_params(options, tape.key_lengths);
  attention(
      qkv.heads(0, m.num_heads, m.head_dim), qkv.heads(m.embed_dim, m.num_kv_heads, m.head_dim),
      qkv.heads(m.embed_dim + m.kv_width, m.num_kv_heads, m.head_dim),
      {.out = TensorView::contiguous(tape.ctx.data(), DType::kF32,
                                     {batch, seq, m.num_heads, m.head_dim}),
       .lse = TensorView::contiguous(tape.lse.data(), DType::kF32, {batch, m.num_heads, seq, 1})},
      params);
  m.out_proj->forward(tape.ctx.data(), rows, out);
}

void MultiHeadAttention::backward(const MhaTape& tape, const float* x, const float* d_out,
                                  float* dx, MultiHeadAttentionParams& grads) const {
  const Impl& m = *impl_;
  const std::int64_t batch = tape.batch, seq = tape.seq, rows = batch * seq;
  const std::int64_t E = m.embed_dim, F = E + 2 * m.kv_width, hd = m.head_dim;
  const std::int64_t kvw = m.kv_width;
  if (grads.packing != m.packing || grads.out_weight.size() != m.out_w.size()) {
    throw Error("MultiHeadAttention::backward: grads are not laid out as this layer's "
                "parameters (make them with zero_grads())");
  }
  if (static_cast<std::int64_t>(tape.qkv.size() + tape.qkv_bf16.size()) != rows * F) {
    throw Error("MultiHeadAttention::backward: the tape is not from this layer's forward_train");
  }
  if (rows == 0) return;
  if (x == nullptr || d_out == nullptr || dx == nullptr) {
    throw Error("MultiHeadAttention::backward: x, d_out and dx must not be null");
  }
  // The backward's buffers, reused from call to call (the layer's scratch).
  const layers::ScratchPool::Lease scratch(*m.scratch);
  // Output projection: d_ctx = d_out W_out; dW_out += d_out^T ctx.
  float* d_ctx = layers::scratch_floats(scratch->d_ctx, rows * E);
  m.out_proj->backward(tape.ctx.data(), rows, d_out, d_ctx, grads.out_weight.data(),
                       grads.out_bias.empty() ? nullptr : grads.out_bias.data());
  // The attention core, writing dq, dk and dv straight into the projection's gradient rows
  // [dq | dk | dv] (column ranges of one buffer, which the core's overlap check tells apart).
  float* d_qkv = layers::scratch_floats(scratch->d_qkv, rows * F);
  const layers::ProjectedRows d_rows{d_qkv, DType::kF32, batch, seq, F};
  const AttentionParams params = layers::core_params(tape.options, tape.key_lengths);
  const layers::ProjectedRows qkv = core_rows(tape, F);
  attention_backward(qkv.heads(0, m.num_heads, hd), qkv.heads(E, m.num_kv_heads, hd),
                     qkv.heads(E + kvw, m.num_kv_heads, hd),
                     TensorView::contiguous(const_cast<float*>(tape.ctx.data()), DType::kF32,
                                            {batch, seq, m.num_heads, hd}),
                     TensorView::contiguous(const_cast<float*>(tape.lse.data()), DType::kF32,
                                            {batch, m.num_heads, seq, 1}),
                     TensorView::contiguous(d_ctx, DType::kF32, {batch, seq, m.num_heads, hd}),
                     {.dq = d_rows.heads(0, m.num_heads, hd),
                      .dk = d_rows.heads(E, m.num_kv_heads, hd),
                      .dv = d_rows.heads(E + kvw, m.num_kv_heads, hd)},
                     params);
  // Its backward on the canonical [Wq; Wk; Wv]: straight into the gradients where they are in
  // that order (kFusedBlocks; the product accumulates into them), else into a buffer whose
  // rows are added into the packing's.
  const bool has_bias = !m.q_b.empty() || !m.k_b.empty() || !m.v_b.empty();
  if (m.packing == QkvPacking::kFusedBlocks) {
    m.qkv_proj->backward(x, rows, d_qkv, dx, grads.qkv_weight.data(),
                         has_bias ? grads.qkv_bias.data() : nullptr);
    return;
  }
  float* dw = layers::scratch_floats(scratch->d_w, F * E);
  float* db = layers::scratch_floats(scratch->d_b, F);
  layers::for_chunks(
      F * E, [&](std::int64_t begin, std::int64_t end) { std::fill(dw + begin, dw + end, 0.0f); });
  std::fill(db, db + F, 0.0f);
  m.qkv_proj->backward(x, rows, d_qkv, dx, dw, has_bias ? db : nullptr);
  // Canonical row c (part `part`, row r of it) added into its row of the packing, in blocks of
  // rows over the threads.
  const bool separate = m.packing == QkvPacking::kSeparate;
  std::vector<float>* w_parts[3] = {&grads.q_weight, &grads.k_weight, &grads.v_weight};
  std::vector<float>* b_parts[3] = {&grads.q_bias, &grads.k_bias, &grads.v_bias};
  constexpr std::int64_t kRows = 64;
  parallel_for((F + kRows - 1) / kRows, resolve_num_threads(0), [&](std::int64_t t, int) {
    for (std::int64_t c = t * kRows; c < std::min(F, (t + 1) * kRows); ++c) {
      const auto [part, r] = m.canonical_part(c);
      float* w_row = separate ? w_parts[part]->data() + r * E
                              : grads.qkv_weight.data() + m.packed_row(part, r) * E;
      for (std::int64_t e = 0; e < E; ++e) w_row[e] += dw[c * E + e];
      if (separate) {
        if (!b_parts[part]->empty()) (*b_parts[part])[r] += db[c];
      } else if (!grads.qkv_bias.empty()) {
        grads.qkv_bias[m.packed_row(part, r)] += db[c];
      }
    }
  });
}

}  // namespace qkv
