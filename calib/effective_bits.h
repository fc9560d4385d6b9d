#pragma once
// Bits stored per cached element, everything counted: codes, scales and
// offsets, sparse outliers and the 16-bit windows, for one context length
// (docs/artifact.md's bit accounting).
//
// Per tensor (keys, values), with b = bits, T = context, D = head_dim,
// Hkv = kv_heads, G = group, f = outlier_fraction:
//   E = exact tokens (sink and the 16-bit window of the tensor's
//       residual_rule, quantize_simulation.h rule 1), q = (T - E) / T;
//   s = scale + offset bits per quantized element (a 16-bit scale and offset
//       per group): kPerToken 32 / min(G, D); kPerChannelTokens 32 / G;
//       kPerTokenAllHeads 32 / (Hkv D); kPerChannelOffline 0, it pays
//       c = 32 bits per channel for the whole context instead;
//   o = outliers (f > 0), stored per token in CSR rows (appendable while
//       decoding) for every grouping, keys included: each a 16-bit value and
//       a w-bit index into its token's span of n elements (n = Hkv D for
//       kPerTokenAllHeads, else D), w = 16 when n <= 65536 else 32, plus one
//       32-bit row pointer per token and span:
//       o = f_eff (16 + w) + 32 / n, f_eff = 2k / n (at most 1) for
//       kTokenTopBottom (the exact count of quantize_simulation.h rule 2),
//       the configured fraction otherwise, or the measured fraction when
//       one is given;
//   bits = 16 (1 - q) + q (b + s + o) + c / T.
// The result averages keys and values.
#include <cstdint>
#include <optional>

#include "formats/quantizer_config.h"

namespace kvforge {

// Outlier shares measured on activations (of the quantized elements), for
// effective bits at the measured rather than the nominal fraction.
struct OutlierFractions {
  double keys = 0;
  double values = 0;
};

double tensor_effective_bits(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                             int64_t kv_heads, int64_t head_dim, int64_t context,
                             std::optional<double> measured_outlier_fraction = std::nullopt);
double effective_bits(const QuantizerSettings& settings, int64_t kv_heads, int64_t head_dim, int64_t context,
                      const std::optional<OutlierFractions>& measured = std::nullopt);

}  // namespace kvforge
