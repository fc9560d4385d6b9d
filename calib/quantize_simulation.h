#pragma once
// Simulated KV-cache quantization: what the runtime would store for a window
// of keys or values, dequantized back to floats. Calibration statistics,
// `inspect`, the bench table and eval use it; kernels must agree with it.
//
// A window of T positions (0..T-1) is quantized as follows, for keys and for
// values alike, each with its TensorQuantizerSettings and its layer's
// TensorQuantizer (arithmetic in float64, result in the input's dtype);
// docs/artifact.md pins the same rules:
//
// 1. 16-bit tokens. Positions < sink_tokens stay exact; of the rest,
//    [begin, end) with begin = min(sink, T) is quantized, by the tensor's
//    residual_rule (R = residual_tokens, G = group):
//    kSliding:    end = max(begin, T - R); kPerChannelTokens rounds end down
//                 to begin + a whole number of G-token groups.
//    kBlockFlush: end = begin + floor((T - begin) / R) * R (KIVI's keys: the
//                 16-bit buffer is quantized whole each time it reaches R
//                 tokens, so (T - begin) mod R tokens stay exact); R > 0 and,
//                 for kPerChannelTokens, a multiple of G (groups of G tokens
//                 tile each block from `begin`). Streaming (a prefill, then
//                 one token at a time) quantizes the same tokens in the same
//                 groups as quantizing the window at once.
// 2. Outliers (outlier_fraction f > 0), kept exact, by the outlier_rule:
//    kChannelThresholds (kPerChannelOffline): x < outlier_low[h, c] or
//      x > outlier_high[h, c];
//    kTokenTopBottom: per token, over its span of n elements (one head's D
//      channels, or all kv_heads * D for kPerTokenAllHeads, channel index
//      head * D + d), the k largest and the k smallest,
//      k = n - ceil((n - 1) (1 - f / 2)); ties by ascending channel index;
//      every element when 2k >= n;
//    kTokenTau: |x - mean_t| > outlier_tau * std_t, mean_t and std_t
//      (population) over the token's head_dim channels of one head.
//    Outliers take no part in their group's min and max.
// 3. The other elements (inliers):
//    kPerChannelOffline: n = (x - channel_offset[h, c]) / channel_scale[h, c];
//      with a grid x^ = offset + scale * grid[code], code the nearest level
//      of encode_grid (of grid when encode_grid is empty; ties to the lower
//      level); without, uniform levels on [-1, 1]:
//      code = clamp(round_half_even((n + 1) * (2^b - 1) / 2), 0, 2^b - 1),
//      x^ = offset + scale * (code * 2 / (2^b - 1) - 1).
//    Runtime groupings (kPerToken, kPerChannelTokens, kPerTokenAllHeads):
//      group_quantizer.h's min/max arithmetic over the group's inliers with
//      the layer's clip_ratio, grid and encode_grid.
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

// k of rule 2's kTokenTopBottom for a span of n elements.
int64_t top_bottom_count(int64_t n, double fraction);

// x: [..., kv_heads, T, D] float (any leading batch axes), positions 0..T-1.
SimulatedTensor simulate_quantization(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                                      const TensorQuantizer& quantizer, const at::Tensor& x);

// Rule 2 on the quantized span x [..., kv_heads, S, D] (float64): the
// outliers, all false when outlier_fraction is 0.
at::Tensor outlier_mask(const TensorQuantizerSettings& tensor, const TensorQuantizer& quantizer, const at::Tensor& x);

// Rule 3's kPerChannelOffline codes of the quantized span x [..., kv_heads,
// S, D] (float64): int64, x's shape and device; the uniform integer level, or
// the index into quantizer.grid. Outliers get codes too (ignored).
at::Tensor offline_codes(const QuantizerSettings& settings, const TensorQuantizer& quantizer, const at::Tensor& x);

// A [kv_heads, head_dim] parameter (channel_scale, ...) as float64
// [kv_heads, 1, head_dim] on `device`; std::invalid_argument naming `what`
// when its shape is not that.
at::Tensor channel_tensor(const Float32Array& array, int64_t heads, int64_t head_dim, const char* what,
                          const at::Device& device);

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

// With config.rotation, x is rotated first and rotated back after (see
// formats/kv_rotation.h): the result is in x's own domain, the outlier flags
// those of the rotated elements.
// keys: [..., kv_heads, T, D], pre-RoPE when config.settings.keys_pre_rope,
// else post-RoPE; returned in the same domain.
SimulatedTensor quantize_dequantize_keys(const QuantizerConfig& config, int64_t layer, const at::Tensor& keys);
SimulatedTensor quantize_dequantize_values(const QuantizerConfig& config, int64_t layer, const at::Tensor& values);

}  // namespace kvforge
