#include "calib/effective_bits.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "calib/quantize_simulation.h"

namespace kvforge {

double tensor_effective_bits(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                             int64_t head_dim, int64_t context) {
  if (context < 1 || head_dim < 1) {
    throw std::invalid_argument("effective bits: context and head_dim must be >= 1, got " + std::to_string(context) +
                                " and " + std::to_string(head_dim));
  }
  const double tokens = static_cast<double>(context);
  const double quantized = static_cast<double>(quantized_tokens(settings, tensor, context).size()) / tokens;
  const double exact = 1.0 - quantized;
  double per_quantized = settings.bits;
  double per_channel = 0;  // bits per channel for the whole context
  if (tensor.grouping == Grouping::kPerChannelOffline) {
    per_channel += 32;
  } else if (tensor.grouping == Grouping::kPerToken) {
    per_quantized += 32.0 / static_cast<double>(std::min(tensor.group, head_dim));
  } else {
    per_quantized += 32.0 / static_cast<double>(tensor.group);
  }
  if (tensor.outlier_fraction > 0) {
    per_quantized += tensor.outlier_fraction * 32;
    if (tensor.grouping == Grouping::kPerToken) {
      per_quantized += 32.0 / static_cast<double>(head_dim);  // one row pointer per token
    } else {
      per_channel += 32;  // one pointer per channel
    }
  }
  return 16 * exact + quantized * per_quantized + per_channel / tokens;
}

double effective_bits(const QuantizerSettings& settings, int64_t head_dim, int64_t context) {
  return 0.5 * (tensor_effective_bits(settings, settings.keys, head_dim, context) +
                tensor_effective_bits(settings, settings.values, head_dim, context));
}

}  // namespace kvforge
