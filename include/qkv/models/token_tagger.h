// TokenTagger: a small trainable transformer encoder that gives every token a class: token and
// learned position embeddings, Pre-LN EncoderLayers (qkv/layers/encoder_layer.h), a final
// LayerNorm and a Linear head. What `qkv train-demo` trains (docs/training.md): sorting digit
// sequences (non-causal), or copying one under a causal mask.
//
//   tokens: [B, L] int32 in [0, vocab)  ->  logits: [B, L, num_classes]   (L <= max_seq)
//
// Training runs each layer's forward_train / backward, cross_entropy and AdamW
// (qkv/layers/loss.h, adamw.h). The weights save to and load from one .safetensors file, the
// config in its metadata.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "qkv/layers/adamw.h"
#include "qkv/tensor.h"

namespace qkv {

struct TokenTaggerConfig {
  std::int64_t vocab = 10, num_classes = 10, max_seq = 16;
  std::int64_t embed_dim = 128, num_heads = 4, num_layers = 2, d_ff = 512;
  bool causal = false;   // causal self-attention (the copy task)
  float dropout = 0.0f;  // in every layer when training
  // The encoder layers' matrix products: kF32, or kBF16 (mixed precision: every projection,
  // FFN and attention product in bf16, forward and backward, on AMX where the CPU has it;
  // the parameters, the optimizer, LayerNorm, softmax and every sum stay f32). Not saved: a
  // run-time choice (load takes it).
  DType matmul_dtype = DType::kF32;
};

// What one training step did.
struct TrainStepResult {
  double loss = 0;               // mean cross-entropy over the counted tokens
  std::int64_t correct = 0;      // counted tokens whose argmax logit is the target
  std::int64_t counted = 0;      // tokens with a target (not ignore_index)
};

class TokenTagger {
 public:
  // Random initial weights from `seed` (normal, std 0.02; LayerNorm gamma 1, beta 0).
  TokenTagger(const TokenTaggerConfig& config, std::uint64_t seed);
  // A file written by save(); throws qkv::Error naming the path and the tensor or key.
  static TokenTagger load(const std::string& path, DType matmul_dtype = DType::kF32);
  ~TokenTagger();
  TokenTagger(TokenTagger&&) noexcept;
  TokenTagger& operator=(TokenTagger&&) noexcept;

  const TokenTaggerConfig& config() const;
  std::int64_t num_parameters() const;

  // Inference (no dropout). tokens: [B, L], logits: [B, L, num_classes].
  void forward(const std::int32_t* tokens, std::int64_t batch, std::int64_t seq,
               float* logits) const;
  // One step of AdamW on the mean cross-entropy of the logits against targets ([B, L]; -100 =
  // no target), with dropout if config.dropout > 0 (seeded by `seed` and the step).
  TrainStepResult train_step(const std::int32_t* tokens, const std::int32_t* targets,
                             std::int64_t batch, std::int64_t seq, AdamW& optimizer,
                             std::uint64_t seed = 0);

  // Writes every weight as F32 with the config as metadata (via a temporary file renamed into
  // place).
  void save(const std::string& path) const;

 private:
  TokenTagger();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace qkv
