// The configuration of a BERT-family encoder stored as a Hugging Face folder:
//   config.json              BertConfig (the transformer's sizes and activation)
//   1_Pooling/config.json    PoolingConfig (sentence-transformers: how token vectors pool)
//   modules.json             whether a sentence_transformers.models.Normalize module follows
//
// Parsed with io/json.h. Every error throws qkv::Error starting with the file's path, e.g.
//   "config.json: missing field 'num_attention_heads'"
//   "config.json: field 'hidden_size' is a string, expected an integer"
// Fields this runner does not use (dropout, initializer_range, architectures, ...) are ignored.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace qkv::models {

enum class HiddenAct : std::uint8_t {
  kGelu,      // "gelu": x * Phi(x) with the exact erf form
  kGeluTanh,  // "gelu_new", "gelu_pytorch_tanh": the tanh approximation
  kRelu,      // "relu"
};

// "gelu", "gelu_tanh", "relu".
const char* hidden_act_name(HiddenAct act);

struct BertConfig {
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t max_position_embeddings = 0;
  std::int64_t type_vocab_size = 0;
  double layer_norm_eps = 0;
  HiddenAct hidden_act = HiddenAct::kGelu;
  std::optional<std::int64_t> pad_token_id;  // absent or null in config.json -> nullopt

  std::int64_t head_dim() const { return hidden_size / num_attention_heads; }
};

// Parses and validates config.json text; `where` (the path) starts every error message.
// Required: the seven sizes above (integers in 1 .. 2^31-1), layer_norm_eps (a number > 0),
// hidden_act (one of the names of HiddenAct). Optional: pad_token_id (0 <= id < vocab_size),
// position_embedding_type (only "absolute" is supported). hidden_size must be a multiple of
// num_attention_heads.
BertConfig parse_bert_config(std::string_view json_text, const std::string& where);
BertConfig read_bert_config(const std::string& path);

// sentence-transformers' pooling. With several modes on, sentence-transformers concatenates
// the pooled vectors in the order cls, max, mean.
struct PoolingConfig {
  bool cls_token = false;
  bool max_tokens = false;
  bool mean_tokens = false;
  std::optional<std::int64_t> word_embedding_dimension = {};  // checked against hidden_size later
};

// Requires pooling_mode_cls_token, pooling_mode_max_tokens and pooling_mode_mean_tokens
// (booleans, at least one true); other pooling_mode_* keys, when present, must be false
// (mean_sqrt_len, weightedmean, lasttoken are not supported).
PoolingConfig parse_pooling_config(std::string_view json_text, const std::string& where);
PoolingConfig read_pooling_config(const std::string& path);

// modules.json: an array of objects each with a string "type"; true when one of them is
// "sentence_transformers.models.Normalize" (the embedding is then L2-normalised).
bool parse_modules_normalize(std::string_view json_text, const std::string& where);
bool read_modules_normalize(const std::string& path);

// tokenizer_config.json (Hugging Face): how the WordPiece tokenizer normalises text. Every
// field is optional; absent or null fields keep BertTokenizer's defaults.
struct TokenizerConfig {
  bool do_lower_case = true;
  std::optional<bool> strip_accents;  // null/absent: the same as do_lower_case
  bool tokenize_chinese_chars = true;
  std::optional<std::int64_t> model_max_length;  // huge sentinel values (1e30) are ignored
};
TokenizerConfig parse_tokenizer_config(std::string_view json_text, const std::string& where);
TokenizerConfig read_tokenizer_config(const std::string& path);

// sentence_bert_config.json (sentence-transformers): max_seq_length, the token count (with
// [CLS] and [SEP]) texts are truncated to. Optional field; nullopt when absent or null.
std::optional<std::int64_t> parse_sentence_max_seq_length(std::string_view json_text,
                                                          const std::string& where);
std::optional<std::int64_t> read_sentence_max_seq_length(const std::string& path);

}  // namespace qkv::models
