#pragma once
// Dense-and-sparse outlier thresholds (KVQuant), fitted on calibration
// activations so that a requested fraction f of the elements is selected.
//
// Per channel (keys, offline): an element is an outlier iff x < low or
// x > high, and each side should select f n / 2 of a channel's n calibration
// values. With the channel's values sorted ascending s[0..n) and j the
// side's target count, low = s[j] selects #{x < s[j]} (f = 0: low = min);
// where equal values make that count miss j (layer-0 pre-RoPE keys repeat
// with their token), low is the next larger value instead when that count
// (#{x <= s[j]}) is nearer. Each channel's target carries the shortfall of
// the channels before it (error diffusion: j = round(running target -
// running selection), at most (n - 1) / 2), so the total over the layer is
// within about one tie of f n. high mirrors low. Once the selection is
// made, a threshold that selected anything is moved off the sample values:
// low becomes the float32 nearest to the midpoint of that sample and the
// largest value below it (strictly between the two; the sample itself when
// they are adjacent float32 values), high likewise with the smallest value
// above it, so the same calibration elements are outliers and none equals
// a threshold (except low = the channel's minimum, high = its maximum).
// The channel's inliers are normalized into [-1, 1] by offset = (low +
// high) / 2 and scale = (high - low) / 2, scale rounded so that both stored
// thresholds map into [-1, 1]; a constant channel gets scale =
// max(|offset|, 1) * 2^-20 instead of 0.
//
// Per token with OutlierRule::kTokenTau (kvforge's variant; KVQuant's own
// per-token rule, kTokenTopBottom, needs nothing fitted): r = |x - mean_t| / std_t, with mean_t and
// std_t (population) over the token's head_dim channels (r = 0 where
// std_t = 0); over all n calibration elements, j = round(n f) and tau is the
// (n - j)-th smallest r, so that r > tau selects j of them; where ties make
// that miss j, the next smaller distinct r when its selection is nearer j.
#include <ATen/core/Tensor.h>

namespace kvforge {

struct ChannelThresholds {
  at::Tensor low, high;      // float32 [kv_heads, head_dim]
  at::Tensor offset, scale;  // float32 [kv_heads, head_dim]
};

// x: [..., kv_heads, T, D]; every leading batch entry and token is a sample.
ChannelThresholds fit_channel_thresholds(const at::Tensor& x, double fraction);

// x: [..., D]; every row is one token of one head.
double fit_outlier_tau(const at::Tensor& x, double fraction);

// r = |x - mean_t| / std_t as above, float64, x's shape.
at::Tensor token_deviation_ratio(const at::Tensor& x);

}  // namespace kvforge
