#include "tools/inspect_artifact.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>
#include <optional>

#include "calib/fingerprint_rope.h"
#include "calib/quantizer_fit.h"
#include "formats/artifact.h"

namespace kvforge::cli {
namespace {

nlohmann::json stats_json(const LayerCalibrationStats& s) {
  return {{"key_relative_mse", s.key_relative_mse},
          {"value_relative_mse", s.value_relative_mse},
          {"logit_relative_mse", s.logit_relative_mse},
          {"key_outlier_fraction", s.key_outlier_fraction},
          {"value_outlier_fraction", s.value_outlier_fraction}};
}

nlohmann::json tensor_json(const TensorQuantizerSettings& settings, const TensorQuantizer& q) {
  nlohmann::json out = {{"grouping", std::string(grouping_name(settings.grouping))},
                        {"group", settings.group},
                        {"outlier_fraction", settings.outlier_fraction},
                        {"clip_ratio", q.clip_ratio}};
  if (!q.grid.empty()) out["grid"] = q.grid;
  if (q.outlier_tau > 0) out["outlier_tau"] = q.outlier_tau;
  return out;
}

nlohmann::json artifact_json(const Artifact& artifact, const std::string& file,
                             const std::optional<ActivationStoreReader>& heldout, int64_t samples) {
  nlohmann::json out = {{"file", file},
                        {"schema", "kvforge.artifact"},
                        {"model", artifact.model.architecture},
                        {"tool_version", artifact.tool_version},
                        {"calibration_tokens", artifact.calibration.calibration_tokens},
                        {"store_file", artifact.calibration.store_file}};
  if (heldout) out["measured_on"] = heldout->path().string();
  std::optional<RopeConfig> rope;
  if (heldout) rope = parse_rope_json(artifact.model.rope, file);
  for (const auto& config : artifact.configs) {
    const auto& s = config.settings;
    nlohmann::json c = {{"name", config.name},
                        {"method", std::string(method_name(s.method))},
                        {"bits", s.bits},
                        {"keys_pre_rope", s.keys_pre_rope},
                        {"sink_tokens", s.sink_tokens},
                        {"residual_tokens", s.residual_tokens},
                        {"fisher_weighted", s.fisher_weighted},
                        {"q_norm", s.keys.q_norm != QNorm::kNone || s.values.q_norm != QNorm::kNone}};
    for (const auto& [context, bits] : config.effective_bits) {
      c["effective_bits"].push_back({{"context", context}, {"bits", bits}});
    }
    for (size_t layer = 0; layer < config.layers.size(); ++layer) {
      const auto& l = config.layers[layer];
      nlohmann::json entry = {{"layer", layer},
                              {"keys", tensor_json(s.keys, l.keys)},
                              {"values", tensor_json(s.values, l.values)},
                              {"calibration", stats_json(l.stats)}};
      if (heldout) {
        const auto activations = load_layer_activations(*heldout, s, static_cast<int64_t>(layer), samples);
        entry["heldout"] = stats_json(measure_layer(s, l, activations, &*rope));
      }
      c["layers"].push_back(entry);
    }
    out["configs"].push_back(c);
  }
  return out;
}

void print_artifact(const nlohmann::json& summary) {
  std::cout << summary["file"].get<std::string>() << ": artifact for " << summary["model"].get<std::string>()
            << ", calibrated on " << summary["calibration_tokens"] << " tokens of "
            << summary["store_file"].get<std::string>() << "\n";
  const bool heldout = summary.contains("measured_on");
  if (heldout) std::cout << "held-out measures on " << summary["measured_on"].get<std::string>() << "\n";
  for (const auto& c : summary["configs"]) {
    std::cout << "\n" << c["name"].get<std::string>() << ": " << c["method"].get<std::string>() << ", "
              << c["bits"] << " bits, keys " << c["layers"][0]["keys"]["grouping"].get<std::string>()
              << (c["keys_pre_rope"].get<bool>() ? " (pre-RoPE)" : "") << ", values "
              << c["layers"][0]["values"]["grouping"].get<std::string>() << ", sink " << c["sink_tokens"]
              << ", residual " << c["residual_tokens"] << "\n  effective bits:";
    for (const auto& entry : c["effective_bits"]) {
      std::printf(" %lld: %.3f", static_cast<long long>(entry["context"].get<int64_t>()), entry["bits"].get<double>());
    }
    std::printf("\n  %5s %11s %11s %11s %9s %9s %s\n", "layer", "K rel.MSE", "V rel.MSE", "logit MSE", "K outl.",
                "V outl.", heldout ? "(calibration | held-out)" : "(calibration)");
    for (const auto& l : c["layers"]) {
      for (const char* which : {"calibration", "heldout"}) {
        if (!l.contains(which)) continue;
        const auto& s = l[which];
        std::printf("  %5s %11.3e %11.3e %11.3e %8.3f%% %8.3f%% %s\n",
                    std::string(which) == "calibration" ? std::to_string(l["layer"].get<int64_t>()).c_str() : "",
                    s["key_relative_mse"].get<double>(), s["value_relative_mse"].get<double>(),
                    s["logit_relative_mse"].get<double>(), 100 * s["key_outlier_fraction"].get<double>(),
                    100 * s["value_outlier_fraction"].get<double>(), which);
      }
      for (const char* kind : {"keys", "values"}) {
        if (l[kind].contains("grid")) std::cout << "        " << kind << " grid " << l[kind]["grid"].dump() << "\n";
      }
    }
  }
}

}  // namespace

int inspect_artifact(const std::string& artifact_file, const std::string& acts_file, int64_t samples, bool json) {
  const Artifact artifact = read_artifact(artifact_file);
  std::optional<ActivationStoreReader> heldout;
  if (!acts_file.empty()) {
    heldout.emplace(acts_file);
    check_artifact_matches(artifact, heldout->layout().model, acts_file);
  }
  const nlohmann::json summary = artifact_json(artifact, artifact_file, heldout, samples);
  if (json) {
    std::cout << summary.dump(2) << "\n";
  } else {
    print_artifact(summary);
  }
  return 0;
}

}  // namespace kvforge::cli
