#include "calib/quantizer_fit.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "calib/calibration_stats.h"
#include "calib/effective_bits.h"
#include "calib/fingerprint_rope.h"
#include "calib/float32_array.h"
#include "calib/grid_fit.h"
#include "calib/group_quantizer.h"
#include "calib/outlier_thresholds.h"
#include "calib/quantize_simulation.h"
#include "formats/input_error.h"
#include "log/log.h"
#include "model/rope.h"

namespace kvforge {
namespace {

void check_group(const char* option, const TensorQuantizerSettings& tensor, int64_t head_dim) {
  if (tensor.grouping == Grouping::kPerChannelOffline || tensor.grouping == Grouping::kPerTokenAllHeads) return;
  if (tensor.group < 1) throw std::invalid_argument(std::string(option) + " must be >= 1");
  if (tensor.grouping == Grouping::kPerToken && tensor.group < head_dim && head_dim % tensor.group != 0) {
    throw std::invalid_argument(std::string(option) + " " + std::to_string(tensor.group) +
                                " must divide head_dim " + std::to_string(head_dim) + " (or be at least head_dim)");
  }
}

std::vector<double> clip_candidates(const FitOptions& options) {
  if (!options.clip_candidates.empty()) return options.clip_candidates;
  std::vector<double> candidates;
  for (int i = 100; i >= 50; --i) candidates.push_back(i / 100.0);
  return candidates;
}

bool clip_search(const FitOptions& options) {
  return options.clip_search.value_or(options.method == QuantMethod::kInt2Rot);
}

// The fit's view of the settings: no residual window (see the header), so
// every position past the sink (in whole token groups) is fitted on.
QuantizerSettings fit_view(QuantizerSettings settings) {
  settings.residual_tokens = 0;
  settings.keys.residual_rule = settings.values.residual_rule = ResidualRule::kSliding;
  return settings;
}
TensorQuantizerSettings fit_view(TensorQuantizerSettings tensor) {
  tensor.residual_rule = ResidualRule::kSliding;
  return tensor;
}

// The clip ratio with the least squared error on the fit positions (the
// first of equals: the largest ratio).
double search_clip_ratio(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                         const TensorQuantizer& quantizer, const at::Tensor& x, const FitOptions& options) {
  const QuantizerSettings view = fit_view(settings);
  const TokenSpan tokens = quantized_tokens(view, fit_view(tensor), x.size(-2));
  if (tokens.size() == 0) return 1.0;
  at::Tensor span = x.narrow(-2, tokens.begin, tokens.size()).to(at::kDouble);
  if (tensor.grouping == Grouping::kPerToken) {
    // Token rows are independent groups: an evenly strided subset of them.
    span = span.reshape({-1, span.size(-1)});
    const int64_t rows = span.size(0);
    const int64_t limit = std::max<int64_t>(options.clip_search_rows, 1);
    if (rows > limit) span = span.slice(0, 0, rows, (rows + limit - 1) / limit);
    span = span.unsqueeze(0).unsqueeze(0);  // [1, 1, rows, D]
  }
  const at::Tensor outliers = outlier_mask(tensor, quantizer, span);
  const at::Tensor inliers = tensor.outlier_fraction > 0 ? outliers.logical_not() : at::Tensor();
  double best_ratio = 1.0, best_error = std::numeric_limits<double>::infinity();
  for (const double ratio : clip_candidates(options)) {
    const GroupQuantizer group{settings.bits, ratio, quantizer.grid, quantizer.encode_grid};
    const at::Tensor approx = quantize_dequantize_grouped(span, tensor.grouping, tensor.group, group, inliers);
    const double error = (approx - span).square().sum().item<double>();
    if (error < best_error) {
      best_error = error;
      best_ratio = ratio;
    }
  }
  return best_ratio;
}

}  // namespace

TensorQuantizer fit_tensor_quantizer(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                                     const at::Tensor& x, const at::Tensor& fisher, const FitOptions& options) {
  const QuantizerSettings view = fit_view(settings);
  const TokenSpan tokens = quantized_tokens(view, fit_view(tensor), x.size(-2));
  TensorQuantizer quantizer;
  if (tokens.size() == 0) {
    log::debug("calibration windows of ", x.size(-2), " tokens leave nothing to fit past the ", settings.sink_tokens,
               " sink tokens; parameters left at their defaults");
    if (tensor.grouping == Grouping::kPerChannelOffline) {
      throw std::invalid_argument("per-channel calibration needs windows longer than the sink");
    }
    if (tensor.non_uniform) quantizer.grid = to_float_grid(weighted_kmeans_1d({}, {}, 1 << settings.bits));
    return quantizer;
  }
  const at::Tensor span = x.narrow(-2, tokens.begin, tokens.size());
  const double fraction = tensor.outlier_fraction;
  if (tensor.grouping == Grouping::kPerChannelOffline) {
    const ChannelThresholds thresholds = fit_channel_thresholds(span, fraction);
    quantizer.channel_offset = float32_array(thresholds.offset);
    quantizer.channel_scale = float32_array(thresholds.scale);
    if (fraction > 0) {
      quantizer.outlier_low = float32_array(thresholds.low);
      quantizer.outlier_high = float32_array(thresholds.high);
    }
  } else if (tensor.outlier_rule == OutlierRule::kTokenTau) {
    quantizer.outlier_tau = static_cast<float>(fit_outlier_tau(span, fraction));
  }
  if (tensor.non_uniform) {
    const at::Tensor weights = settings.fisher_weighted ? fisher : at::Tensor();
    const NormalizedInliers inliers = normalized_inliers(view, fit_view(tensor), quantizer, x, weights);
    quantizer.grid = fit_grid(inliers.values, inliers.weights, settings.bits, options.kmeans);
    switch (tensor.q_norm) {
      case QNorm::kNone:
        break;
      case QNorm::kAffine:
        quantizer.encode_grid = quantizer.grid;
        quantizer.grid = q_norm_affine_grid(quantizer.encode_grid, inliers.values, inliers.weights);
        break;
      case QNorm::kIterated:
        quantizer.grid = q_norm_iterated_grid(quantizer.grid, inliers.values);
        break;
    }
  }
  if (tensor.grouping != Grouping::kPerChannelOffline && clip_search(options)) {
    quantizer.clip_ratio = static_cast<float>(search_clip_ratio(settings, tensor, quantizer, x, options));
  }
  return quantizer;
}

namespace {

double outlier_share(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                     const SimulatedTensor& simulated) {
  const at::Tensor& mask = simulated.outliers;
  const int64_t quantized = quantized_tokens(settings, tensor, mask.size(-2)).size();
  const int64_t elements = mask.numel() / mask.size(-2) * quantized;
  return elements > 0 ? static_cast<double>(mask.sum().item<int64_t>()) / static_cast<double>(elements) : 0.0;
}

void check_activations(const LayerActivations& a) {
  const auto same = [&](const at::Tensor& t) { return !t.defined() || t.sizes() == a.keys.sizes(); };
  if (!a.keys.defined() || !a.values.defined() || a.keys.dim() != 4 || a.values.sizes() != a.keys.sizes() ||
      !same(a.fisher_keys) || !same(a.fisher_values) || !same(a.keys_post_rope)) {
    throw std::invalid_argument("fit_layer: keys, values and Fisher must be [N, kv_heads, T, D] alike");
  }
}

}  // namespace

QuantizerSettings resolve_settings(const FitOptions& options, int64_t head_dim) {
  if (options.bits < 1 || options.bits > 8) {
    throw std::invalid_argument("bits must be in 1..8, got " + std::to_string(options.bits));
  }
  if (head_dim < 1) throw std::invalid_argument("head_dim must be >= 1");
  QuantizerSettings s;
  s.method = options.method;
  s.bits = options.bits;
  double fraction = 0;
  bool non_uniform = false, fisher = false;
  switch (options.method) {
    case QuantMethod::kKvquant:
      s.keys_pre_rope = true;
      s.keys = {Grouping::kPerChannelOffline, 0};
      s.values = {Grouping::kPerTokenAllHeads, 0};
      s.sink_tokens = 1;
      fraction = 0.01;
      non_uniform = fisher = true;
      break;
    case QuantMethod::kKivi:
      s.keys = {Grouping::kPerChannelTokens, 32};
      s.keys.residual_rule = ResidualRule::kBlockFlush;
      s.values = {Grouping::kPerToken, 32};
      s.residual_tokens = 128;
      break;
    case QuantMethod::kInt2Rot:
      s.keys = {Grouping::kPerToken, head_dim};
      s.values = {Grouping::kPerToken, head_dim};
      s.sink_tokens = 64;
      s.residual_tokens = 256;
      break;
    case QuantMethod::kRtn:
      s.keys = {Grouping::kPerToken, head_dim};
      s.values = {Grouping::kPerToken, head_dim};
      break;
  }
  fraction = options.outlier_fraction.value_or(fraction);
  if (!(fraction >= 0 && fraction < 1)) {
    throw std::invalid_argument("outlier_fraction must be in [0, 1), got " + std::to_string(fraction));
  }
  non_uniform = options.non_uniform.value_or(non_uniform);
  s.fisher_weighted = non_uniform && options.fisher.value_or(fisher);
  // The paper's Q-Norm at 2 bits only (its checkpoints use it there).
  const QNorm q_norm = non_uniform ? options.q_norm.value_or(s.bits == 2 ? QNorm::kAffine : QNorm::kNone) : QNorm::kNone;
  if (options.value_grouping) {
    if (*options.value_grouping == Grouping::kPerTokenAllHeads) {
      s.values = {Grouping::kPerTokenAllHeads, 0};
    } else if (*options.value_grouping == Grouping::kPerToken) {
      if (s.values.grouping != Grouping::kPerToken) s.values = {Grouping::kPerToken, head_dim};
    } else {
      throw std::invalid_argument("value grouping must be per_token or per_token_all_heads, got " +
                                  std::string(grouping_name(*options.value_grouping)));
    }
  }
  if (options.key_residual_rule) s.keys.residual_rule = *options.key_residual_rule;
  const OutlierRule runtime_rule = options.value_outlier_rule.value_or(OutlierRule::kTokenTopBottom);
  if (runtime_rule != OutlierRule::kTokenTopBottom && runtime_rule != OutlierRule::kTokenTau) {
    throw std::invalid_argument("value outlier rule must be token_top_bottom or token_tau, got " +
                                std::string(outlier_rule_name(runtime_rule)));
  }
  // tau is per token and head: the tau variant scales values per head too
  // (per_token, group head_dim) unless the value grouping was asked for.
  if (runtime_rule == OutlierRule::kTokenTau && fraction > 0 && s.values.grouping == Grouping::kPerTokenAllHeads) {
    if (options.value_grouping) {
      throw std::invalid_argument("value outlier rule token_tau is per head: it needs per-head value scaling "
                                  "(per_token), not per_token_all_heads");
    }
    s.values = {Grouping::kPerToken, head_dim};
  }
  for (TensorQuantizerSettings* t : {&s.keys, &s.values}) {
    t->non_uniform = non_uniform;
    t->q_norm = q_norm;
    t->outlier_fraction = fraction;
    if (fraction == 0) {
      t->outlier_rule = OutlierRule::kNone;
    } else {
      t->outlier_rule = t->grouping == Grouping::kPerChannelOffline ? OutlierRule::kChannelThresholds : runtime_rule;
    }
  }
  const auto ungrouped = [](const TensorQuantizerSettings& t) {
    return t.grouping == Grouping::kPerChannelOffline || t.grouping == Grouping::kPerTokenAllHeads;
  };
  if (options.key_group && !ungrouped(s.keys)) s.keys.group = *options.key_group;
  if (options.value_group && !ungrouped(s.values)) s.values.group = *options.value_group;
  if (options.sink_tokens) s.sink_tokens = *options.sink_tokens;
  if (options.residual_tokens) s.residual_tokens = *options.residual_tokens;
  if (s.sink_tokens < 0 || s.residual_tokens < 0) {
    throw std::invalid_argument("sink and residual tokens must be >= 0");
  }
  check_group("key group", s.keys, head_dim);
  check_group("value group", s.values, head_dim);
  // The windows' own checks (block_flush: residual > 0, a multiple of the group).
  for (const TensorQuantizerSettings* t : {&s.keys, &s.values}) quantized_tokens(s, *t, s.residual_tokens + 1);
  return s;
}

CalibrationSubset calibration_subset(int64_t samples, int64_t seq_len, int64_t max_calibration_tokens) {
  CalibrationSubset subset{samples, seq_len};
  if (max_calibration_tokens > 0 && samples > 0) {
    subset.tokens = std::min(seq_len, max_calibration_tokens);
    subset.windows = std::clamp<int64_t>(max_calibration_tokens / subset.tokens, 1, samples);
  }
  return subset;
}

namespace {
// The measures of simulated keys and values (in the activations' domain).
LayerCalibrationStats measure_simulated(const QuantizerSettings& settings, const SimulatedTensor& keys,
                                        const SimulatedTensor& values, const LayerActivations& activations,
                                        const RopeConfig* rope) {
  LayerCalibrationStats stats;
  stats.key_relative_mse = tensor_error(activations.keys, keys.dequantized).relative();
  stats.value_relative_mse = tensor_error(activations.values, values.dequantized).relative();
  stats.key_outlier_fraction = outlier_share(settings, settings.keys, keys);
  stats.value_outlier_fraction = outlier_share(settings, settings.values, values);
  if (activations.queries.defined()) {
    at::Tensor reference = activations.keys_post_rope.defined() ? activations.keys_post_rope : activations.keys;
    at::Tensor approx = keys.dequantized;
    if (settings.keys_pre_rope) {
      if (rope == nullptr || !activations.keys_post_rope.defined()) {
        throw std::invalid_argument("measure_layer: pre-RoPE keys need the RoPE settings and post-RoPE reference keys");
      }
      const RotaryEmbedding rotary(*rope, approx.size(-1), approx.device());
      approx = RotaryEmbedding::apply(approx.to(at::kDouble), rotary.tables(0, approx.size(-2), at::kDouble));
    }
    stats.logit_relative_mse = logit_error(activations.queries, reference, approx).relative();
  }
  return stats;
}
}  // namespace

LayerCalibrationStats measure_layer(const QuantizerSettings& settings, const LayerQuantizers& quantizers,
                                    const LayerActivations& activations, const RopeConfig* rope) {
  return measure_simulated(settings, simulate_quantization(settings, settings.keys, quantizers.keys, activations.keys),
                           simulate_quantization(settings, settings.values, quantizers.values, activations.values),
                           activations, rope);
}

LayerCalibrationStats measure_layer(const QuantizerConfig& config, int64_t layer,
                                    const LayerActivations& activations, const RopeConfig* rope) {
  return measure_simulated(config.settings, quantize_dequantize_keys(config, layer, activations.keys),
                           quantize_dequantize_values(config, layer, activations.values), activations, rope);
}

LayerQuantizers fit_layer(const QuantizerSettings& settings, const LayerActivations& activations,
                          const FitOptions& options, const RopeConfig* rope) {
  check_activations(activations);
  LayerQuantizers layer;
  layer.keys = fit_tensor_quantizer(settings, settings.keys, activations.keys, activations.fisher_keys, options);
  layer.values =
      fit_tensor_quantizer(settings, settings.values, activations.values, activations.fisher_values, options);
  layer.stats = measure_layer(settings, layer, activations, rope);
  return layer;
}

namespace {

// One field of one layer over the calibration subset: [N, heads, T, D].
at::Tensor read_field(const ActivationStoreReader& store, ActivationField field, int64_t layer, int64_t windows,
                      int64_t tokens) {
  const ModelFingerprint& model = store.layout().model;
  const int64_t heads = uses_query_heads(field) ? model.num_heads : model.num_kv_heads;
  const int64_t length = store.layout().provenance.seq_len;
  std::vector<at::Tensor> per_head;
  for (int64_t head = 0; head < heads; ++head) {
    std::vector<float> data = store.read_head(field, layer, head, 0, windows);
    per_head.push_back(at::from_blob(data.data(), {windows, length, model.head_dim}, at::kFloat)
                           .narrow(1, 0, tokens)
                           .clone());
  }
  return at::stack(per_head, 1);
}

bool has_field(const ActivationStoreReader& store, ActivationField field) {
  const auto& fields = store.layout().fields;
  return std::find(fields.begin(), fields.end(), field) != fields.end();
}

void require_field(const ActivationStoreReader& store, ActivationField field, const std::string& why,
                   const std::string& otherwise = "") {
  if (!has_field(store, field)) {
    throw InputError(store.path().string(), "fields",
                     "expected field " + std::string(field_name(field)) + " (" + why +
                         "): capture it (capture --fields)" + otherwise);
  }
}

}  // namespace

LayerActivations read_layer_activations(const ActivationStoreReader& store, const QuantizerSettings& settings,
                                        int64_t layer, int64_t windows, int64_t tokens, bool fisher, bool logits) {
  const ActivationField key_field = settings.keys_pre_rope ? ActivationField::kKeysPreRope
                                                           : ActivationField::kKeysPostRope;
  LayerActivations a;
  a.keys = read_field(store, key_field, layer, windows, tokens);
  a.values = read_field(store, ActivationField::kValues, layer, windows, tokens);
  if (fisher) {
    a.fisher_keys = read_field(store, ActivationField::kFisherKeys, layer, windows, tokens);
    a.fisher_values = read_field(store, ActivationField::kFisherValues, layer, windows, tokens);
  }
  if (logits) {
    a.queries = read_field(store, ActivationField::kQueries, layer, windows, tokens);
    if (settings.keys_pre_rope) a.keys_post_rope = read_field(store, ActivationField::kKeysPostRope, layer, windows, tokens);
  }
  return a;
}

LayerActivations load_layer_activations(const ActivationStoreReader& store, const QuantizerSettings& settings,
                                        int64_t layer, int64_t max_samples) {
  const ActivationField key_field = settings.keys_pre_rope ? ActivationField::kKeysPreRope
                                                           : ActivationField::kKeysPostRope;
  require_field(store, key_field, "the configuration's keys");
  require_field(store, ActivationField::kValues, "values are quantized");
  const bool logits = has_field(store, ActivationField::kQueries) &&
                      (!settings.keys_pre_rope || has_field(store, ActivationField::kKeysPostRope));
  const int64_t samples = store.samples_complete();
  if (samples < 1) throw InputError(store.path().string(), "samples_complete", "expected at least one sample");
  const int64_t windows = max_samples > 0 ? std::min(max_samples, samples) : samples;
  return read_layer_activations(store, settings, layer, windows, store.layout().provenance.seq_len, false, logits);
}

QuantizerConfig fit_quantizers(const ActivationStoreReader& store, const FitOptions& options) {
  const ModelFingerprint& model = store.layout().model;
  QuantizerConfig config;
  config.name = options.name.empty() ? std::string(method_name(options.method)) : options.name;
  config.settings = resolve_settings(options, model.head_dim);
  const QuantizerSettings& settings = config.settings;

  const int64_t samples = store.samples_complete();
  const int64_t length = store.layout().provenance.seq_len;
  if (samples < 1) throw InputError(store.path().string(), "samples_complete", "expected at least one sample");
  const CalibrationSubset subset = calibration_subset(samples, length, options.max_calibration_tokens);
  const int64_t tokens = subset.tokens, windows = subset.windows;
  const ActivationField key_field = settings.keys_pre_rope ? ActivationField::kKeysPreRope
                                                           : ActivationField::kKeysPostRope;
  require_field(store, key_field, settings.keys_pre_rope ? "the method quantizes pre-RoPE keys"
                                                         : "the method quantizes post-RoPE keys");
  require_field(store, ActivationField::kValues, "values are quantized");
  const bool fisher = settings.fisher_weighted;
  if (fisher) {
    require_field(store, ActivationField::kFisherKeys, "Fisher-weighted grids", " or fit without Fisher weighting");
    require_field(store, ActivationField::kFisherValues, "Fisher-weighted grids", " or fit without Fisher weighting");
  }
  const bool logits = has_field(store, ActivationField::kQueries) &&
                      (!settings.keys_pre_rope || has_field(store, ActivationField::kKeysPostRope));
  if (!logits) log::warn(store.path().string(), ": no q (or k_post) field: the logit statistic is left at 0");
  const RopeConfig rope = parse_rope_json(model.rope, store.path().string());
  log::info("fitting ", config.name, " (", method_name(settings.method), ", ", settings.bits, " bits) on ", windows,
            " windows x ", tokens, " tokens");
  if (settings.sink_tokens >= tokens) {
    log::warn("calibration windows of ", tokens, " tokens are not longer than the ", settings.sink_tokens,
              " sink tokens: nothing to fit, parameters left at their defaults");
  } else if (settings.sink_tokens + settings.residual_tokens >= tokens) {
    log::warn("calibration windows of ", tokens, " tokens are not longer than sink + residual (",
              settings.sink_tokens + settings.residual_tokens, "): the statistics see nothing quantized");
  }

  for (int64_t layer = 0; layer < model.num_layers; ++layer) {
    const LayerActivations a = read_layer_activations(store, settings, layer, windows, tokens, fisher, logits);
    config.layers.push_back(fit_layer(settings, a, options, &rope));
    const LayerCalibrationStats& s = config.layers.back().stats;
    log::info("layer ", layer, ": key rel. MSE ", s.key_relative_mse, ", value rel. MSE ", s.value_relative_mse,
              ", logit rel. MSE ", s.logit_relative_mse, ", outliers ", s.key_outlier_fraction, " / ",
              s.value_outlier_fraction);
  }
  for (const int64_t context : options.effective_bits_contexts) {
    config.effective_bits.emplace_back(context, effective_bits(settings, model.num_kv_heads, model.head_dim, context));
  }
  return config;
}

}  // namespace kvforge
