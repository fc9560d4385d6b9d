#pragma once
// Hugging Face config.json for the Llama family: LlamaForCausalLM (Llama 2
// and 3), MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM. Anything
// else, or an option kvforge does not implement, is an InputError that names
// it.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "formats/dtype.h"

namespace kvforge {

enum class Architecture { kLlama, kMistral, kQwen2, kQwen3 };
std::string architecture_name(Architecture arch);  // "LlamaForCausalLM", ...

enum class RopeType { kDefault, kLinear, kLlama3 };
std::string rope_type_name(RopeType type);  // "default", "linear", "llama3"

struct RopeConfig {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;                           // linear, llama3
  double low_freq_factor = 1.0;                  // llama3
  double high_freq_factor = 4.0;                 // llama3
  int64_t original_max_position_embeddings = 0;  // llama3
};

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  std::string model_type;  // "llama", "mistral", "qwen2", "qwen3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;  // explicit in config.json, else hidden_size / num_heads
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v biases (Qwen2 always; Llama optional)
  bool qk_norm = false;         // Qwen3 q_norm / k_norm over head_dim
  // Per layer: 0 for full causal attention, else the sliding window (tokens a
  // query may see, itself included), from sliding_window / layer_types.
  std::vector<int64_t> layer_window;
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> eos_token_id;
  DType checkpoint_dtype = DType::kBF16;  // torch_dtype / dtype

  // Derived.
  int64_t q_per_kv() const { return num_heads / num_kv_heads; }
  // Bytes of K and V for one token across all layers at `bits` per element.
  double kv_bytes_per_token(double bits) const;
};

ModelConfig parse_model_config(const std::string& json_text, const std::string& file_for_errors);
ModelConfig load_model_config(const std::filesystem::path& model_dir);  // reads model_dir/config.json

}  // namespace kvforge
