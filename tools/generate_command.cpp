// kvforge generate: greedy decoding through the KV cache.
#include <nlohmann/json.hpp>

#include <iostream>

#include "log/log.h"
#include "model/generation.h"
#include "tools/commands.h"
#include "tools/flag_checks.h"
#include "tools/model_flags.h"
#include "tools/text_input.h"

namespace kvforge::cli {
namespace {

struct GenerateFlags {
  ModelFlags model;
  std::string prompt;
  int64_t max_new_tokens = 64;
  bool no_bos = false;
  bool ignore_eos = false;
  bool json = false;
};

// Bytes of `text` that form complete UTF-8 characters (a token can end in
// the middle of one; it is printed once the rest arrives).
size_t complete_utf8_prefix(const std::string& text) {
  size_t end = text.size();
  for (size_t back = 1; back <= 3 && back <= text.size(); ++back) {
    const auto byte = static_cast<unsigned char>(text[text.size() - back]);
    if ((byte & 0xC0) == 0x80) continue;  // continuation byte
    const size_t needed = byte >= 0xF0 ? 4 : byte >= 0xE0 ? 3 : byte >= 0xC0 ? 2 : 1;
    if (needed > back) end = text.size() - back;
    break;
  }
  return end;
}

int run(const GenerateFlags& flags) {
  const ComputeTarget target = flags.model.target();
  const std::filesystem::path model_dir = flags.model.model_dir;
  const ModelConfig config = load_model_config(model_dir);
  const Tokenizer tokenizer = load_tokenizer(model_dir);
  std::vector<int32_t> prompt;
  if (const auto bos = bos_token(config, flags.no_bos)) prompt.push_back(*bos);
  const auto encoded = tokenizer.encode(flags.prompt);
  prompt.insert(prompt.end(), encoded.begin(), encoded.end());
  if (prompt.empty()) throw std::invalid_argument("--prompt: expected text (or a model with a BOS token)");

  log::info("loading ", model_dir.string(), " on ", target.device.str(), " as ", dtype_label(target.dtype));
  const Transformer model = Transformer::load(model_dir, target);
  GenerationOptions options;
  options.max_new_tokens = flags.max_new_tokens;
  if (!flags.ignore_eos && config.eos_token_id) options.stop_token = static_cast<int32_t>(*config.eos_token_id);

  std::vector<int32_t> generated;
  size_t printed = 0;
  if (!flags.json) {
    std::cout << flags.prompt << std::flush;
    options.on_token = [&](int32_t token) {
      generated.push_back(token);
      const std::string text = tokenizer.decode(generated, /*skip_special_tokens=*/true);
      const size_t ready = complete_utf8_prefix(text);
      if (ready > printed) {
        std::cout << text.substr(printed, ready - printed) << std::flush;
        printed = ready;
      }
    };
  }
  const GenerationResult result = greedy_generate(model, prompt, options);
  const double decode_rate = result.decode_seconds > 0 && result.tokens.size() > 1
                                 ? static_cast<double>(result.tokens.size() - 1) / result.decode_seconds
                                 : 0.0;
  if (flags.json) {
    nlohmann::json out = {{"prompt", flags.prompt},
                          {"prompt_ids", prompt},
                          {"generated_ids", result.tokens},
                          {"text", tokenizer.decode(result.tokens, true)},
                          {"prefill_seconds", result.prefill_seconds},
                          {"decode_tokens_per_second", decode_rate}};
    std::cout << out.dump(2) << "\n";
  } else {
    const std::string text = tokenizer.decode(generated, true);
    std::cout << text.substr(printed) << std::endl;
  }
  log::info("generated ", result.tokens.size(), " tokens: prefill ", result.prefill_seconds, " s, decode ",
            decode_rate, " tokens/s");
  return 0;
}

}  // namespace

Command add_generate_command(CLI::App& app) {
  auto flags = std::make_shared<GenerateFlags>();
  CLI::App* command = app.add_subcommand("generate", "Greedy decoding through the KV cache");
  flags->model.add_to(*command);
  command->add_option("-p,--prompt", flags->prompt, "Prompt text")->required();
  command->add_option("-n,--max-new", flags->max_new_tokens, "Tokens to generate")
      ->capture_default_str()
      ->check(positive_integer());
  command->add_flag("--no-bos", flags->no_bos, "Do not prepend the model's BOS token");
  command->add_flag("--ignore-eos", flags->ignore_eos, "Keep generating after the EOS token");
  command->add_flag("--json", flags->json, "Print prompt and generated ids as JSON");
  return [flags](const Invocation&) { return run(*flags); };
}

}  // namespace kvforge::cli
