#include "rotation/model_rotation.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>

#include "calib/effective_bits.h"
#include "calib/fingerprint_rope.h"
#include "calib/kv_rotation.h"
#include "calib/quantize_simulation.h"
#include "calib/quantizer_fit.h"
#include "formats/hf_config.h"
#include "formats/input_error.h"
#include "formats/model_fingerprint.h"
#include "log/log.h"
#include "log/progress.h"

namespace kvforge {
namespace {

c10::ScalarType scalar_type_of(DType dtype) {
  switch (dtype) {
    case DType::kF32: return at::kFloat;
    case DType::kF16: return at::kHalf;
    case DType::kBF16: return at::kBFloat16;
  }
  return at::kFloat;
}

at::Tensor o_proj_weight(const Checkpoint& checkpoint, int64_t layer, int64_t hidden, int64_t columns) {
  const TensorView& view =
      checkpoint.tensor("model.layers." + std::to_string(layer) + ".self_attn.o_proj.weight", {hidden, columns});
  // A copy: the mapping is read-only and may outlive nothing of ours.
  return at::from_blob(const_cast<std::byte*>(view.bytes.data()), view.shape,
                       at::TensorOptions().dtype(scalar_type_of(view.dtype)))
      .to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
}

void require_field(const ActivationStoreReader& store, ActivationField field, const std::string& why) {
  const auto& fields = store.layout().fields;
  if (std::find(fields.begin(), fields.end(), field) == fields.end()) {
    throw InputError(store.path().string(), "fields",
                     "expected field " + std::string(field_name(field)) + " (" + why + "): capture it (capture --fields)");
  }
}

void check_same_model(const ActivationStoreReader& store, const std::filesystem::path& model_dir,
                      const Checkpoint& checkpoint) {
  const ModelFingerprint fingerprint = fingerprint_model(load_model_config(model_dir), checkpoint, "");
  const ModelFingerprint& stored = store.layout().model;
  if (fingerprint.kvo_sha256 != stored.kvo_sha256) {
    throw InputError(model_dir.string(), "kvo_sha256",
                     "expected the model " + store.path().string() + " was captured from (k/v/o weights " +
                         stored.kvo_sha256.substr(0, 12) + "...), got " + fingerprint.kvo_sha256.substr(0, 12) + "...");
  }
}

struct Window {
  int64_t samples = 0, tokens = 0, layers = 0;
};

Window window_of(const ActivationStoreReader& store, int64_t max_samples, int64_t max_tokens, int64_t max_layers) {
  const int64_t samples = store.samples_complete();
  if (samples < 1) throw InputError(store.path().string(), "samples_complete", "expected at least one sample");
  const int64_t length = store.layout().provenance.seq_len, layers = store.layout().model.num_layers;
  return {max_samples > 0 ? std::min(max_samples, samples) : samples,
          max_tokens > 0 ? std::min(max_tokens, length) : length, max_layers > 0 ? std::min(max_layers, layers) : layers};
}

std::vector<double> head_means(const std::vector<HeadRotationLoss>& losses) {
  std::vector<double> sums(4, 0.0);
  for (const HeadRotationLoss& l : losses) {
    sums[0] += l.key_base;
    sums[1] += l.key_learned;
    sums[2] += l.value_base;
    sums[3] += l.value_learned;
  }
  for (double& s : sums) s /= std::max<double>(1.0, static_cast<double>(losses.size()));
  return sums;
}

int64_t count(const std::vector<bool>& flags) { return std::count(flags.begin(), flags.end(), true); }

double orthogonality(const QuantizerSettings& settings, const RotationSettings& rotation, const LayerRotation& layer,
                     int64_t kv_heads, int64_t head_dim) {
  const at::TensorOptions options = at::TensorOptions().dtype(at::kDouble);
  return std::max(orthogonality_error(rotation_matrices(layer.keys, rotation.keys, kv_heads, head_dim, options)),
                  orthogonality_error(rotation_matrices(layer.values, rotation.values, kv_heads, head_dim, options)));
}

void log_layer(int64_t layer, const RotationOptions& options, const LayerRotationFit& fit, double orthogonality) {
  std::ostringstream line;
  line << "layer " << layer << " validation (key term / value term, mean over KV heads):";
  for (const BaseRotation& base : fit.bases) {
    const std::vector<double> m = head_means(base.quantizers.rotation.loss);
    line << " " << basis_name(base.basis) << " " << m[0] << " / " << m[2] << ";";
  }
  const std::vector<double> m = head_means(fit.learned.rotation.loss);
  line << " learned from " << basis_name(options.key_basis) << "/" << basis_name(options.value_basis) << ": keys "
       << m[0] << " -> " << m[1] << " (kept on " << count(fit.learned.rotation.keys.learned) << "/"
       << fit.learned.rotation.keys.learned.size() << " heads, " << fit.key_steps << " steps), values " << m[2]
       << " -> " << m[3] << " (kept on " << count(fit.learned.rotation.values.learned) << "/"
       << fit.learned.rotation.values.learned.size() << " heads, " << fit.value_steps
       << " steps); max ||R^T R - I|| " << orthogonality;
  log::info(line.str());
  log::debug("layer ", layer, " seconds: bases ", fit.seconds.bases, ", keys ", fit.seconds.keys, ", values ",
             fit.seconds.values, ", final refit ", fit.seconds.final);
}

}  // namespace

WindowSplit split_windows(int64_t samples, double validation_fraction) {
  if (samples < 2) {
    throw std::invalid_argument("rotation: at least 2 captured windows are needed (fit and validation), got " +
                                std::to_string(samples));
  }
  if (!(validation_fraction > 0 && validation_fraction < 1)) {
    throw std::invalid_argument("rotation: the validation fraction must be in (0, 1), got " +
                                std::to_string(validation_fraction));
  }
  const int64_t validation = std::clamp<int64_t>(
      static_cast<int64_t>(std::llround(static_cast<double>(samples) * validation_fraction)), 1, samples - 1);
  return {samples - validation, validation};
}

RotationLayerData read_rotation_layer(const ActivationStoreReader& store, const Checkpoint& checkpoint,
                                      const QuantizerSettings& settings, int64_t layer, int64_t windows,
                                      int64_t tokens, bool fisher) {
  const ModelFingerprint& model = store.layout().model;
  require_field(store, ActivationField::kQueries, "the objective attends with the captured queries");
  require_field(store, settings.keys_pre_rope ? ActivationField::kKeysPreRope : ActivationField::kKeysPostRope,
                "the configuration's keys");
  require_field(store, ActivationField::kValues, "values are rotated");
  if (fisher) {
    require_field(store, ActivationField::kFisherKeys, "Fisher-weighted grids");
    require_field(store, ActivationField::kFisherValues, "Fisher-weighted grids");
  }
  const LayerActivations a = read_layer_activations(store, settings, layer, windows, tokens, fisher, true);
  RotationLayerData data;
  data.queries = a.queries;
  data.keys = a.keys;
  data.values = a.values;
  data.fisher_keys = a.fisher_keys;
  data.fisher_values = a.fisher_values;
  data.o_proj = o_proj_weight(checkpoint, layer, model.hidden_size, model.num_heads * model.head_dim);
  if (settings.keys_pre_rope) data.rope = parse_rope_json(model.rope, store.path().string());
  return data;
}

ModelRotation rotate_model(const ActivationStoreReader& store, const std::filesystem::path& model_dir,
                           const QuantizerSettings& settings, const ModelRotationOptions& options) {
  const ModelFingerprint& model = store.layout().model;
  const RotationOptions& o = options.rotation;
  const Window window = window_of(store, options.max_samples, options.max_tokens, options.max_layers);
  const WindowSplit split = split_windows(window.samples, o.validation_fraction);
  const Checkpoint checkpoint(model_dir);
  check_same_model(store, model_dir, checkpoint);

  ModelRotation result;
  result.rotated.name = options.name.empty() ? std::string(method_name(settings.method)) + "-rot" : options.name;
  result.rotated.settings = settings;
  RotationSettings record = rotation_settings(settings, o);
  record.fit_samples = split.fit;
  record.validation_samples = split.validation;
  result.rotated.rotation = record;
  for (const RotationBasis basis : o.fixed_bases) {
    QuantizerConfig base;
    base.name = result.rotated.name + "-" + std::string(basis_name(basis));
    base.settings = settings;
    RotationSettings fixed = record;
    fixed.key_basis = settings.keys_pre_rope && basis != RotationBasis::kRandom ? RotationBasis::kIdentity : basis;
    fixed.value_basis = basis;
    fixed.steps = 0;
    base.rotation = fixed;
    result.bases.push_back(base);
  }
  log::info("rotating ", method_name(settings.method), " over ", window.layers, " layers: ", split.fit,
            " fit and ", split.validation, " validation windows of ", window.tokens, " tokens, on ",
            o.device.str());

  log::ProgressMeter progress("rotate", window.layers);
  for (int64_t layer = 0; layer < window.layers; ++layer) {
    const RotationLayerData data =
        read_rotation_layer(store, checkpoint, settings, layer, window.samples, window.tokens, settings.fisher_weighted)
            .to(o.device, o.dtype);
    const LayerRotationFit fit = fit_layer_rotation(settings, data.windows_slice(0, split.fit),
                                                    data.windows_slice(split.fit, split.validation), o);
    log_layer(layer, o, fit, orthogonality(settings, record, fit.learned.rotation, model.num_kv_heads, model.head_dim));
    result.rotated.layers.push_back(fit.learned);
    for (size_t i = 0; i < fit.bases.size(); ++i) result.bases[i].layers.push_back(fit.bases[i].quantizers);
    if (options.on_layer) options.on_layer(layer, fit);
    progress.advance(1, window.samples * window.tokens, "layer " + std::to_string(layer));
  }
  progress.finish();
  for (QuantizerConfig* config : [&] {
         std::vector<QuantizerConfig*> all{&result.rotated};
         for (QuantizerConfig& b : result.bases) all.push_back(&b);
         return all;
       }()) {
    for (const int64_t context : FitOptions().effective_bits_contexts) {
      config->effective_bits.emplace_back(context,
                                          effective_bits(settings, model.num_kv_heads, model.head_dim, context));
    }
  }
  return result;
}

std::vector<LayerAttentionTerms> measure_attention_terms(const ActivationStoreReader& store,
                                                         const std::filesystem::path& model_dir,
                                                         const QuantizerConfig& config,
                                                         const AttentionTermOptions& options) {
  const Window window = window_of(store, options.max_samples, options.max_tokens, options.max_layers);
  if (static_cast<int64_t>(config.layers.size()) < window.layers) {
    throw InputError(config.name, "layers",
                     "expected " + std::to_string(window.layers) + " layers, got " + std::to_string(config.layers.size()));
  }
  const Checkpoint checkpoint(model_dir);
  check_same_model(store, model_dir, checkpoint);
  c10::NoGradGuard no_grad;
  std::vector<LayerAttentionTerms> terms;
  for (int64_t layer = 0; layer < window.layers; ++layer) {
    const RotationLayerData data =
        read_rotation_layer(store, checkpoint, config.settings, layer, window.samples, window.tokens, false)
            .to(options.device, options.dtype);
    const AttentionObjective objective(data, options.last_queries);
    const at::Tensor keys = quantize_dequantize_keys(config, layer, data.keys).dequantized;
    const at::Tensor values = quantize_dequantize_values(config, layer, data.values).dequantized;
    const KeyTerms key = objective.key_terms(keys);
    const auto to_vector = [](const at::Tensor& t) {
      const at::Tensor c = t.to(at::kCPU, at::kDouble).contiguous();
      return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
    };
    terms.push_back({to_vector(key.kl), to_vector(key.output),
                     to_vector(key.total(options.key_kl_weight, options.key_output_weight)),
                     to_vector(objective.value_term(values, objective.exact_probabilities()))});
  }
  return terms;
}

}  // namespace kvforge
