// kvforge calibrate: fit KV-cache quantizers on an activation store and
// write them, as named configurations, into one versioned artifact.
#include <filesystem>
#include <set>
#include <sstream>

#include "calib/quantizer_fit.h"
#include "formats/artifact.h"
#include "formats/input_error.h"
#include "kvforge/version.h"
#include "log/log.h"
#include "log/progress.h"
#include "tools/commands.h"

namespace kvforge::cli {
namespace {

struct CalibrateFlags {
  std::string acts;
  std::string out;
  std::vector<std::string> methods = {"kvquant"};
  std::vector<int> bits = {2};
  std::string name;
  std::optional<double> outliers;
  std::optional<int64_t> sink;
  std::optional<int64_t> residual;
  std::optional<int64_t> group;
  std::optional<int64_t> key_group;
  std::optional<int64_t> value_group;
  bool no_fisher = false;
  bool no_qnorm = false;
  bool uniform = false;
  int64_t max_tokens = 0;
  bool append = false;
};

std::string config_name(const CalibrateFlags& flags, QuantMethod method, int bits, size_t configs) {
  if (!flags.name.empty()) {
    if (configs > 1) return flags.name + "-" + std::string(method_name(method)) + "-" + std::to_string(bits) + "bit";
    return flags.name;
  }
  return std::string(method_name(method)) + "-" + std::to_string(bits) + "bit";
}

FitOptions fit_options(const CalibrateFlags& flags, QuantMethod method, int bits, std::string name) {
  FitOptions options;
  options.name = std::move(name);
  options.method = method;
  options.bits = bits;
  options.outlier_fraction = flags.outliers;
  options.sink_tokens = flags.sink;
  options.residual_tokens = flags.residual;
  options.key_group = flags.key_group ? flags.key_group : flags.group;
  options.value_group = flags.value_group ? flags.value_group : flags.group;
  if (flags.no_fisher) options.fisher = false;
  if (flags.no_qnorm) options.q_norm = false;
  if (flags.uniform) options.non_uniform = false;
  options.max_calibration_tokens = flags.max_tokens;
  return options;
}

int run(const CalibrateFlags& flags, const Invocation& invocation) {
  const ActivationStoreReader store(flags.acts);
  if (!store.complete()) {
    throw InputError(flags.acts, "/@samples_complete",
                     "a complete store (" + std::to_string(store.samples_complete()) + " of " +
                         std::to_string(store.layout().provenance.samples) + " samples; finish it with capture --resume)");
  }
  Artifact artifact;
  if (flags.append && std::filesystem::exists(flags.out)) {
    artifact = read_artifact(flags.out);
    check_artifact_matches(artifact, store.layout().model, flags.out);
  } else {
    artifact.model = store.layout().model;
  }
  artifact.calibration.sources = store.sources();
  artifact.calibration.store_file = std::filesystem::path(flags.acts).filename().string();
  const auto& provenance = store.layout().provenance;
  artifact.calibration.calibration_tokens =
      flags.max_tokens > 0 ? std::min(flags.max_tokens, store.samples_complete() * provenance.seq_len)
                           : store.samples_complete() * provenance.seq_len;
  artifact.tool_version = kVersion;
  artifact.command_line = invocation.command_line;
  artifact.created_utc = current_utc_timestamp();

  std::vector<std::pair<QuantMethod, int>> jobs;
  for (const auto& text : flags.methods) {
    const auto method = parse_method(text);
    if (!method) throw std::invalid_argument("--method " + text + ": expected kvquant, kivi, int2-rot or rtn");
    for (int bits : flags.bits) jobs.emplace_back(*method, bits);
  }
  log::ProgressMeter progress("calibrate", static_cast<int64_t>(jobs.size()), 0.0);
  for (const auto& [method, bits] : jobs) {
    const std::string name = config_name(flags, method, bits, jobs.size());
    log::info("fitting ", name, " on ", flags.acts);
    QuantizerConfig config = fit_quantizers(store, fit_options(flags, method, bits, name));
    std::erase_if(artifact.configs, [&](const QuantizerConfig& c) { return c.name == name; });
    artifact.configs.push_back(std::move(config));
    progress.advance(1, artifact.calibration.calibration_tokens, name);
  }
  // Validates every parameter and refuses degenerate ones; writes atomically.
  write_artifact(flags.out, artifact);
  log::info("wrote ", flags.out, ": ", artifact.configs.size(), " configuration(s)");
  return 0;
}

}  // namespace

Command add_calibrate_command(CLI::App& app) {
  auto flags = std::make_shared<CalibrateFlags>();
  CLI::App* command = app.add_subcommand(
      "calibrate", "Fit KV-cache quantizers (kvquant, kivi, int2-rot, rtn) on an activation store into an artifact");
  command->add_option("-a,--acts", flags->acts, "Activation store from kvforge capture")
      ->required()
      ->check(CLI::ExistingFile);
  command->add_option("-o,--out", flags->out, "Artifact to write (HDF5)")->required();
  command->add_option("--method", flags->methods, "kvquant, kivi, int2-rot, rtn (several: a configuration each)")
      ->delimiter(',')
      ->capture_default_str();
  command->add_option("--bits", flags->bits, "2, 3 or 4 (several: a configuration each)")
      ->delimiter(',')
      ->check(CLI::IsMember({2, 3, 4}))
      ->capture_default_str();
  command->add_option("--name", flags->name, "Configuration name (default METHOD-Nbit)");
  command->add_option("--outliers", flags->outliers, "Fraction kept exact in the sparse store (kvquant default 0.01)")
      ->check(CLI::Range(0.0, 0.5));
  command->add_option("--sink", flags->sink, "First tokens kept in 16 bits (kvquant 1, int2-rot 64)");
  command->add_option("--residual", flags->residual, "Newest tokens kept in 16 bits (kivi 128, int2-rot 256)");
  command->add_option("--group", flags->group, "Group size for keys and values (kivi 32, int2-rot 128)");
  command->add_option("--key-group", flags->key_group, "Group size for keys");
  command->add_option("--value-group", flags->value_group, "Group size for values");
  command->add_flag("--no-fisher", flags->no_fisher, "kvquant: plain k-means instead of Fisher-weighted");
  command->add_flag("--no-qnorm", flags->no_qnorm, "kvquant: no Q-Norm correction of the grids");
  command->add_flag("--uniform", flags->uniform, "kvquant: uniform levels instead of fitted grids (ablation)");
  command->add_option("--max-tokens", flags->max_tokens, "Fit on at most this many calibration tokens");
  command->add_flag("--append", flags->append, "Add the configurations to an existing artifact of the same model");
  return [flags](const Invocation& invocation) { return run(*flags, invocation); };
}

}  // namespace kvforge::cli
