#pragma once
// A differentiable quantize-dequantize ("fake quantization") of keys or
// values, for learning what sits in front of the quantizer (kvforge rotate:
// an orthogonal rotation trained by backpropagating an attention-output loss
// through this path).
//
// Forward: exactly quantize_simulation.h's arithmetic (docs/artifact.md, "The
// arithmetic"): the same window of quantized tokens, the same outliers and
// the same codes. Every decision (window, outlier masks, group bounds'
// selection, codes) is taken by the float64 helpers simulate_quantization
// itself uses, on a detached float64 copy of x on x's device, so the codes
// are those of the oracle by construction; only the values are then rebuilt
// from the codes in the compute dtype (float32 for float32 and bf16 inputs,
// bf16 returned in bf16; float64 for float64, which then reproduces the
// oracle's values bit for bit), differentiably:
//   uniform groups:  x^ = lo + code * (hi - lo) / (2^b - 1)
//   grid groups:     x^ = c + h * grid[code], c = (lo + hi) / 2, h = (hi - lo) / 2
//   per_channel_offline: x^ = offset + scale * level(code)
// with lo = r * min, hi = r * max over the group's inliers computed from x in
// the compute dtype. The dequantized values therefore equal the oracle's up
// to float32 rounding (a few ulps of the group's max |lo|, |hi|).
// Passed-through elements (sink and residual tokens, outliers, constant
// groups) are x itself: value exact, d x^ / d x = 1.
//
// Gradients. In both modes the group bounds lo, hi (so scale, center, half)
// are functions of x: the gradient reaches the group's inlier minimum and
// maximum through them (at::amin / at::amax: split evenly between ties).
// per_channel_offline's offset and scale are fitted constants, not functions
// of x. Outlier masks and codes carry no gradient.
//
//  kStraightThrough: rounding is the identity inside the clipped range and
//    constant outside it. With u = (x - lo) / scale (uniform) or
//    v = (x - c) / h (grid; n = (x - offset) / scale for offline), the value
//    is lo + scale * (code + s * (u - stop_gradient(u))), s = 1 where the
//    element lies in its group's clipped range [lo, hi] (offline: n in
//    [-1, 1]) and 0 where it is clamped. Hence the direct derivative
//    d x^ / d x is 1 inside the range and 0 outside it, and the bounds get
//    the LSQ-style gradients d x^ / d scale = code - u (inside) or code
//    (outside), d x^ / d lo = 1 at fixed u.
//  kSmoothed: the forward value is still the hard one (same codes), the
//    gradient is that of a soft assignment to the levels (temperature tau):
//      w_k = softmax_k(-((t - t_k) / delta)^2 / tau),  x^_soft = A + B * sum_k w_k L_k,
//    t the element in the assignment domain (uniform: u, levels t_k = k,
//    delta = 1, L_k = k, A = lo, B = scale; grid: v, t_k the encode grid
//    (the grid when empty), delta their mean spacing, L_k = grid[k], A = c,
//    B = h; offline: n with the uniform levels 2k/(2^b-1) - 1 or the grid).
//    x^_soft tends to the hard value as tau -> 0 and is smooth in x and in
//    the bounds, so a rotation's loss is not piecewise flat: elements
//    between two levels feel which way rounding will go. Outside the range
//    the soft code saturates at the end levels (gradient -> 0, as clamping).
//    smoothed_surrogate() returns x^_soft itself (what the gradient is the
//    gradient of; tests compare against its finite differences).
#include <ATen/core/Tensor.h>

#include "formats/quantizer_config.h"

namespace kvforge {

enum class GradientMode { kStraightThrough, kSmoothed };

struct FakeQuantizeOptions {
  GradientMode mode = GradientMode::kStraightThrough;
  double temperature = 0.1;  // kSmoothed's tau, in squared level spacings
};

struct FakeQuantized {
  at::Tensor values;    // x's shape, dtype and device; differentiable in x
  at::Tensor codes;     // int64, x's shape: the code of every quantized element, -1 where passed through
  at::Tensor outliers;  // bool, x's shape: elements kept exact as outliers (simulate_quantization's)
};

// x: [..., kv_heads, T, D] float32, bfloat16 or float64 on any device
// (leading axes are batch), positions 0..T-1. std::invalid_argument for
// other dtypes or shapes, and as simulate_quantization for bad settings.
FakeQuantized fake_quantize(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                            const TensorQuantizer& quantizer, const at::Tensor& x,
                            const FakeQuantizeOptions& options = {});

// The soft value whose gradient kSmoothed uses (not the hard codes):
// x^_soft above where quantized, x elsewhere.
at::Tensor smoothed_surrogate(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                              const TensorQuantizer& quantizer, const at::Tensor& x, double temperature = 0.1);

}  // namespace kvforge
