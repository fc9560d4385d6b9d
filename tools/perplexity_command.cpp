// kvforge perplexity: llama.cpp-style perplexity of a model over a text file.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>

#include "eval/perplexity.h"
#include "log/log.h"
#include "tools/commands.h"
#include "tools/flag_checks.h"
#include "tools/model_flags.h"
#include "tools/text_input.h"

namespace kvforge::cli {
namespace {

struct PerplexityFlags {
  ModelFlags model;
  std::string data;
  int64_t context = 2048;
  int64_t stride = 0;
  int64_t batch = 1;
  int64_t max_windows = 0;
  bool no_bos = false;
  bool json = false;
};

int run(const PerplexityFlags& flags) {
  const ComputeTarget target = flags.model.target();
  const std::filesystem::path model_dir = flags.model.model_dir;
  const ModelConfig config = load_model_config(model_dir);
  const Tokenizer tokenizer = load_tokenizer(model_dir);
  const std::string text = read_text_file(flags.data);
  const std::vector<int32_t> tokens = tokenizer.encode(text);
  log::info("tokenized ", flags.data, ": ", text.size(), " bytes, ", tokens.size(), " tokens");

  PerplexityOptions options;
  options.context = flags.context;
  if (flags.stride > 0) options.stride = flags.stride;
  options.bos = bos_token(config, flags.no_bos);
  options.batch = flags.batch;
  if (flags.max_windows > 0) options.max_windows = flags.max_windows;
  if (flags.context > config.max_position_embeddings) {
    log::warn("--ctx ", flags.context, " exceeds the model's max_position_embeddings ",
              config.max_position_embeddings);
  }
  log::info("loading ", model_dir.string(), " on ", target.device.str(), " as ", dtype_label(target.dtype));
  const Transformer model = Transformer::load(model_dir, target);
  const PerplexityResult result = evaluate_perplexity(model, tokens, options);

  if (flags.json) {
    nlohmann::json out = {{"model", model_dir.string()},
                          {"data", flags.data},
                          {"device", target.device.str()},
                          {"dtype", dtype_label(target.dtype)},
                          {"context", options.context},
                          {"stride", options.stride.value_or(options.context - (options.bos ? 1 : 0))},
                          {"bos", options.bos ? nlohmann::json(*options.bos) : nlohmann::json(nullptr)},
                          {"text_tokens", tokens.size()},
                          {"windows", result.windows},
                          {"tokens_scored", result.tokens_scored},
                          {"mean_nll", result.mean_nll},
                          {"nll_stderr", result.nll_stderr},
                          {"perplexity", result.perplexity},
                          {"seconds", result.seconds},
                          {"tokens_per_second", result.tokens_per_second},
                          {"window_mean_nll", result.window_mean_nll}};
    std::cout << out.dump(2) << "\n";
  } else {
    char line[160];
    std::snprintf(line, sizeof line, "windows: %lld, tokens scored: %lld, mean NLL: %.6f +/- %.6f nats",
                  static_cast<long long>(result.windows), static_cast<long long>(result.tokens_scored),
                  result.mean_nll, result.nll_stderr);
    std::cout << line << "\n";
    std::snprintf(line, sizeof line, "perplexity: %.6f", result.perplexity);
    std::cout << line << std::endl;
  }
  return 0;
}

}  // namespace

Command add_perplexity_command(CLI::App& app) {
  auto flags = std::make_shared<PerplexityFlags>();
  CLI::App* command = app.add_subcommand("perplexity", "Perplexity of a model over a text file");
  flags->model.add_to(*command);
  command->add_option("-f,--data", flags->data, "Text file, tokenized as a whole")
      ->required()
      ->check(CLI::ExistingFile);
  command->add_option("-c,--ctx", flags->context, "Window length in positions, BOS included")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 24));
  command->add_option("--stride", flags->stride,
                      "Text tokens between window starts (default: the window's text length, no overlap)")
      ->check(positive_integer());
  command->add_option("-b,--batch", flags->batch, "Windows per forward pass")
      ->capture_default_str()
      ->check(positive_integer());
  command->add_option("--max-windows", flags->max_windows, "Evaluate only the first N windows")
      ->check(positive_integer());
  command->add_flag("--no-bos", flags->no_bos, "Do not prepend the model's BOS token to each window");
  command->add_flag("--json", flags->json, "Print the result as JSON");
  return [flags](const Invocation&) { return run(*flags); };
}

}  // namespace kvforge::cli
