// kvforge info: what a checkpoint is and what its KV cache costs.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <iostream>

#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "tools/commands.h"

namespace kvforge::cli {
namespace {

struct InfoFlags {
  std::string model_dir;
  int64_t context = 0;
  bool json = false;
};

int64_t count_parameters(const Checkpoint& checkpoint, const ModelConfig& config) {
  int64_t count = 0;
  for (const auto& name : checkpoint.names()) {
    // A tied lm_head stored anyway is the embedding counted twice.
    if (config.tie_word_embeddings && name == "lm_head.weight") continue;
    count += checkpoint.tensor(name).numel();
  }
  return count;
}

nlohmann::json describe(const std::filesystem::path& dir, int64_t context) {
  const ModelConfig config = load_model_config(dir);
  const Checkpoint checkpoint(dir);
  nlohmann::json rope = {{"type", rope_type_name(config.rope.type)}, {"theta", config.rope.theta}};
  if (config.rope.type != RopeType::kDefault) rope["factor"] = config.rope.factor;
  if (config.rope.type == RopeType::kLlama3) {
    rope["low_freq_factor"] = config.rope.low_freq_factor;
    rope["high_freq_factor"] = config.rope.high_freq_factor;
    rope["original_max_position_embeddings"] = config.rope.original_max_position_embeddings;
  }
  nlohmann::json windows = nlohmann::json::array();
  for (int64_t w : config.layer_window) windows.push_back(w);
  nlohmann::json kv = nlohmann::json::object();
  for (int bits : {16, 4, 2}) {
    kv[std::to_string(bits) + "bit"] = {
        {"bytes_per_token", config.kv_bytes_per_token(bits)},
        {"bytes_at_context", config.kv_bytes_per_token(bits) * static_cast<double>(context)}};
  }
  return {{"model", dir.string()},
          {"architecture", architecture_name(config.architecture)},
          {"parameters", count_parameters(checkpoint, config)},
          {"layers", config.num_layers},
          {"hidden_size", config.hidden_size},
          {"intermediate_size", config.intermediate_size},
          {"heads", config.num_heads},
          {"kv_heads", config.num_kv_heads},
          {"head_dim", config.head_dim},
          {"vocab_size", config.vocab_size},
          {"max_position_embeddings", config.max_position_embeddings},
          {"rope", rope},
          {"sliding_window_per_layer", windows},
          {"tie_word_embeddings", config.tie_word_embeddings},
          {"attention_bias", config.attention_bias},
          {"qk_norm", config.qk_norm},
          {"dtype", std::string(dtype_name(config.checkpoint_dtype))},
          {"context_for_totals", context},
          {"kv_cache", kv}};
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, unit == 0 ? "%.0f %s" : "%.2f %s", bytes, units[unit]);
  return buffer;
}

void print_text(const nlohmann::json& info) {
  std::cout << "model:          " << info["model"].get<std::string>() << "\n"
            << "architecture:   " << info["architecture"].get<std::string>() << "\n"
            << "parameters:     " << info["parameters"].get<int64_t>() << "\n"
            << "layers:         " << info["layers"] << "\n"
            << "hidden size:    " << info["hidden_size"] << " (MLP " << info["intermediate_size"] << ")\n"
            << "heads:          " << info["heads"] << " query, " << info["kv_heads"] << " KV, head_dim "
            << info["head_dim"] << "\n"
            << "vocab:          " << info["vocab_size"] << "\n"
            << "RoPE:           " << info["rope"].dump() << "\n"
            << "max positions:  " << info["max_position_embeddings"] << "\n"
            << "dtype:          " << info["dtype"].get<std::string>() << "\n";
  const auto& windows = info["sliding_window_per_layer"];
  bool any_window = false;
  for (const auto& w : windows) any_window = any_window || w.get<int64_t>() > 0;
  if (any_window) std::cout << "sliding window: " << windows.dump() << "\n";
  const int64_t context = info["context_for_totals"].get<int64_t>();
  std::cout << "KV cache (keys + values, all layers):\n";
  for (const char* key : {"16bit", "4bit", "2bit"}) {
    const auto& entry = info["kv_cache"][key];
    std::cout << "  " << key << ": " << human_bytes(entry["bytes_per_token"].get<double>()) << "/token, "
              << human_bytes(entry["bytes_at_context"].get<double>()) << " at " << context << " tokens\n";
  }
}

}  // namespace

Command add_info_command(CLI::App& app) {
  auto flags = std::make_shared<InfoFlags>();
  CLI::App* command = app.add_subcommand("info", "Architecture, sizes and KV-cache bytes per token of a model");
  command->add_option("-m,--model", flags->model_dir, "Hugging Face model folder")
      ->required()
      ->check(CLI::ExistingDirectory);
  command->add_option("--ctx", flags->context, "Context length for KV-cache totals (default: max positions)");
  command->add_flag("--json", flags->json, "Print JSON");
  return [flags](const Invocation&) {
    const std::filesystem::path dir = flags->model_dir;
    int64_t context = flags->context;
    if (context <= 0) context = load_model_config(dir).max_position_embeddings;
    const nlohmann::json info = describe(dir, context);
    if (flags->json) {
      std::cout << info.dump(2) << "\n";
    } else {
      print_text(info);
    }
    return 0;
  };
}

}  // namespace kvforge::cli
