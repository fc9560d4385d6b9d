#include "formats/hf_config.h"
#include "formats/json_error_text.h"

#include <array>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "formats/input_error.h"

namespace kvforge {
namespace {

using json = nlohmann::json;

// Sizes beyond this are not a real model but a corrupt or hostile config;
// capping them keeps every product of two sizes far from int64 overflow.
constexpr int64_t kMaxSize = int64_t{1} << 31;

struct ArchitectureInfo {
  Architecture arch;
  std::string_view class_name;
  std::string_view model_type;
};

constexpr std::array<ArchitectureInfo, 4> kArchitectures{{
    {Architecture::kLlama, "LlamaForCausalLM", "llama"},
    {Architecture::kMistral, "MistralForCausalLM", "mistral"},
    {Architecture::kQwen2, "Qwen2ForCausalLM", "qwen2"},
    {Architecture::kQwen3, "Qwen3ForCausalLM", "qwen3"},
}};

const ArchitectureInfo& info(Architecture arch) {
  for (const auto& entry : kArchitectures) {
    if (entry.arch == arch) return entry;
  }
  return kArchitectures[0];
}

std::string supported_list(std::string_view ArchitectureInfo::*column) {
  std::string list;
  for (const auto& entry : kArchitectures) list += (list.empty() ? "" : ", ") + std::string(entry.*column);
  return list;
}


// Typed access to the fields of one JSON object. A field that is absent or
// null counts as not given (transformers treats both as "use the default").
// Every failure is an InputError naming the file and the field, with the
// field prefixed for nested objects ("rope_scaling.factor").
class FieldReader {
 public:
  FieldReader(const json& object, std::string file, std::string prefix = "")
      : object_(object), file_(std::move(file)), prefix_(std::move(prefix)) {}

  const std::string& file() const { return file_; }
  bool has_key(std::string_view key) const { return object_.contains(key); }

  const json* find(std::string_view key) const {
    const auto it = object_.find(key);
    return (it == object_.end() || it->is_null()) ? nullptr : &*it;
  }

  InputError error(std::string_view key, const std::string& expected) const {
    return InputError(file_, prefix_ + std::string(key), expected);
  }

  int64_t required_size(std::string_view key) const {
    const auto value = optional_size(key);
    if (!value) throw error(key, "a positive integer; field missing");
    return *value;
  }

  // Positive integer, capped at kMaxSize.
  std::optional<int64_t> optional_size(std::string_view key) const {
    const auto value = optional_int(key);
    if (value && (*value <= 0 || *value > kMaxSize)) {
      throw error(key, "a positive integer up to 2^31, got " + std::to_string(*value));
    }
    return value;
  }

  std::optional<int64_t> optional_non_negative(std::string_view key) const {
    const auto value = optional_int(key);
    if (value && *value < 0) throw error(key, "a non-negative integer, got " + std::to_string(*value));
    return value;
  }

  std::optional<int64_t> optional_int(std::string_view key) const {
    const json* value = find(key);
    if (value == nullptr) return std::nullopt;
    return as_int(*value, key);
  }

  std::optional<double> optional_positive_number(std::string_view key) const {
    const json* value = find(key);
    if (value == nullptr) return std::nullopt;
    if (!value->is_number()) throw error(key, "a number, got " + quote_json(*value));
    const auto number = value->get<double>();
    if (!std::isfinite(number) || number <= 0) throw error(key, "a positive number, got " + quote_json(*value));
    return number;
  }

  double required_positive_number(std::string_view key) const {
    const auto value = optional_positive_number(key);
    if (!value) throw error(key, "a positive number; field missing");
    return *value;
  }

  bool optional_bool(std::string_view key, bool fallback) const {
    const json* value = find(key);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) throw error(key, "true or false, got " + quote_json(*value));
    return value->get<bool>();
  }

  std::optional<std::string> optional_string(std::string_view key) const {
    const json* value = find(key);
    if (value == nullptr) return std::nullopt;
    if (!value->is_string()) throw error(key, "a string, got " + quote_json(*value));
    return value->get<std::string>();
  }

  // An integer that fits in int64 (nlohmann keeps positive values unsigned).
  int64_t as_int(const json& value, std::string_view key) const {
    const bool fits = value.is_number_integer() &&
                      (!value.is_number_unsigned() ||
                       value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
    if (!fits) throw error(key, "an integer, got " + quote_json(value));
    return value.get<int64_t>();
  }

 private:
  const json& object_;
  std::string file_;
  std::string prefix_;
};

Architecture parse_architecture(const FieldReader& config) {
  if (const json* archs = config.find("architectures")) {
    if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
      throw config.error("architectures", "a non-empty list of class names, got " + quote_json(*archs));
    }
    const auto name = (*archs)[0].get<std::string>();
    for (const auto& entry : kArchitectures) {
      if (entry.class_name == name) return entry.arch;
    }
    throw config.error("architectures", "one of " + supported_list(&ArchitectureInfo::class_name) + "; got " + name);
  }
  if (const auto type = config.optional_string("model_type")) {
    for (const auto& entry : kArchitectures) {
      if (entry.model_type == *type) return entry.arch;
    }
    throw config.error("model_type", "one of " + supported_list(&ArchitectureInfo::model_type) + "; got " + *type);
  }
  throw config.error("architectures", "one of " + supported_list(&ArchitectureInfo::class_name) +
                                          "; neither architectures nor model_type is given");
}

// transformers' defaults where config.json omits the field.
int64_t default_max_position_embeddings(Architecture arch) {
  switch (arch) {
    case Architecture::kLlama: return 2048;
    case Architecture::kMistral: return 4096 * 32;
    case Architecture::kQwen2:
    case Architecture::kQwen3: return 32768;
  }
  return 2048;
}

int64_t parse_num_kv_heads(const FieldReader& config, int64_t num_heads) {
  const int64_t kv_heads = config.optional_size("num_key_value_heads").value_or(num_heads);
  if (num_heads % kv_heads != 0) {
    throw config.error("num_key_value_heads", "a divisor of num_attention_heads (" + std::to_string(num_heads) +
                                                  "), got " + std::to_string(kv_heads));
  }
  return kv_heads;
}

int64_t parse_head_dim(const FieldReader& config, Architecture arch, int64_t hidden_size, int64_t num_heads) {
  if (const auto head_dim = config.optional_size("head_dim")) return *head_dim;
  // Qwen3Config declares head_dim = 128 as its default, so only an explicit
  // null falls back to the division there.
  if (arch == Architecture::kQwen3 && !config.has_key("head_dim")) return 128;
  if (hidden_size % num_heads != 0) {
    throw config.error("hidden_size", "a multiple of num_attention_heads (" + std::to_string(num_heads) +
                                          ") when head_dim is not given, got " + std::to_string(hidden_size));
  }
  return hidden_size / num_heads;
}

void check_full_rotary(const FieldReader& reader) {
  const auto factor = reader.optional_positive_number("partial_rotary_factor");
  if (factor && *factor != 1.0) {
    throw reader.error("partial_rotary_factor",
                       "1.0 (partial rotary embeddings are not supported), got " + std::to_string(*factor));
  }
}

void check_low_below_high(const FieldReader& params, const RopeConfig& rope) {
  if (rope.high_freq_factor <= rope.low_freq_factor) {
    throw params.error("high_freq_factor", "greater than low_freq_factor (" + std::to_string(rope.low_freq_factor) +
                                               "), got " + std::to_string(rope.high_freq_factor));
  }
}

// RoPE from transformers 5's `rope_parameters`, else the legacy `rope_theta`
// plus optional `rope_scaling` (whose type key was once "type").
RopeConfig parse_rope(const FieldReader& config, int64_t max_position_embeddings) {
  check_full_rotary(config);
  RopeConfig rope;
  rope.theta = config.optional_positive_number("rope_theta").value_or(rope.theta);

  std::string source = "rope_parameters";
  const json* params = config.find(source);
  if (params == nullptr) {
    source = "rope_scaling";
    params = config.find(source);
  }
  if (params == nullptr) return rope;
  if (!params->is_object()) throw config.error(source, "an object, got " + quote_json(*params));
  for (const auto& [key, value] : params->items()) {
    if (value.is_object()) {
      throw config.error(source, "one set of RoPE parameters (per-layer-type RoPE is not supported), got key " + key);
    }
  }

  const FieldReader p(*params, config.file(), source + ".");
  check_full_rotary(p);
  rope.theta = p.optional_positive_number("rope_theta").value_or(rope.theta);
  const std::string type_key = p.find("rope_type") != nullptr ? "rope_type" : "type";
  const std::string type = p.optional_string(type_key).value_or("default");

  if (type == "default") {
    rope.type = RopeType::kDefault;
  } else if (type == "linear") {
    rope.type = RopeType::kLinear;
    rope.factor = p.required_positive_number("factor");
  } else if (type == "llama3") {
    rope.type = RopeType::kLlama3;
    rope.factor = p.required_positive_number("factor");
    rope.low_freq_factor = p.required_positive_number("low_freq_factor");
    rope.high_freq_factor = p.required_positive_number("high_freq_factor");
    check_low_below_high(p, rope);
    // transformers falls back to max_position_embeddings when it is absent.
    const auto original = p.optional_size("original_max_position_embeddings");
    rope.original_max_position_embeddings =
        original ? *original
                 : config.optional_size("original_max_position_embeddings").value_or(max_position_embeddings);
  } else {
    throw p.error(type_key, "one of default, linear, llama3; got " + type + " (unsupported RoPE type)");
  }
  return rope;
}

// Mistral: one window (or none) for every layer; transformers defaults an
// absent sliding_window to 4096 and null to none.
std::vector<int64_t> mistral_windows(const FieldReader& config, int64_t num_layers) {
  const int64_t window = config.has_key("sliding_window") ? config.optional_size("sliding_window").value_or(0) : 4096;
  return std::vector<int64_t>(static_cast<std::size_t>(num_layers), window);
}

// Qwen2/Qwen3, following transformers: the window exists only with
// use_sliding_window; explicit layer_types choose the sliding layers, else
// layers from max_window_layers on slide. A "sliding_attention" layer
// without a window attends fully, as in transformers.
std::vector<int64_t> qwen_windows(const FieldReader& config, int64_t num_layers) {
  const bool use_window = config.optional_bool("use_sliding_window", false);
  const int64_t declared = config.has_key("sliding_window") ? config.optional_size("sliding_window").value_or(0) : 4096;
  const int64_t window = use_window ? declared : 0;

  std::vector<int64_t> windows;
  if (const json* types = config.find("layer_types")) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != num_layers) {
      throw config.error("layer_types", "a list of num_hidden_layers (" + std::to_string(num_layers) +
                                            ") layer types, got " + quote_json(*types));
    }
    for (const auto& type : *types) {
      if (type == "full_attention") {
        windows.push_back(0);
      } else if (type == "sliding_attention") {
        windows.push_back(window);
      } else {
        throw config.error("layer_types", "full_attention or sliding_attention for every layer, got " +
                                              quote_json(type));
      }
    }
    return windows;
  }
  const int64_t first_sliding = config.optional_non_negative("max_window_layers").value_or(28);
  for (int64_t layer = 0; layer < num_layers; ++layer) windows.push_back(layer >= first_sliding ? window : 0);
  return windows;
}

std::vector<int64_t> parse_layer_windows(const FieldReader& config, Architecture arch, int64_t num_layers) {
  switch (arch) {
    case Architecture::kMistral: return mistral_windows(config, num_layers);
    case Architecture::kQwen2:
    case Architecture::kQwen3: return qwen_windows(config, num_layers);
    case Architecture::kLlama: break;  // LlamaConfig has no sliding window
  }
  return std::vector<int64_t>(static_cast<std::size_t>(num_layers), 0);
}

// q/k/v biases as the transformers model classes build them.
bool parse_attention_bias(const FieldReader& config, Architecture arch) {
  switch (arch) {
    case Architecture::kQwen2: return true;      // Qwen2Attention: always bias=True
    case Architecture::kMistral: return false;   // MistralAttention: always bias=False
    case Architecture::kLlama:
    case Architecture::kQwen3: return config.optional_bool("attention_bias", false);
  }
  return false;
}

void check_mlp(const FieldReader& config) {
  const auto act = config.optional_string("hidden_act").value_or("silu");
  if (act != "silu") throw config.error("hidden_act", "silu (the only supported MLP activation), got " + act);
  if (config.optional_bool("mlp_bias", false)) {
    throw config.error("mlp_bias", "false (MLP biases are not supported), got true");
  }
}

std::optional<int64_t> parse_token_id(const FieldReader& config, std::string_view key) {
  const json* value = config.find(key);
  if (value == nullptr) return std::nullopt;
  if (value->is_array()) {  // several end tokens: the first is the canonical one
    if (value->empty()) return std::nullopt;
    value = &(*value)[0];
  }
  const int64_t id = config.as_int(*value, key);
  if (id < 0) throw config.error(key, "a non-negative token id, got " + std::to_string(id));
  return id;
}

// transformers 5 writes "dtype", older versions "torch_dtype".
DType parse_checkpoint_dtype(const FieldReader& config) {
  const std::string key = config.find("dtype") != nullptr ? "dtype" : "torch_dtype";
  const auto name = config.optional_string(key);
  if (!name || *name == "bfloat16") return DType::kBF16;
  if (*name == "float32") return DType::kF32;
  if (*name == "float16") return DType::kF16;
  throw config.error(key, "one of float32, float16, bfloat16; got " + *name);
}

json parse_json_object(const std::string& text, const std::string& file) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& error) {
    throw InputError(file, "", "valid JSON; " + parse_error_text(error));
  }
  if (!root.is_object()) throw InputError(file, "", "a JSON object, got " + quote_json(root));
  return root;
}

}  // namespace

std::string architecture_name(Architecture arch) { return std::string(info(arch).class_name); }

std::string rope_type_name(RopeType type) {
  switch (type) {
    case RopeType::kDefault: return "default";
    case RopeType::kLinear: return "linear";
    case RopeType::kLlama3: return "llama3";
  }
  return "?";
}

double ModelConfig::kv_bytes_per_token(double bits) const {
  // K and V, each num_kv_heads x head_dim elements per layer.
  return 2.0 * static_cast<double>(num_layers) * static_cast<double>(num_kv_heads) *
         static_cast<double>(head_dim) * bits / 8.0;
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& file_for_errors) {
  const json root = parse_json_object(json_text, file_for_errors);
  const FieldReader config(root, file_for_errors);

  ModelConfig model;
  model.architecture = parse_architecture(config);
  model.model_type = std::string(info(model.architecture).model_type);
  model.vocab_size = config.required_size("vocab_size");
  model.hidden_size = config.required_size("hidden_size");
  model.intermediate_size = config.required_size("intermediate_size");
  model.num_layers = config.required_size("num_hidden_layers");
  model.num_heads = config.required_size("num_attention_heads");
  model.num_kv_heads = parse_num_kv_heads(config, model.num_heads);
  model.head_dim = parse_head_dim(config, model.architecture, model.hidden_size, model.num_heads);
  model.max_position_embeddings = config.optional_size("max_position_embeddings")
                                      .value_or(default_max_position_embeddings(model.architecture));
  model.rms_norm_eps = config.optional_positive_number("rms_norm_eps").value_or(model.rms_norm_eps);
  model.rope = parse_rope(config, model.max_position_embeddings);
  model.tie_word_embeddings = config.optional_bool("tie_word_embeddings", false);
  model.attention_bias = parse_attention_bias(config, model.architecture);
  model.qk_norm = model.architecture == Architecture::kQwen3;
  check_mlp(config);
  model.layer_window = parse_layer_windows(config, model.architecture, model.num_layers);
  model.bos_token_id = parse_token_id(config, "bos_token_id");
  model.eos_token_id = parse_token_id(config, "eos_token_id");
  model.checkpoint_dtype = parse_checkpoint_dtype(config);
  return model;
}

ModelConfig load_model_config(const std::filesystem::path& model_dir) {
  const auto path = model_dir / "config.json";
  std::ifstream in(path, std::ios::binary);
  if (!std::filesystem::is_regular_file(path) || !in.is_open()) {
    throw InputError(path.string(), "", "a readable config.json in the model directory");
  }
  std::ostringstream text;
  text << in.rdbuf();
  return parse_model_config(text.str(), path.string());
}

}  // namespace kvforge
