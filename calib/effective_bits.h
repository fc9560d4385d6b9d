#pragma once
// Bits stored per cached element, everything counted: codes, scales and
// offsets, sparse outliers and the 16-bit windows, for one context length.
//
// Per tensor (keys, values), with b = bits, T = context, D = head_dim,
// G = group, f = outlier_fraction, E = exact tokens, q = (T - E) / T:
//   E = min(T, sink + residual + incomplete), incomplete = the tokens of
//       [sink, T - residual) past the last whole group (kPerChannelTokens);
//   bits = 16 E / T
//        + q (b + scales + f (16 + 16) + row pointers)
//        + per-channel costs
//   scales: 32 / G for runtime groupings (a 16-bit scale and offset per
//           group; kPerToken G = min(group, D)); kPerChannelOffline: a 16-bit scale and offset per channel
//           for the whole context, 32 / T per element (a per-channel cost);
//   outliers (f > 0): 16-bit value + 16-bit index each; the sparse pointer
//           is 32 bits per token per head for kPerToken tensors (values):
//           32 / D per quantized element, else 32 bits per channel (keys):
//           32 / T per element.
// The result averages keys and values.
#include <cstdint>

#include "formats/quantizer_config.h"

namespace kvforge {

double tensor_effective_bits(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                             int64_t head_dim, int64_t context);
double effective_bits(const QuantizerSettings& settings, int64_t head_dim, int64_t context);

}  // namespace kvforge
