#pragma once
// Quantize-dequantize of min/max groups, the arithmetic every runtime
// grouping shares (KIVI, INT2 per-token, RTN, KVQuant's per-token values).
// All in float64, on x's device; callers convert.
//
// For one group g with (inlier) minimum m and maximum M and clip ratio r:
//   lo = r * m, hi = r * M
//   uniform (no grid), 2^b levels:
//     scale = (hi - lo) / (2^b - 1)
//     code  = clamp(round_half_even((x - lo) / scale), 0, 2^b - 1)
//     x^    = lo + code * scale
//   non-uniform grid (ascending levels in [-1, 1] units):
//     center = (lo + hi) / 2, half = (hi - lo) / 2
//     code = nearest level of the encode grid (`encode_grid`, or `grid`
//            itself when it is empty) to (x - center) / half, ties to the lower
//     x^ = center + half * grid[code]
//   a group with hi == lo (constant, or without inliers) is kept as it is.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "formats/quantizer_config.h"

namespace kvforge {

struct GroupQuantizer {
  int bits = 2;
  double clip_ratio = 1.0;
  std::vector<float> grid;  // empty: uniform integer levels
  std::vector<float> encode_grid;  // empty: codes by `grid` (Q-Norm affine: the k-means levels)
};

// The grid level nearest to each element (float64 tensor), ties to the lower
// level. `grid` ascending, not empty.
at::Tensor nearest_level(const at::Tensor& normalized, const std::vector<float>& grid);

// grid[code] with code the index of the encode_grid level nearest to each
// element (ties to the lower); encode_grid empty: nearest_level(grid). Both
// ascending, of one size.
at::Tensor dequantize_levels(const at::Tensor& normalized, const std::vector<float>& grid,
                             const std::vector<float>& encode_grid);

// The index into `grid` of each element's level: the nearest level of
// encode_grid (of grid when encode_grid is empty), ties to the lower; int64,
// the input's shape and device. dequantize_levels is grid[level_codes(...)].
at::Tensor level_codes(const at::Tensor& normalized, const std::vector<float>& grid,
                       const std::vector<float>& encode_grid);

// A group quantizer's decisions, which quantize_dequantize_groups turns into
// values (and calib/differentiable_quantizer.h into a differentiable path):
// codes (int64, x's shape; uniform: the integer level, grid: the index into
// grid; meaningless where `exact`), each group's clipped bounds lo and hi
// (float64, keepdim along `dim`; (0, 1) for kept groups), the kept groups
// (bool, keepdim: hi <= lo, constant or without inliers) and the elements
// returned as they are (kept groups and non-inliers).
struct GroupCodes {
  at::Tensor codes, lo, hi, kept, exact;
};
GroupCodes group_codes(const at::Tensor& x, int64_t dim, const GroupQuantizer& quantizer,
                       const at::Tensor& inliers = {});

// The shape x of a runtime grouping is viewed in (kPerToken,
// kPerChannelTokens; std::invalid_argument otherwise) so that every slice
// along `dim` (set here) is one group.
std::vector<int64_t> group_shape(const at::Tensor& x, Grouping grouping, int64_t group, int64_t& dim);

// x: float64; every slice along `dim` is one group. `inliers`: undefined (all
// elements are inliers) or a bool tensor of x's shape; elements outside it
// keep their value and take no part in the group's min and max.
at::Tensor quantize_dequantize_groups(const at::Tensor& x, int64_t dim, const GroupQuantizer& quantizer,
                                      const at::Tensor& inliers = {});

// kPerTokenAllHeads' rows: x [..., kv_heads, T, D] as [..., T, kv_heads * D]
// (channel index head * D + d), and back into `like`'s layout.
at::Tensor to_all_head_rows(const at::Tensor& x);
at::Tensor from_all_head_rows(const at::Tensor& rows, const at::Tensor& like);

// The normalized value (x - center) / half of every element the group
// quantizer would round (the non-uniform arithmetic's domain, also used for
// uniform groups), NaN for the elements it keeps as they are (non-inliers,
// constant groups). Same layout rules as quantize_dequantize_grouped.
at::Tensor normalize_grouped(const at::Tensor& x, Grouping grouping, int64_t group, double clip_ratio,
                             const at::Tensor& inliers = {});

// x: float64 [..., T, D], one head's slab per trailing [T, D] (leading axes
// are batch and heads). kPerToken: groups of G' = min(group, D) consecutive
// channels of one token (D % G' == 0). kPerChannelTokens: groups of `group`
// consecutive tokens of one channel, from token 0 (T % group == 0; callers
// keep incomplete groups out). kPerTokenAllHeads: x is [..., kv_heads, T, D]
// and each token's group is its kv_heads * D elements across the heads
// (`group` unused). kPerChannelOffline is not a runtime grouping
// (std::invalid_argument).
at::Tensor quantize_dequantize_grouped(const at::Tensor& x, Grouping grouping, int64_t group,
                                       const GroupQuantizer& quantizer, const at::Tensor& inliers = {});

}  // namespace kvforge
