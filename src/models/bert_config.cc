#include "qkv/models/bert_config.h"

#include <limits>

#include "io/json.h"
#include "qkv/error.h"

namespace qkv::models {

namespace {

using io::JsonValue;

constexpr std::int64_t kMaxSize = std::numeric_limits<std::int32_t>::max();

// Typed field access on a JSON object, with messages that name the file and the field.
class Fields {
 public:
  Fields(const JsonValue& object, const std::string& where) : object_(object), where_(where) {
    if (!object.is_object()) {
      fail(std::string("top level is ") + io::json_kind_name(object.kind()) +
           ", expected an object");
    }
  }

  [[noreturn]] void fail(const std::string& what) const { throw Error(where_ + ": " + what); }

  const JsonValue* optional(const char* name) const { return object_.find(name); }
  const JsonValue& required(const char* name) const {
    const JsonValue* value = object_.find(name);
    if (value == nullptr) fail(std::string("missing field '") + name + "'");
    return *value;
  }

  [[noreturn]] void wrong_type(const char* name, const JsonValue& value,
                               const char* expected) const {
    std::string found = io::json_kind_name(value.kind());
    if (value.is_number()) found += " " + value.string();
    if (value.is_string()) found += " \"" + value.string() + "\"";
    fail(std::string("field '") + name + "' is " + found + ", expected " + expected);
  }

  std::int64_t integer(const char* name, const JsonValue& value, std::int64_t min,
                       std::int64_t max) const {
    if (!value.is_integer()) wrong_type(name, value, "an integer");
    if (value.integer() < min || value.integer() > max) {
      fail(std::string("field '") + name + "' is " + std::to_string(value.integer()) +
           ", expected " + std::to_string(min) + " .. " + std::to_string(max));
    }
    return value.integer();
  }
  std::int64_t positive(const char* name) const {
    return integer(name, required(name), 1, kMaxSize);
  }
  bool boolean(const char* name, const JsonValue& value) const {
    if (!value.is_bool()) wrong_type(name, value, "true or false");
    return value.boolean();
  }
  const std::string& string(const char* name, const JsonValue& value) const {
    if (!value.is_string()) wrong_type(name, value, "a string");
    return value.string();
  }

 private:
  const JsonValue& object_;
  const std::string& where_;
};

BertConfig bert_config_from_json(const JsonValue& json, const std::string& where) {
  const Fields fields(json, where);
  BertConfig config;
  config.vocab_size = fields.positive("vocab_size");
  config.hidden_size = fields.positive("hidden_size");
  config.num_hidden_layers = fields.positive("num_hidden_layers");
  config.num_attention_heads = fields.positive("num_attention_heads");
  config.intermediate_size = fields.positive("intermediate_size");
  config.max_position_embeddings = fields.positive("max_position_embeddings");
  config.type_vocab_size = fields.positive("type_vocab_size");

  const JsonValue& eps = fields.required("layer_norm_eps");
  if (!eps.is_number()) fields.wrong_type("layer_norm_eps", eps, "a number");
  if (!(eps.number() > 0) || eps.number() == std::numeric_limits<double>::infinity()) {
    fields.fail("field 'layer_norm_eps' is " + eps.string() + ", expected a finite number > 0");
  }
  config.layer_norm_eps = eps.number();

  const std::string& act = fields.string("hidden_act", fields.required("hidden_act"));
  if (act == "gelu") {
    config.hidden_act = HiddenAct::kGelu;
  } else if (act == "gelu_new" || act == "gelu_pytorch_tanh") {
    config.hidden_act = HiddenAct::kGeluTanh;
  } else if (act == "relu") {
    config.hidden_act = HiddenAct::kRelu;
  } else {
    fields.fail("field 'hidden_act' is \"" + act +
                "\", expected \"gelu\", \"gelu_new\", \"gelu_pytorch_tanh\" or \"relu\"");
  }

  if (const JsonValue* pad = fields.optional("pad_token_id"); pad != nullptr && !pad->is_null()) {
    config.pad_token_id = fields.integer("pad_token_id", *pad, 0, config.vocab_size - 1);
  }
  if (const JsonValue* type = fields.optional("position_embedding_type"); type != nullptr) {
    const std::string& name = fields.string("position_embedding_type", *type);
    if (name != "absolute") {
      fields.fail("field 'position_embedding_type' is \"" + name +
                  "\"; only \"absolute\" is supported");
    }
  }

  if (config.hidden_size % config.num_attention_heads != 0) {
    fields.fail("hidden_size " + std::to_string(config.hidden_size) +
                " is not a multiple of num_attention_heads " +
                std::to_string(config.num_attention_heads));
  }
  return config;
}

PoolingConfig pooling_config_from_json(const JsonValue& json, const std::string& where) {
  const Fields fields(json, where);
  PoolingConfig config;
  config.cls_token =
      fields.boolean("pooling_mode_cls_token", fields.required("pooling_mode_cls_token"));
  config.max_tokens =
      fields.boolean("pooling_mode_max_tokens", fields.required("pooling_mode_max_tokens"));
  config.mean_tokens =
      fields.boolean("pooling_mode_mean_tokens", fields.required("pooling_mode_mean_tokens"));
  for (const char* name : {"pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                           "pooling_mode_lasttoken"}) {
    const JsonValue* value = fields.optional(name);
    if (value != nullptr && fields.boolean(name, *value)) {
      fields.fail(std::string("field '") + name +
                  "' is true; only cls, max and mean pooling are supported");
    }
  }
  if (!config.cls_token && !config.max_tokens && !config.mean_tokens) {
    fields.fail(
        "no pooling mode is on (pooling_mode_cls_token, pooling_mode_max_tokens and "
        "pooling_mode_mean_tokens are all false)");
  }
  if (const JsonValue* dim = fields.optional("word_embedding_dimension"); dim != nullptr) {
    config.word_embedding_dimension = fields.integer("word_embedding_dimension", *dim, 1, kMaxSize);
  }
  return config;
}

bool modules_normalize_from_json(const JsonValue& json, const std::string& where) {
  if (!json.is_array()) {
    throw Error(where + ": top level is " + io::json_kind_name(json.kind()) +
                ", expected an array of modules");
  }
  bool normalize = false;
  for (std::size_t i = 0; i < json.array().size(); ++i) {
    const JsonValue& module = json.array()[i];
    const std::string at = where + ": module " + std::to_string(i);
    if (!module.is_object()) {
      throw Error(at + " is " + io::json_kind_name(module.kind()) + ", expected an object");
    }
    const Fields fields(module, at);
    const std::string& type = fields.string("type", fields.required("type"));
    normalize = normalize || type == "sentence_transformers.models.Normalize";
  }
  return normalize;
}

TokenizerConfig tokenizer_config_from_json(const JsonValue& json, const std::string& where) {
  const Fields fields(json, where);
  TokenizerConfig config;
  const auto optional_bool = [&](const char* name) -> std::optional<bool> {
    const JsonValue* value = fields.optional(name);
    if (value == nullptr || value->is_null()) return std::nullopt;
    return fields.boolean(name, *value);
  };
  config.do_lower_case = optional_bool("do_lower_case").value_or(true);
  config.strip_accents = optional_bool("strip_accents");
  config.tokenize_chinese_chars = optional_bool("tokenize_chinese_chars").value_or(true);
  // transformers writes int(1e30) for "no limit"; anything past int32 means the same here.
  if (const JsonValue* max = fields.optional("model_max_length"); max != nullptr) {
    if (max->is_integer() && max->integer() >= 1 && max->integer() <= kMaxSize) {
      config.model_max_length = max->integer();
    } else if (!max->is_number() && !max->is_null()) {
      fields.wrong_type("model_max_length", *max, "an integer");
    }
  }
  return config;
}

std::optional<std::int64_t> sentence_max_seq_length_from_json(const JsonValue& json,
                                                              const std::string& where) {
  const Fields fields(json, where);
  const JsonValue* value = fields.optional("max_seq_length");
  if (value == nullptr || value->is_null()) return std::nullopt;
  return fields.integer("max_seq_length", *value, 2, kMaxSize);
}

}  // namespace

const char* hidden_act_name(HiddenAct act) {
  switch (act) {
    case HiddenAct::kGelu:
      return "gelu";
    case HiddenAct::kGeluTanh:
      return "gelu_tanh";
    case HiddenAct::kRelu:
      return "relu";
  }
  return "?";
}

BertConfig parse_bert_config(std::string_view json_text, const std::string& where) {
  return bert_config_from_json(io::parse_json(json_text, where), where);
}
BertConfig read_bert_config(const std::string& path) {
  return bert_config_from_json(io::read_json_file(path), path);
}

PoolingConfig parse_pooling_config(std::string_view json_text, const std::string& where) {
  return pooling_config_from_json(io::parse_json(json_text, where), where);
}
PoolingConfig read_pooling_config(const std::string& path) {
  return pooling_config_from_json(io::read_json_file(path), path);
}

bool parse_modules_normalize(std::string_view json_text, const std::string& where) {
  return modules_normalize_from_json(io::parse_json(json_text, where), where);
}
bool read_modules_normalize(const std::string& path) {
  return modules_normalize_from_json(io::read_json_file(path), path);
}

TokenizerConfig parse_tokenizer_config(std::string_view json_text, const std::string& where) {
  return tokenizer_config_from_json(io::parse_json(json_text, where), where);
}
TokenizerConfig read_tokenizer_config(const std::string& path) {
  return tokenizer_config_from_json(io::read_json_file(path), path);
}

std::optional<std::int64_t> parse_sentence_max_seq_length(std::string_view json_text,
                                                          const std::string& where) {
  return sentence_max_seq_length_from_json(io::parse_json(json_text, where), where);
}
std::optional<std::int64_t> read_sentence_max_seq_length(const std::string& path) {
  return sentence_max_seq_length_from_json(io::read_json_file(path), path);
}

}  // namespace qkv::models
