// kvforge inspect FILE: summarize an activation store (per-channel magnitude,
// kurtosis, outlier channels) or a quantizer artifact (per configuration and
// layer: bits, outliers, grids, calibration error, effective bits).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "calib/activation_statistics.h"
#include "formats/hdf5_file.h"
#include "formats/input_error.h"
#include "tools/commands.h"
#include "tools/inspect_artifact.h"

namespace kvforge::cli {
namespace {

struct InspectFlags {
  std::string file;
  std::string acts;  // artifact: evaluate its quantizers on this store
  int64_t samples = 0;
  bool json = false;
};

std::string file_schema(const std::string& path) {
  const hdf5::QuietErrors quiet;  // failures become one InputError line
  const auto file = hdf5::File::open(path, hdf5::File::Mode::kReadOnly);
  const auto root = file.root();
  if (!root.has_attribute("schema")) {
    throw InputError(path, "/@schema", "an activation store or artifact written by kvforge (no schema attribute)");
  }
  return root.read_string("schema");
}

nlohmann::json store_summary(const ActivationStoreReader& store, int64_t samples) {
  const auto& layout = store.layout();
  nlohmann::json out = {{"file", store.path().string()},
                        {"schema", "kvforge.activations"},
                        {"model", layout.model.architecture},
                        {"layers", layout.model.num_layers},
                        {"samples_complete", store.samples_complete()},
                        {"samples_planned", layout.provenance.samples},
                        {"seq_len", layout.provenance.seq_len},
                        {"data_file", layout.provenance.data_file},
                        {"fields", nlohmann::json::array()}};
  for (const auto field : layout.fields) out["fields"].push_back(std::string(field_name(field)));
  for (const auto field : {ActivationField::kKeysPreRope, ActivationField::kKeysPostRope, ActivationField::kValues}) {
    if (std::find(layout.fields.begin(), layout.fields.end(), field) == layout.fields.end()) continue;
    for (const auto& stats : channel_statistics(store, field, samples)) {
      out["statistics"][std::string(field_name(field))].push_back(
          {{"layer", stats.layer},
           {"tokens", stats.tokens},
           {"max_over_median_mean_abs", stats.max_over_median},
           {"top_channels", stats.top_channels},
           {"kurtosis_max", *std::max_element(stats.kurtosis.begin(), stats.kurtosis.end())},
           {"kurtosis_median", [&] {
              auto k = stats.kurtosis;
              std::nth_element(k.begin(), k.begin() + static_cast<std::ptrdiff_t>(k.size() / 2), k.end());
              return k[k.size() / 2];
            }()},
           {"mean_abs", stats.mean_abs},
           {"kurtosis", stats.kurtosis}});
    }
  }
  return out;
}

void print_store(const nlohmann::json& summary) {
  std::cout << summary["file"].get<std::string>() << ": activation store of " << summary["model"].get<std::string>()
            << ", " << summary["samples_complete"] << "/" << summary["samples_planned"] << " samples x "
            << summary["seq_len"] << " tokens of " << summary["data_file"].get<std::string>()
            << ", fields " << summary["fields"].dump() << "\n";
  std::cout << "channel = kv_head * head_dim + dim; max/median of the per-channel mean |x|; kurtosis 3 = Gaussian\n";
  std::printf("%-7s %5s %14s %-24s %13s %12s\n", "field", "layer", "max/median", "top channels", "kurtosis max",
              "median");
  for (const auto& [field, layers] : summary["statistics"].items()) {
    for (const auto& layer : layers) {
      std::printf("%-7s %5lld %14.2f %-24s %13.1f %12.2f\n", field.c_str(),
                  static_cast<long long>(layer["layer"].get<int64_t>()), layer["max_over_median_mean_abs"].get<double>(),
                  layer["top_channels"].dump().c_str(), layer["kurtosis_max"].get<double>(),
                  layer["kurtosis_median"].get<double>());
    }
  }
}

int run(const InspectFlags& flags) {
  const std::string schema = file_schema(flags.file);
  if (schema == "kvforge.activations") {
    const ActivationStoreReader store(flags.file);
    nlohmann::json summary = store_summary(store, flags.samples);
    if (flags.json) {
      std::cout << summary.dump(2) << "\n";
    } else {
      print_store(summary);
    }
    return 0;
  }
  if (schema == "kvforge.artifact") return inspect_artifact(flags.file, flags.acts, flags.samples, flags.json);
  throw InputError(flags.file, "/@schema", "kvforge.activations or kvforge.artifact, got \"" + schema + "\"");
}

}  // namespace

Command add_inspect_command(CLI::App& app) {
  auto flags = std::make_shared<InspectFlags>();
  CLI::App* command = app.add_subcommand(
      "inspect", "Summarize an activation store (channel statistics) or an artifact (quantizers per layer)");
  command->add_option("file", flags->file, "acts.h5 or artifact.h5")->required()->check(CLI::ExistingFile);
  command->add_option("--acts", flags->acts,
                      "Artifact only: measure its quantizers on this activation store (e.g. held-out captures)")
      ->check(CLI::ExistingFile);
  command->add_option("--samples", flags->samples, "Use only the first N samples of a store");
  command->add_flag("--json", flags->json, "Print JSON");
  return [flags](const Invocation&) { return run(*flags); };
}

}  // namespace kvforge::cli
