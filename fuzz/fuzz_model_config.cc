// The model-folder readers on arbitrary JSON text: config.json (BertConfig), 1_Pooling/config.json,
// modules.json, tokenizer_config.json and sentence_bert_config.json. Each returns validated
// values or throws qkv::Error.
#include <cstdlib>
#include <string_view>

#include "qkv/error.h"
#include "qkv/models/bert_config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace qkv::models;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const BertConfig c = parse_bert_config(text, "config.json");
    // What parse_bert_config promises (bert_config.h).
    if (c.hidden_size < 1 || c.num_attention_heads < 1 ||
        c.hidden_size % c.num_attention_heads != 0 || !(c.layer_norm_eps > 0)) {
      std::abort();
    }
  } catch (const qkv::Error&) {
  }
  try {
    (void)parse_pooling_config(text, "1_Pooling/config.json");
  } catch (const qkv::Error&) {
  }
  try {
    (void)parse_modules_normalize(text, "modules.json");
  } catch (const qkv::Error&) {
  }
  try {
    (void)parse_tokenizer_config(text, "tokenizer_config.json");
  } catch (const qkv::Error&) {
  }
  try {
    (void)parse_sentence_max_seq_length(text, "sentence_bert_config.json");
  } catch (const qkv::Error&) {
  }
  return 0;
}
