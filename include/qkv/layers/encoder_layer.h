// EncoderLayer and Encoder: the transformer encoder block (the seed's
// TransformerEncoderLayer; torch.nn.TransformerEncoderLayer; BERT's layer).
//
//   x: [B, L, E], updated in place.
//   Post-LN (norm_first = false):  x = LN1(x + Drop(MHA(x)));  x = LN2(x + Drop(FFN(x)))
//   Pre-LN  (norm_first = true):   x = x + Drop(MHA(LN1(x)));  x = x + Drop(FFN(LN2(x)))
//   FFN(h) = Linear2(Drop(act(Linear1(h))))   Linear1: [d_ff, E], Linear2: [E, d_ff]
//
// Dropout runs only in training mode (set_training(true, seed)): a counter-based RNG keyed by
// (seed, step, site, element index), so the same seed and step give the same mask whatever the
// thread count; step counts forward() calls since set_training. Inference: dropout is a no-op.
// Threads: in inference mode one object may be shared by threads (each concurrent call borrows
// a scratch set of its own; layers/scratch.h). In training mode calls advance the dropout step,
// so a training object belongs to one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "qkv/layers/activation.h"
#include "qkv/layers/layer_norm.h"
#include "qkv/layers/multi_head_attention.h"

namespace qkv {

struct EncoderLayerConfig {
  std::int64_t embed_dim = 512, num_heads = 8, num_kv_heads = 0, d_ff = 2048;
  Activation activation = Activation::kGeluErf;  // kRelu, kGeluTanh also
  bool norm_first = false;  // false = Post-LN (the seed's and BERT's); true = Pre-LN
  float eps = 1e-5f;
  float dropout = 0.1f;  // used only when training; in [0, 1)
  // The products of the attention (its projections and its core: MultiHeadAttentionConfig's
  // matmul_dtype) and of the FFN: kF32, or kBF16 (LayerNorm, softmax, GELU and accumulation
  // stay f32). kBF16 also trains (mixed precision): backward runs its products in bf16 too
  // (Linear::backward, attention_backward), the gradients are f32.
  DType matmul_dtype = DType::kF32;
};

// Spans are copied at construction.
//   norm*_gamma/beta: [E]   ff1_weight: [d_ff, E]   ff1_bias: [d_ff]   ff2_weight: [E, d_ff]
//   ff2_bias: [E]  (biases may be empty)
struct EncoderLayerWeights {
  MultiHeadAttentionWeights attention = {};
  std::span<const float> norm1_gamma = {}, norm1_beta = {}, ff1_weight = {}, ff1_bias = {},
                         ff2_weight = {}, ff2_bias = {}, norm2_gamma = {}, norm2_beta = {};
};

// An EncoderLayer's parameters, or their gradients, as owned vectors (EncoderLayerWeights's
// fields; the attention's in its packing's layout).
struct EncoderLayerParams {
  MultiHeadAttentionParams attention = {};
  std::vector<float> norm1_gamma = {}, norm1_beta = {}, ff1_weight = {}, ff1_bias = {},
                     ff2_weight = {}, ff2_bias = {}, norm2_gamma = {}, norm2_beta = {};
  EncoderLayerWeights weights() const;  // spans over the vectors
  // The non-empty vectors, in a fixed order (an optimizer walks them).
  std::vector<std::vector<float>*> tensors();
};

// What forward_train keeps for backward: the layer's input, the sub-layers' inputs and
// outputs after dropout, the FFN's pre-activation, and the attention's tape.
struct EncoderLayerTape {
  std::int64_t batch = 0, seq = 0;
  std::uint64_t step = 0;  // the dropout step of the call
  MhaTape attention;
  std::vector<float> x0, n1, a, x1, n2, h, g, f;
  // bf16 products without dropout on the hidden activations: g as bf16 bits instead (the
  // rounding ff2 applies to it anyway; g stays empty).
  std::vector<std::uint16_t> g_bf16;
};

class EncoderLayer {
 public:
  EncoderLayer(const EncoderLayerConfig& config, const EncoderLayerWeights& weights);
  ~EncoderLayer();
  EncoderLayer(EncoderLayer&&) noexcept;
  EncoderLayer& operator=(EncoderLayer&&) noexcept;

  const EncoderLayerConfig& config() const;

  // x: [B, L, E] in place. options.key_lengths: per-batch valid tokens (padding is never
  // attended; padded rows are computed but meaningless). options.attn_weights is passed to
  // the attention sub-layer.
  void forward(float* x, std::int64_t batch, std::int64_t seq,
               const MhaOptions& options = {}) const;

  // Use `other`'s scratch buffers (its attention's too) from now on; both layers must then
  // never run at the same time. Encoder shares one set among its layers.
  void share_scratch_with(const EncoderLayer& other);

  // Training mode: dropout with a seeded counter-based RNG (after the attention, the
  // activation and the FFN, and on the attention probabilities, each with p = config.dropout);
  // resets the step counter to 0.
  void set_training(bool training, std::uint64_t seed = 0);
  bool training() const;

  // Training (encoder_layer_train.cc): forward() that keeps in `tape` what backward needs
  // (options: no mask, bias or attn_weights). Dropout as forward() applies it.
  void forward_train(float* x, std::int64_t batch, std::int64_t seq, const MhaOptions& options,
                     EncoderLayerTape& tape) const;
  // dx: on entry dL/d(the layer's output), on return dL/d(its input), [B, L, E]; the
  // parameters' gradients are ADDED to `grads` (start from zero_grads()). The same dropout
  // masks as the tape's forward.
  void backward(const EncoderLayerTape& tape, float* dx, EncoderLayerParams& grads) const;
  EncoderLayerParams parameters() const;
  EncoderLayerParams zero_grads() const;
  // An optimizer's step: the same shapes as parameters().
  void set_parameters(const EncoderLayerParams& params);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A stack of EncoderLayers plus an optional final LayerNorm (Pre-LN stacks usually have one).
class Encoder {
 public:
  explicit Encoder(std::vector<EncoderLayer> layers,
                   std::optional<LayerNorm> final_norm = std::nullopt);

  std::int64_t num_layers() const { return static_cast<std::int64_t>(layers_.size()); }
  EncoderLayer& layer(std::int64_t i) { return layers_[i]; }

  // x: [B, L, E] in place; options go to every layer (attn_weights: to the last layer only).
  void forward(float* x, std::int64_t batch, std::int64_t seq,
               const MhaOptions& options = {}) const;

  // Sets every layer; layer i uses seed + i so layers draw different masks.
  void set_training(bool training, std::uint64_t seed = 0);

 private:
  std::vector<EncoderLayer> layers_;
  std::optional<LayerNorm> final_norm_;
};

}  // namespace qkv
