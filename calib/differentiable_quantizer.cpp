#include "calib/differentiable_quantizer.h"

#include <ATen/ATen.h>

#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "calib/group_quantizer.h"
#include "calib/quantize_simulation.h"

namespace kvforge {
namespace {

enum class Output { kHard, kSurrogate };

struct Path {
  GradientMode mode = GradientMode::kStraightThrough;
  double temperature = 0.1;
  Output output = Output::kHard;
};

at::Tensor levels_tensor(const std::vector<double>& values, const at::Tensor& like) {
  return at::tensor(at::ArrayRef<double>(values)).to(like.device(), like.scalar_type());
}

std::vector<double> to_double(const std::vector<float>& values) { return {values.begin(), values.end()}; }

// One quantized element rebuilt as A + B * level, where `t` (compute dtype,
// differentiable) is the element in the assignment domain, `values` [L] the
// level values and `assign` [L] the levels codes are chosen by (in t's
// units), `codes` the oracle's codes and `inside` (bool) the elements within
// the clipped range. The forward value is always A + B * values[code].
at::Tensor rebuild(const at::Tensor& a, const at::Tensor& b, const at::Tensor& t, const at::Tensor& codes,
                   const at::Tensor& inside, const std::vector<double>& values, const std::vector<double>& assign,
                   const Path& path) {
  const at::Tensor level_values = levels_tensor(values, t);
  const at::Tensor hard_level = level_values.index_select(0, codes.reshape({-1})).view(t.sizes());
  if (path.output == Output::kHard && path.mode == GradientMode::kStraightThrough) {
    // u - stop_gradient(u) is exactly 0 forward, 1 backward.
    return a + b * (hard_level + inside.to(t.scalar_type()) * (t - t.detach()));
  }
  const int64_t count = static_cast<int64_t>(assign.size());
  const double delta = count > 1 ? (assign.back() - assign.front()) / static_cast<double>(count - 1) : 1.0;
  const at::Tensor distance = (t.unsqueeze(-1) - levels_tensor(assign, t)) / (delta > 0 ? delta : 1.0);
  const at::Tensor weights = at::softmax(-distance.square() / path.temperature, -1);
  const at::Tensor soft = a + b * (weights * level_values).sum(-1);
  if (path.output == Output::kSurrogate) return soft;
  // Forward: the hard value exactly (soft - soft is 0); backward: the soft one's.
  return (a + b * hard_level).detach() + (soft - soft.detach());
}

struct SpanResult {
  at::Tensor values, codes;
};

SpanResult runtime_groups(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                          const TensorQuantizer& quantizer, const at::Tensor& span, const at::Tensor& span64,
                          const at::Tensor& outliers, const Path& path) {
  Grouping grouping = tensor.grouping;
  int64_t group = tensor.group;
  at::Tensor xs = span, x64 = span64, mask = outliers;
  if (grouping == Grouping::kPerTokenAllHeads) {
    xs = to_all_head_rows(xs);
    x64 = to_all_head_rows(x64);
    mask = to_all_head_rows(mask);
    grouping = Grouping::kPerToken;
    group = xs.size(-1);
  }
  int64_t dim = 0;
  const std::vector<int64_t> shape = group_shape(x64, grouping, group, dim);
  const at::Tensor xg = xs.reshape(shape), x64g = x64.reshape(shape);
  const at::Tensor inliers = tensor.outlier_fraction > 0 ? mask.reshape(shape).logical_not() : at::Tensor();
  const GroupQuantizer quant{settings.bits, quantizer.clip_ratio, quantizer.grid, quantizer.encode_grid};
  const GroupCodes decided = group_codes(x64g, dim, quant, inliers);

  // The bounds again, from x in the compute dtype and differentiably.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const at::Tensor low = (inliers.defined() ? xg.masked_fill(inliers.logical_not(), kInf) : xg).amin(dim, true);
  const at::Tensor high = (inliers.defined() ? xg.masked_fill(inliers.logical_not(), -kInf) : xg).amax(dim, true);
  const double clip = quantizer.clip_ratio;
  const at::Tensor lo = at::where(decided.kept, at::zeros_like(low), low * clip);
  const at::Tensor hi = at::where(decided.kept, at::ones_like(high), high * clip);
  const at::Tensor inside = (x64g >= decided.lo).logical_and(x64g <= decided.hi);

  at::Tensor quantized;
  if (quantizer.grid.empty()) {
    const int64_t top = (int64_t{1} << settings.bits) - 1;
    std::vector<double> levels;
    for (int64_t k = 0; k <= top; ++k) levels.push_back(static_cast<double>(k));
    const at::Tensor scale = (hi - lo) / static_cast<double>(top);
    quantized = rebuild(lo, scale, (xg - lo) / scale, decided.codes, inside, levels, levels, path);
  } else {
    const at::Tensor center = (lo + hi) / 2;
    const at::Tensor half = (hi - lo) / 2;
    const std::vector<double> grid = to_double(quantizer.grid);
    const std::vector<double> assign = quantizer.encode_grid.empty() ? grid : to_double(quantizer.encode_grid);
    quantized = rebuild(center, half, (xg - center) / half, decided.codes, inside, grid, assign, path);
  }
  SpanResult result;
  result.values = at::where(decided.exact, xg, quantized).reshape(xs.sizes());
  result.codes = decided.codes.masked_fill(decided.exact, -1).reshape(xs.sizes());
  if (tensor.grouping == Grouping::kPerTokenAllHeads) {
    result.values = from_all_head_rows(result.values, span);
    result.codes = from_all_head_rows(result.codes, span);
  }
  return result;
}

SpanResult offline_channels(const QuantizerSettings& settings, const TensorQuantizer& quantizer,
                            const at::Tensor& span, const at::Tensor& span64, const at::Tensor& outliers,
                            const Path& path) {
  const int64_t heads = span.size(-3), head_dim = span.size(-1);
  const at::Tensor offset64 =
      channel_tensor(quantizer.channel_offset, heads, head_dim, "channel_offset", span.device());
  const at::Tensor scale64 = channel_tensor(quantizer.channel_scale, heads, head_dim, "channel_scale", span.device());
  const at::Tensor codes = offline_codes(settings, quantizer, span64);
  const at::Tensor normalized64 = (span64 - offset64) / scale64;
  const at::Tensor inside = (normalized64 >= -1.0).logical_and(normalized64 <= 1.0);
  const at::Tensor offset = offset64.to(span.scalar_type()), scale = scale64.to(span.scalar_type());
  std::vector<double> values, assign;
  if (quantizer.grid.empty()) {
    const int64_t top = (int64_t{1} << settings.bits) - 1;
    for (int64_t k = 0; k <= top; ++k) values.push_back(static_cast<double>(k) * 2 / static_cast<double>(top) - 1);
    assign = values;
  } else {
    values = to_double(quantizer.grid);
    assign = quantizer.encode_grid.empty() ? values : to_double(quantizer.encode_grid);
  }
  const at::Tensor quantized = rebuild(offset, scale, (span - offset) / scale, codes, inside, values, assign, path);
  return {at::where(outliers, span, quantized), codes.masked_fill(outliers, -1)};
}

FakeQuantized run(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                  const TensorQuantizer& quantizer, const at::Tensor& x, const Path& path) {
  if (x.dim() < 3) throw std::invalid_argument("fake_quantize: expected [..., kv_heads, T, D]");
  const at::ScalarType dtype = x.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kDouble) {
    throw std::invalid_argument("fake_quantize: expected float32, bfloat16 or float64, got " +
                                std::string(c10::toString(dtype)));
  }
  if (path.mode == GradientMode::kSmoothed && !(path.temperature > 0)) {
    throw std::invalid_argument("fake_quantize: the smoothed gradient needs a temperature > 0");
  }
  const at::ScalarType compute = dtype == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor xc = x.to(compute);
  const TokenSpan tokens = quantized_tokens(settings, tensor, x.size(-2));
  FakeQuantized result;
  result.codes = at::full(x.sizes(), -1, x.options().dtype(at::kLong));
  result.outliers = at::zeros(x.sizes(), x.options().dtype(at::kBool));
  if (tokens.size() == 0) {
    result.values = x.clone();
    return result;
  }
  const at::Tensor span = xc.narrow(-2, tokens.begin, tokens.size());
  // The decisions in float64 from the input's values, as simulate_quantization.
  const at::Tensor span64 = x.detach().to(at::kDouble).narrow(-2, tokens.begin, tokens.size());
  const at::Tensor mask = outlier_mask(tensor, quantizer, span64);
  const SpanResult quantized = tensor.grouping == Grouping::kPerChannelOffline
                                   ? offline_channels(settings, quantizer, span, span64, mask, path)
                                   : runtime_groups(settings, tensor, quantizer, span, span64, mask, path);
  std::vector<at::Tensor> pieces;
  if (tokens.begin > 0) pieces.push_back(xc.narrow(-2, 0, tokens.begin));
  pieces.push_back(quantized.values);
  if (tokens.end < x.size(-2)) pieces.push_back(xc.narrow(-2, tokens.end, x.size(-2) - tokens.end));
  result.values = at::cat(pieces, -2).to(dtype);
  result.codes.narrow(-2, tokens.begin, tokens.size()).copy_(quantized.codes);
  result.outliers.narrow(-2, tokens.begin, tokens.size()).copy_(mask);
  return result;
}

}  // namespace

FakeQuantized fake_quantize(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                            const TensorQuantizer& quantizer, const at::Tensor& x, const FakeQuantizeOptions& options) {
  return run(settings, tensor, quantizer, x, Path{options.mode, options.temperature, Output::kHard});
}

at::Tensor smoothed_surrogate(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                              const TensorQuantizer& quantizer, const at::Tensor& x, double temperature) {
  if (!(temperature > 0)) throw std::invalid_argument("smoothed_surrogate: temperature must be > 0");
  return run(settings, tensor, quantizer, x, Path{GradientMode::kSmoothed, temperature, Output::kSurrogate}).values;
}

}  // namespace kvforge
