// kvforge rotate: learn per-layer, per-KV-head orthogonal rotations of keys
// and values (OptR) for configurations of an artifact, on an activation
// store, and add the rotated configurations to the artifact.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/atomic_text_file.h"
#include "formats/input_error.h"
#include "formats/name_table.h"
#include "formats/utc_timestamp.h"
#include "kvforge/version.h"
#include "log/log.h"
#include "model/device.h"
#include "rotation/model_rotation.h"
#include "tools/commands.h"
#include "tools/flag_checks.h"

namespace kvforge::cli {
namespace {

struct RotateFlags {
  std::string acts, model_dir, artifact, out;
  std::vector<std::string> configs;  // empty: every unrotated int2-rot and kvquant configuration
  std::string name;                  // empty: CONFIG-optr
  std::string key_basis = "hadamard", value_basis = "hadamard";
  int64_t steps = 80;
  double learning_rate = 1e-2;
  double key_output_weight = 1.0, key_kl_weight = 1.0, value_output_weight = 1.0;
  int64_t last_queries = 64;
  double validation_fraction = 0.25;
  std::string gradient = "straight_through";
  double temperature = 0.1;
  int64_t refit_interval = 10, patience = 10;
  uint64_t seed = 0;
  bool write_bases = false;
  bool no_centre = false;
  std::string device = "cpu";
  int64_t max_samples = 0, max_tokens = 0;
  std::string heldout_acts, json_out;
};

constexpr NameTable<GradientMode, 2> kGradients{{{GradientMode::kStraightThrough, "straight_through"},
                                                 {GradientMode::kSmoothed, "smoothed"}}};
const std::vector<std::string> kBasisChoices = {"identity", "hadamard", "eigen", "random"};

RotationOptions rotation_options(const RotateFlags& flags) {
  RotationOptions options;
  options.key_basis = *parse_basis(flags.key_basis);
  options.value_basis = *parse_basis(flags.value_basis);
  options.centre_keys = !flags.no_centre;
  options.steps = flags.steps;
  options.learning_rate = flags.learning_rate;
  options.key_kl_weight = flags.key_kl_weight;
  options.key_output_weight = flags.key_output_weight;
  options.value_output_weight = flags.value_output_weight;
  options.last_queries = flags.last_queries;
  options.validation_fraction = flags.validation_fraction;
  options.gradient.mode = *parse_in(kGradients, flags.gradient);
  options.gradient.temperature = flags.temperature;
  options.refit_interval = flags.refit_interval;
  options.patience = flags.patience;
  options.seed = flags.seed;
  options.device = parse_device(flags.device);
  return options;
}

// The configurations to rotate: the named ones (InputError for a name the
// artifact lacks or one already rotated), else every unrotated int2-rot and
// kvquant configuration.
std::vector<const QuantizerConfig*> select_configs(const Artifact& artifact, const RotateFlags& flags) {
  std::vector<const QuantizerConfig*> selected;
  if (flags.configs.empty()) {
    for (const QuantizerConfig& config : artifact.configs) {
      const QuantMethod method = config.settings.method;
      if (!config.rotation && (method == QuantMethod::kInt2Rot || method == QuantMethod::kKvquant)) {
        selected.push_back(&config);
      }
    }
    if (selected.empty()) {
      throw InputError(flags.artifact, "/configs", "an unrotated int2-rot or kvquant configuration to rotate (or name one with --config)");
    }
    return selected;
  }
  for (const std::string& name : flags.configs) {
    const auto found = std::find_if(artifact.configs.begin(), artifact.configs.end(),
                                    [&](const QuantizerConfig& c) { return c.name == name; });
    if (found == artifact.configs.end()) {
      std::string names;
      for (const QuantizerConfig& c : artifact.configs) names += (names.empty() ? "" : ", ") + c.name;
      throw InputError(flags.artifact, "/configs/" + name, "a configuration of that name (the artifact has " + names + ")");
    }
    if (found->rotation) {
      throw InputError(flags.artifact, "/configs/" + name, "an unrotated configuration (this one is rotated already)");
    }
    selected.push_back(&*found);
  }
  return selected;
}

std::string rotated_name(const RotateFlags& flags, const QuantizerConfig& config, size_t selected) {
  if (flags.name.empty()) return config.name + "-optr";
  return selected > 1 ? flags.name + "-" + config.name : flags.name;
}

double mean(const std::vector<double>& values) {
  double sum = 0;
  for (double v : values) sum += v;
  return values.empty() ? 0.0 : sum / static_cast<double>(values.size());
}

// One row of the held-out comparison: a configuration and what it is.
struct HeldoutRow {
  std::string kind;  // "none" (the configuration as calibrated), a basis name, or "learned"
  const QuantizerConfig* config = nullptr;
};

nlohmann::json measure_heldout(const RotateFlags& flags, const std::string& base_name,
                               const std::vector<HeldoutRow>& rows, const RotationOptions& rotation) {
  const ActivationStoreReader heldout(flags.heldout_acts);
  AttentionTermOptions options;
  options.last_queries = flags.last_queries;
  options.key_kl_weight = flags.key_kl_weight;
  options.key_output_weight = flags.key_output_weight;
  options.device = rotation.device;
  nlohmann::json result = {{"config", base_name}, {"store", flags.heldout_acts}, {"rows", nlohmann::json::array()}};
  std::ostringstream table;
  table << "held-out attention terms of " << base_name << " on " << flags.heldout_acts
        << " (mean over KV heads; key = KL + lambda * post-W_O error, value = post-W_O error)\n";
  table << "  layer  rotation        key KL    key out      key      value\n";
  for (const HeldoutRow& row : rows) {
    const std::vector<LayerAttentionTerms> terms = measure_attention_terms(heldout, flags.model_dir, *row.config, options);
    nlohmann::json layers = nlohmann::json::array();
    for (size_t layer = 0; layer < terms.size(); ++layer) {
      const LayerAttentionTerms& t = terms[layer];
      layers.push_back({{"layer", layer}, {"key_kl", t.key_kl}, {"key_output", t.key_output}, {"key", t.key},
                        {"value", t.value}});
      char line[160];
      std::snprintf(line, sizeof line, "  %5zu  %-10s %10.3e %10.3e %10.3e %10.3e\n", layer, row.kind.c_str(),
                    mean(t.key_kl), mean(t.key_output), mean(t.key), mean(t.value));
      table << line;
    }
    result["rows"].push_back({{"rotation", row.kind}, {"name", row.config->name}, {"layers", layers}});
  }
  log::info(table.str());
  return result;
}

int run(const RotateFlags& flags, const Invocation& invocation) {
  const ActivationStoreReader store(flags.acts);
  if (!store.complete()) {
    throw InputError(flags.acts, "/@samples_complete",
                     "a complete store (" + std::to_string(store.samples_complete()) + " of " +
                         std::to_string(store.layout().provenance.samples) + " samples; finish it with capture --resume)");
  }
  Artifact artifact = read_artifact(flags.artifact);
  check_artifact_matches(artifact, store.layout().model, flags.artifact);
  const RotationOptions rotation = rotation_options(flags);
  std::vector<const QuantizerConfig*> selected = select_configs(artifact, flags);
  // Copies: the artifact's vector grows below.
  std::vector<QuantizerConfig> to_rotate;
  for (const QuantizerConfig* config : selected) to_rotate.push_back(*config);

  nlohmann::json heldout = nlohmann::json::array();
  for (const QuantizerConfig& base : to_rotate) {
    ModelRotationOptions options;
    options.rotation = rotation;
    options.name = rotated_name(flags, base, to_rotate.size());
    options.max_samples = flags.max_samples;
    options.max_tokens = flags.max_tokens;
    log::info("rotating ", base.name, " into ", options.name, " on ", flags.acts, " (", flags.device, ")");
    ModelRotation result = rotate_model(store, flags.model_dir, base.settings, options);
    result.rotated.effective_bits = base.effective_bits;  // rotations add no bits per cached element
    // Each fixed base as its own configuration, CONFIG-BASIS (ModelRotation::bases
    // follows RotationOptions::fixed_bases).
    for (size_t i = 0; i < result.bases.size(); ++i) {
      result.bases[i].name = base.name + "-" + std::string(basis_name(options.rotation.fixed_bases.at(i)));
      result.bases[i].effective_bits = base.effective_bits;
    }
    if (!flags.heldout_acts.empty()) {
      std::vector<HeldoutRow> rows{{"none", &base}};
      for (const QuantizerConfig& config : result.bases) {
        rows.push_back({config.name.substr(base.name.size() + 1), &config});
      }
      rows.push_back({"learned", &result.rotated});
      heldout.push_back(measure_heldout(flags, base.name, rows, rotation));
    }
    const auto replace = [&](QuantizerConfig config) {
      std::erase_if(artifact.configs, [&](const QuantizerConfig& c) { return c.name == config.name; });
      artifact.configs.push_back(std::move(config));
    };
    replace(std::move(result.rotated));
    if (flags.write_bases) {
      for (QuantizerConfig& config : result.bases) replace(std::move(config));
    }
  }
  artifact.tool_version = kVersion;
  artifact.command_line = invocation.command_line;
  artifact.created_utc = current_utc_timestamp();
  if (!flags.json_out.empty()) {
    const nlohmann::json json = {
        {"tool_version", kVersion}, {"command_line", invocation.command_line}, {"heldout", heldout}};
    write_text_file_atomically(flags.json_out, json.dump(1) + "\n", "the held-out comparison's JSON");
  }
  // Validates every rotation and quantizer; writes atomically.
  write_artifact(flags.out.empty() ? flags.artifact : flags.out, artifact);
  log::info("wrote ", flags.out.empty() ? flags.artifact : flags.out, ": ", artifact.configs.size(),
            " configuration(s)");
  return 0;
}

}  // namespace

Command add_rotate_command(CLI::App& app) {
  auto flags = std::make_shared<RotateFlags>();
  CLI::App* command = app.add_subcommand(
      "rotate", "Learn per-head orthogonal rotations of keys and values (OptR) for an artifact's configurations");
  command->add_option("-a,--acts", flags->acts, "Activation store of calibration text (kvforge capture)")
      ->required()
      ->check(CLI::ExistingFile);
  command->add_option("-m,--model", flags->model_dir, "Model directory the store was captured from (o_proj weights)")
      ->required()
      ->check(CLI::ExistingDirectory);
  command->add_option("--artifact", flags->artifact, "Artifact with the configurations to rotate (kvforge calibrate)")
      ->required()
      ->check(CLI::ExistingFile);
  command->add_option("-o,--out", flags->out, "Artifact to write (default: update --artifact in place, atomically)");
  command->add_option("--config", flags->configs,
                      "Configurations to rotate (default: every unrotated int2-rot and kvquant one)")
      ->delimiter(',');
  command->add_option("--name", flags->name, "Name of the rotated configuration (default CONFIG-optr)");
  command->add_option("--key-basis", flags->key_basis,
                      "Base the key rotation starts from: hadamard (QuaRot), eigen (OSCAR), identity, random; "
                      "pre-RoPE keys (kvquant) learn RoPE-commuting pair angles from identity")
      ->check(CLI::IsMember(kBasisChoices))
      ->capture_default_str();
  command->add_option("--value-basis", flags->value_basis, "Base the value rotation starts from")
      ->check(CLI::IsMember(kBasisChoices))
      ->capture_default_str();
  command->add_option("--steps", flags->steps, "Adam steps per layer for keys and for values (0: the base only)")
      ->check(CLI::Range(int64_t{0}, int64_t{100000}))
      ->capture_default_str();
  command->add_option("--lr", flags->learning_rate, "Adam learning rate")
      ->check(CLI::Range(0.0, 10.0))
      ->capture_default_str();
  command->add_option("--lambda", flags->key_output_weight,
                      "Weight of the post-W_O output error in the key objective (KL + lambda * error)")
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();
  command->add_option("--kl-weight", flags->key_kl_weight, "Weight of the attention KL in the key objective")
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();
  command->add_option("--value-weight", flags->value_output_weight, "Weight of the value objective")
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();
  command->add_option("--last-queries", flags->last_queries, "Queries per window the objective attends with (the last ones)")
      ->check(positive_integer())
      ->capture_default_str();
  command->add_option("--validation-fraction", flags->validation_fraction,
                      "Windows held out of the fit for early stopping and for keeping a head's learned rotation")
      ->check(CLI::Range(0.01, 0.99))
      ->capture_default_str();
  command->add_option("--gradient", flags->gradient, "Through the quantizer: straight_through or smoothed")
      ->check(CLI::IsMember(names_in(kGradients)))
      ->capture_default_str();
  command->add_option("--temperature", flags->temperature, "Smoothed gradient's temperature (squared level spacings)")
      ->check(CLI::Range(1e-6, 100.0))
      ->capture_default_str();
  command->add_option("--refit-interval", flags->refit_interval,
                      "Steps between refits of the quantizer to the rotated data while learning (0: never)")
      ->capture_default_str();
  command->add_option("--patience", flags->patience, "Stop after this many steps without a better validation loss")
      ->check(positive_integer())
      ->capture_default_str();
  command->add_option("--seed", flags->seed, "Seed of random bases")->capture_default_str();
  command->add_flag("--write-bases", flags->write_bases,
                    "Also store each fixed base (identity, hadamard, eigen) as its own configuration CONFIG-BASIS");
  command->add_flag("--no-centre", flags->no_centre, "Do not mean-centre keys before rotating them");
  command->add_option("--device", flags->device, "cpu or cuda[:N]")->capture_default_str();
  command->add_option("--max-samples", flags->max_samples, "Use at most this many windows of the store (0: all)");
  command->add_option("--max-tokens", flags->max_tokens, "Use at most this many leading positions per window (0: all)");
  command->add_option("--heldout-acts", flags->heldout_acts,
                      "Activation store of held-out text: log and --json the key and value terms per layer of the "
                      "unrotated configuration, every fixed base and the learned rotation")
      ->check(CLI::ExistingFile);
  command->add_option("--json", flags->json_out, "Write the held-out comparison as JSON (needs --heldout-acts)")
      ->needs(command->get_option("--heldout-acts"));
  return [flags](const Invocation& invocation) { return run(*flags, invocation); };
}

}  // namespace kvforge::cli
