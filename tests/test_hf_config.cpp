// config.json parsing: the pyllama-16m fixture, inline configs in the shapes
// Llama 2/3.1, Mistral, Qwen2, Qwen3 and transformers 5 write, and one test
// per kind of bad field.
#include "formats/hf_config.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "formats/input_error.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

using json = nlohmann::json;
constexpr const char* kFile = "models/x/config.json";

// A minimal valid Llama config; tests override or erase fields.
json base_config() {
  return {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", 32000},
      {"hidden_size", 4096},
      {"intermediate_size", 11008},
      {"num_hidden_layers", 32},
      {"num_attention_heads", 32},
      {"max_position_embeddings", 4096},
      {"rms_norm_eps", 1e-5},
      {"hidden_act", "silu"},
  };
}

ModelConfig parse(const json& config) { return parse_model_config(config.dump(), kFile); }

// what() of the InputError parsing `text` throws; fails the test otherwise.
std::string parse_error(const std::string& text) {
  try {
    parse_model_config(text, kFile);
  } catch (const InputError& error) {
    EXPECT_EQ(error.file(), kFile);
    return error.what();
  }
  ADD_FAILURE() << "expected an InputError for " << text;
  return "";
}
std::string parse_error(const json& config) { return parse_error(config.dump()); }

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

std::vector<int64_t> all_layers(int64_t layers, int64_t window) {
  return std::vector<int64_t>(static_cast<std::size_t>(layers), window);
}

// --- real and realistic configs ----------------------------------------------

TEST(HfConfig, LoadsPyllama16m) {
  const ModelConfig config = load_model_config(testing::pyllama_dir());
  EXPECT_EQ(config.architecture, Architecture::kLlama);
  EXPECT_EQ(config.model_type, "llama");
  EXPECT_EQ(config.vocab_size, 8192);
  EXPECT_EQ(config.hidden_size, 512);
  EXPECT_EQ(config.intermediate_size, 1024);
  EXPECT_EQ(config.num_layers, 5);
  EXPECT_EQ(config.num_heads, 4);
  EXPECT_EQ(config.num_kv_heads, 2);
  EXPECT_EQ(config.q_per_kv(), 2);
  EXPECT_EQ(config.head_dim, 128);
  EXPECT_EQ(config.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(config.rms_norm_eps, 1e-5);
  EXPECT_EQ(config.rope.type, RopeType::kDefault);
  EXPECT_DOUBLE_EQ(config.rope.theta, 500000.0);
  EXPECT_TRUE(config.tie_word_embeddings);
  EXPECT_FALSE(config.attention_bias);
  EXPECT_FALSE(config.qk_norm);
  EXPECT_EQ(config.layer_window, all_layers(5, 0));
  EXPECT_EQ(config.bos_token_id, 0);
  EXPECT_EQ(config.eos_token_id, 1);
  EXPECT_EQ(config.checkpoint_dtype, DType::kBF16);
  EXPECT_DOUBLE_EQ(config.kv_bytes_per_token(16), 5120.0);  // 2 * 5 * 2 * 128 * 2
  EXPECT_DOUBLE_EQ(config.kv_bytes_per_token(2), 640.0);
}

TEST(HfConfig, ParsesLlama31RopeScaling) {
  json config = base_config();
  config["num_key_value_heads"] = 8;
  config["max_position_embeddings"] = 131072;
  config["rope_theta"] = 500000.0;
  config["rope_scaling"] = {{"rope_type", "llama3"},
                            {"factor", 8.0},
                            {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0},
                            {"original_max_position_embeddings", 8192}};
  config["bos_token_id"] = 128000;
  config["eos_token_id"] = {128001, 128008, 128009};
  config["torch_dtype"] = "bfloat16";
  const ModelConfig parsed = parse(config);
  EXPECT_EQ(parsed.num_kv_heads, 8);
  EXPECT_EQ(parsed.q_per_kv(), 4);
  EXPECT_EQ(parsed.head_dim, 128);
  EXPECT_EQ(parsed.rope.type, RopeType::kLlama3);
  EXPECT_DOUBLE_EQ(parsed.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(parsed.rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(parsed.rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(parsed.rope.high_freq_factor, 4.0);
  EXPECT_EQ(parsed.rope.original_max_position_embeddings, 8192);
  EXPECT_EQ(parsed.bos_token_id, 128000);
  EXPECT_EQ(parsed.eos_token_id, 128001);
  EXPECT_EQ(rope_type_name(parsed.rope.type), "llama3");
}

TEST(HfConfig, ParsesLlama2LegacyDefaults) {
  json config = base_config();
  config["rope_scaling"] = nullptr;
  config["torch_dtype"] = "float16";
  const ModelConfig parsed = parse(config);
  EXPECT_EQ(parsed.num_kv_heads, 32);  // absent: one KV head per query head
  EXPECT_EQ(parsed.head_dim, 128);
  EXPECT_EQ(parsed.rope.type, RopeType::kDefault);
  EXPECT_DOUBLE_EQ(parsed.rope.theta, 10000.0);  // rope_theta absent
  EXPECT_FALSE(parsed.tie_word_embeddings);
  EXPECT_FALSE(parsed.bos_token_id.has_value());
  EXPECT_EQ(parsed.checkpoint_dtype, DType::kF16);
  EXPECT_EQ(parsed.layer_window, all_layers(32, 0));
  EXPECT_EQ(architecture_name(parsed.architecture), "LlamaForCausalLM");
}

TEST(HfConfig, ParsesLegacyLinearScaling) {
  json config = base_config();
  config["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  const ModelConfig parsed = parse(config);
  EXPECT_EQ(parsed.rope.type, RopeType::kLinear);
  EXPECT_DOUBLE_EQ(parsed.rope.factor, 2.0);
  EXPECT_EQ(rope_type_name(parsed.rope.type), "linear");
}

TEST(HfConfig, ParsesMistralSlidingWindow) {
  json config = base_config();
  config["architectures"] = {"MistralForCausalLM"};
  config["model_type"] = "mistral";
  config["num_key_value_heads"] = 8;
  config["sliding_window"] = 4096;
  config["max_position_embeddings"] = 32768;
  const ModelConfig parsed = parse(config);
  EXPECT_EQ(parsed.architecture, Architecture::kMistral);
  EXPECT_EQ(parsed.model_type, "mistral");
  EXPECT_EQ(parsed.layer_window, all_layers(32, 4096));
  EXPECT_FALSE(parsed.attention_bias);

  config["sliding_window"] = nullptr;  // Mistral v0.2 and later
  EXPECT_EQ(parse(config).layer_window, all_layers(32, 0));
}

json qwen2_config() {
  return {
      {"architectures", {"Qwen2ForCausalLM"}},
      {"model_type", "qwen2"},
      {"vocab_size", 151936},
      {"hidden_size", 896},
      {"intermediate_size", 4864},
      {"num_hidden_layers", 24},
      {"num_attention_heads", 14},
      {"num_key_value_heads", 2},
      {"max_position_embeddings", 32768},
      {"max_window_layers", 21},
      {"rms_norm_eps", 1e-6},
      {"rope_theta", 1000000.0},
      {"sliding_window", 32768},
      {"use_sliding_window", false},
      {"tie_word_embeddings", true},
      {"hidden_act", "silu"},
      {"bos_token_id", 151643},
      {"eos_token_id", 151643},
      {"torch_dtype", "bfloat16"},
  };
}

TEST(HfConfig, ParsesQwen2) {
  const ModelConfig parsed = parse(qwen2_config());
  EXPECT_EQ(parsed.architecture, Architecture::kQwen2);
  EXPECT_EQ(parsed.head_dim, 64);
  EXPECT_EQ(parsed.q_per_kv(), 7);
  EXPECT_TRUE(parsed.attention_bias);  // Qwen2 always has q/k/v biases
  EXPECT_FALSE(parsed.qk_norm);
  EXPECT_TRUE(parsed.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(parsed.rope.theta, 1e6);
  EXPECT_EQ(parsed.layer_window, all_layers(24, 0));  // use_sliding_window false
}

TEST(HfConfig, Qwen2SlidesFromMaxWindowLayersOn) {
  json config = qwen2_config();
  config["use_sliding_window"] = true;
  config["sliding_window"] = 4096;
  std::vector<int64_t> expected = all_layers(24, 0);
  for (std::size_t layer = 21; layer < 24; ++layer) expected[layer] = 4096;
  EXPECT_EQ(parse(config).layer_window, expected);
}

TEST(HfConfig, LayerTypesTakePrecedence) {
  json config = qwen2_config();
  config["num_hidden_layers"] = 4;
  config["use_sliding_window"] = true;
  config["sliding_window"] = 128;
  config["layer_types"] = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  EXPECT_EQ(parse(config).layer_window, (std::vector<int64_t>{128, 0, 128, 0}));

  config["layer_types"] = {"full_attention", "full_attention"};
  const auto message = parse_error(config);
  EXPECT_TRUE(Contains(message, "layer_types: a list of num_hidden_layers (4)"));

  config["layer_types"] = {"full_attention", "full_attention", "chunked_attention", "full_attention"};
  EXPECT_TRUE(Contains(parse_error(config), "layer_types: full_attention or sliding_attention"));
}

TEST(HfConfig, ParsesQwen3) {
  const json config = {
      {"architectures", {"Qwen3ForCausalLM"}},
      {"model_type", "qwen3"},
      {"vocab_size", 151936},
      {"hidden_size", 1024},
      {"intermediate_size", 3072},
      {"num_hidden_layers", 28},
      {"num_attention_heads", 16},
      {"num_key_value_heads", 8},
      {"head_dim", 128},
      {"max_position_embeddings", 40960},
      {"max_window_layers", 28},
      {"rms_norm_eps", 1e-6},
      {"rope_scaling", nullptr},
      {"rope_theta", 1000000},
      {"sliding_window", nullptr},
      {"use_sliding_window", false},
      {"attention_bias", false},
      {"tie_word_embeddings", true},
      {"hidden_act", "silu"},
      {"eos_token_id", 151645},
      {"torch_dtype", "bfloat16"},
  };
  const ModelConfig parsed = parse(config);
  EXPECT_EQ(parsed.architecture, Architecture::kQwen3);
  EXPECT_EQ(parsed.head_dim, 128);  // explicit, not 1024 / 16 = 64
  EXPECT_TRUE(parsed.qk_norm);
  EXPECT_FALSE(parsed.attention_bias);
  EXPECT_DOUBLE_EQ(parsed.rope.theta, 1e6);
  EXPECT_EQ(parsed.layer_window, all_layers(28, 0));
  EXPECT_EQ(parsed.kv_bytes_per_token(16), 2.0 * 28 * 8 * 128 * 2);
}

TEST(HfConfig, ParsesTransformers5RopeParameters) {
  json config = base_config();
  config["rope_theta"] = 1234.0;  // stale legacy value: rope_parameters wins
  config["rope_parameters"] = {{"rope_type", "llama3"},
                               {"rope_theta", 500000.0},
                               {"factor", 32.0},
                               {"low_freq_factor", 1.0},
                               {"high_freq_factor", 4.0},
                               {"original_max_position_embeddings", 8192}};
  config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  config["dtype"] = "float32";
  config["torch_dtype"] = "bfloat16";  // dtype wins, as in transformers 5
  const ModelConfig parsed = parse(config);
  EXPECT_EQ(parsed.rope.type, RopeType::kLlama3);
  EXPECT_DOUBLE_EQ(parsed.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(parsed.rope.factor, 32.0);
  EXPECT_EQ(parsed.checkpoint_dtype, DType::kF32);
}

TEST(HfConfig, AcceptsModelTypeWithoutArchitectures) {
  json config = qwen2_config();
  config.erase("architectures");
  EXPECT_EQ(parse(config).architecture, Architecture::kQwen2);
}

TEST(HfConfig, HeadDimNullFallsBackToDivision) {
  json config = base_config();
  config["head_dim"] = nullptr;
  EXPECT_EQ(parse(config).head_dim, 128);
}

// --- bad configs -------------------------------------------------------------

TEST(HfConfig, RejectsUnknownArchitecture) {
  json config = base_config();
  config["architectures"] = {"GPT2LMHeadModel"};
  const auto message = parse_error(config);
  EXPECT_TRUE(Contains(message, "architectures"));
  EXPECT_TRUE(Contains(message, "GPT2LMHeadModel"));
  EXPECT_TRUE(Contains(message, "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"));

  config.erase("architectures");
  config["model_type"] = "gemma";
  EXPECT_TRUE(Contains(parse_error(config), "model_type: one of llama, mistral, qwen2, qwen3; got gemma"));
}

TEST(HfConfig, RejectsUnsupportedRopeType) {
  json config = base_config();
  config["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_TRUE(Contains(parse_error(config), "rope_scaling.rope_type: one of default, linear, llama3; got yarn"));

  config["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
  EXPECT_TRUE(Contains(parse_error(config), "rope_scaling.type: one of default, linear, llama3; got dynamic"));

  config.erase("rope_scaling");
  config["rope_parameters"] = {{"rope_type", "longrope"}, {"rope_theta", 10000.0}};
  EXPECT_TRUE(Contains(parse_error(config), "rope_parameters.rope_type"));
}

TEST(HfConfig, RejectsIncompleteRopeScaling) {
  json config = base_config();
  config["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"high_freq_factor", 4.0}};
  EXPECT_TRUE(Contains(parse_error(config), "rope_scaling.low_freq_factor: a positive number; field missing"));
  config["rope_scaling"] = {{"type", "linear"}};
  EXPECT_TRUE(Contains(parse_error(config), "rope_scaling.factor"));
}

TEST(HfConfig, RejectsPartialRotary) {
  json config = base_config();
  config["partial_rotary_factor"] = 0.5;
  EXPECT_TRUE(Contains(parse_error(config), "partial_rotary_factor: 1.0"));
}

TEST(HfConfig, RejectsKvHeadsThatDoNotDivideHeads) {
  json config = base_config();
  config["num_key_value_heads"] = 5;
  EXPECT_TRUE(Contains(parse_error(config), "num_key_value_heads: a divisor of num_attention_heads (32), got 5"));
}

TEST(HfConfig, RejectsHiddenSizeNotDivisibleWithoutHeadDim) {
  json config = base_config();
  config["num_attention_heads"] = 24;  // 4096 / 24 is not whole
  EXPECT_TRUE(Contains(parse_error(config), "hidden_size: a multiple of num_attention_heads (24)"));
}

TEST(HfConfig, RejectsMissingRequiredField) {
  json config = base_config();
  config.erase("hidden_size");
  EXPECT_TRUE(Contains(parse_error(config), "hidden_size: a positive integer; field missing"));
}

TEST(HfConfig, RejectsWrongTypes) {
  json config = base_config();
  config["hidden_size"] = "4096";
  EXPECT_TRUE(Contains(parse_error(config), "hidden_size: an integer, got \"4096\""));

  config = base_config();
  config["num_hidden_layers"] = 32.5;
  EXPECT_TRUE(Contains(parse_error(config), "num_hidden_layers: an integer"));

  config = base_config();
  config["tie_word_embeddings"] = "yes";
  EXPECT_TRUE(Contains(parse_error(config), "tie_word_embeddings: true or false"));

  config = base_config();
  config["rms_norm_eps"] = "1e-5";
  EXPECT_TRUE(Contains(parse_error(config), "rms_norm_eps: a number"));
}

TEST(HfConfig, RejectsNonPositiveSizes) {
  for (const char* field : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"}) {
    json config = base_config();
    config[field] = 0;
    EXPECT_TRUE(Contains(parse_error(config), std::string(field) + ": a positive integer")) << field;
    config[field] = -4;
    EXPECT_TRUE(Contains(parse_error(config), std::string(field) + ": a positive integer")) << field;
  }
}

TEST(HfConfig, RejectsUnsupportedMlp) {
  json config = base_config();
  config["hidden_act"] = "gelu";
  EXPECT_TRUE(Contains(parse_error(config), "hidden_act: silu"));
  EXPECT_TRUE(Contains(parse_error(config), "got gelu"));

  config = base_config();
  config["mlp_bias"] = true;
  EXPECT_TRUE(Contains(parse_error(config), "mlp_bias: false"));
}

TEST(HfConfig, RejectsUnknownDtype) {
  json config = base_config();
  config["torch_dtype"] = "float64";
  EXPECT_TRUE(Contains(parse_error(config), "torch_dtype: one of float32, float16, bfloat16; got float64"));
}

TEST(HfConfig, RejectsMalformedJson) {
  const auto message = parse_error(std::string("{\"vocab_size\": 32000,"));
  EXPECT_TRUE(Contains(message, kFile));
  EXPECT_TRUE(Contains(message, "valid JSON"));
  EXPECT_TRUE(Contains(parse_error(std::string("[1, 2]")), "a JSON object"));
}

TEST(HfConfig, LoadRejectsDirectoryWithoutConfig) {
  const auto dir = testing::scratch_dir("cfg-missing");
  try {
    load_model_config(dir);
    ADD_FAILURE() << "expected an InputError";
  } catch (const InputError& error) {
    EXPECT_EQ(error.file(), (dir / "config.json").string());
  }
}

}  // namespace
}  // namespace kvforge
