// A BERT-family encoder (Hugging Face BertModel) built from qkv's layers:
//
//   ids [B, L] -> word[ids] + position[0..L) + token_type[0] -> LayerNorm      (embeddings)
//              -> num_hidden_layers x EncoderLayer (Post-LN, separate Q/K/V, hidden_act)
//              -> hidden [B, L, E]
//
// Weights come from model.safetensors with BertModel's names ("embeddings.word_embeddings.weight",
// "encoder.layer.N.attention.self.query.weight", ...), optionally under a "bert." prefix (as
// BertForMaskedLM & co. store them). f32, f16 and bf16 tensors are read (widened to f32); the
// layers copy what they need, so the file is closed after loading. The pooler is not used.
//
// Padding is expressed as per-sequence lengths: keys at or past lengths[b] are never attended,
// so padded positions cost no attention work and cannot change the real tokens' outputs.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "qkv/models/bert_config.h"
#include "qkv/layers/encoder_layer.h"
#include "qkv/layers/layer_norm.h"

namespace qkv::io {
class SafetensorsFile;
}

namespace qkv::models {

class BertModel {
 public:
  // Builds the model from `config` and the tensors of `weights`; throws qkv::Error naming the
  // file and tensor when one is missing or has the wrong shape or dtype. matmul_dtype: the
  // layers' products (EncoderLayerConfig::matmul_dtype): f32, or bf16 (weights rounded to bf16
  // once; activations before each product; embeddings, LayerNorm, softmax, GELU and
  // accumulation in f32).
  static BertModel from_safetensors(const BertConfig& config, const io::SafetensorsFile& weights,
                                    DType matmul_dtype = DType::kF32);

  const BertConfig& config() const { return config_; }
  std::int64_t hidden_size() const { return config_.hidden_size; }

  // ids: [batch, seq] row-major token ids; lengths: [batch], each in 1..seq (tokens at and past
  // lengths[b] are padding: their outputs are computed but attend nothing beyond the real
  // tokens, and no real token attends them).
  // hidden: [batch, seq, hidden_size], written.
  // Throws qkv::Error if seq > max_position_embeddings, an id is outside the vocabulary, or a
  // length is outside 1..seq. Safe to call from several threads at once.
  void forward(std::span<const std::int32_t> ids, std::span<const std::int64_t> lengths,
               std::int64_t batch, std::int64_t seq, float* hidden) const;

 private:
  BertModel(const BertConfig& config, std::vector<float> word_embeddings,
            std::vector<float> position_embeddings, std::vector<float> token_type_embedding,
            LayerNorm embeddings_norm, Encoder encoder);

  BertConfig config_;
  std::vector<float> word_embeddings_;      // [vocab_size, E]
  std::vector<float> position_embeddings_;  // [max_position_embeddings, E]
  std::vector<float> token_type_embedding_;  // [E]: token type 0 (single-segment inputs)
  LayerNorm embeddings_norm_;
  Encoder encoder_;  // its layers share one set of scratch buffers
};

}  // namespace qkv::models
