// EncoderLayer's training half (qkv/layers/encoder_layer.h). forward_train runs what forward()
// runs, unfused where backward needs the pieces (Linear1 without its activation, the residual
// add apart from LayerNorm), and keeps them; backward walks them in reverse:
//
//   Post-LN  x1 = LN1(a + x0), a = Drop(MHA(x0));  out = LN2(f + x1), f = Drop(FFN(x1))
//   Pre-LN   x1 = x0 + a, a = Drop(MHA(LN1(x0)));  out = x1 + f, f = Drop(FFN(LN2(x1)))
//   FFN(n) = Linear2(g), g = Drop(act(h)), h = Linear1(n)
//
// Dropout's backward is dropout of the gradient with the same stream (qkv/layers/dropout.h).
#include <algorithm>
#include <string>
#include <vector>

#include "layers/encoder_layer_impl.h"
#include "layers/layer_kernels.h"
#include "qkv/error.h"
#include "qkv/layers/activation.h"
#include "qkv/layers/encoder_layer.h"

namespace qkv {
namespace {

using enum layers::Site;

std::span<const float> span_of(const std::vector<float>& v) { return {v.data(), v.size()}; }

void add(float* x, const std::vector<float>& a) { layers::add_in_place(x, a.data(), a.size()); }

}  // namespace

EncoderLayerWeights EncoderLayerParams::weights() const {
  return {.attention = attention.weights(),
          .norm1_gamma = span_of(norm1_gamma),
          .norm1_beta = span_of(norm1_beta),
          .ff1_weight = span_of(ff1_weight),
          .ff1_bias = span_of(ff1_bias),
          .ff2_weight = span_of(ff2_weight),
          .ff2_bias = span_of(ff2_bias),
          .norm2_gamma = span_of(norm2_gamma),
          .norm2_beta = span_of(norm2_beta)};
}

std::vector<std::vector<float>*> EncoderLayerParams::tensors() {
  std::vector<std::vector<float>*> all = attention.tensors();
  for (std::vector<float>* t : {&norm1_gamma, &norm1_beta, &ff1_weight, &ff1_bias, &ff2_weight,
                                &ff2_bias, &norm2_gamma, &norm2_beta}) {
    if (!t->empty()) all.push_back(t);
  }
  return all;
}

EncoderLayerParams EncoderLayer::parameters() const {
  const Impl& m = *impl_;
  auto vec = [](std::span<const float> s) { return std::vector<float>(s.begin(), s.end()); };
  return {.attention = m.attention.parameters(),
          .norm1_gamma = vec(m.norm1.gamma()),
          .norm1_beta = vec(m.norm1.beta()),
          .ff1_weight = m.ff1.weight(),
          .ff1_bias = m.ff1.bias(),
          .ff2_weight = m.ff2.weight(),
          .ff2_bias = m.ff2.bias(),
          .norm2_gamma = vec(m.norm2.gamma()),
          .norm2_beta = vec(m.norm2.beta())};
}

EncoderLayerParams EncoderLayer::zero_grads() const {
  EncoderLayerParams p = parameters();
  for (std::vector<float>* t : p.tensors()) std::fill(t->begin(), t->end(), 0.0f);
  return p;
}

void EncoderLayer::set_parameters(const EncoderLayerParams& params) {
  Impl& m = *impl_;
  // Each sub-layer checks its own shapes; prefix the layer's name.
  try {
    m.attention.set_parameters(params.attention);
    m.norm1.set_affine(params.norm1_gamma, params.norm1_beta);
    m.norm2.set_affine(params.norm2_gamma, params.norm2_beta);
    m.ff1.set_weights(params.ff1_weight, params.ff1_bias);
    m.ff2.set_weights(params.ff2_weight, params.ff2_bias);
  } catch (const Error& e) {
    throw Error(std::string("EncoderLayer::set_parameters: ") + e.what());
  }
}

void EncoderLayer::forward_train(float* x, std::int64_t batch, std::int64_t seq,
                                 const MhaOptions& options, EncoderLayerTape& t) const {
  // x: [B, L, E] in place
  Impl& m = *impl_;
  if (batch < 0 || seq < 0) {
    throw Error("EncoderLayer::forward_train: batch = " + std::to_string(batch) +
                " and seq = " + std::to_string(seq) + " must be >= 0");
  }
  const std::int64_t rows = batch * seq, E = m.config.embed_dim, F = m.config.d_ff;
  if (rows > 0 && x == nullptr) throw Error("EncoderLayer::forward_train: x is null");
  t.batch = batch;
  t.seq = seq;
  t.step = m.step;
  const auto n = static_cast<std::size_t>(rows * E), nf = static_cast<std::size_t>(rows * F);
  t.x0.resize(n);
  layers::copy_floats(x, t.x0.data(), rows * E);
  t.a.resize(n);
  t.x1.resize(n);
  t.h.resize(nf);
  t.f.resize(n);
  const MhaOptions attention_options = m.attention_options(options, t.step);
  // g as bf16 bits (Impl::hidden_as_bf16), made with the activation in one pass.
  const bool g_as_bf16 = m.hidden_as_bf16();
  t.g.resize(g_as_bf16 ? 0 : nf);
  t.g_bf16.resize(g_as_bf16 ? nf : 0);
  auto ffn = [&](const float* in) {  // t.h, t.g or t.g_bf16, t.f from the FFN's input
    m.ff1.forward_linear(in, rows, t.h.data());
    if (g_as_bf16) {
      layers::for_chunks(rows * F, [&](std::int64_t begin, std::int64_t end) {
        layers::activation_to_bf16_kernel(m.config.activation, t.h.data() + begin,
                                          t.g_bf16.data() + begin, end - begin);
      });
      m.ff2.forward_from_bf16(t.g_bf16.data(), rows, t.f.data());
    } else {
      apply_activation(m.config.activation, t.h.data(), t.g.data(), rows * F);
      m.dropout_at(t.g.data(), rows * F, kAfterActivation, t.step);
      m.ff2.forward(t.g.data(), rows, t.f.data());
    }
    m.dropout_at(t.f.data(), rows * E, kAfterFeedForward, t.step);
  };
  if (!m.config.norm_first) {
    m.attention.forward_train(t.x0.data(), batch, seq, t.a.data(), attention_options, t.attention);
    m.dropout_at(t.a.data(), rows * E, kAfterAttention, t.step);
    m.norm1.forward(t.a.data(), t.x0.data(), rows, t.x1.data());
    ffn(t.x1.data());
    m.norm2.forward(t.f.data(), t.x1.data(), rows, x);
  } else {
    t.n1.resize(n);
    t.n2.resize(n);
    m.norm1.forward(t.x0.data(), nullptr, rows, t.n1.data());
    m.attention.forward_train(t.n1.data(), batch, seq, t.a.data(), attention_options, t.attention);
    m.dropout_at(t.a.data(), rows * E, kAfterAttention, t.step);
    layers::copy_floats(t.x0.data(), t.x1.data(), rows * E);
    add(t.x1.data(), t.a);
    m.norm2.forward(t.x1.data(), nullptr, rows, t.n2.data());
    ffn(t.n2.data());
    layers::copy_floats(t.x1.data(), x, rows * E);
    add(x, t.f);
  }
  if (m.training) ++m.step;
}

void EncoderLayer::backward(const EncoderLayerTape& t, float* dx, EncoderLayerParams& g) const {
  const Impl& m = *impl_;
  const std::int64_t rows = t.batch * t.seq, E = m.config.embed_dim, F = m.config.d_ff;
  if (static_cast<std::int64_t>(t.x0.size()) != rows * E || g.ff1_weight.size() != static_cast<std::size_t>(F * E) ||
      g.norm1_gamma.size() != static_cast<std::size_t>(E)) {
    throw Error("EncoderLayer::backward: the tape or the grads are not this layer's (make them "
                "with forward_train and zero_grads)");
  }
  if (rows == 0) return;
  if (dx == nullptr) throw Error("EncoderLayer::backward: dx is null");
  const std::int64_t n = rows * E;
  const layers::ScratchPool::Lease scratch(*m.scratch);
  float* d_g = layers::scratch_floats(scratch->d_hidden, rows * F);
  float* d_in = layers::scratch_floats(scratch->d_in, n);
  float* d_sub = layers::scratch_floats(scratch->d_sub, n);
  auto nullable = [](std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  // dL/d(FFN input) into d_in, from d_f = dL/d(f) (overwritten).
  auto ffn_backward = [&](const float* in, float* d_f) {
    m.dropout_at(d_f, rows * E, kAfterFeedForward, t.step);
    if (!t.g_bf16.empty()) {
      m.ff2.backward_from_bf16(t.g_bf16.data(), rows, d_f, d_g, g.ff2_weight.data(),
                               nullable(g.ff2_bias));
    } else {
      m.ff2.backward(t.g.data(), rows, d_f, d_g, g.ff2_weight.data(), nullable(g.ff2_bias));
    }
    m.dropout_at(d_g, rows * F, kAfterActivation, t.step);
    activation_backward(m.config.activation, t.h.data(), d_g, d_g, rows * F);
    m.ff1.backward(in, rows, d_g, d_in, g.ff1_weight.data(), nullable(g.ff1_bias));
  };
  // dL/d(attention input) into d_in, from d_a = dL/d(a) (overwritten).
  auto attention_backward = [&](const float* in, float* d_a) {
    m.dropout_at(d_a, rows * E, kAfterAttention, t.step);
    m.attention.backward(t.attention, in, d_a, d_in, g.attention);
  };
  if (!m.config.norm_first) {
    // out = LN2(f + x1): dz2 = dL/d(f) = the residual's share of dL/d(x1).
    float* dz = layers::scratch_floats(scratch->d_z, n);
    m.norm2.backward(t.f.data(), t.x1.data(), rows, dx, dz, g.norm2_gamma.data(),
                     g.norm2_beta.data());
    layers::copy_floats(dz, d_sub, n);
    ffn_backward(t.x1.data(), d_sub);
    layers::add_in_place(dz, d_in, n);  // dL/d(x1)
    // x1 = LN1(a + x0)
    m.norm1.backward(t.a.data(), t.x0.data(), rows, dz, dz, g.norm1_gamma.data(),
                     g.norm1_beta.data());
    layers::copy_floats(dz, d_sub, n);
    attention_backward(t.x0.data(), d_sub);
    layers::copy_floats(dz, dx, n);
    layers::add_in_place(dx, d_in, n);
  } else {
    // out = x1 + f: dL/d(x1) = dx + LN2's backward of dL/d(n2).
    layers::copy_floats(dx, d_sub, n);
    ffn_backward(t.n2.data(), d_sub);
    m.norm2.backward(t.x1.data(), nullptr, rows, d_in, d_in, g.norm2_gamma.data(),
                     g.norm2_beta.data());
    layers::add_in_place(dx, d_in, n);  // dL/d(x1)
    // x1 = x0 + a: dL/d(x0) = dL/d(x1) + LN1's backward of dL/d(n1).
    layers::copy_floats(dx, d_sub, n);
    attention_backward(t.n1.data(), d_sub);
    m.norm1.backward(t.x0.data(), nullptr, rows, d_in, d_in, g.norm1_gamma.data(),
                     g.norm1_beta.data());
    layers::add_in_place(dx, d_in, n);
  }
}

}  // namespace qkv
