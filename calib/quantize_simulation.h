#pragma once
// Simulated KV-cache quantization: what the runtime would store for a window
// of keys or values, dequantized back to floats. Calibration statistics,
// `inspect`, the bench table and eval use it; kernels must agree with it.
//
// A window of T positions (0..T-1) is quantized as follows, for keys and for
// values alike, each with its TensorQuantizerSettings and its layer's
// TensorQuantizer (arithmetic in float64, result in the input's dtype):
//
// 1. 16-bit tokens. Positions < sink_tokens and the newest residual_tokens
//    are kept exact; the rest, [begin, end) with begin = min(sink, T) and
//    end = max(begin, T - residual), is quantized. kPerChannelTokens groups
//    run from `begin` in steps of `group` tokens; the tokens of an incomplete
//    last group stay exact too (end is rounded down to a whole group).
// 2. Outliers (outlier_fraction > 0), kept exact:
//    kPerChannelOffline: x < outlier_low[h, c] or x > outlier_high[h, c];
//    runtime groupings (kPerToken, kPerChannelTokens):
//    |x - mean_t| > outlier_tau * std_t, mean_t and std_t (population) over
//    the token's head_dim channels, all of them. Outliers take no part in
//    their group's min and max.
// 3. The other elements (inliers):
//    kPerChannelOffline: n = (x - channel_offset[h, c]) / channel_scale[h, c];
//      with a grid x^ = offset + scale * nearest_level(n) (ties to the lower
//      level); without, uniform levels on [-1, 1]:
//      code = clamp(round_half_even((n + 1) * (2^b - 1) / 2), 0, 2^b - 1),
//      x^ = offset + scale * (code * 2 / (2^b - 1) - 1).
//    kPerToken / kPerChannelTokens: group_quantizer.h's min/max arithmetic
//      over the group's inliers with the layer's clip_ratio and grid.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "formats/quantizer_config.h"

namespace kvforge {

struct SimulatedTensor {
  at::Tensor dequantized;  // the input's shape and dtype; exact where not quantized
  at::Tensor outliers;     // bool, the input's shape: elements kept exact as outliers
};

// The span [begin, end) of positions quantized in a window of `tokens`.
struct TokenSpan {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
TokenSpan quantized_tokens(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor, int64_t tokens);

// x: [..., kv_heads, T, D] float (any leading batch axes), positions 0..T-1.
SimulatedTensor simulate_quantization(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                                      const TensorQuantizer& quantizer, const at::Tensor& x);

// Rule 2 on the quantized span x [..., kv_heads, S, D] (float64): the
// outliers, all false when outlier_fraction is 0.
at::Tensor outlier_mask(const TensorQuantizerSettings& tensor, const TensorQuantizer& quantizer, const at::Tensor& x);

// Rule 3's normalized domain, where grids live: n for every inlier of the
// quantized span that is rounded (not for outliers or constant groups),
// flattened to float32, with the same elements of `weights` (x's shape;
// undefined: none).
struct NormalizedInliers {
  at::Tensor values;   // float32 [n]
  at::Tensor weights;  // float32 [n], or undefined
};
NormalizedInliers normalized_inliers(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                                     const TensorQuantizer& quantizer, const at::Tensor& x,
                                     const at::Tensor& weights = {});

// keys: [..., kv_heads, T, D], pre-RoPE when config.settings.keys_pre_rope,
// else post-RoPE; returned in the same domain.
SimulatedTensor quantize_dequantize_keys(const QuantizerConfig& config, int64_t layer, const at::Tensor& keys);
SimulatedTensor quantize_dequantize_values(const QuantizerConfig& config, int64_t layer, const at::Tensor& values);

}  // namespace kvforge
