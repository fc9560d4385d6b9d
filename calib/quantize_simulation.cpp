#include "calib/quantize_simulation.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "calib/group_quantizer.h"
#include "calib/kv_rotation.h"
#include "model/cpu_vector_math.h"

namespace kvforge {

at::Tensor channel_tensor(const Float32Array& array, int64_t heads, int64_t head_dim, const char* what,
                          const at::Device& device) {
  if (array.shape != std::vector<int64_t>{heads, head_dim} ||
      static_cast<int64_t>(array.values.size()) != heads * head_dim) {
    throw std::invalid_argument(std::string("quantizer ") + what + ": expected shape [" + std::to_string(heads) +
                                ", " + std::to_string(head_dim) + "]");
  }
  return at::tensor(at::ArrayRef<float>(array.values)).to(device, at::kDouble).view({heads, 1, head_dim});
}

namespace {

at::Tensor offline_normalized(const TensorQuantizer& quantizer, const at::Tensor& span) {
  const int64_t heads = span.size(-3), head_dim = span.size(-1);
  const at::Tensor offset = channel_tensor(quantizer.channel_offset, heads, head_dim, "channel_offset", span.device());
  const at::Tensor scale = channel_tensor(quantizer.channel_scale, heads, head_dim, "channel_scale", span.device());
  return (span - offset) / scale;
}

}  // namespace

int64_t top_bottom_count(int64_t n, double fraction) {
  if (n < 1 || !(fraction >= 0 && fraction < 1)) {
    throw std::invalid_argument("top_bottom_count: expected n >= 1 and a fraction in [0, 1)");
  }
  // The rank torch.quantile(w, 1 - f/2) interpolates at, (n - 1)(1 - f/2);
  // elements >= that quantile are the top k = n - ceil(rank). A rank that is
  // an integer in exact arithmetic may come out a few ulps above it in
  // float64 (e.g. n = 201, f = 0.01: 199): the tolerance keeps it integer.
  const double rank = static_cast<double>(n - 1) * (1 - fraction / 2);
  return n - static_cast<int64_t>(std::ceil(rank - 1e-9 * std::max(1.0, rank)));
}

namespace {

// Rule 2's kTokenTopBottom on rows [..., n]: a bool mask of the rows' shape.
at::Tensor top_bottom_mask(const at::Tensor& rows, double fraction) {
  const int64_t n = rows.size(-1);
  const int64_t k = top_bottom_count(n, fraction);
  at::Tensor mask = at::zeros(rows.sizes(), rows.options().dtype(at::kBool));
  if (k == 0 || rows.numel() == 0) return mask;
  if (2 * k >= n) return mask.fill_(true);
  // Stable sorts keep equal values in ascending channel order, both ways.
  const at::Tensor flat = rows.reshape({-1, n});
  const at::Tensor largest = std::get<1>(flat.sort(true, -1, true)).narrow(1, 0, k);
  const at::Tensor smallest = std::get<1>(flat.sort(true, -1, false)).narrow(1, 0, k);
  at::Tensor flat_mask = mask.view({-1, n});
  flat_mask.scatter_(1, largest, true);
  flat_mask.scatter_(1, smallest, true);
  return mask;
}

}  // namespace

at::Tensor outlier_mask(const TensorQuantizerSettings& tensor, const TensorQuantizer& quantizer,
                        const at::Tensor& span) {
  if (tensor.outlier_fraction <= 0) return at::zeros(span.sizes(), span.options().dtype(at::kBool));
  const int64_t heads = span.size(-3), head_dim = span.size(-1);
  if (tensor.grouping == Grouping::kPerChannelOffline) {
    const at::Tensor low = channel_tensor(quantizer.outlier_low, heads, head_dim, "outlier_low", span.device());
    const at::Tensor high = channel_tensor(quantizer.outlier_high, heads, head_dim, "outlier_high", span.device());
    return (span < low).logical_or(span > high);
  }
  switch (tensor.outlier_rule) {
    case OutlierRule::kTokenTopBottom:
      if (tensor.grouping == Grouping::kPerTokenAllHeads) {
        return from_all_head_rows(top_bottom_mask(to_all_head_rows(span), tensor.outlier_fraction), span);
      }
      return top_bottom_mask(span, tensor.outlier_fraction);
    case OutlierRule::kTokenTau: {
      const at::Tensor mean = span.mean(-1, true);
      prepare_cpu_vector_math();  // sqrt
      const at::Tensor std = (span - mean).square().mean(-1, true).sqrt();
      return (span - mean).abs() > std * static_cast<double>(quantizer.outlier_tau);
    }
    case OutlierRule::kNone:
    case OutlierRule::kChannelThresholds:
      break;
  }
  throw std::invalid_argument(std::string("outlier_mask: outlier_rule ") +
                              std::string(outlier_rule_name(tensor.outlier_rule)) + " with grouping " +
                              std::string(grouping_name(tensor.grouping)) + " and outlier fraction " +
                              std::to_string(tensor.outlier_fraction));
}

namespace {

at::Tensor quantize_offline_channels(const QuantizerSettings& settings, const TensorQuantizer& quantizer,
                                     const at::Tensor& span) {
  const int64_t heads = span.size(-3), head_dim = span.size(-1);
  const at::Tensor offset = channel_tensor(quantizer.channel_offset, heads, head_dim, "channel_offset", span.device());
  const at::Tensor scale = channel_tensor(quantizer.channel_scale, heads, head_dim, "channel_scale", span.device());
  const at::Tensor codes = offline_codes(settings, quantizer, span);
  at::Tensor level;
  if (!quantizer.grid.empty()) {
    level = at::tensor(at::ArrayRef<float>(quantizer.grid))
                .to(span.device(), at::kDouble)
                .index_select(0, codes.reshape({-1}))
                .view(span.sizes());
  } else {
    const double top = static_cast<double>((int64_t{1} << settings.bits) - 1);
    level = codes.to(at::kDouble) * 2 / top - 1;
  }
  return offset + scale * level;
}

}  // namespace

at::Tensor offline_codes(const QuantizerSettings& settings, const TensorQuantizer& quantizer, const at::Tensor& span) {
  const at::Tensor normalized = offline_normalized(quantizer, span);
  if (!quantizer.grid.empty()) return level_codes(normalized, quantizer.grid, quantizer.encode_grid);
  const double top = static_cast<double>((int64_t{1} << settings.bits) - 1);
  return at::round((normalized + 1) * top / 2).clamp(0.0, top).to(at::kLong);
}

TokenSpan quantized_tokens(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor, int64_t tokens) {
  TokenSpan span;
  span.begin = std::clamp<int64_t>(settings.sink_tokens, 0, tokens);
  const int64_t residual = settings.residual_tokens;
  const bool channel_groups = tensor.grouping == Grouping::kPerChannelTokens;
  if (channel_groups && tensor.group < 1) throw std::invalid_argument("per_channel_tokens group must be >= 1");
  switch (tensor.residual_rule) {
    case ResidualRule::kSliding:
      span.end = std::max(span.begin, tokens - std::max<int64_t>(residual, 0));
      if (channel_groups) span.end = span.begin + span.size() / tensor.group * tensor.group;
      return span;
    case ResidualRule::kBlockFlush:
      if (residual < 1) {
        throw std::invalid_argument("block_flush needs residual_tokens >= 1, got " + std::to_string(residual));
      }
      if (channel_groups && residual % tensor.group != 0) {
        throw std::invalid_argument("block_flush with per_channel_tokens needs residual_tokens (" +
                                    std::to_string(residual) + ") a multiple of the group (" +
                                    std::to_string(tensor.group) + ")");
      }
      span.end = span.begin + (tokens - span.begin) / residual * residual;
      return span;
  }
  throw std::invalid_argument("quantized_tokens: unknown residual rule");
}

SimulatedTensor simulate_quantization(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                                      const TensorQuantizer& quantizer, const at::Tensor& x) {
  if (x.dim() < 3) throw std::invalid_argument("simulate_quantization: expected [..., kv_heads, T, D]");
  const TokenSpan tokens = quantized_tokens(settings, tensor, x.size(-2));
  const at::Tensor exact = x.to(at::kDouble);
  at::Tensor result = exact.clone();
  at::Tensor outliers = at::zeros(x.sizes(), x.options().dtype(at::kBool));
  if (tokens.size() > 0) {
    const at::Tensor span = exact.narrow(-2, tokens.begin, tokens.size());
    const at::Tensor mask = outlier_mask(tensor, quantizer, span);
    at::Tensor quantized;
    if (tensor.grouping == Grouping::kPerChannelOffline) {
      quantized = at::where(mask, span, quantize_offline_channels(settings, quantizer, span));
    } else {
      const GroupQuantizer group{settings.bits, quantizer.clip_ratio, quantizer.grid, quantizer.encode_grid};
      quantized = quantize_dequantize_grouped(span, tensor.grouping, tensor.group, group,
                                              tensor.outlier_fraction > 0 ? mask.logical_not() : at::Tensor());
    }
    result.narrow(-2, tokens.begin, tokens.size()).copy_(quantized);
    outliers.narrow(-2, tokens.begin, tokens.size()).copy_(mask);
  }
  return {result.to(x.scalar_type()), outliers};
}

NormalizedInliers normalized_inliers(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                                     const TensorQuantizer& quantizer, const at::Tensor& x,
                                     const at::Tensor& weights) {
  if (x.dim() < 3) throw std::invalid_argument("normalized_inliers: expected [..., kv_heads, T, D]");
  if (weights.defined() && weights.sizes() != x.sizes()) {
    throw std::invalid_argument("normalized_inliers: weights and x differ in shape");
  }
  const TokenSpan tokens = quantized_tokens(settings, tensor, x.size(-2));
  NormalizedInliers result;
  const at::Tensor span = x.narrow(-2, tokens.begin, tokens.size()).to(at::kDouble);
  const at::Tensor outliers = outlier_mask(tensor, quantizer, span);
  at::Tensor normalized;
  if (tensor.grouping == Grouping::kPerChannelOffline) {
    normalized = offline_normalized(quantizer, span).masked_fill(outliers, std::nan(""));
  } else {
    normalized = normalize_grouped(span, tensor.grouping, tensor.group, quantizer.clip_ratio,
                                   tensor.outlier_fraction > 0 ? outliers.logical_not() : at::Tensor());
  }
  const at::Tensor keep = normalized.isnan().logical_not();
  result.values = normalized.masked_select(keep).to(at::kFloat);
  if (weights.defined()) {
    result.weights = weights.narrow(-2, tokens.begin, tokens.size()).to(at::kFloat).masked_select(keep);
  }
  return result;
}

namespace {
const LayerQuantizers& layer_of(const QuantizerConfig& config, int64_t layer) {
  if (layer < 0 || layer >= static_cast<int64_t>(config.layers.size())) {
    throw std::out_of_range("quantizer config " + config.name + ": no layer " + std::to_string(layer));
  }
  return config.layers[static_cast<size_t>(layer)];
}
}  // namespace

namespace {
// Rotation (formats/kv_rotation.h): quantize x' = (x - c) R, return
// x^ = x'^ R^T + c in x's own domain, outlier flags of the rotated elements.
SimulatedTensor simulate_rotated(const QuantizerConfig& config, const TensorQuantizerSettings& tensor,
                                 const TensorQuantizer& quantizer, const TensorRotation& rotation, RotationForm form,
                                 const at::Tensor& x) {
  if (!config.rotation || form == RotationForm::kNone) {
    return simulate_quantization(config.settings, tensor, quantizer, x);
  }
  const int64_t heads = x.size(-3), head_dim = x.size(-1);
  const at::TensorOptions options = x.options().dtype(at::kDouble);
  const at::Tensor matrices = rotation_matrices(rotation, form, heads, head_dim, options);
  const at::Tensor centre = rotation_centre(rotation, heads, head_dim, options);
  at::Tensor shifted = x.to(at::kDouble);
  if (centre.defined()) shifted = shifted - centre;
  SimulatedTensor rotated = simulate_quantization(config.settings, tensor, quantizer, rotate(shifted, matrices));
  at::Tensor back = unrotate(rotated.dequantized.to(at::kDouble), matrices);
  if (centre.defined()) back = back + centre;
  return {back.to(x.scalar_type()), rotated.outliers};
}
}  // namespace

SimulatedTensor quantize_dequantize_keys(const QuantizerConfig& config, int64_t layer, const at::Tensor& keys) {
  const LayerQuantizers& quantizers = layer_of(config, layer);
  return simulate_rotated(config, config.settings.keys, quantizers.keys, quantizers.rotation.keys,
                          config.rotation ? config.rotation->keys : RotationForm::kNone, keys);
}

SimulatedTensor quantize_dequantize_values(const QuantizerConfig& config, int64_t layer, const at::Tensor& values) {
  const LayerQuantizers& quantizers = layer_of(config, layer);
  return simulate_rotated(config, config.settings.values, quantizers.values, quantizers.rotation.values,
                          config.rotation ? config.rotation->values : RotationForm::kNone, values);
}

}  // namespace kvforge
