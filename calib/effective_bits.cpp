#include "calib/effective_bits.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "calib/quantize_simulation.h"

namespace kvforge {
namespace {

// s of the header: scale and offset bits per quantized element.
double scale_bits(const TensorQuantizerSettings& tensor, int64_t kv_heads, int64_t head_dim) {
  switch (tensor.grouping) {
    case Grouping::kPerToken:
      return 32.0 / static_cast<double>(std::min(tensor.group, head_dim));
    case Grouping::kPerChannelTokens:
      return 32.0 / static_cast<double>(tensor.group);
    case Grouping::kPerTokenAllHeads:
      return 32.0 / static_cast<double>(kv_heads * head_dim);
    case Grouping::kPerChannelOffline:
      return 0.0;
  }
  throw std::invalid_argument("effective bits: unknown grouping");
}

// o of the header: outlier bits per quantized element.
double outlier_bits(const TensorQuantizerSettings& tensor, int64_t kv_heads, int64_t head_dim,
                    std::optional<double> measured) {
  if (tensor.outlier_fraction <= 0) return 0.0;
  const int64_t span = tensor.grouping == Grouping::kPerTokenAllHeads ? kv_heads * head_dim : head_dim;
  const double n = static_cast<double>(span);
  const double index_bits = span <= 65536 ? 16.0 : 32.0;
  double fraction = tensor.outlier_fraction;
  if (measured) {
    fraction = *measured;
  } else if (tensor.outlier_rule == OutlierRule::kTokenTopBottom) {
    fraction = std::min(1.0, 2.0 * static_cast<double>(top_bottom_count(span, tensor.outlier_fraction)) / n);
  }
  return fraction * (16.0 + index_bits) + 32.0 / n;
}

}  // namespace

double tensor_effective_bits(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                             int64_t kv_heads, int64_t head_dim, int64_t context,
                             std::optional<double> measured_outlier_fraction) {
  if (context < 1 || head_dim < 1 || kv_heads < 1) {
    throw std::invalid_argument("effective bits: context, kv_heads and head_dim must be >= 1, got " +
                                std::to_string(context) + ", " + std::to_string(kv_heads) + " and " +
                                std::to_string(head_dim));
  }
  const double tokens = static_cast<double>(context);
  const double quantized = static_cast<double>(quantized_tokens(settings, tensor, context).size()) / tokens;
  const double per_quantized = settings.bits + scale_bits(tensor, kv_heads, head_dim) +
                               outlier_bits(tensor, kv_heads, head_dim, measured_outlier_fraction);
  const double per_channel = tensor.grouping == Grouping::kPerChannelOffline ? 32.0 : 0.0;
  return 16 * (1.0 - quantized) + quantized * per_quantized + per_channel / tokens;
}

double effective_bits(const QuantizerSettings& settings, int64_t kv_heads, int64_t head_dim, int64_t context,
                      const std::optional<OutlierFractions>& measured) {
  const auto keys = measured ? std::optional<double>(measured->keys) : std::nullopt;
  const auto values = measured ? std::optional<double>(measured->values) : std::nullopt;
  return 0.5 * (tensor_effective_bits(settings, settings.keys, kv_heads, head_dim, context, keys) +
                tensor_effective_bits(settings, settings.values, kv_heads, head_dim, context, values));
}

}  // namespace kvforge
