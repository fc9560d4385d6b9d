#include "calib/group_quantizer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace kvforge {
namespace {

// A group's clipped bounds; `keep` marks groups left as they are (hi <= lo),
// whose bounds are replaced by (0, 1) so that the arithmetic stays finite.
struct GroupBounds {
  at::Tensor lo, hi, keep;
};

GroupBounds group_bounds(const at::Tensor& x, int64_t dim, double clip_ratio, const at::Tensor& inliers) {
  if (x.scalar_type() != at::kDouble) throw std::invalid_argument("group quantizer: x must be float64");
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const bool masked = inliers.defined();
  const at::Tensor low = (masked ? x.masked_fill(inliers.logical_not(), kInf) : x).amin(dim, true);
  const at::Tensor high = (masked ? x.masked_fill(inliers.logical_not(), -kInf) : x).amax(dim, true);
  GroupBounds bounds;
  bounds.lo = low * clip_ratio;
  bounds.hi = high * clip_ratio;
  bounds.keep = (bounds.hi > bounds.lo).logical_not();
  bounds.lo = at::where(bounds.keep, at::zeros_like(bounds.lo), bounds.lo);
  bounds.hi = at::where(bounds.keep, at::ones_like(bounds.hi), bounds.hi);
  return bounds;
}

// Elements returned as they are: those of kept groups and non-inliers.
at::Tensor exact_elements(const at::Tensor& x, const GroupBounds& bounds, const at::Tensor& inliers) {
  at::Tensor exact = bounds.keep.expand_as(x);
  if (inliers.defined()) exact = exact.logical_or(inliers.logical_not());
  return exact;
}

}  // namespace

// Views x (and inliers) so that every slice along the returned dim is a group.
std::vector<int64_t> group_shape(const at::Tensor& x, Grouping grouping, int64_t group, int64_t& dim) {
  if (x.dim() < 2) throw std::invalid_argument("group quantizer: x must be [..., T, D]");
  if (group < 1) throw std::invalid_argument("group quantizer: group must be >= 1");
  const int64_t tokens = x.size(-2), channels = x.size(-1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 2);
  switch (grouping) {
    case Grouping::kPerToken:
      group = std::min(group, channels);  // a group of head_dim or more is the whole head
      if (channels % group != 0) {
        throw std::invalid_argument("per_token groups of " + std::to_string(group) + " channels do not divide " +
                                    std::to_string(channels) + " channels");
      }
      shape.insert(shape.end(), {tokens, channels / group, group});
      dim = -1;
      return shape;
    case Grouping::kPerChannelTokens:
      if (tokens % group != 0) {
        throw std::invalid_argument("per_channel_tokens groups of " + std::to_string(group) +
                                    " tokens do not divide " + std::to_string(tokens) + " tokens");
      }
      shape.insert(shape.end(), {tokens / group, group, channels});
      dim = -2;
      return shape;
    case Grouping::kPerChannelOffline:
    case Grouping::kPerTokenAllHeads:  // rearranged into rows by the callers below
      break;
  }
  throw std::invalid_argument("group quantizer: per_channel_offline is not a runtime grouping");
}

static at::Tensor grid_levels(const std::vector<float>& grid, const at::Tensor& like) {
  return at::tensor(at::ArrayRef<float>(grid)).to(like.device(), at::kDouble);
}

at::Tensor nearest_level_index(const at::Tensor& normalized, const std::vector<float>& grid) {
  if (grid.empty()) throw std::invalid_argument("nearest_level_index: empty grid");
  if (grid.size() == 1) return at::zeros(normalized.sizes(), normalized.options().dtype(at::kLong));
  const at::Tensor levels = grid_levels(grid, normalized);
  // Midpoints between neighbouring levels; bucketize (right=false) counts the
  // midpoints strictly below x, so x on a midpoint goes to the lower level.
  const at::Tensor midpoints = (levels.slice(0, 0, -1) + levels.slice(0, 1)) / 2;
  return at::bucketize(normalized.contiguous(), midpoints);
}

at::Tensor nearest_level(const at::Tensor& normalized, const std::vector<float>& grid) {
  const at::Tensor index = nearest_level_index(normalized, grid);
  return grid_levels(grid, normalized).index_select(0, index.reshape({-1})).view(normalized.sizes());
}

at::Tensor to_all_head_rows(const at::Tensor& x) {
  if (x.dim() < 3) throw std::invalid_argument("per_token_all_heads: x must be [..., kv_heads, T, D]");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 3);
  shape.insert(shape.end(), {x.size(-2), x.size(-3) * x.size(-1)});
  return x.movedim(-3, -2).reshape(shape);
}

at::Tensor from_all_head_rows(const at::Tensor& rows, const at::Tensor& like) {
  std::vector<int64_t> shape(like.sizes().begin(), like.sizes().end() - 3);
  shape.insert(shape.end(), {like.size(-2), like.size(-3), like.size(-1)});
  return rows.reshape(shape).movedim(-2, -3).contiguous();
}

at::Tensor dequantize_levels(const at::Tensor& normalized, const std::vector<float>& grid,
                             const std::vector<float>& encode_grid) {
  // The codes by the encode grid (ties to the lower level), the values from `grid`.
  const at::Tensor index = level_codes(normalized, grid, encode_grid);
  return grid_levels(grid, normalized).index_select(0, index.reshape({-1})).view(normalized.sizes());
}

at::Tensor level_codes(const at::Tensor& normalized, const std::vector<float>& grid,
                       const std::vector<float>& encode_grid) {
  if (encode_grid.empty()) return nearest_level_index(normalized, grid);
  if (encode_grid.size() != grid.size()) throw std::invalid_argument("dequantize_levels: grid sizes differ");
  return nearest_level_index(normalized, encode_grid);
}

GroupCodes group_codes(const at::Tensor& x, int64_t dim, const GroupQuantizer& quantizer, const at::Tensor& inliers) {
  if (quantizer.bits < 1 || quantizer.bits > 16) {
    throw std::invalid_argument("group quantizer: bits must be in 1..16, got " + std::to_string(quantizer.bits));
  }
  const GroupBounds bounds = group_bounds(x, dim, quantizer.clip_ratio, inliers);
  GroupCodes result;
  result.lo = bounds.lo;
  result.hi = bounds.hi;
  result.kept = bounds.keep;
  result.exact = exact_elements(x, bounds, inliers);
  if (quantizer.grid.empty()) {
    const double top = static_cast<double>((int64_t{1} << quantizer.bits) - 1);
    const at::Tensor scale = (bounds.hi - bounds.lo) / top;
    result.codes = at::round((x - bounds.lo) / scale).clamp(0.0, top).to(at::kLong);
  } else {
    const at::Tensor center = (bounds.lo + bounds.hi) / 2;
    const at::Tensor half = (bounds.hi - bounds.lo) / 2;
    result.codes = level_codes((x - center) / half, quantizer.grid, quantizer.encode_grid);
  }
  return result;
}

at::Tensor quantize_dequantize_groups(const at::Tensor& x, int64_t dim, const GroupQuantizer& quantizer,
                                      const at::Tensor& inliers) {
  const GroupCodes codes = group_codes(x, dim, quantizer, inliers);
  at::Tensor quantized;
  if (quantizer.grid.empty()) {
    const double top = static_cast<double>((int64_t{1} << quantizer.bits) - 1);
    const at::Tensor scale = (codes.hi - codes.lo) / top;
    quantized = codes.lo + codes.codes.to(at::kDouble) * scale;
  } else {
    const at::Tensor center = (codes.lo + codes.hi) / 2;
    const at::Tensor half = (codes.hi - codes.lo) / 2;
    const at::Tensor level = grid_levels(quantizer.grid, x).index_select(0, codes.codes.reshape({-1}));
    quantized = center + half * level.view(x.sizes());
  }
  return at::where(codes.exact, x, quantized);
}

at::Tensor quantize_dequantize_grouped(const at::Tensor& x, Grouping grouping, int64_t group,
                                       const GroupQuantizer& quantizer, const at::Tensor& inliers) {
  if (grouping == Grouping::kPerTokenAllHeads) {
    const at::Tensor rows = to_all_head_rows(x);
    const at::Tensor mask = inliers.defined() ? to_all_head_rows(inliers) : at::Tensor();
    return from_all_head_rows(quantize_dequantize_grouped(rows, Grouping::kPerToken, rows.size(-1), quantizer, mask), x);
  }
  int64_t dim = 0;
  const auto shape = group_shape(x, grouping, group, dim);
  const at::Tensor mask = inliers.defined() ? inliers.reshape(shape) : at::Tensor();
  return quantize_dequantize_groups(x.reshape(shape), dim, quantizer, mask).view(x.sizes());
}

at::Tensor normalize_grouped(const at::Tensor& x, Grouping grouping, int64_t group, double clip_ratio,
                             const at::Tensor& inliers) {
  if (grouping == Grouping::kPerTokenAllHeads) {
    const at::Tensor rows = to_all_head_rows(x);
    const at::Tensor mask = inliers.defined() ? to_all_head_rows(inliers) : at::Tensor();
    return from_all_head_rows(normalize_grouped(rows, Grouping::kPerToken, rows.size(-1), clip_ratio, mask), x);
  }
  int64_t dim = 0;
  const auto shape = group_shape(x, grouping, group, dim);
  const at::Tensor grouped = x.reshape(shape);
  const at::Tensor mask = inliers.defined() ? inliers.reshape(shape) : at::Tensor();
  const GroupBounds bounds = group_bounds(grouped, dim, clip_ratio, mask);
  const at::Tensor center = (bounds.lo + bounds.hi) / 2;
  const at::Tensor half = (bounds.hi - bounds.lo) / 2;
  const at::Tensor normalized = (grouped - center) / half;
  return normalized.masked_fill(exact_elements(grouped, bounds, mask), std::numeric_limits<double>::quiet_NaN())
      .view(x.sizes());
}

}  // namespace kvforge
