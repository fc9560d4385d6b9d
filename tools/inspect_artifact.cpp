#include "tools/inspect_artifact.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <optional>

#include "calib/effective_bits.h"
#include "calib/fingerprint_rope.h"
#include "calib/kv_rotation.h"
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
                        {"outlier_rule", std::string(outlier_rule_name(settings.outlier_rule))},
                        {"residual_rule", std::string(residual_rule_name(settings.residual_rule))},
                        {"q_norm", std::string(q_norm_name(settings.q_norm))},
                        {"clip_ratio", q.clip_ratio}};
  if (!q.grid.empty()) out["grid"] = q.grid;
  if (!q.encode_grid.empty()) out["encode_grid"] = q.encode_grid;
  if (q.outlier_tau > 0) out["outlier_tau"] = q.outlier_tau;
  return out;
}

// One layer's rotation of keys or values: its form's per-head origin and how
// far its matrices are from orthogonal (float64, ||R^T R - I||_F, the largest head).
nlohmann::json tensor_rotation_json(const TensorRotation& rotation, RotationForm form, const ModelFingerprint& model) {
  if (form == RotationForm::kNone) return nullptr;
  std::vector<std::string> bases;
  for (const RotationBasis basis : rotation.basis) bases.emplace_back(basis_name(basis));
  const auto learned = std::count(rotation.learned.begin(), rotation.learned.end(), true);
  const at::Tensor matrices = rotation_matrices(rotation, form, model.num_kv_heads, model.head_dim,
                                                at::TensorOptions().dtype(at::kDouble));
  return {{"form", std::string(rotation_form_name(form))},
          {"bases", bases},
          {"learned_heads", learned},
          {"heads", rotation.learned.size()},
          {"orthogonality_error", orthogonality_error(matrices)},
          {"centred", !rotation.centre.empty()}};
}

// Per-head validation losses as four arrays, and their means over heads.
nlohmann::json loss_json(const std::vector<HeadRotationLoss>& loss) {
  if (loss.empty()) return nullptr;
  nlohmann::json out;
  for (const auto& [name, member] : {std::pair<const char*, double HeadRotationLoss::*>{"key_base", &HeadRotationLoss::key_base},
                                     {"key_learned", &HeadRotationLoss::key_learned},
                                     {"value_base", &HeadRotationLoss::value_base},
                                     {"value_learned", &HeadRotationLoss::value_learned}}) {
    double mean = 0;
    for (const HeadRotationLoss& head : loss) {
      out["heads"][name].push_back(head.*member);
      mean += head.*member / static_cast<double>(loss.size());
    }
    out["mean"][name] = mean;
  }
  return out;
}

nlohmann::json rotation_json(const QuantizerConfig& config, const ModelFingerprint& model) {
  const RotationSettings& r = *config.rotation;
  nlohmann::json out = {{"keys_form", std::string(rotation_form_name(r.keys))},
                        {"values_form", std::string(rotation_form_name(r.values))},
                        {"keys_basis", std::string(basis_name(r.key_basis))},
                        {"values_basis", std::string(basis_name(r.value_basis))},
                        {"key_centred", r.key_centred},
                        {"folded", r.folded},
                        {"gradient", r.gradient},
                        {"key_kl_weight", r.key_kl_weight},
                        {"key_output_weight", r.key_output_weight},
                        {"value_output_weight", r.value_output_weight},
                        {"learning_rate", r.learning_rate},
                        {"steps", r.steps},
                        {"last_queries", r.last_queries},
                        {"fit_samples", r.fit_samples},
                        {"validation_samples", r.validation_samples}};
  for (size_t layer = 0; layer < config.layers.size(); ++layer) {
    const LayerRotation& l = config.layers[layer].rotation;
    out["layers"].push_back({{"layer", layer},
                             {"keys", tensor_rotation_json(l.keys, r.keys, model)},
                             {"values", tensor_rotation_json(l.values, r.values, model)},
                             {"validation_loss", loss_json(l.loss)}});
  }
  return out;
}

// The outlier shares measured per layer, averaged over layers (every layer
// quantizes as many elements): the fraction effective bits are counted at.
OutlierFractions mean_outlier_fractions(const std::vector<LayerCalibrationStats>& layers) {
  OutlierFractions mean;
  for (const auto& l : layers) {
    mean.keys += l.key_outlier_fraction / static_cast<double>(layers.size());
    mean.values += l.value_outlier_fraction / static_cast<double>(layers.size());
  }
  return mean;
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
                        {"fisher_weighted", s.fisher_weighted}};
    for (const auto& [context, bits] : config.effective_bits) {
      c["effective_bits"].push_back({{"context", context}, {"bits", bits}});
    }
    c["rotation"] = config.rotation ? rotation_json(config, artifact.model) : nullptr;
    // Held-out measures in the model's own domain, rotations applied and undone.
    const bool measure = heldout.has_value();
    std::vector<LayerCalibrationStats> heldout_stats;
    for (size_t layer = 0; layer < config.layers.size(); ++layer) {
      const auto& l = config.layers[layer];
      nlohmann::json entry = {{"layer", layer},
                              {"keys", tensor_json(s.keys, l.keys)},
                              {"values", tensor_json(s.values, l.values)},
                              {"calibration", stats_json(l.stats)}};
      if (measure) {
        const auto activations = load_layer_activations(*heldout, s, static_cast<int64_t>(layer), samples);
        heldout_stats.push_back(measure_layer(config, static_cast<int64_t>(layer), activations, &*rope));
        entry["heldout"] = stats_json(heldout_stats.back());
      }
      c["layers"].push_back(entry);
    }
    if (measure && !heldout_stats.empty()) {
      const OutlierFractions measured = mean_outlier_fractions(heldout_stats);
      c["heldout_outlier_fraction"] = {{"keys", measured.keys}, {"values", measured.values}};
      for (const auto& [context, bits] : config.effective_bits) {
        c["effective_bits_heldout"].push_back(
            {{"context", context},
             {"bits", effective_bits(s, artifact.model.num_kv_heads, artifact.model.head_dim, context, measured)}});
      }
    }
    out["configs"].push_back(c);
  }
  return out;
}

// "hadamard" when every head kept one base, else "hadamard x3, eigen x1".
std::string bases_text(const nlohmann::json& bases) {
  std::vector<std::pair<std::string, int>> counts;
  for (const auto& basis : bases) {
    const std::string name = basis.get<std::string>();
    auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& c) { return c.first == name; });
    if (it == counts.end()) {
      counts.emplace_back(name, 1);
    } else {
      ++it->second;
    }
  }
  if (counts.size() == 1) return counts[0].first;
  std::string text;
  for (const auto& [name, count] : counts) text += (text.empty() ? "" : ", ") + name + " x" + std::to_string(count);
  return text;
}

void print_rotation(const nlohmann::json& r) {
  std::cout << "  rotation: keys " << r["keys_form"].get<std::string>()
            << (r["key_centred"].get<bool>() ? " (centred)" : "") << ", values " << r["values_form"].get<std::string>()
            << "; " << r["steps"] << " steps, " << r["gradient"].get<std::string>() << ", " << r["fit_samples"]
            << " fit + " << r["validation_samples"] << " validation windows"
            << (r["folded"].get<bool>() ? "; folded into the weights (the runtime applies none)" : "") << "\n";
  std::printf("  %5s %-28s %-28s %12s  %s\n", "layer", "K base (learned heads)", "V base (learned heads)",
              "max|RtR-I|", "validation loss K, V: base -> learned (mean over heads)");
  for (const auto& l : r["layers"]) {
    std::string columns[2];
    double orthogonality = 0;
    for (int i = 0; i < 2; ++i) {
      const auto& t = l[i == 0 ? "keys" : "values"];
      if (t.is_null()) {
        columns[i] = "-";
        continue;
      }
      columns[i] = bases_text(t["bases"]) + " (" + std::to_string(t["learned_heads"].get<int64_t>()) + "/" +
                   std::to_string(t["heads"].get<int64_t>()) + ")";
      orthogonality = std::max(orthogonality, t["orthogonality_error"].get<double>());
    }
    std::printf("  %5lld %-28s %-28s %12.3e", static_cast<long long>(l["layer"].get<int64_t>()), columns[0].c_str(),
                columns[1].c_str(), orthogonality);
    if (l["validation_loss"].is_null()) {
      std::printf("  (not measured)\n");
    } else {
      const auto& mean = l["validation_loss"]["mean"];
      std::printf("  K %.4g -> %.4g, V %.4g -> %.4g\n", mean["key_base"].get<double>(),
                  mean["key_learned"].get<double>(), mean["value_base"].get<double>(),
                  mean["value_learned"].get<double>());
    }
  }
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
              << ", residual " << c["residual_tokens"] << "\n";
    const auto& keys = c["layers"][0]["keys"];
    const auto& values = c["layers"][0]["values"];
    std::cout << "  keys: window " << keys["residual_rule"].get<std::string>() << ", outliers "
              << keys["outlier_rule"].get<std::string>() << ", Q-Norm " << keys["q_norm"].get<std::string>()
              << "; values: window " << values["residual_rule"].get<std::string>() << ", outliers "
              << values["outlier_rule"].get<std::string>() << ", Q-Norm " << values["q_norm"].get<std::string>()
              << "\n  effective bits (nominal outliers):";
    for (const auto& entry : c["effective_bits"]) {
      std::printf(" %lld: %.3f", static_cast<long long>(entry["context"].get<int64_t>()), entry["bits"].get<double>());
    }
    if (c.contains("effective_bits_heldout")) {
      std::printf("\n  effective bits (held-out outliers, K %.3f%% V %.3f%%):",
                  100 * c["heldout_outlier_fraction"]["keys"].get<double>(),
                  100 * c["heldout_outlier_fraction"]["values"].get<double>());
      for (const auto& entry : c["effective_bits_heldout"]) {
        std::printf(" %lld: %.3f", static_cast<long long>(entry["context"].get<int64_t>()),
                    entry["bits"].get<double>());
      }
    }
    std::printf("\n");
    if (!c["rotation"].is_null()) print_rotation(c["rotation"]);
    std::printf("  %5s %11s %11s %11s %9s %9s %s\n", "layer", "K rel.MSE", "V rel.MSE", "logit MSE", "K outl.",
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
