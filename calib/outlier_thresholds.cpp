#include "calib/outlier_thresholds.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "model/cpu_vector_math.h"

namespace kvforge {
namespace {

void check_fraction(double fraction) {
  if (!(fraction >= 0 && fraction < 1)) {
    throw std::invalid_argument("outlier fraction must be in [0, 1), got " + std::to_string(fraction));
  }
}

// The threshold that separates the chosen calibration value `sample` (the
// last inlier) from `beyond` (the next distinct value, the first outlier):
// a float32 strictly between them, their midpoint rounded to float32 (the
// float32 nearest to the exact midpoint lies strictly between whenever any
// float32 does; the next float32 after `sample` covers a midpoint that
// float64 could not represent exactly), or `sample` itself when the two are
// adjacent float32 values. A threshold that is a calibration value would make
// elements equal to it (layer-0 keys repeat with their token) flip between
// inlier and outlier on a last-bit difference in the model's arithmetic.
float threshold_between(float sample, float beyond) {
  const auto strictly_between = [&](float t) {
    return sample < beyond ? sample < t && t < beyond : beyond < t && t < sample;
  };
  const float middle = static_cast<float>((static_cast<double>(sample) + static_cast<double>(beyond)) / 2);
  if (strictly_between(middle)) return middle;
  const float next = std::nextafter(sample, beyond);
  return strictly_between(next) ? next : sample;
}

}  // namespace

ChannelThresholds fit_channel_thresholds(const at::Tensor& x, double fraction) {
  check_fraction(fraction);
  if (x.dim() < 3) throw std::invalid_argument("fit_channel_thresholds: expected [..., kv_heads, T, D]");
  const int64_t heads = x.size(-3), head_dim = x.size(-1);
  // [heads * head_dim, samples], each row sorted ascending (on x's device),
  // then searched on the host.
  const at::Tensor rows = x.to(at::kFloat).reshape({-1, heads, x.size(-2), head_dim})
                              .permute({1, 3, 0, 2}).reshape({heads * head_dim, -1});
  const int64_t n = rows.size(-1);
  if (n == 0) throw std::invalid_argument("fit_channel_thresholds: no calibration values");
  const at::Tensor sorted = std::get<0>(rows.sort(-1)).to(at::kCPU).contiguous();
  at::Tensor low = at::empty({heads, head_dim}, at::kFloat), high = at::empty({heads, head_dim}, at::kFloat);
  float* low_out = low.data_ptr<float>();
  float* high_out = high.data_ptr<float>();
  // Equal values make some counts unreachable (keys of layer 0 repeat with
  // their token); each side takes the reachable count nearest to what keeps
  // the running total of selected elements nearest to f/2 n per channel.
  const double target = static_cast<double>(n) * fraction / 2;
  double wanted_low = 0, wanted_high = 0;  // running targets minus running selections
  for (int64_t row = 0; row < sorted.size(0); ++row) {
    const float* s = sorted.data_ptr<float>() + row * n;
    const int64_t middle = (n - 1) / 2;
    wanted_low += target;
    wanted_high += target;
    // Low side: x < low selects #{x < s[j]} (at most j) or, taking the next
    // larger value, #{x <= s[j]} (more than j).
    const int64_t j = std::clamp<int64_t>(std::llround(wanted_low), 0, middle);
    int64_t below = std::lower_bound(s, s + n, s[j]) - s;
    const int64_t through = std::upper_bound(s, s + n, s[j]) - s;
    float lo = s[j];
    if (through <= middle && std::abs(static_cast<double>(through) - wanted_low) <
                                 std::abs(static_cast<double>(below) - wanted_low)) {
      lo = s[through];
      below = through;
    }
    // High side, mirrored: x > high selects #{x > s[n-1-k]} (at most k) or,
    // taking the next smaller value, #{x >= s[n-1-k]} (more than k).
    const int64_t k = std::clamp<int64_t>(std::llround(wanted_high), 0, middle);
    const float top = s[n - 1 - k];
    const int64_t first_top = std::lower_bound(s, s + n, top) - s;
    int64_t above = n - (std::upper_bound(s, s + n, top) - s);
    float hi = top;
    if (first_top - 1 >= n - 1 - middle && std::abs(static_cast<double>(n - first_top) - wanted_high) <
                                               std::abs(static_cast<double>(above) - wanted_high)) {
      hi = s[first_top - 1];
      above = n - first_top;
    }
    wanted_low -= static_cast<double>(below);
    wanted_high -= static_cast<double>(above);
    // The selection is made; move each threshold off the sample values into
    // the gap before the first outlier (s[below - 1] is the largest value
    // below lo, s[n - above] the smallest above hi), which selects the same
    // calibration elements. Nothing beyond: the sample stays.
    low_out[row] = below > 0 ? threshold_between(lo, s[below - 1]) : lo;
    high_out[row] = above > 0 ? threshold_between(hi, s[n - above]) : hi;
  }
  ChannelThresholds result;
  result.low = low;
  result.high = high;
  const at::Tensor low64 = low.to(at::kDouble), high64 = high.to(at::kDouble);
  const at::Tensor offset = (low64 + high64) / 2;
  const at::Tensor half = (high64 - low64) / 2;
  const at::Tensor fallback = offset.abs().clamp_min(1.0) * std::ldexp(1.0, -20);
  result.offset = offset.to(at::kFloat);
  // The scale reaches both thresholds from the offset as stored: when the
  // range is narrow against the values' magnitude, float32 moves the
  // midpoint by up to half an ulp of the offset, which (high - low) / 2 alone
  // would leave outside [-1, 1] (2 samples per channel: -1.00056). Rounded up
  // to float32, so that |threshold - offset| / scale <= 1 holds exactly.
  const at::Tensor stored_offset = result.offset.to(at::kDouble);
  const at::Tensor reach = at::maximum(high64 - stored_offset, stored_offset - low64);
  const at::Tensor wanted = at::where(half > 0, at::maximum(half, reach), fallback);
  at::Tensor scale = wanted.to(at::kFloat);
  scale = at::where(scale.to(at::kDouble) < wanted,
                    at::nextafter(scale, at::full_like(scale, std::numeric_limits<float>::infinity())), scale);
  // A scale that rounds to 0 in float32 would divide by zero at runtime.
  result.scale = at::where(scale > 0, scale, fallback.to(at::kFloat));
  return result;
}

at::Tensor token_deviation_ratio(const at::Tensor& x) {
  const at::Tensor xd = x.to(at::kDouble);
  const at::Tensor mean = xd.mean(-1, true);
  const at::Tensor deviation = (xd - mean).abs();
  prepare_cpu_vector_math();  // sqrt
  const at::Tensor std = (xd - mean).square().mean(-1, true).sqrt();
  return at::where(std > 0, deviation / std, at::zeros_like(deviation));
}

double fit_outlier_tau(const at::Tensor& x, double fraction) {
  check_fraction(fraction);
  const at::Tensor ratio = token_deviation_ratio(x).reshape({-1});
  const int64_t n = ratio.numel();
  if (n == 0) throw std::invalid_argument("fit_outlier_tau: no calibration values");
  const auto j = std::min<int64_t>(static_cast<int64_t>(std::llround(static_cast<double>(n) * fraction)), n - 1);
  const double tau = std::get<0>(ratio.kthvalue(n - j)).item<double>();
  // Equal ratios (a token repeated in layer 0) may make j unreachable: of
  // tau and the next smaller ratio, the one whose selection is nearer j.
  const int64_t above = (ratio > tau).sum().item<int64_t>();
  const at::Tensor smaller = ratio.masked_select(ratio < tau);
  if (smaller.numel() == 0) return tau;
  const double next = smaller.max().item<double>();
  const int64_t with_next = (ratio > next).sum().item<int64_t>();
  return std::abs(with_next - j) < std::abs(above - j) ? next : tau;
}

}  // namespace kvforge
