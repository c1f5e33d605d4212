// Tests of the model-folder configuration readers (src/models/bert_config.h): config.json of
// all-MiniLM-L6-v2 and each of its errors, sentence-transformers' pooling config and
// modules.json, and (when QKV_MODEL_DIR is set) the real files of that model.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <tuple>

#include "expect_error.h"
#include "qkv/models/bert_config.h"
#include "qkv/error.h"

namespace qkv::models {
namespace {

using qkv::testing::expect_error;

// all-MiniLM-L6-v2's config.json (fields this runner ignores included), as raw JSON values.
std::map<std::string, std::string> minilm_fields() {
  return {{"_name_or_path", R"("nreimers/MiniLM-L6-H384-uncased")"},
          {"architectures", R"(["BertModel"])"},
          {"attention_probs_dropout_prob", "0.1"},
          {"gradient_checkpointing", "false"},
          {"hidden_act", R"("gelu")"},
          {"hidden_dropout_prob", "0.1"},
          {"hidden_size", "384"},
          {"initializer_range", "0.02"},
          {"intermediate_size", "1536"},
          {"layer_norm_eps", "1e-12"},
          {"max_position_embeddings", "512"},
          {"model_type", R"("bert")"},
          {"num_attention_heads", "12"},
          {"num_hidden_layers", "6"},
          {"pad_token_id", "0"},
          {"position_embedding_type", R"("absolute")"},
          {"transformers_version", R"("4.8.2")"},
          {"type_vocab_size", "2"},
          {"use_cache", "true"},
          {"vocab_size", "30522"}};
}

std::string to_json(const std::map<std::string, std::string>& fields) {
  std::string text = "{\n";
  for (const auto& [key, value] : fields) {
    text += (text.size() > 2 ? ",\n  \"" : "  \"") + key + "\": " + value;
  }
  return text + "\n}\n";
}

// The MiniLM config with `key` set to `value` (raw JSON), or removed when value is nullopt.
std::string minilm_with(const std::string& key, std::optional<std::string> value) {
  auto fields = minilm_fields();
  if (value) {
    fields[key] = *value;
  } else {
    fields.erase(key);
  }
  return to_json(fields);
}

TEST(BertConfigTest, ParsesMiniLmConfig) {
  const BertConfig config = parse_bert_config(to_json(minilm_fields()), "config.json");
  EXPECT_EQ(config.vocab_size, 30522);
  EXPECT_EQ(config.hidden_size, 384);
  EXPECT_EQ(config.num_hidden_layers, 6);
  EXPECT_EQ(config.num_attention_heads, 12);
  EXPECT_EQ(config.head_dim(), 32);
  EXPECT_EQ(config.intermediate_size, 1536);
  EXPECT_EQ(config.max_position_embeddings, 512);
  EXPECT_EQ(config.type_vocab_size, 2);
  EXPECT_EQ(config.layer_norm_eps, 1e-12);
  EXPECT_EQ(config.hidden_act, HiddenAct::kGelu);
  EXPECT_EQ(config.pad_token_id, 0);
}

TEST(BertConfigTest, ActivationsAndOptionalFields) {
  const std::pair<const char*, HiddenAct> acts[] = {
      {R"("gelu")", HiddenAct::kGelu},
      {R"("gelu_new")", HiddenAct::kGeluTanh},
      {R"("gelu_pytorch_tanh")", HiddenAct::kGeluTanh},
      {R"("relu")", HiddenAct::kRelu}};
  for (const auto& [name, act] : acts) {
    EXPECT_EQ(parse_bert_config(minilm_with("hidden_act", name), "c").hidden_act, act) << name;
  }
  EXPECT_STREQ(hidden_act_name(HiddenAct::kGeluTanh), "gelu_tanh");
  EXPECT_FALSE(parse_bert_config(minilm_with("pad_token_id", std::nullopt), "c").pad_token_id);
  EXPECT_FALSE(parse_bert_config(minilm_with("pad_token_id", "null"), "c").pad_token_id);
  EXPECT_EQ(parse_bert_config(minilm_with("pad_token_id", "30521"), "c").pad_token_id, 30521);
  EXPECT_NO_THROW(parse_bert_config(minilm_with("position_embedding_type", std::nullopt), "c"));
  EXPECT_EQ(parse_bert_config(minilm_with("layer_norm_eps", "0.00001"), "c").layer_norm_eps, 1e-5);
}

TEST(BertConfigTest, MissingFields) {
  for (const char* field : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size", "max_position_embeddings", "type_vocab_size",
                            "layer_norm_eps", "hidden_act"}) {
    expect_error([&] { parse_bert_config(minilm_with(field, std::nullopt), "config.json"); },
                 std::string("config.json: missing field '") + field + "'");
  }
}

TEST(BertConfigTest, WrongTypesAndValues) {
  const std::tuple<const char*, const char*, const char*> cases[] = {
      {"hidden_size", R"("384")", "field 'hidden_size' is a string \"384\", expected an integer"},
      {"hidden_size", "384.0", "field 'hidden_size' is a number 384.0, expected an integer"},
      {"num_hidden_layers", "[6]", "field 'num_hidden_layers' is an array, expected an integer"},
      {"vocab_size", "null", "field 'vocab_size' is null, expected an integer"},
      {"num_attention_heads", "true", "field 'num_attention_heads' is a boolean"},
      {"num_hidden_layers", "0", "field 'num_hidden_layers' is 0, expected 1 .. 2147483647"},
      {"intermediate_size", "-1536", "field 'intermediate_size' is -1536, expected 1 .. "},
      {"vocab_size", "4294967296", "field 'vocab_size' is 4294967296, expected 1 .. 2147483647"},
      {"layer_norm_eps", R"("1e-12")",
       "field 'layer_norm_eps' is a string \"1e-12\", expected a "
       "number"},
      {"layer_norm_eps", "0", "field 'layer_norm_eps' is 0, expected a finite number > 0"},
      {"layer_norm_eps", "-1e-12", "field 'layer_norm_eps' is -1e-12, expected a finite number"},
      {"layer_norm_eps", "1e999", "field 'layer_norm_eps' is 1e999, expected a finite number"},
      {"hidden_act", R"("silu")",
       "field 'hidden_act' is \"silu\", expected \"gelu\", "
       "\"gelu_new\", \"gelu_pytorch_tanh\" or \"relu\""},
      {"hidden_act", "1", "field 'hidden_act' is a number 1, expected a string"},
      {"pad_token_id", "30522", "field 'pad_token_id' is 30522, expected 0 .. 30521"},
      {"pad_token_id", R"("0")", "field 'pad_token_id' is a string \"0\", expected an integer"},
      {"position_embedding_type", R"("relative_key")",
       "field 'position_embedding_type' is \"relative_key\"; only \"absolute\" is supported"},
      {"num_attention_heads", "7", "hidden_size 384 is not a multiple of num_attention_heads 7"},
  };
  for (const auto& [field, value, expected] : cases) {
    SCOPED_TRACE(std::string(field) + " = " + value);
    // Init-captures: clang 14 cannot capture structured bindings themselves.
    expect_error([&, field = field, value = value] {
                   parse_bert_config(minilm_with(field, value), "config.json");
                 },
                 std::string("config.json: ") + expected);
  }
}

TEST(BertConfigTest, DocumentErrors) {
  expect_error([] { parse_bert_config("[]", "config.json"); },
               "config.json: top level is an array, expected an object");
  expect_error([] { parse_bert_config("{\"hidden_size\": 384,}", "config.json"); },
               "config.json: invalid JSON at line 1, column 21");
  expect_error([] { read_bert_config("/nonexistent/dir/config.json"); },
               "/nonexistent/dir/config.json: cannot open");
}

// ---------------------------------------------------------------------------------------------
// sentence-transformers: 1_Pooling/config.json and modules.json.

constexpr char kMiniLmPooling[] = R"({
  "word_embedding_dimension": 384,
  "pooling_mode_cls_token": false,
  "pooling_mode_mean_tokens": true,
  "pooling_mode_max_tokens": false,
  "pooling_mode_mean_sqrt_len_tokens": false
})";

TEST(PoolingConfigTest, ParsesMiniLmPooling) {
  const PoolingConfig config = parse_pooling_config(kMiniLmPooling, "p");
  EXPECT_TRUE(config.mean_tokens);
  EXPECT_FALSE(config.cls_token);
  EXPECT_FALSE(config.max_tokens);
  EXPECT_EQ(config.word_embedding_dimension, 384);

  const PoolingConfig several = parse_pooling_config(
      R"({"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": true,
          "pooling_mode_max_tokens": true, "pooling_mode_weightedmean_tokens": false,
          "pooling_mode_lasttoken": false, "include_prompt": true})",
      "p");
  EXPECT_TRUE(several.cls_token && several.mean_tokens && several.max_tokens);
  EXPECT_FALSE(several.word_embedding_dimension);
}

TEST(PoolingConfigTest, Errors) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"pooling_mode_cls_token": false, "pooling_mode_max_tokens": false})",
       "pooling.json: missing field 'pooling_mode_mean_tokens'"},
      {R"({"pooling_mode_cls_token": 0, "pooling_mode_max_tokens": false,
           "pooling_mode_mean_tokens": true})",
       "pooling.json: field 'pooling_mode_cls_token' is a number 0, expected true or false"},
      {R"({"pooling_mode_cls_token": false, "pooling_mode_max_tokens": false,
           "pooling_mode_mean_tokens": false})",
       "pooling.json: no pooling mode is on"},
      {R"({"pooling_mode_cls_token": false, "pooling_mode_max_tokens": false,
           "pooling_mode_mean_tokens": false, "pooling_mode_mean_sqrt_len_tokens": true})",
       "pooling.json: field 'pooling_mode_mean_sqrt_len_tokens' is true; only cls, max and mean"},
      {R"({"pooling_mode_cls_token": true, "pooling_mode_max_tokens": false,
           "pooling_mode_mean_tokens": false, "word_embedding_dimension": "384"})",
       "pooling.json: field 'word_embedding_dimension' is a string \"384\", expected an integer"},
      {"true", "pooling.json: top level is a boolean, expected an object"},
  };
  for (const auto& [text, expected] : cases) {
    SCOPED_TRACE(text);
    expect_error([&, text = text] { parse_pooling_config(text, "pooling.json"); }, expected);
  }
}

TEST(PoolingConfigTest, ModulesNormalize) {
  constexpr char kMiniLmModules[] = R"([
  {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
  {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
  {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
])";
  EXPECT_TRUE(parse_modules_normalize(kMiniLmModules, "modules.json"));
  EXPECT_FALSE(parse_modules_normalize(
      R"([{"type": "sentence_transformers.models.Transformer"},
          {"type": "sentence_transformers.models.Pooling"}])",
      "modules.json"));
  EXPECT_FALSE(parse_modules_normalize("[]", "modules.json"));
  expect_error([] { parse_modules_normalize("{}", "modules.json"); },
               "modules.json: top level is an object, expected an array of modules");
  expect_error([] { parse_modules_normalize(R"([{"type": "x"}, {"path": ""}])", "modules.json"); },
               "modules.json: module 1: missing field 'type'");
  expect_error([] { parse_modules_normalize(R"([{"type": "x"}, 3])", "modules.json"); },
               "modules.json: module 1 is a number, expected an object");
}

TEST(TokenizerConfigTest, DefaultsAndFields) {
  const TokenizerConfig minilm = parse_tokenizer_config(
      R"({"do_lower_case": true, "unk_token": "[UNK]", "tokenize_chinese_chars": true,
          "strip_accents": null, "model_max_length": 512})",
      "tokenizer_config.json");
  EXPECT_TRUE(minilm.do_lower_case);
  EXPECT_FALSE(minilm.strip_accents.has_value());
  EXPECT_TRUE(minilm.tokenize_chinese_chars);
  EXPECT_EQ(minilm.model_max_length, 512);

  const TokenizerConfig cased = parse_tokenizer_config(
      R"({"do_lower_case": false, "strip_accents": true, "tokenize_chinese_chars": false,
          "model_max_length": 1000000000000000019884624838656})",
      "tokenizer_config.json");
  EXPECT_FALSE(cased.do_lower_case);
  EXPECT_EQ(cased.strip_accents, true);
  EXPECT_FALSE(cased.tokenize_chinese_chars);
  EXPECT_FALSE(cased.model_max_length.has_value());  // transformers' "no limit" sentinel

  const TokenizerConfig empty = parse_tokenizer_config("{}", "tokenizer_config.json");
  EXPECT_TRUE(empty.do_lower_case);
  expect_error([] { parse_tokenizer_config(R"({"do_lower_case": "yes"})", "t.json"); },
               "t.json: field 'do_lower_case' is a string \"yes\", expected true or false");
  expect_error([] { parse_tokenizer_config(R"({"model_max_length": "512"})", "t.json"); },
               "t.json: field 'model_max_length' is a string \"512\", expected an integer");
}

TEST(SentenceBertConfigTest, MaxSeqLength) {
  EXPECT_EQ(parse_sentence_max_seq_length(R"({"max_seq_length": 256, "do_lower_case": false})",
                                          "s.json"),
            256);
  EXPECT_FALSE(parse_sentence_max_seq_length("{}", "s.json").has_value());
  expect_error([] { parse_sentence_max_seq_length(R"({"max_seq_length": 1})", "s.json"); },
               "s.json: field 'max_seq_length' is 1, expected 2 .. 2147483647");
}

// The real all-MiniLM-L6-v2 files, when a model folder is given (see docs/model-files.md).
TEST(BertConfigModelTest, ReadsAllMiniLmL6V2) {
  const char* dir = std::getenv("QKV_MODEL_DIR");
  if (dir == nullptr) GTEST_SKIP() << "QKV_MODEL_DIR is not set";
  const std::string root(dir);
  const BertConfig config = read_bert_config(root + "/config.json");
  EXPECT_EQ(config.vocab_size, 30522);
  EXPECT_EQ(config.hidden_size, 384);
  EXPECT_EQ(config.num_hidden_layers, 6);
  EXPECT_EQ(config.num_attention_heads, 12);
  EXPECT_EQ(config.intermediate_size, 1536);
  EXPECT_EQ(config.hidden_act, HiddenAct::kGelu);
  EXPECT_EQ(config.layer_norm_eps, 1e-12);
  const PoolingConfig pooling = read_pooling_config(root + "/1_Pooling/config.json");
  EXPECT_TRUE(pooling.mean_tokens && !pooling.cls_token && !pooling.max_tokens);
  EXPECT_EQ(pooling.word_embedding_dimension, 384);
  EXPECT_TRUE(read_modules_normalize(root + "/modules.json"));
}

}  // namespace
}  // namespace qkv::models
