// kvforge calibrate: fit KV-cache quantizers on an activation store and
// write them, as named configurations, into one versioned artifact.
#include <filesystem>
#include <optional>
#include <string_view>
#include <set>
#include <sstream>

#include "calib/quantizer_fit.h"
#include "formats/artifact.h"
#include "formats/input_error.h"
#include "formats/name_table.h"
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
  // Variants of the published defaults ("" : the method's default).
  std::string key_window;      // sliding, block_flush
  std::string value_outliers;  // top_bottom, tau
  std::string value_scaling;   // all_heads, head
  std::string q_norm;          // auto, affine, iterated, none
  bool uniform = false;
  int64_t max_tokens = 0;
  bool append = false;
};

// The flags' names for the variant values, one table each (they are not the
// artifact's names: `tau`, not `token_tau`).
constexpr NameTable<ResidualRule, 2> kKeyWindows{{{ResidualRule::kSliding, "sliding"},
                                                  {ResidualRule::kBlockFlush, "block_flush"}}};
constexpr NameTable<OutlierRule, 2> kValueOutliers{{{OutlierRule::kTokenTopBottom, "top_bottom"},
                                                    {OutlierRule::kTokenTau, "tau"}}};
constexpr NameTable<Grouping, 2> kValueScalings{{{Grouping::kPerTokenAllHeads, "all_heads"},
                                                 {Grouping::kPerToken, "head"}}};
constexpr NameTable<QNorm, 3> kQNorms{{{QNorm::kAffine, "affine"}, {QNorm::kIterated, "iterated"},
                                       {QNorm::kNone, "none"}}};

FitOptions fit_options(const CalibrateFlags& flags, QuantMethod method, int bits, std::string name);

// What sets a variant apart from the method's published default, as a name
// suffix ("" for the default itself): e.g. kivi-2bit-keys-sliding,
// kvquant-2bit-tau-head-scaling-qnorm-iterated. Only the variant flags
// count, and only where they change the resolved settings.
std::string variant_suffix(const CalibrateFlags& flags, QuantMethod method, int bits, int64_t head_dim) {
  const FitOptions with = fit_options(flags, method, bits, "");
  FitOptions without = with;
  without.key_residual_rule.reset();
  without.value_outlier_rule.reset();
  without.value_grouping.reset();
  without.q_norm.reset();
  const QuantizerSettings a = resolve_settings(with, head_dim), b = resolve_settings(without, head_dim);
  std::string suffix;
  if (a.keys.residual_rule != b.keys.residual_rule) {
    suffix += "-keys-" + std::string(name_in(kKeyWindows, a.keys.residual_rule));
  }
  if (a.values.grouping != b.values.grouping) {
    suffix += "-" + std::string(name_in(kValueScalings, a.values.grouping)) + "-scaling";
  }
  if (a.values.outlier_rule != b.values.outlier_rule || a.keys.outlier_rule != b.keys.outlier_rule) {
    suffix += "-" + std::string(name_in(kValueOutliers, a.values.outlier_rule));
  }
  if (a.values.q_norm != b.values.q_norm) suffix += "-qnorm-" + std::string(name_in(kQNorms, a.values.q_norm));
  return suffix;
}

std::string config_name(const CalibrateFlags& flags, QuantMethod method, int bits, size_t configs, int64_t head_dim) {
  const std::string automatic =
      std::string(method_name(method)) + "-" + std::to_string(bits) + "bit" + variant_suffix(flags, method, bits, head_dim);
  if (!flags.name.empty()) return configs > 1 ? flags.name + "-" + automatic : flags.name;
  return automatic;
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
  if (flags.no_qnorm) options.q_norm = QNorm::kNone;
  if (const auto q_norm = parse_in(kQNorms, flags.q_norm)) options.q_norm = q_norm;
  options.key_residual_rule = parse_in(kKeyWindows, flags.key_window);
  options.value_outlier_rule = parse_in(kValueOutliers, flags.value_outliers);
  options.value_grouping = parse_in(kValueScalings, flags.value_scaling);
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
  // The tokens the fit uses (whole leading windows), not the flag's value.
  artifact.calibration.calibration_tokens =
      calibration_subset(store.samples_complete(), provenance.seq_len, flags.max_tokens).total();
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
    const std::string name = config_name(flags, method, bits, jobs.size(), store.layout().model.head_dim);
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
  command->add_option("--name", flags->name, "Configuration name (default METHOD-Nbit, plus a suffix naming any variant flags)");
  command->add_option("--outliers", flags->outliers, "Fraction kept exact in the sparse store (kvquant default 0.01: keys by per-channel thresholds, values per token)")
      ->check(CLI::Range(0.0, 0.5));
  command->add_option("--sink", flags->sink, "First tokens kept in 16 bits (kvquant 1, int2-rot 64)");
  command->add_option("--residual", flags->residual, "16-bit window R: kivi 128 (keys: the T mod R not yet flushed, values: the newest R), int2-rot 256 newest");
  command->add_option("--group", flags->group, "Group size for keys and values (kivi 32, int2-rot 128)");
  command->add_option("--key-group", flags->key_group, "Group size for keys");
  command->add_option("--value-group", flags->value_group, "Group size for values");
  command->add_flag("--no-fisher", flags->no_fisher, "kvquant: plain k-means instead of Fisher-weighted");
  command->add_flag("--no-qnorm", flags->no_qnorm, "kvquant: no Q-Norm correction of the grids (= --q-norm none)");
  // Variants: the default of each is the published method; a variant adds a
  // suffix to the configuration name so that both fit in one artifact.
  command->add_option("--q-norm", flags->q_norm,
                      "kvquant grids: auto (default: the paper's affine Q-Norm at 2 bits, none at 3 and 4), "
                      "affine, iterated (kvforge variant: levels moved, iterated), none; name suffix -qnorm-X")
      ->check(CLI::IsMember([] {
        std::vector<std::string> choices = names_in(kQNorms);
        choices.insert(choices.begin(), "auto");  // the method's default
        return choices;
      }()));
  command->add_option("--key-window", flags->key_window,
                      "kivi keys' 16-bit window: block_flush (default, KIVI: keys quantized in blocks of --residual, "
                      "T mod R stay exact) or sliding (kvforge variant: the newest R and an incomplete group stay exact); suffix -keys-X")
      ->check(CLI::IsMember(names_in(kKeyWindows)));
  command->add_option("--value-outliers", flags->value_outliers,
                      "Outliers of runtime groupings (kvquant values): top_bottom (default, KVQuant: the f/2 largest "
                      "and f/2 smallest of each token) or tau (kvforge variant: |x - mean| > tau std per token and "
                      "head, tau fitted; implies --value-scaling head); suffix -X")
      ->check(CLI::IsMember(names_in(kValueOutliers)));
  command->add_option("--value-scaling", flags->value_scaling,
                      "kvquant values' per-token scaling span: all_heads (default, KVQuant: the token's row over all "
                      "KV heads) or head (kvforge variant: per head); suffix -X-scaling")
      ->check(CLI::IsMember(names_in(kValueScalings)));
  command->add_flag("--uniform", flags->uniform, "kvquant: uniform levels instead of fitted grids (ablation)");
  command->add_option("--max-tokens", flags->max_tokens,
                      "Fit on at most this many calibration tokens (leading whole windows; the artifact records "
                      "the tokens actually used)");
  command->add_flag("--append", flags->append, "Add the configurations to an existing artifact of the same model");
  return [flags](const Invocation& invocation) { return run(*flags, invocation); };
}

}  // namespace kvforge::cli
