// Greedy decoding speed at batch 1 (bench/README.md), with its baseline in
// the same run: attention over a growing KV cache through SDPA (what every
// decoding step did before model/grouped_attention.h; on Hopper SDPA picks
// cuDNN attention, which compiles a plan for every new key length) against
// grouped_attention, on the model's own cache shapes; then whole greedy
// generations with each attention backend.
//
//   kvforge_bench_decode [--model DIR | --layers N] [--device cuda] [--dtype bf16]
//                        [--prompt 512] [--new 256] [--out FILE]
//
// Without --model: Llama-3-8B shapes with random weights.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <functional>
#include <iostream>
#include <vector>

#include "bench/device_timer.h"
#include "bench/llama3_shapes.h"
#include "model/device.h"
#include "model/generation.h"
#include "model/grouped_attention.h"
#include "model/transformer.h"

namespace kvforge {
namespace {

// One decoding run's attention calls of one layer: a query token over the
// cache view [0, L) of a preallocated buffer, for L = prompt+1 .. prompt+steps.
double attention_over_growing_cache(const ModelConfig& config, const ComputeTarget& target, int64_t prompt,
                                    int64_t steps, bool through_sdpa) {
  const auto options = at::TensorOptions().dtype(target.dtype).device(target.device);
  const at::Tensor keys = at::randn({1, config.num_kv_heads, prompt + steps, config.head_dim}, options);
  const at::Tensor values = at::randn_like(keys);
  const at::Tensor query = at::randn({1, config.num_heads, 1, config.head_dim}, options);
  const double scale = 1.0 / std::sqrt(static_cast<double>(config.head_dim));
  const bool gqa = config.num_heads != config.num_kv_heads;
  return seconds_of(target.device, [&] {
    for (int64_t length = prompt + 1; length <= prompt + steps; ++length) {
      const at::Tensor k = keys.narrow(2, 0, length), v = values.narrow(2, 0, length);
      if (through_sdpa) {
        (void)at::scaled_dot_product_attention(query, k, v, std::nullopt, 0.0, false, scale, gqa);
      } else {
        (void)grouped_attention(query, k, v, std::nullopt, scale);
      }
    }
  });
}

}  // namespace
}  // namespace kvforge

int main(int argc, char** argv) {
  using namespace kvforge;
  CLI::App app{"greedy decoding speed at batch 1, with SDPA over the cache as the baseline"};
  std::string model_dir, device_name = "cuda", dtype_name = "bf16", out;
  int64_t layers = 32, prompt = 512, new_tokens = 256;
  app.add_option("--model", model_dir, "A Hugging Face model folder (default: random Llama-3-8B shapes)");
  app.add_option("--layers", layers, "Layers of the random Llama-3-8B-shaped model");
  app.add_option("--device", device_name);
  app.add_option("--dtype", dtype_name);
  app.add_option("--prompt", prompt, "Prompt tokens (random ids)");
  app.add_option("--new", new_tokens, "Tokens to generate");
  app.add_option("--out", out, "Write the JSON result here too");
  CLI11_PARSE(app, argc, argv);

  c10::InferenceMode inference;
  ComputeTarget target{parse_device(device_name), parse_dtype(dtype_name), AttentionBackend::kFused};
  nlohmann::json result = {{"device", target.device.str()}, {"dtype", dtype_label(target.dtype)},
                           {"batch", 1}, {"prompt_tokens", prompt}, {"new_tokens", new_tokens}};
  auto load = [&](AttentionBackend attention) {
    ComputeTarget t = target;
    t.attention = attention;
    return model_dir.empty() ? Transformer::random(llama3_8b_shapes(layers), t, 1234) : Transformer::load(model_dir, t);
  };
  const ModelConfig config = load(AttentionBackend::kFused).config();
  result["model"] = model_dir.empty() ? "random Llama-3-8B shapes, " + std::to_string(layers) + " layers" : model_dir;

  // Attention alone, one layer: warm up both paths on other lengths first.
  for (bool sdpa : {true, false}) (void)attention_over_growing_cache(config, target, 8, 8, sdpa);
  const double sdpa_seconds = attention_over_growing_cache(config, target, prompt, new_tokens, true);
  const double grouped_seconds = attention_over_growing_cache(config, target, prompt, new_tokens, false);
  result["attention_per_step_ms"] = {{"sdpa_baseline", 1e3 * sdpa_seconds / new_tokens},
                                     {"grouped_attention", 1e3 * grouped_seconds / new_tokens},
                                     {"speedup", sdpa_seconds / grouped_seconds}};

  std::vector<int32_t> ids(static_cast<size_t>(prompt));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 7919 + 13) % config.vocab_size);
  for (const AttentionBackend attention : {AttentionBackend::kEager, AttentionBackend::kFused}) {
    const Transformer model = load(attention);
    (void)greedy_generate(model, std::span<const int32_t>(ids).first(16), {.max_new_tokens = 8});  // warm-up
    const GenerationResult run = greedy_generate(model, ids, {.max_new_tokens = new_tokens});
    const double decoded = static_cast<double>(run.tokens.size() - 1);  // the first token comes from the prefill
    result["generate"][attention_label(attention)] = {
        {"prefill_tokens_per_second", prompt / run.prefill_seconds},
        {"decode_tokens_per_second", decoded / run.decode_seconds}};
  }
  std::cout << result.dump(2) << "\n";
  if (!out.empty()) std::ofstream(out) << result.dump(2) << "\n";
  return 0;
}
