// The runtime KV cache on the CPU (kernels/): for every layout calibrate and
// rotate write, streamed in prefill chunks and single decoding steps over a
// batch of sequences of different lengths,
//   - what the pages read back equals calib's float64 oracle
//     (simulate_quantization over the whole prefix) after every append:
//     codes equal calib's codes exactly, outliers are calib's, exact tokens
//     and outliers bit for bit, and dequantized values within the float32
//     rounding of the dequantization formula (the bound is derived below);
//   - decode_attention equals float64 attention over that oracle's read-back
//     within 1e-5 of the values' magnitude (derived below);
//   - the bytes a decoding step reads are the layout's formula, which differs
//     from calib's effective-bits accounting by exactly the documented terms;
//   - bad configurations and bad calls are refused with one line;
//   - fp16/bf16 rows and queries (AppendBatch::input, decode_attention's io)
//     store the bytes float32 rows of the same values store, and attend to
//     the float32 output rounded once to the io type.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <numbers>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "calib/effective_bits.h"
#include "calib/group_quantizer.h"
#include "calib/kv_rotation.h"
#include "calib/quantize_simulation.h"
#include "calib/quantizer_fit.h"
#include "eval/simulated_quantized_cache.h"
#include "kernels/element_conversion.h"
#include "kernels/quantized_kv_cache.h"
#include "kernels/step_append.h"
#include "tests/hooked_cpu_backend.h"
#include "tests/kernel_activations.h"
#include "tests/kernel_cases.h"
#include "model/rope.h"

namespace kvforge {
namespace {

using kernels::ElementType;
using kernels::TensorKind;

constexpr double kUnit = 0x1p-24;  // float32 unit roundoff (round to nearest)

// ------------------------------------------------------------ element conversions

TEST(RuntimeElementConversion, FloatInputsRoundAsTorchDoes) {
  // c10::Half and c10::BFloat16 round a float to nearest, ties to even: an
  // independent implementation of the same conversion.
  std::mt19937 rng(5);
  std::vector<float> values{0.0f, -0.0f, 1.0f, 65504.0f, 65519.0f, 65520.0f, 1e-8f, 5.96e-8f, 2.98e-8f, 6.1e-5f,
                            3.0e38f, -1.7e38f, 1.0f + 0x1p-11f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-11f,
                            std::numeric_limits<float>::infinity(), 1e-40f};
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t word = bits(rng);
    float value;
    std::memcpy(&value, &word, 4);
    if (!std::isnan(value)) values.push_back(value);
  }
  for (float value : values) {
    ASSERT_EQ(kernels::half_bits(value), c10::Half(value).x) << value;
    ASSERT_EQ(kernels::bfloat16_bits(value), c10::BFloat16(value).x) << value;
    ASSERT_EQ(kernels::half_value(kernels::half_bits(value)), static_cast<float>(c10::Half(value))) << value;
  }
}

TEST(RuntimeElementConversion, DoubleInputsRoundOnceToTheNearestElement) {
  // Brute force: the result is a representable value no farther from x than
  // its neighbours, and on a tie the one with an even last bit. 1 + 2^-11 +
  // 2^-40 is just above a half tie: through float (which drops 2^-40) it
  // would round down to 1.
  EXPECT_EQ(kernels::half_value(kernels::half_bits(1.0 + 0x1p-11 + 0x1p-40)), 1.0f + 0x1p-10f);
  EXPECT_EQ(kernels::bfloat16_value(kernels::bfloat16_bits(1.0 + 0x1p-8 + 0x1p-40)), 1.0f + 0x1p-7f);
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<double> mantissa(-2, 2);
  std::uniform_int_distribution<int> exponent(-30, 18);
  for (int i = 0; i < 100000; ++i) {
    const double x = std::ldexp(mantissa(rng), exponent(rng));
    for (bool half : {true, false}) {
      const uint16_t b = half ? kernels::half_bits(x) : kernels::bfloat16_bits(x);
      const auto value = [&](uint16_t bits) {
        return static_cast<double>(half ? kernels::half_value(bits) : kernels::bfloat16_value(bits));
      };
      const double r = value(b), error = std::fabs(x - r);
      if (std::isinf(r)) continue;
      for (uint16_t neighbour : {static_cast<uint16_t>(b - 1), static_cast<uint16_t>(b + 1)}) {
        const double n = value(neighbour);
        if (std::isnan(n) || ((neighbour ^ b) & 0x8000)) continue;  // across the sign or into NaN
        ASSERT_LE(error, std::fabs(x - n)) << x;
        if (error == std::fabs(x - n)) ASSERT_EQ(b & 1, 0) << "tie not to even at " << x;
      }
    }
  }
}

// ------------------------------------------------------------ layouts

kernels::TensorLayoutSpec spec(kernels::ScaleGrouping grouping, int32_t group, bool outliers = false) {
  kernels::TensorLayoutSpec s;
  s.kv_heads = 2;
  s.head_dim = 128;
  s.bits = 2;
  s.page_size = 16;
  s.grouping = grouping;
  s.group = group;
  s.outliers = outliers;
  return s;
}

TEST(RuntimeLayout, PagesOfTheWorkedExamples) {
  // docs/runtime-layout.md's examples: Hkv = 2, D = 128, 2 bits, 16 tokens, fp16.
  const auto rtn = kernels::page_layout(spec(kernels::ScaleGrouping::kPerToken, 128));
  EXPECT_EQ(rtn.codes_bytes, 2 * 16 * 32);
  EXPECT_EQ(rtn.params_offset, 1024);
  EXPECT_EQ(rtn.params_bytes, 2 * 16 * 4);
  EXPECT_EQ(rtn.page_bytes, 1152);  // 1152 * 8 / (16 * 256) = 2.25 bits, calib's 2 + 32/128
  const auto kivi = kernels::page_layout(spec(kernels::ScaleGrouping::kPerChannelTokens, 32));
  EXPECT_EQ(kivi.pairs_per_slot, 8);  // 256 channels / 32 tokens
  EXPECT_EQ(kivi.page_bytes, 1024 + 16 * 8 * 4);  // 3 bits per element: 2 + 32/32
  const auto values = kernels::page_layout(spec(kernels::ScaleGrouping::kPerTokenAllHeads, 0, true));
  EXPECT_EQ(values.outlier_spans, 1);
  EXPECT_EQ(values.outlier_span_size, 256);
  EXPECT_EQ(values.row_pointers_offset, 1024 + 64);
  EXPECT_EQ(values.row_pointers_bytes, (16 + 1) * 4);
  EXPECT_EQ(values.page_bytes, 1168);  // 1156 rounded up to 16
  EXPECT_EQ(values.outlier_page_bytes, 256 * 4);
  const auto keys = kernels::page_layout(spec(kernels::ScaleGrouping::kPerChannelOffline, 0, true));
  EXPECT_EQ(keys.params_bytes, 0);
  EXPECT_EQ(keys.row_pointers_bytes, (16 * 2 + 1) * 4);
}

TEST(RuntimeLayout, WindowsFollowTheArtifactRule) {
  // docs/artifact.md's worked example: KIVI, sink 0, R = 128, G = 32, T = 300.
  auto keys = spec(kernels::ScaleGrouping::kPerChannelTokens, 32);
  keys.residual_tokens = 128;
  keys.window_rule = kernels::WindowRule::kBlockFlush;
  EXPECT_EQ(kernels::quantized_end(keys, 300), 256);
  EXPECT_EQ(kernels::quantized_end(keys, 383), 256);
  EXPECT_EQ(kernels::quantized_end(keys, 384), 384);
  auto values = spec(kernels::ScaleGrouping::kPerToken, 32);
  values.residual_tokens = 128;
  EXPECT_EQ(kernels::quantized_end(values, 300), 172);
  auto sliding_keys = keys;
  sliding_keys.window_rule = kernels::WindowRule::kSliding;
  EXPECT_EQ(kernels::quantized_end(sliding_keys, 300), 160);
  EXPECT_EQ(kernels::page_layout(sliding_keys).ring_capacity, 128 + 31);
  EXPECT_EQ(kernels::page_layout(keys).ring_capacity, 128);
  // Against calib's rule for every T of a few settings.
  QuantizerSettings settings;
  settings.sink_tokens = 3;
  settings.residual_tokens = 8;
  for (auto [grouping, group, rule] : {std::tuple{Grouping::kPerChannelTokens, 4, ResidualRule::kBlockFlush},
                                       std::tuple{Grouping::kPerChannelTokens, 3, ResidualRule::kSliding},
                                       std::tuple{Grouping::kPerToken, 128, ResidualRule::kSliding},
                                       std::tuple{Grouping::kPerToken, 128, ResidualRule::kBlockFlush}}) {
    TensorQuantizerSettings tensor{grouping, group};
    tensor.residual_rule = rule;
    auto s = spec(grouping == Grouping::kPerToken ? kernels::ScaleGrouping::kPerToken
                                                  : kernels::ScaleGrouping::kPerChannelTokens,
                  group);
    s.sink_tokens = 3;
    s.residual_tokens = 8;
    s.window_rule = rule == ResidualRule::kBlockFlush ? kernels::WindowRule::kBlockFlush : kernels::WindowRule::kSliding;
    for (int64_t t = 0; t < 60; ++t) {
      const TokenSpan expected = quantized_tokens(settings, tensor, t);
      ASSERT_EQ(kernels::quantized_begin(s, t), expected.begin) << t;
      ASSERT_EQ(kernels::quantized_end(s, t), expected.end) << t;
      ASSERT_LE(t - expected.end, kernels::page_layout(s).ring_capacity) << "the ring holds the window at " << t;
    }
  }
}

TEST(RuntimeLayout, SameQuantizedRangesHoldsExactlyWhereEveryContextsRangesAgree) {
  // Every pair of a few specs: same_quantized_ranges against the ranges
  // compared at every T (brute force). Where it holds, the decode's exact
  // blocks read no codes; where it says no although the ranges agreed at
  // every T tried, only a slower kernel is chosen (allowed but counted: the
  // rule is exact on these specs).
  std::vector<kernels::TensorLayoutSpec> specs;
  for (auto [grouping, group] : {std::pair{kernels::ScaleGrouping::kPerToken, 128},
                                 std::pair{kernels::ScaleGrouping::kPerToken, 32},
                                 std::pair{kernels::ScaleGrouping::kPerChannelTokens, 32},
                                 std::pair{kernels::ScaleGrouping::kPerChannelTokens, 16}}) {
    for (auto rule : {kernels::WindowRule::kSliding, kernels::WindowRule::kBlockFlush}) {
      for (int32_t sink : {0, 3}) {
        for (int32_t residual : {0, 64, 128}) {
          auto s = spec(grouping, group);
          s.window_rule = rule;
          s.sink_tokens = sink;
          s.residual_tokens = residual;
          if (rule == kernels::WindowRule::kBlockFlush && residual == 0) continue;  // a flush needs R > 0
          specs.push_back(s);
        }
      }
    }
  }
  int agreeing_pairs = 0;
  for (const auto& k : specs) {
    for (const auto& v : specs) {
      bool agree = true;
      for (int64_t t = 0; t < 700 && agree; ++t) {
        agree = kernels::quantized_begin(k, t) == kernels::quantized_begin(v, t) &&
                kernels::quantized_end(k, t) == kernels::quantized_end(v, t);
      }
      ASSERT_EQ(kernels::same_quantized_ranges(k, v), agree)
          << "sink " << k.sink_tokens << "/" << v.sink_tokens << ", residual " << k.residual_tokens << "/"
          << v.residual_tokens << ", rule " << static_cast<int>(k.window_rule) << "/" << static_cast<int>(v.window_rule)
          << ", group " << k.group << "/" << v.group;
      agreeing_pairs += agree ? 1 : 0;
    }
  }
  EXPECT_GT(agreeing_pairs, static_cast<int>(specs.size()));  // not only each spec with itself
}

// ------------------------------------------------------------ configurations

// The layouts: tests/kernel_cases.h (the CUDA append test runs them too).
using Case = testing::KernelCase;
using testing::make_kernel_case;

constexpr int64_t kKvHeads = 2, kLayers = 2;

using testing::to_element;
using Activations = testing::KernelActivations;
Activations synthetic(int64_t windows, int64_t tokens, int64_t dim, double layer_scale, ElementType element,
                      const RotaryEmbedding& rope) {
  return testing::synthetic_activations(windows, kKvHeads, tokens, dim, layer_scale, element, rope);
}

// Rounds every element of a float64 tensor to the cache's element type, once
// (torch would round double -> float -> half, twice).
at::Tensor round_each(const at::Tensor& x, ElementType element) {
  at::Tensor out = x.to(at::kDouble).contiguous().clone();
  double* data = out.data_ptr<double>();
  for (int64_t i = 0; i < out.numel(); ++i) data[i] = kernels::round_to_element(element, data[i]);
  return out;
}

kernels::ModelDimensions dimensions(const Case& c, const RopeConfig& rope) {
  return testing::kernel_model_dimensions(kLayers, c.heads, kKvHeads, c.head_dim, rope);
}

// The configuration of a case, fitted by calib's fit_layer on synthetic
// calibration windows (rotated ones for a rotated case: the quantizer is
// fitted to the tensors it quantizes).
QuantizerConfig fitted_config(const Case& c, const RotaryEmbedding& rope) {
  return testing::fitted_kernel_config(c.name, c.fit, kLayers, kKvHeads, c.head_dim, c.element, c.key_rotation,
                                       c.value_rotation, c.key_centre, rope);
}

// ------------------------------------------------------------ the oracle

const TensorQuantizerSettings& settings_of(const QuantizerConfig& c, TensorKind kind) {
  return kind == TensorKind::kKeys ? c.settings.keys : c.settings.values;
}
const TensorQuantizer& quantizer_of(const QuantizerConfig& c, int64_t layer, TensorKind kind) {
  return kind == TensorKind::kKeys ? c.layers[layer].keys : c.layers[layer].values;
}
RotationForm form_of(const QuantizerConfig& c, TensorKind kind) {
  if (!c.rotation) return RotationForm::kNone;
  return kind == TensorKind::kKeys ? c.rotation->keys : c.rotation->values;
}
const TensorRotation& rotation_of(const QuantizerConfig& c, int64_t layer, TensorKind kind) {
  return kind == TensorKind::kKeys ? c.layers[layer].rotation.keys : c.layers[layer].rotation.values;
}

// x [1, kv_heads, T, D] in the configuration's domain -> the tensors the
// cache quantizes: calib's rotation (float64), rounded to the element type.
at::Tensor stored_basis(const QuantizerConfig& c, int64_t layer, TensorKind kind, const at::Tensor& x,
                        ElementType element) {
  const RotationForm form = form_of(c, kind);
  at::Tensor y = x.to(at::kDouble);
  if (form == RotationForm::kNone) return y;
  const int64_t dim = x.size(-1);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor centre = rotation_centre(rotation_of(c, layer, kind), kKvHeads, dim, options);
  if (centre.defined()) y = y - centre;
  return round_each(rotate(y, rotation_matrices(rotation_of(c, layer, kind), form, kKvHeads, dim, options)), element);
}

// The stored basis back in the model's (calib's unrotate and centre).
at::Tensor model_basis(const QuantizerConfig& c, int64_t layer, TensorKind kind, const at::Tensor& y) {
  const RotationForm form = form_of(c, kind);
  if (form == RotationForm::kNone) return y;
  const int64_t dim = y.size(-1);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = unrotate(y, rotation_matrices(rotation_of(c, layer, kind), form, kKvHeads, dim, options));
  const at::Tensor centre = rotation_centre(rotation_of(c, layer, kind), kKvHeads, dim, options);
  return centre.defined() ? x + centre : x;
}

// calib's codes of the quantized span y [1, kv_heads, S, D] and, per element,
// the float32 dequantization bound: (a, b) are formed from the stored
// (min, max) with at most 4 float32 roundings each and x^ = fma(b, L, a)
// rounds once more, so |x^32 - x^64| <= 5.1 u (|lo| + |hi|) for uniform and
// <= 3 u (|lo| + |hi|) max(1, |grid|) for grids (docs/runtime-layout.md,
// "Dequantization"); 8 u (|lo| + |hi|) max(1, |grid|) covers both, and a
// flipped code moves x^ by a whole level, (hi - lo) / 15 or more.
// kPerChannelOffline: x^ = fma(scale, L, offset) with exact scale and offset
// and L rounded to float32 once: <= 2 u (|offset| + |scale| max|L|); 4 u used.
struct OracleCodes {
  at::Tensor codes;  // int64
  at::Tensor bound;  // float64
  at::Tensor kept;   // bool: groups kept as they are
};

OracleCodes oracle_codes(const QuantizerSettings& settings, const TensorQuantizerSettings& tensor,
                         const TensorQuantizer& q, const at::Tensor& span, const at::Tensor& outliers) {
  double level_max = 1;
  for (float g : q.grid) level_max = std::max(level_max, std::fabs(static_cast<double>(g)));
  const int64_t heads = span.size(-3), dim = span.size(-1);
  OracleCodes o;
  if (tensor.grouping == Grouping::kPerChannelOffline) {
    o.codes = offline_codes(settings, q, span);
    const at::Tensor offset = channel_tensor(q.channel_offset, heads, dim, "offset", span.device());
    const at::Tensor scale = channel_tensor(q.channel_scale, heads, dim, "scale", span.device());
    o.bound = (4 * kUnit * (offset.abs() + scale.abs() * level_max)).expand(span.sizes());
    o.kept = at::zeros(span.sizes(), at::kBool);
    return o;
  }
  const GroupQuantizer group{settings.bits, q.clip_ratio, q.grid, q.encode_grid};
  const at::Tensor inliers = tensor.outlier_fraction > 0 ? outliers.logical_not() : at::Tensor();
  if (tensor.grouping == Grouping::kPerTokenAllHeads) {
    const at::Tensor rows = to_all_head_rows(span);
    const GroupCodes g = group_codes(rows, -1, group, inliers.defined() ? to_all_head_rows(inliers) : at::Tensor());
    o.codes = from_all_head_rows(g.codes, span);
    o.bound = from_all_head_rows((8 * kUnit * level_max * (g.lo.abs() + g.hi.abs())).expand(rows.sizes()), span);
    o.kept = from_all_head_rows(g.kept.expand(rows.sizes()), span);
    return o;
  }
  int64_t axis = 0;
  const std::vector<int64_t> shape = group_shape(span, tensor.grouping, tensor.group, axis);
  const GroupCodes g = group_codes(span.reshape(shape), axis, group, inliers.defined() ? inliers.reshape(shape) : at::Tensor());
  o.codes = g.codes.reshape(span.sizes());
  o.bound = (8 * kUnit * level_max * (g.lo.abs() + g.hi.abs())).expand(shape).reshape(span.sizes());
  o.kept = g.kept.expand(shape).reshape(span.sizes());
  return o;
}

// ------------------------------------------------------------ streaming

// The inputs a sequence is fed, per layer: [1, kv_heads, total, D] float32.
struct SequenceInputs {
  std::vector<Activations> layers;
};

struct Step {
  std::vector<std::pair<int, int64_t>> appends;  // (sequence index, tokens)
};

// A prefill of A and B, decoding steps, B's second chunk while C arrives,
// more decoding, a long chunk of A across flushes and page boundaries.
std::vector<Step> schedule(bool long_context) {
  std::vector<Step> steps;
  if (long_context) {  // two sequences, prefill chunks of 1000 and 700, then decoding
    steps.push_back({{{0, 1000}, {1, 700}}});
    steps.push_back({{{0, 1000}, {1, 1}}});
    steps.push_back({{{0, 1000}, {1, 700}}});
    for (int i = 0; i < 3; ++i) steps.push_back({{{0, 1}, {1, 1}}});
    return steps;
  }
  steps.push_back({{{0, 37}, {1, 5}}});
  for (int i = 0; i < 4; ++i) steps.push_back({{{0, 1}, {1, 1}}});
  steps.push_back({{{1, 20}, {0, 1}, {2, 33}}});
  for (int i = 0; i < 8; ++i) steps.push_back({{{2, 1}, {0, 1}, {1, 1}}});
  steps.push_back({{{0, 41}, {2, 1}}});
  for (int i = 0; i < 6; ++i) steps.push_back({{{0, 1}, {1, 1}, {2, 1}}});
  return steps;
}

struct StreamResult {
  double worst_attention = 0;   // max |o - o64| / max |v|
  double worst_value_ratio = 0; // max |x^32 - x^64| / bound
  int64_t quantized_compared = 0, outliers_seen = 0, tokens_checked = 0;
};

class Stream {
 public:
  Stream(const Case& c, const RopeConfig& rope_config)
      : case_(c), rope_(rope_config, c.head_dim, at::kCPU), dims_(dimensions(c, rope_config)) {}

  StreamResult run(const QuantizerConfig& config) {
    kernels::CacheOptions options;
    options.page_size = case_.page_size;
    options.max_sequences = 4;
    options.max_context = case_.long_context ? 4096 : 256;
    options.element = case_.element;
    options.tokens_per_split = case_.tokens_per_split;
    options.outlier_page_entries = 64;
    kernels::QuantizedKVCache cache(config, dims_, options);
    const std::vector<Step> steps = schedule(case_.long_context);
    std::vector<int64_t> totals(3, 0);
    for (const Step& step : steps) {
      for (auto [seq, n] : step.appends) totals[seq] += n;
    }
    for (int s = 0; s < 3; ++s) {
      if (totals[s] == 0) totals[s] = 1;  // unused
      SequenceInputs in;
      for (int64_t layer = 0; layer < kLayers; ++layer) {
        in.layers.push_back(synthetic(1, totals[s], case_.head_dim, 1.0 + 0.5 * layer, case_.element, rope_));
      }
      inputs_.push_back(std::move(in));
    }
    std::vector<int32_t> ids(3, -1);
    std::vector<int64_t> lengths(3, 0);
    StreamResult result;
    for (const Step& step : steps) {
      kernels::AppendBatch batch;
      for (auto [seq, n] : step.appends) {
        if (ids[seq] < 0) ids[seq] = cache.add_sequence();
        batch.sequences.push_back(ids[seq]);
        batch.positions.push_back(lengths[seq]);
        batch.tokens.push_back(n);
      }
      for (int64_t layer = 0; layer < kLayers; ++layer) {
        std::vector<float> keys, values;
        for (auto [seq, n] : step.appends) {
          testing::append_token_rows(inputs_[seq].layers[layer], config.settings.keys_pre_rope, lengths[seq], n, keys,
                                     values);
        }
        batch.keys = keys.data();
        batch.values = values.data();
        cache.append(layer, batch);
      }
      for (auto [seq, n] : step.appends) lengths[seq] += n;
      std::vector<int32_t> active;
      std::vector<int> indices;
      for (int s = 0; s < 3; ++s) {
        if (ids[s] >= 0) {
          active.push_back(ids[s]);
          indices.push_back(s);
        }
      }
      for (int64_t layer = 0; layer < kLayers; ++layer) {
        std::vector<at::Tensor> keys_model, values_model;
        for (size_t i = 0; i < active.size(); ++i) {
          const int s = indices[i];
          const Activations& a = inputs_[s].layers[layer];
          const int64_t t = lengths[s];
          const at::Tensor k = (config.settings.keys_pre_rope ? a.keys_pre : a.keys).narrow(2, 0, t);
          keys_model.push_back(check_readback(cache, config, layer, TensorKind::kKeys, active[i], k, result));
          values_model.push_back(
              check_readback(cache, config, layer, TensorKind::kValues, active[i], a.values.narrow(2, 0, t), result));
          if (config.settings.keys_pre_rope) {
            keys_model.back() = RotaryEmbedding::apply(keys_model.back(), rope_.tables(0, t, at::kDouble));
          }
        }
        check_attention(cache, layer, active, keys_model, values_model, result);
        check_bytes(cache, config, layer, active, lengths, indices);
      }
    }
    return result;
  }

 private:
  // Compares what the pages read back for every token with calib's oracle
  // over the whole prefix; returns the oracle's read-back in the model's
  // basis (float64 [1, Hkv, T, D]).
  at::Tensor check_readback(const kernels::QuantizedKVCache& cache, const QuantizerConfig& config, int64_t layer,
                            TensorKind kind, int32_t id, const at::Tensor& x, StreamResult& result) {
    const int64_t tokens = x.size(2), dim = case_.head_dim;
    const at::Tensor y = stored_basis(config, layer, kind, x, case_.element);
    const TensorQuantizerSettings& tensor = settings_of(config, kind);
    const TensorQuantizer& q = quantizer_of(config, layer, kind);
    const SimulatedTensor simulated = simulate_quantization(config.settings, tensor, q, y);
    const TokenSpan span = quantized_tokens(config.settings, tensor, tokens);
    OracleCodes codes;
    if (span.size() > 0) {
      codes = oracle_codes(config.settings, tensor, q, y.narrow(2, span.begin, span.size()),
                           simulated.outliers.narrow(2, span.begin, span.size()));
    }
    at::Tensor oracle_codes_, oracle_bound, oracle_kept;
    if (span.size() > 0) {
      oracle_codes_ = codes.codes.contiguous();
      oracle_bound = codes.bound.contiguous();
      oracle_kept = codes.kept.contiguous();
    } else {
      oracle_codes_ = at::zeros({1, 1, 1, 1}, at::kLong);
      oracle_bound = at::zeros({1, 1, 1, 1}, at::kDouble);
      oracle_kept = at::zeros({1, 1, 1, 1}, at::kBool);
    }
    const auto ca = oracle_codes_.accessor<int64_t, 4>();
    const auto ba = oracle_bound.accessor<double, 4>();
    const auto ka = oracle_kept.accessor<bool, 4>();
    const auto ya = y.accessor<double, 4>();
    const auto sa = simulated.dequantized.accessor<double, 4>();
    const auto oa = simulated.outliers.accessor<bool, 4>();
    std::string first_failure;
    int64_t failures = 0;
    const auto fail = [&](const std::string& what) {
      if (failures++ == 0) first_failure = what;
    };
    const std::string where = case_.name + (kind == TensorKind::kKeys ? " keys" : " values") + " layer " +
                              std::to_string(layer) + " at T=" + std::to_string(tokens);
    for (int64_t t = 0; t < tokens; ++t) {
      const kernels::TokenReadout r = cache.read_token(layer, kind, id, t);
      const bool quantized = t >= span.begin && t < span.end;
      ++result.tokens_checked;
      if (r.quantized != quantized) fail(where + ": token " + std::to_string(t) + " quantized flag");
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t d = 0; d < dim; ++d) {
          const int64_t e = h * dim + d;
          const double got = r.values[e], exact = ya[0][h][t][d];
          if (!quantized) {
            if (got != exact) fail(where + ": exact token " + std::to_string(t) + " differs");
            continue;
          }
          const int64_t i = t - span.begin;
          const bool outlier = oa[0][h][t][d];
          result.outliers_seen += outlier;
          if (static_cast<bool>(r.outliers[e]) != outlier) fail(where + ": outlier flag of token " + std::to_string(t));
          if (outlier || ka[0][h][i][d]) {
            if (got != exact) fail(where + ": kept value of token " + std::to_string(t));
            continue;
          }
          ++result.quantized_compared;
          if (r.codes[e] != ca[0][h][i][d]) {
            fail(where + ": code of token " + std::to_string(t) + " head " + std::to_string(h) + " channel " +
                 std::to_string(d) + ": " + std::to_string(r.codes[e]) + " vs calib's " +
                 std::to_string(ca[0][h][i][d]));
          }
          const double bound = ba[0][h][i][d];
          const double error = std::fabs(got - sa[0][h][t][d]);
          if (bound > 0) result.worst_value_ratio = std::max(result.worst_value_ratio, error / bound);
          if (error > bound) fail(where + ": value of token " + std::to_string(t) + " off by " + std::to_string(error));
        }
      }
    }
    EXPECT_EQ(failures, 0) << first_failure << " (" << failures << " mismatches)";
    return model_basis(config, layer, kind, simulated.dequantized);
  }

  // decode_attention of the whole batch against float64 attention over the
  // oracle's read-back.
  //
  // Tolerance 1e-5 of max|v|, derived: the read-back differs from the
  // oracle's by < 8u of the groups' range (above), a logit error of
  // about 8u * scale * sum|q_d| |k_d| < 1e-5 * |s| for these data; float32
  // then rounds each logit's D-term dot product (16 lanes of D/16 fmas, a
  // 4-level tree: (D/16 + 4) roundings), exp, the online rescaling (2 per
  // token of a split of S tokens) and the merge of the splits. With
  // independent rounding errors (Higham & Mary's probabilistic bound,
  // lambda = 3 sqrt(n) u, holding with probability > 1 - 2e-4 per sum) the
  // logits err by 3 sqrt(12) u * sum|q_d k_d| scale ~ 1.8e-6 (sum ~ 15 here)
  // and the output, a convex combination, by |delta s| * max|v - o| +
  // 3 sqrt(2S + splits) u * max|v| ~ 2e-6 max|v| (S = 16..64): under
  // 1e-5 max|v| with a margin of 4. (The worst-case bound, n u instead of
  // sqrt(n) u, would be ~5e-5: never reached by rounding that does not
  // conspire.)
  void check_attention(kernels::QuantizedKVCache& cache, int64_t layer, const std::vector<int32_t>& active,
                       const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                       StreamResult& result) {
    const int64_t heads = case_.heads, dim = case_.head_dim, group = heads / kKvHeads;
    const auto count = static_cast<int64_t>(active.size());
    const at::Tensor queries = at::randn({count, heads, dim}, at::kFloat).contiguous();
    std::vector<float> output(static_cast<size_t>(count * heads * dim));
    cache.decode_attention(layer, active, queries.data_ptr<float>(), output.data());
    const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
    for (int64_t i = 0; i < count; ++i) {
      const at::Tensor k = keys[i][0], v = values[i][0];  // [Hkv, T, D] float64
      const double vmax = v.abs().max().item<double>();
      for (int64_t g = 0; g < heads; ++g) {
        const at::Tensor q = queries[i][g].to(at::kDouble);
        const at::Tensor p = at::softmax(at::matmul(k[g / group], q) * scale, 0);
        const at::Tensor expected = at::matmul(p, v[g / group]);
        const at::Tensor got = at::from_blob(output.data() + (i * heads + g) * dim, {dim}, at::kFloat).to(at::kDouble);
        const double error = (got - expected).abs().max().item<double>() / vmax;
        result.worst_attention = std::max(result.worst_attention, error);
        EXPECT_LE(error, 1e-5) << case_.name << " layer " << layer << " sequence " << active[i] << " head " << g
                               << " at T=" << k.size(1);
      }
    }
  }

  // What one sequence holds (the allocators' pages) is bytes_held(); the
  // bytes one sequence's decoding step reads (ReadTally) equal the layout's
  // formula; the formula minus calib's effective-bits accounting is
  // exactly the documented difference.
  void check_bytes(kernels::QuantizedKVCache& cache, const QuantizerConfig& config, int64_t layer,
                   const std::vector<int32_t>& active, const std::vector<int64_t>& lengths,
                   const std::vector<int>& indices) {
    const int64_t dim = case_.head_dim;
    for (size_t i = 0; i < active.size(); ++i) {
      const int64_t tokens = lengths[indices[i]];
      kernels::ReadTally tally;
      const at::Tensor query = at::randn({1, case_.heads, dim}, at::kFloat).contiguous();
      std::vector<float> output(static_cast<size_t>(case_.heads * dim));
      cache.decode_attention(layer, std::span<const int32_t>(&active[i], 1), query.data_ptr<float>(), output.data(),
                             &tally);
      for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
        const kernels::TensorBytes held = cache.held_bytes(layer, kind, active[i]);
        const kernels::TensorBytes expected =
            kernels::bytes_held(cache.layout(kind), tokens, cache.outlier_entries(layer, kind, active[i]));
        EXPECT_EQ(held.total(), expected.total()) << case_.name << " layer " << layer << " T=" << tokens;
        EXPECT_EQ(held.codes, expected.codes) << case_.name << " layer " << layer << " T=" << tokens;
      }
      int64_t formula = 0, shared_page_table = std::numeric_limits<int64_t>::max(), extra = 0;
      double accounting = 0;
      for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
        const kernels::TensorPageLayout& l = cache.layout(kind);
        const int64_t begin = kernels::quantized_begin(l.spec, tokens), end = kernels::quantized_end(l.spec, tokens);
        int64_t visible = 0;
        for (int64_t t = begin; t < end; ++t) {
          for (uint8_t flag : cache.read_token(layer, kind, active[i], t).outliers) visible += flag;
        }
        const kernels::TensorBytes b = kernels::bytes_read(l, tokens, visible);
        formula += b.total();
        shared_page_table = std::min(shared_page_table, b.page_table);
        const TensorQuantizerSettings& tensor = settings_of(config, kind);
        const int64_t elements = (end - begin) * kKvHeads * dim;
        const std::optional<double> measured =
            tensor.outlier_fraction > 0 && elements > 0
                ? std::optional<double>(static_cast<double>(visible) / static_cast<double>(elements))
                : std::nullopt;
        accounting += tensor_effective_bits(config.settings, tensor, kKvHeads, dim, tokens, measured) *
                      static_cast<double>(tokens * kKvHeads * dim) / 8;
        // What the accounting does not count: page ids, each page's closing
        // row pointer, outlier page ids; and it counts the offline channel
        // parameters (4 bytes per channel at 16 bits), a per-layer constant
        // here.
        extra += b.page_table + b.outlier_page_table;
        if (b.row_pointers > 0) extra += kernels::ceil_div(end - begin, l.spec.page_size) * kernels::kRowPointerBytes;
        if (tensor.grouping == Grouping::kPerChannelOffline) extra -= 4 * kKvHeads * dim;
      }
      formula -= shared_page_table;  // keys and values read one page table
      extra -= shared_page_table;
      EXPECT_EQ(tally.distinct_bytes(), formula) << case_.name << " layer " << layer << " T=" << tokens;
      if (case_.element != ElementType::kFloat32) {
        EXPECT_NEAR(static_cast<double>(formula - extra), accounting, 1e-6 * accounting)
            << case_.name << " layer " << layer << " T=" << tokens;
      }
    }
  }

  Case case_;
  RotaryEmbedding rope_;
  kernels::ModelDimensions dims_;
  std::vector<SequenceInputs> inputs_;
};

class RuntimeKernelsCpu : public ::testing::TestWithParam<Case> {};

TEST_P(RuntimeKernelsCpu, StreamedBatchReadsBackTheOracleAndAttendsLikeFloat64) {
  const Case& c = GetParam();
  at::manual_seed(1234);
  const RopeConfig rope_config;
  const RotaryEmbedding rope(rope_config, c.head_dim, at::kCPU);
  const auto start = std::chrono::steady_clock::now();
  const QuantizerConfig config = fitted_config(c, rope);
  Stream stream(c, rope_config);
  const StreamResult r = stream.run(config);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ %s ] %lld quantized elements compared, %lld outliers, worst value error %.3f of its bound, worst "
              "attention error %.2e of max|v|, %.1f s\n",
              c.name.c_str(), static_cast<long long>(r.quantized_compared), static_cast<long long>(r.outliers_seen),
              r.worst_value_ratio, r.worst_attention, seconds);
  EXPECT_GT(r.quantized_compared, 10000) << "the case must quantize";
  if (config.settings.keys.outlier_fraction > 0 || config.settings.values.outlier_fraction > 0) {
    EXPECT_GT(r.outliers_seen, 50) << "the case must find outliers";
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, RuntimeKernelsCpu, ::testing::ValuesIn(testing::layout_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// ------------------------------------------------------------ the eval's cache

// The same stream through SimulatedQuantizedCache (what kvforge eval runs the
// model through) and the runtime cache: after every chunk of every layer
// the runtime reads back what the simulated cache returns, post-RoPE keys
// included. Bound: the float32 dequantization error, 8 u (|lo| + |hi|)
// max(1, |grid|) <= 8 u * 2 max|x| * 1.5 < 32 u max|x| (grids lie within
// +-1.5 here); a wrong code or a missed outlier moves a value by a level.
void expect_runtime_reads_what_eval_simulates(const Case& c) {
  at::manual_seed(77);
  const RopeConfig rope_config;
  const RotaryEmbedding rope(rope_config, c.head_dim, at::kCPU);
  const QuantizerConfig config = fitted_config(c, rope);
  for (const LayerQuantizers& layer : config.layers) {
    for (float g : layer.keys.grid) ASSERT_LE(std::fabs(g), 1.5f);
    for (float g : layer.values.grid) ASSERT_LE(std::fabs(g), 1.5f);
  }
  ModelConfig model;
  model.num_layers = kLayers;
  model.num_heads = c.heads;
  model.num_kv_heads = kKvHeads;
  model.head_dim = c.head_dim;
  model.rope = rope_config;
  const int64_t total = 80;
  SimulatedQuantizedCache simulated(model, config, rope, 1, total, at::kCPU, at::kDouble);
  kernels::CacheOptions options;
  options.page_size = c.page_size;
  options.element = c.element;
  options.max_context = total;
  kernels::QuantizedKVCache runtime(config, dimensions(c, rope_config), options);
  const int32_t id = runtime.add_sequence();
  std::vector<Activations> data;
  for (int64_t layer = 0; layer < kLayers; ++layer) data.push_back(synthetic(1, total, c.head_dim, 1.0 + layer, c.element, rope));
  int64_t position = 0, quantized_steps = 0;
  for (int64_t chunk : {7, 1, 1, 12, 1, 1, 1, 30, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}) {
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      const Activations& a = data[layer];
      NewKeysValues block;
      block.layer = layer;
      block.position_start = position;
      block.keys_pre_rope = a.keys_pre.narrow(2, position, chunk).to(at::kDouble);
      block.keys = a.keys.narrow(2, position, chunk).to(at::kDouble);
      block.values = a.values.narrow(2, position, chunk).to(at::kDouble);
      const CachedKeysValues expected = simulated.append(block);
      const at::Tensor k = (config.settings.keys_pre_rope ? a.keys_pre : a.keys).narrow(2, position, chunk)[0]
                               .permute({1, 0, 2}).contiguous();
      const at::Tensor v = a.values.narrow(2, position, chunk)[0].permute({1, 0, 2}).contiguous();
      runtime.append(layer, {{id}, {position}, {chunk}, k.data_ptr<float>(), v.data_ptr<float>()});
      const int64_t length = position + chunk;
      at::Tensor keys = at::empty({1, kKvHeads, length, c.head_dim}, at::kDouble);
      at::Tensor values = at::empty_like(keys);
      for (int64_t t = 0; t < length; ++t) {
        const kernels::TokenReadout rk = runtime.read_token(layer, TensorKind::kKeys, id, t);
        const kernels::TokenReadout rv = runtime.read_token(layer, TensorKind::kValues, id, t);
        keys.select(2, t).copy_(at::tensor(rk.values, at::kFloat).view({1, kKvHeads, c.head_dim}));
        values.select(2, t).copy_(at::tensor(rv.values, at::kFloat).view({1, kKvHeads, c.head_dim}));
      }
      if (config.settings.keys_pre_rope) keys = RotaryEmbedding::apply(keys, rope.tables(0, length, at::kDouble));
      const double key_bound = 32 * kUnit * expected.keys.abs().max().item<double>();
      const double value_bound = 32 * kUnit * expected.values.abs().max().item<double>();
      EXPECT_LE((keys - expected.keys).abs().max().item<double>(), key_bound) << c.name << " layer " << layer << " T=" << length;
      EXPECT_LE((values - expected.values).abs().max().item<double>(), value_bound) << c.name << " layer " << layer << " T=" << length;
      quantized_steps += !at::equal(expected.values, a.values.narrow(2, 0, length).to(at::kDouble));
    }
    simulated.commit(chunk);
    position += chunk;
  }
  ASSERT_EQ(position, total);
  EXPECT_GT(quantized_steps, 40) << "the simulated cache must quantize";
}

TEST(RuntimeKernelsCpuAgainstEval, KvquantReadsWhatTheSimulatedCacheReturns) {
  Case c = make_kernel_case("kvquant_vs_eval", QuantMethod::kKvquant, 2, 64, 4);
  c.fit.outlier_fraction = 0.05;
  expect_runtime_reads_what_eval_simulates(c);
}

TEST(RuntimeKernelsCpuAgainstEval, SlidingKiviWithASinkReadsWhatTheSimulatedCacheReturns) {
  Case c = make_kernel_case("kivi_vs_eval", QuantMethod::kKivi, 2, 64, 4);
  c.fit.residual_tokens = 8;
  c.fit.key_group = 8;
  c.fit.value_group = 16;
  c.fit.sink_tokens = 3;
  c.fit.key_residual_rule = ResidualRule::kSliding;
  c.page_size = 5;
  expect_runtime_reads_what_eval_simulates(c);
}

// ------------------------------------------------------------ refusals

QuantizerConfig small_rtn(int64_t layers, int64_t head_dim) {
  QuantizerConfig c;
  c.name = "small-rtn";
  c.settings.method = QuantMethod::kRtn;
  c.settings.keys = {Grouping::kPerToken, head_dim};
  c.settings.values = {Grouping::kPerToken, head_dim};
  c.layers.resize(static_cast<size_t>(layers));
  return c;
}

kernels::ModelDimensions small_dims(int64_t head_dim = 64) {
  kernels::ModelDimensions d;
  d.num_layers = 2;
  d.num_heads = 4;
  d.num_kv_heads = 2;
  d.head_dim = head_dim;
  return d;
}

void expect_refusal(const QuantizerConfig& config, const kernels::ModelDimensions& dims,
                    const kernels::CacheOptions& options, const std::string& field) {
  try {
    kernels::QuantizedKVCache cache(config, dims, options);
    ADD_FAILURE() << "accepted; expected a refusal naming " << field;
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_EQ(what.rfind("quantizer config '" + config.name + "': ", 0), 0u) << what;
    EXPECT_NE(what.find(field), std::string::npos) << what << " should name " << field;
  }
}

TEST(RuntimeKernelsCpuRefusals, BadConfigurationsAreOneLineNamingTheField) {
  const kernels::CacheOptions options;
  kernels::QuantizedKVCache accepted(small_rtn(2, 64), small_dims(), options);
  expect_refusal(small_rtn(3, 64), small_dims(), options, "layers");
  QuantizerConfig c = small_rtn(2, 64);
  c.settings.bits = 3;
  expect_refusal(c, small_dims(), options, "bits");
  c = small_rtn(2, 64);
  c.settings.keys.group = 48;
  expect_refusal(c, small_dims(), options, "keys_group");
  c = small_rtn(2, 64);
  c.settings.keys = {Grouping::kPerChannelTokens, 32};
  c.settings.keys.residual_rule = ResidualRule::kBlockFlush;
  c.settings.residual_tokens = 40;
  expect_refusal(c, small_dims(), options, "keys_residual_rule");
  c = small_rtn(2, 64);
  c.settings.keys = {Grouping::kPerChannelOffline, 0};
  for (LayerQuantizers& l : c.layers) {
    l.keys.channel_scale = {{2, 64}, std::vector<float>(128, 1.5f)};
    l.keys.channel_offset = {{2, 64}, std::vector<float>(128, 0.0f)};
  }
  c.layers[1].keys.channel_scale = {{2, 32}, std::vector<float>(64, 1.5f)};
  expect_refusal(c, small_dims(), options, "layers/1/keys/channel_scale");
  c = small_rtn(2, 64);
  c.settings.values.non_uniform = true;
  for (LayerQuantizers& l : c.layers) l.values.grid = {-1.0f, -0.2f, 0.3f, 1.0f};
  c.layers[1].values.grid = {-1.0f, 0.0f, 1.0f};
  expect_refusal(c, small_dims(), options, "layers/1/values/grid");
  c = small_rtn(2, 64);
  c.settings.values.outlier_fraction = 0.01;
  expect_refusal(c, small_dims(), options, "values_outlier_rule");
  c = small_rtn(2, 64);
  c.settings.values = {Grouping::kPerTokenAllHeads, 0, false, 0.01, OutlierRule::kTokenTau};
  for (LayerQuantizers& l : c.layers) l.values.outlier_tau = 2.0f;
  expect_refusal(c, small_dims(), options, "token_tau");
  c = small_rtn(2, 64);
  c.settings.keys_pre_rope = true;
  expect_refusal(c, small_dims(), options, "keys_pre_rope");  // no RoPE frequencies given
  c = small_rtn(2, 64);
  c.settings.keys_pre_rope = true;
  RotationSettings rotation;
  rotation.keys = RotationForm::kMatrix;
  c.rotation = rotation;
  kernels::ModelDimensions with_rope = small_dims();
  with_rope.rope_inverse_frequencies.assign(32, 1.0f);
  expect_refusal(c, with_rope, options, "keys_form matrix");
  c = small_rtn(2, 64);
  c.rotation = rotation;
  c.settings.keys_pre_rope = false;
  for (LayerQuantizers& l : c.layers) l.rotation.keys.matrix = {{2, 64, 64}, std::vector<float>(2 * 64 * 64, 0.0f)};
  c.layers[0].rotation.keys.matrix = {{2, 64, 32}, std::vector<float>(2 * 64 * 32, 0.0f)};
  expect_refusal(c, small_dims(), options, "layers/0/rotation/keys/matrix");
  expect_refusal(small_rtn(2, 36), small_dims(36), options, "head_dim");
  kernels::CacheOptions bad = options;
  bad.page_size = 0;
  expect_refusal(small_rtn(2, 64), small_dims(), bad, "page_size");
}

TEST(RuntimeKernelsCpuRefusals, BadCallsAreOneLine) {
  kernels::CacheOptions options;
  options.max_context = 40;
  options.max_sequences = 2;
  kernels::QuantizedKVCache cache(small_rtn(2, 64), small_dims(), options);
  const int32_t a = cache.add_sequence();
  std::vector<float> rows(50 * 2 * 64, 0.5f);
  kernels::AppendBatch batch{{a}, {3}, {2}, rows.data(), rows.data()};
  const auto one_line = [](const std::exception& e) { return std::string(e.what()).find('\n') == std::string::npos; };
  try {
    cache.append(0, batch);
    ADD_FAILURE() << "a block at position 3 of an empty sequence was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_TRUE(one_line(e)) << e.what();
    EXPECT_NE(std::string(e.what()).find("expected its length 0"), std::string::npos) << e.what();
  }
  batch = {{a}, {0}, {41}, rows.data(), rows.data()};
  try {
    cache.append(0, batch);
    ADD_FAILURE() << "41 tokens past max_context 40 were accepted";
  } catch (const std::length_error& e) {
    EXPECT_TRUE(one_line(e)) << e.what();
  }
  batch = {{a, a}, {0, 0}, {1, 1}, rows.data(), rows.data()};
  EXPECT_THROW(cache.append(0, batch), std::invalid_argument);
  float q[4 * 64] = {}, o[4 * 64];
  EXPECT_THROW(cache.decode_attention(0, std::span<const int32_t>(&a, 1), q, o), std::invalid_argument);
  cache.add_sequence();
  EXPECT_THROW(cache.add_sequence(), std::length_error);
}

// Empty batches (no sequences) are accepted and do nothing: decode writes no
// output (it once read the longest length of no sequences) and append stores
// nothing.
TEST(RuntimeKernelsCpuEmptyBatches, DecodeAndAppendOfNoSequencesDoNothing) {
  kernels::CacheOptions options;
  options.max_context = 40;
  options.max_sequences = 2;
  kernels::QuantizedKVCache cache(small_rtn(2, 64), small_dims(), options);
  const int32_t a = cache.add_sequence();
  std::vector<float> rows(3 * 2 * 64, 0.5f);
  cache.append(0, kernels::AppendBatch{{a}, {0}, {3}, rows.data(), rows.data()});
  float q[4 * 64] = {}, o[4 * 64];
  std::fill(std::begin(o), std::end(o), -7.0f);
  for (bool backend_memory : {false, true}) {
    cache.decode_attention(0, std::span<const int32_t>(), q, o, nullptr, backend_memory);
    cache.decode_attention(0, std::span<const int32_t>(), nullptr, nullptr, nullptr, backend_memory);
    kernels::AppendBatch empty;
    empty.backend_memory = backend_memory;
    cache.append(0, empty);
  }
  for (float x : o) ASSERT_EQ(x, -7.0f);
  EXPECT_EQ(cache.length(a, 0), 3);
}

// The options' CUDA kernel choices reach the launch's parameters unchanged
// (the CPU reference ignores them: it stores and attends alike).
TEST(RuntimeKernelsCpuOptions, DecodeParamsCarryTheKernelChoices) {
  kernels::CacheOptions options;
  options.max_context = 40;
  options.max_sequences = 1;
  const kernels::QuantizedKVCache defaults(small_rtn(2, 64), small_dims(), options);
  EXPECT_EQ(defaults.decode_params(0).kernel, kernels::DecodeKernel::kAuto);
  EXPECT_EQ(defaults.decode_params(0).int8_steps, kernels::Int8Steps::kAuto);
  options.decode_kernel = kernels::DecodeKernel::kInt8TensorCores;
  options.int8_steps = kernels::Int8Steps::kSteps64Stages4;
  const kernels::QuantizedKVCache chosen(small_rtn(2, 64), small_dims(), options);
  EXPECT_EQ(chosen.decode_params(0).kernel, kernels::DecodeKernel::kInt8TensorCores);
  EXPECT_EQ(chosen.decode_params(0).int8_steps, kernels::Int8Steps::kSteps64Stages4);
}

// A configuration with token_top_bottom value outliers and options whose
// outlier pool holds 48 entries: 12 tokens fill it (each token has 2 heads x
// 2k = 4 entries, k = 1 of 64 at 2%), the 13th exhausts it.
QuantizerConfig small_pool_config() {
  QuantizerConfig c = small_rtn(2, 64);
  c.settings.values.outlier_fraction = 0.02;
  c.settings.values.outlier_rule = OutlierRule::kTokenTopBottom;
  return c;
}
kernels::CacheOptions small_pool_options() {
  kernels::CacheOptions options;
  options.max_context = 64;
  options.max_sequences = 2;
  options.outlier_page_entries = 16;
  options.max_outlier_pages = 3;
  return options;
}

// asynchronous_append: the append that exhausts the outlier pool returns,
// and the next synchronizing call (decode_attention here, then
// synchronize() and remove_sequence for later ones) reports it once, naming
// the layer and the batch; until then, and in every other respect, the
// cache stores and attends exactly as with synchronous appends.
TEST(RuntimeKernelsCpuAsynchronousAppend, ExhaustionIsReportedByTheNextSynchronizingCall) {
  const QuantizerConfig c = small_pool_config();
  kernels::CacheOptions options = small_pool_options();
  kernels::QuantizedKVCache synchronous(c, small_dims(), options);
  options.asynchronous_append = true;
  kernels::QuantizedKVCache asynchronous(c, small_dims(), options);
  const int32_t a = synchronous.add_sequence();
  ASSERT_EQ(asynchronous.add_sequence(), a);
  const at::Tensor rows = at::randn({20, 2, 64}, at::kFloat).contiguous();
  kernels::AppendBatch batch{{a}, {0}, {12}, rows.data_ptr<float>(), rows.data_ptr<float>()};
  synchronous.append(0, batch);
  asynchronous.append(0, batch);
  const at::Tensor queries = at::randn({1, 4, 64}, at::kFloat).contiguous();
  std::vector<float> expected(4 * 64), got(4 * 64);
  synchronous.decode_attention(0, std::span<const int32_t>(&a, 1), queries.data_ptr<float>(), expected.data());
  asynchronous.decode_attention(0, std::span<const int32_t>(&a, 1), queries.data_ptr<float>(), got.data());
  EXPECT_EQ(expected, got) << "the same cache and the same attention";
  EXPECT_NO_THROW(asynchronous.synchronize());

  batch = {{a}, {12}, {1}, rows.data_ptr<float>(), rows.data_ptr<float>()};
  EXPECT_THROW(synchronous.append(0, batch), std::length_error);
  ASSERT_NO_THROW(asynchronous.append(0, batch)) << "the exhausting append itself returns";
  EXPECT_EQ(asynchronous.length(a, 0), 13);
  try {
    asynchronous.decode_attention(0, std::span<const int32_t>(&a, 1), queries.data_ptr<float>(), got.data());
    ADD_FAILURE() << "the exhausted pool was not reported by the next decode_attention";
  } catch (const std::length_error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_NE(what.find("append to layer 0 (sequences " + std::to_string(a) + ", reported by a later call"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("values' outlier pool is exhausted"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(asynchronous.synchronize()) << "reported once";
  // A later exhausting append is reported by remove_sequence, which then
  // removes the sequence when called again.
  batch = {{a}, {13}, {1}, rows.data_ptr<float>(), rows.data_ptr<float>()};
  ASSERT_NO_THROW(asynchronous.append(0, batch));
  EXPECT_THROW(asynchronous.remove_sequence(a), std::length_error);
  const int64_t free_before = asynchronous.free_pages();
  asynchronous.remove_sequence(a);
  EXPECT_EQ(asynchronous.free_pages(), free_before + 1);
}

TEST(RuntimeKernelsCpuRefusals, AnExhaustedOutlierPoolIsOneLineAndSequencesGiveTheirPagesBack) {
  const QuantizerConfig c = small_pool_config();
  kernels::CacheOptions options = small_pool_options();
  kernels::QuantizedKVCache cache(c, small_dims(), options);
  const int32_t a = cache.add_sequence();
  const at::Tensor rows = at::randn({20, 2, 64}, at::kFloat).contiguous();
  kernels::AppendBatch batch{{a}, {0}, {12}, rows.data_ptr<float>(), rows.data_ptr<float>()};
  cache.append(0, batch);
  EXPECT_EQ(cache.outlier_entries(0, TensorKind::kValues, a), 12 * 4);
  batch = {{a}, {12}, {1}, rows.data_ptr<float>(), rows.data_ptr<float>()};
  try {
    cache.append(0, batch);
    ADD_FAILURE() << "the 49th outlier entry found a page";
  } catch (const std::length_error& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("max_outlier_pages"), std::string::npos) << e.what();
  }
  const int64_t free_before = cache.free_pages();
  EXPECT_EQ(cache.pages_held(a), 1);
  cache.remove_sequence(a);
  EXPECT_EQ(cache.free_pages(), free_before + 1);
  const int32_t b = cache.add_sequence();
  batch = {{b}, {0}, {12}, rows.data_ptr<float>(), rows.data_ptr<float>()};
  cache.append(0, batch);  // the outlier pages came back too
  EXPECT_EQ(cache.outlier_entries(0, TensorKind::kValues, b), 48);
}

// small_rtn(2, 64) with a sink of 2 and a window of 4 tokens, and a cache
// of two sequences of up to 64 tokens for it.
QuantizerConfig windowed_small_rtn() {
  QuantizerConfig c = small_rtn(2, 64);
  c.settings.sink_tokens = 2;
  c.settings.residual_tokens = 4;
  return c;
}
kernels::CacheOptions two_sequence_options() {
  kernels::CacheOptions options;
  options.max_context = 64;
  options.max_sequences = 2;
  return options;
}

// The zero-copy path (rows, queries and output already in backend memory,
// host memory for the CPU reference) is the staged path without the copies:
// the same bytes in every pool and the same attention output, bit for bit.
TEST(RuntimeKernelsCpuZeroCopy, BackendMemoryCallsWriteAndReadWhatStagedCallsDo) {
  const QuantizerConfig c = windowed_small_rtn();
  const kernels::CacheOptions options = two_sequence_options();
  kernels::QuantizedKVCache staged(c, small_dims(), options), direct(c, small_dims(), options);
  const at::Tensor keys = at::randn({30, 2, 64}, at::kFloat), values = at::randn({30, 2, 64}, at::kFloat);
  const at::Tensor queries = at::randn({2, 4, 64}, at::kFloat);
  std::vector<int32_t> sequences;
  for (kernels::QuantizedKVCache* cache : {&staged, &direct}) {
    const int32_t a = cache->add_sequence(), b = cache->add_sequence();
    sequences = {a, b};
    kernels::AppendBatch batch{{a, b}, {0, 0}, {19, 11}, keys.data_ptr<float>(), values.data_ptr<float>()};
    batch.backend_memory = cache == &direct;
    cache->append(1, batch);
  }
  for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
    const kernels::TensorPoolCopy want = staged.copy_pools(1, kind), got = direct.copy_pools(1, kind);
    EXPECT_EQ(got.pages, want.pages);
    EXPECT_EQ(got.exact, want.exact);
  }
  std::vector<float> want(2 * 4 * 64, -1.0f), got(2 * 4 * 64, -2.0f);
  staged.decode_attention(1, sequences, queries.data_ptr<float>(), want.data());
  direct.decode_attention(1, sequences, queries.data_ptr<float>(), got.data(), nullptr, /*backend_memory=*/true);
  EXPECT_EQ(got, want);
  for (float x : got) ASSERT_TRUE(std::isfinite(x));
}

// 16-bit rows and queries: values exactly representable in the input type
// reach the cache as the same numbers as their float32 copies (each is
// rounded once to the cache's element type either way), so the pools hold
// the same bytes; attention runs in float32 whatever io is, so the 16-bit
// output is the float32 output rounded once to io (torch's own rounding here,
// independent of element_conversion.cpp).
TEST(RuntimeKernelsCpuInputTypes, SixteenBitRowsAndQueriesStoreAndAttendAsTheirFloat32Values) {
  QuantizerConfig c = small_rtn(2, 64);
  c.settings.sink_tokens = 2;
  c.settings.residual_tokens = 4;
  for (const auto& [input, scalar] : {std::pair{ElementType::kFloat16, at::kHalf},
                                      std::pair{ElementType::kBFloat16, at::kBFloat16}}) {
    for (ElementType element : {ElementType::kFloat16, ElementType::kBFloat16}) {
      SCOPED_TRACE("input " + std::to_string(static_cast<int>(input)) + ", element " +
                   std::to_string(static_cast<int>(element)));
      kernels::CacheOptions options;
      options.max_context = 64;
      options.max_sequences = 2;
      options.element = element;
      kernels::QuantizedKVCache wide(c, small_dims(), options), narrow(c, small_dims(), options);
      const at::Tensor keys = at::randn({34, 2, 64}, at::kFloat).to(scalar).contiguous();
      const at::Tensor values = (3 * at::randn({34, 2, 64}, at::kFloat)).to(scalar).contiguous();
      const at::Tensor queries = at::randn({2, 4, 64}, at::kFloat).to(scalar).contiguous();
      const at::Tensor keys32 = keys.to(at::kFloat), values32 = values.to(at::kFloat),
                       queries32 = queries.to(at::kFloat);
      std::vector<int32_t> sequences;
      for (kernels::QuantizedKVCache* cache : {&wide, &narrow}) {
        const int32_t a = cache->add_sequence(), b = cache->add_sequence();
        sequences = {a, b};
        // A prefill chunk of 19 and 11 tokens (rows 0..29), then two decoding
        // steps of one token each (rows 30..33).
        int64_t row = 0;
        for (const auto& [ta, tb] : {std::pair<int64_t, int64_t>{19, 11}, {1, 1}, {1, 1}}) {
          kernels::AppendBatch batch{{a, b}, {cache->length(a, 1), cache->length(b, 1)}, {ta, tb}, nullptr, nullptr};
          const bool wide_rows = cache == &wide;
          const at::Tensor& k = wide_rows ? keys32 : keys;
          const at::Tensor& v = wide_rows ? values32 : values;
          batch.keys = static_cast<const uint8_t*>(k.data_ptr()) + row * k.stride(0) * k.element_size();
          batch.values = static_cast<const uint8_t*>(v.data_ptr()) + row * v.stride(0) * v.element_size();
          batch.input = wide_rows ? ElementType::kFloat32 : input;
          cache->append(1, batch);
          row += ta + tb;
        }
      }
      for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
        const kernels::TensorPoolCopy want = wide.copy_pools(1, kind), got = narrow.copy_pools(1, kind);
        EXPECT_EQ(got.pages, want.pages);
        EXPECT_EQ(got.exact, want.exact);
      }
      at::Tensor want = at::empty({2, 4, 64}, at::kFloat), got = at::empty({2, 4, 64}, scalar),
                 got_in_place = at::empty({2, 4, 64}, scalar);
      wide.decode_attention(1, sequences, queries32.data_ptr(), want.data_ptr());
      narrow.decode_attention(1, sequences, queries.data_ptr(), got.data_ptr(), nullptr, false, input);
      narrow.decode_attention(1, sequences, queries.data_ptr(), got_in_place.data_ptr(), nullptr, true, input);
      ASSERT_TRUE(at::isfinite(want).all().item<bool>());
      EXPECT_TRUE(at::equal(got, want.to(scalar)));
      EXPECT_TRUE(at::equal(got_in_place, want.to(scalar)));
    }
  }
}

// ------------------------------------------------------------ scratch reuse

// The cache reuses its call scratch (packed lengths, offsets and slots,
// staged rows, queries and output) and uploads only the page table entries
// that changed. A long history of appends and decodes over batches that grow
// and shrink, with sequences removed and slots and pages reused, must store
// and attend exactly as a fresh cache fed each surviving sequence's chunks
// one sequence per call: any state leaking from one call into the next (a
// stale slot, length or offset, a page table entry not uploaded) stores a
// token in the wrong place or reads the wrong page.
struct FedSequence {
  int32_t slot = -1;
  // Per layer, the chunks appended in order: keys and values [tokens][2][64].
  std::vector<std::vector<std::vector<float>>> keys{2}, values{2};
};

constexpr int64_t kScratchWidth = 2 * 64;  // small_dims(): kv_heads x head_dim

QuantizerConfig scratch_config() {
  QuantizerConfig c = small_rtn(2, 64);
  c.settings.sink_tokens = 2;
  c.settings.residual_tokens = 4;
  c.settings.keys = {Grouping::kPerChannelTokens, 4};
  c.settings.values.outlier_fraction = 0.05;
  c.settings.values.outlier_rule = OutlierRule::kTokenTopBottom;
  return c;
}

kernels::CacheOptions scratch_options() {
  kernels::CacheOptions options;
  options.page_size = 4;
  options.max_context = 64;
  options.max_sequences = 5;
  options.tokens_per_split = 8;
  return options;
}

void expect_page_table_uploaded(const kernels::QuantizedKVCache& cache, const std::string& when) {
  const std::span<const int32_t> host = cache.page_table();
  EXPECT_EQ(cache.copy_page_table(), std::vector<int32_t>(host.begin(), host.end())) << when;
}

// A fresh cache holding `fed`'s sequences, appended chunk by chunk, one
// sequence per call; `slots` receives each sequence's slot in it.
std::unique_ptr<kernels::QuantizedKVCache> replay(const std::vector<FedSequence>& fed, std::vector<int32_t>& slots) {
  auto cache = std::make_unique<kernels::QuantizedKVCache>(scratch_config(), small_dims(), scratch_options());
  slots.clear();
  for (const FedSequence& s : fed) {
    const int32_t slot = cache->add_sequence();
    slots.push_back(slot);
    for (int64_t layer = 0; layer < 2; ++layer) {
      for (size_t chunk = 0; chunk < s.keys[layer].size(); ++chunk) {
        const auto tokens = static_cast<int64_t>(s.keys[layer][chunk].size()) / kScratchWidth;
        kernels::AppendBatch batch{{slot}, {cache->length(slot, layer)}, {tokens}, s.keys[layer][chunk].data(),
                                   s.values[layer][chunk].data()};
        cache->append(layer, batch);
      }
    }
  }
  return cache;
}

TEST(RuntimeKernelsCpuScratch, CallsOfVaryingBatchesStoreAndAttendAsAFreshCacheFedOneSequenceAtATime) {
  kernels::QuantizedKVCache cache(scratch_config(), small_dims(), scratch_options());
  std::mt19937 random(20251201);
  std::normal_distribution<float> normal;
  const auto draw = [&](int64_t count) {
    std::vector<float> v(static_cast<size_t>(count));
    for (float& x : v) x = normal(random);
    return v;
  };
  const auto uniform = [&](int64_t low, int64_t high) {
    return std::uniform_int_distribution<int64_t>(low, high)(random);
  };
  std::vector<FedSequence> live;
  int64_t removed = 0, largest_batch = 0, smallest_batch = 1 << 30, decodes = 0;
  for (int step = 0; step < 60; ++step) {
    const std::string when = "step " + std::to_string(step);
    // Churn: remove a sequence now and then, fill free slots.
    if (!live.empty() && uniform(0, 3) == 0) {
      const auto victim = static_cast<size_t>(uniform(0, static_cast<int64_t>(live.size()) - 1));
      cache.remove_sequence(live[victim].slot);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(victim));
      ++removed;
      expect_page_table_uploaded(cache, when + " after a removal");
    }
    while (static_cast<int64_t>(live.size()) < 5 && uniform(0, 2) != 0) live.push_back({cache.add_sequence()});
    if (live.empty()) live.push_back({cache.add_sequence()});
    // Append to a random subset in a random order, both layers, host or
    // "backend" rows (both host memory here: the staged and the direct path).
    std::vector<size_t> order(live.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::shuffle(order.begin(), order.end(), random);
    order.resize(static_cast<size_t>(uniform(1, static_cast<int64_t>(order.size()))));
    largest_batch = std::max<int64_t>(largest_batch, static_cast<int64_t>(order.size()));
    smallest_batch = std::min<int64_t>(smallest_batch, static_cast<int64_t>(order.size()));
    for (int64_t layer = 0; layer < 2; ++layer) {
      kernels::AppendBatch batch;
      std::vector<float> keys, values;
      for (size_t i : order) {
        const int64_t room = 64 - cache.length(live[i].slot, layer);
        const int64_t tokens = std::min(room, std::vector<int64_t>{0, 1, 1, 1, 2, 5, 9}[uniform(0, 6)]);
        const std::vector<float> k = draw(tokens * kScratchWidth), v = draw(tokens * kScratchWidth);
        keys.insert(keys.end(), k.begin(), k.end());
        values.insert(values.end(), v.begin(), v.end());
        if (tokens > 0) {
          live[i].keys[layer].push_back(k);
          live[i].values[layer].push_back(v);
        }
        batch.sequences.push_back(live[i].slot);
        batch.positions.push_back(cache.length(live[i].slot, layer));
        batch.tokens.push_back(tokens);
      }
      batch.keys = keys.data();
      batch.values = values.data();
      batch.backend_memory = step % 3 == 0;
      cache.append(layer, batch);
      expect_page_table_uploaded(cache, when + " layer " + std::to_string(layer));
    }
    // Decode a random subset of the sequences holding tokens; the fresh
    // cache decodes each alone.
    const int64_t layer = step % 2;
    std::vector<size_t> holding;
    for (size_t i = 0; i < live.size(); ++i) {
      if (cache.length(live[i].slot, layer) > 0) holding.push_back(i);
    }
    std::shuffle(holding.begin(), holding.end(), random);
    if (!holding.empty()) holding.resize(static_cast<size_t>(uniform(1, static_cast<int64_t>(holding.size()))));
    std::vector<int32_t> slots;
    for (size_t i : holding) slots.push_back(live[i].slot);
    const int64_t query_size = 4 * 64;
    const std::vector<float> queries = draw(static_cast<int64_t>(slots.size()) * query_size);
    std::vector<float> output(queries.size(), -1.0f);
    if (!slots.empty()) {
      cache.decode_attention(layer, slots, queries.data(), output.data(), nullptr, /*backend_memory=*/step % 2 == 1);
      ++decodes;
    }

    std::vector<int32_t> fresh_slots;
    const auto fresh = replay(live, fresh_slots);
    for (size_t n = 0; n < holding.size(); ++n) {
      std::vector<float> alone(static_cast<size_t>(query_size), -2.0f);
      const int32_t slot = fresh_slots[holding[n]];
      fresh->decode_attention(layer, std::span<const int32_t>(&slot, 1), queries.data() + n * query_size, alone.data());
      EXPECT_EQ(std::vector<float>(output.begin() + static_cast<std::ptrdiff_t>(n * query_size),
                                   output.begin() + static_cast<std::ptrdiff_t>((n + 1) * query_size)),
                alone)
          << when << ": the output of batch entry " << n;
    }
    for (size_t i = 0; i < live.size(); ++i) {
      const int32_t ours = live[i].slot, theirs = fresh_slots[i];
      for (int64_t l = 0; l < 2; ++l) {
        ASSERT_EQ(cache.length(ours, l), fresh->length(theirs, l)) << when;
        for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
          EXPECT_EQ(cache.outlier_entries(l, kind, ours), fresh->outlier_entries(l, kind, theirs)) << when;
          for (int64_t t = 0; t < cache.length(ours, l); ++t) {
            const kernels::TokenReadout got = cache.read_token(l, kind, ours, t);
            const kernels::TokenReadout want = fresh->read_token(l, kind, theirs, t);
            ASSERT_EQ(got.quantized, want.quantized) << when << " layer " << l << " token " << t;
            ASSERT_EQ(got.codes, want.codes) << when << " layer " << l << " token " << t;
            ASSERT_EQ(got.outliers, want.outliers) << when << " layer " << l << " token " << t;
            ASSERT_EQ(got.values, want.values) << when << " layer " << l << " token " << t;
          }
        }
      }
    }
  }
  // The history did what it is for.
  EXPECT_GE(removed, 5);
  EXPECT_EQ(largest_batch, 5);
  EXPECT_EQ(smallest_batch, 1);
  EXPECT_GE(decodes, 50);
}

// Pages added to rows far apart in a large page table (stride 18750 entries:
// more than the gap the upload bridges) are uploaded as separate ranges; the
// copy the kernels read equals the host table after every call, and a
// removed sequence's entries return to -1 there too.
TEST(RuntimeKernelsCpuScratch, PageTableUploadsAfterNewPagesEqualTheHostTable) {
  kernels::CacheOptions options;
  options.page_size = 16;
  options.max_context = 300000;
  options.max_sequences = 3;
  options.max_pages = 64;
  kernels::QuantizedKVCache cache(small_rtn(2, 64), small_dims(), options);
  expect_page_table_uploaded(cache, "fresh");
  const int32_t a = cache.add_sequence(), b = cache.add_sequence(), c = cache.add_sequence();
  const std::vector<float> rows(40 * kScratchWidth, 0.5f);
  const auto append = [&](std::vector<int32_t> sequences, std::vector<int64_t> tokens) {
    kernels::AppendBatch batch;
    batch.sequences = sequences;
    for (int32_t s : sequences) batch.positions.push_back(cache.length(s, 0));
    batch.tokens = tokens;
    batch.keys = batch.values = rows.data();
    cache.append(0, batch);
  };
  append({a, c}, {17, 33});  // rows 0 and 2: 2 and 3 pages
  expect_page_table_uploaded(cache, "after a and c");
  EXPECT_EQ(cache.pages_held(a), 2);
  EXPECT_EQ(cache.pages_held(c), 3);
  append({c, b, a}, {1, 16, 15});  // no new page for c, one for b, none for a
  expect_page_table_uploaded(cache, "after c, b and a");
  cache.remove_sequence(a);
  expect_page_table_uploaded(cache, "after removing a");
  const int32_t again = cache.add_sequence();
  append({c, again}, {40, 40});
  expect_page_table_uploaded(cache, "after c and a re-added slot");
  const std::span<const int32_t> host = cache.page_table();
  const int64_t stride = static_cast<int64_t>(host.size()) / 3;
  ASSERT_GT(stride, 16384);
  std::vector<int32_t> held;
  for (int32_t s : {b, c, again}) {
    for (int64_t p = 0; p < stride; ++p) {
      const int32_t entry = host[static_cast<size_t>(s * stride + p)];
      EXPECT_EQ(entry >= 0, p < cache.pages_held(s)) << "slot " << s << " page " << p;
      if (entry >= 0) held.push_back(entry);
    }
  }
  std::sort(held.begin(), held.end());
  EXPECT_EQ(std::adjacent_find(held.begin(), held.end()), held.end()) << "a page held twice";
  EXPECT_EQ(static_cast<int64_t>(held.size()) + cache.free_pages(), 64);
}

// A decoding step's new page travels in the append's launch and the kernel
// writes it into the table; when the backend's append throws instead, the
// page reaches the kernels' table with the next call's upload.
TEST(RuntimeKernelsCpuScratch, ANewPageOfAFailedAppendIsUploadedByTheNextCall) {
  kernels::CacheOptions options;
  options.page_size = 4;
  options.max_context = 64;
  options.max_sequences = 2;
  bool fail_next = false;
  auto backend = std::make_unique<testing::HookedCpuBackend>();
  backend->before_append = [&](const kernels::AppendParams&) {
    if (fail_next) {
      fail_next = false;
      throw std::runtime_error("append failed");
    }
  };
  kernels::QuantizedKVCache cache(small_rtn(2, 64), small_dims(), options, std::move(backend));
  const int32_t a = cache.add_sequence();
  const std::vector<float> rows(4 * kScratchWidth, 0.5f);
  kernels::AppendBatch batch{{a}, {0}, {4}, rows.data(), rows.data()};
  cache.append(0, batch);  // one page, opened right after length 0: in the launch
  expect_page_table_uploaded(cache, "after the first page");
  batch.positions = {4};
  batch.tokens = {1};
  fail_next = true;
  EXPECT_THROW(cache.append(0, batch), std::runtime_error);
  EXPECT_EQ(cache.pages_held(a), 2);
  cache.synchronize();
  cache.append(1, kernels::AppendBatch{{a}, {0}, {1}, rows.data(), rows.data()});
  expect_page_table_uploaded(cache, "after the failed append and the next call");
}

// The same with a batch past kInlineBatchEntries, whose arrays and new
// pages are uploaded before the launch: the failed append's pages are in
// the kernels' table already, and the failure path walks the inline
// entries only (it had read past their 32 slots).
TEST(RuntimeKernelsCpuScratch, ANewPageOfAFailedUploadedAppendIsInTheTable) {
  constexpr int kSequences = 40;
  ASSERT_GT(kSequences, kernels::kInlineBatchEntries);
  kernels::CacheOptions options;
  options.page_size = 4;
  options.max_context = 64;
  options.max_sequences = kSequences;
  bool fail_next = false;
  auto backend = std::make_unique<testing::HookedCpuBackend>();
  backend->before_append = [&](const kernels::AppendParams& params) {
    EXPECT_EQ(params.inline_arrays.count, 0) << "a batch of " << kSequences << " travels uploaded";
    if (fail_next) {
      fail_next = false;
      throw std::runtime_error("append failed");
    }
  };
  kernels::QuantizedKVCache cache(small_rtn(2, 64), small_dims(), options, std::move(backend));
  kernels::AppendBatch batch;
  for (int i = 0; i < kSequences; ++i) {
    batch.sequences.push_back(cache.add_sequence());
    batch.positions.push_back(0);
    batch.tokens.push_back(4);
  }
  const std::vector<float> rows(static_cast<size_t>(4 * kSequences * kScratchWidth), 0.5f);
  batch.keys = batch.values = rows.data();
  cache.append(0, batch);
  expect_page_table_uploaded(cache, "after the first pages");
  for (int i = 0; i < kSequences; ++i) {
    batch.positions[static_cast<size_t>(i)] = 4;
    batch.tokens[static_cast<size_t>(i)] = 1;
  }
  fail_next = true;
  EXPECT_THROW(cache.append(0, batch), std::runtime_error);
  for (const int32_t s : batch.sequences) EXPECT_EQ(cache.pages_held(s), 2);
  expect_page_table_uploaded(cache, "after the failed append");
}

// A batch of up to kInlineBatchEntries sequences carries its slots, lengths
// and token offsets in the launch's parameters, a larger one uploads them:
// the same tokens appended as one batch of 40 (uploaded) and as batches of
// 8 (inline), in the same sequence order, store the same codes, pairs,
// outliers and exact rows, and attend alike.
TEST(RuntimeKernelsCpuScratch, InlineAndUploadedBatchArraysStoreAndAttendAlike) {
  ASSERT_LT(kernels::kInlineBatchEntries, 40);
  kernels::CacheOptions options = scratch_options();
  options.max_sequences = 40;
  kernels::QuantizedKVCache uploaded(scratch_config(), small_dims(), options);
  kernels::QuantizedKVCache in_params(scratch_config(), small_dims(), options);
  std::vector<int32_t> slots;
  for (int i = 0; i < 40; ++i) {
    slots.push_back(uploaded.add_sequence());
    ASSERT_EQ(in_params.add_sequence(), slots.back());
  }
  std::mt19937 random(20261201);
  std::normal_distribution<float> normal;
  for (int round = 0; round < 4; ++round) {
    for (int64_t layer = 0; layer < 2; ++layer) {
      std::vector<int64_t> tokens;
      for (size_t i = 0; i < slots.size(); ++i) tokens.push_back(static_cast<int64_t>((i + round) % 4));
      const int64_t rows = std::accumulate(tokens.begin(), tokens.end(), int64_t{0});
      std::vector<float> keys(static_cast<size_t>(rows * kScratchWidth)), values(keys.size());
      for (float& x : keys) x = normal(random);
      for (float& x : values) x = normal(random);
      kernels::AppendBatch whole;
      whole.sequences = slots;
      for (int32_t s : slots) whole.positions.push_back(uploaded.length(s, layer));
      whole.tokens = tokens;
      whole.keys = keys.data();
      whole.values = values.data();
      uploaded.append(layer, whole);
      int64_t row = 0;
      for (size_t begin = 0; begin < slots.size(); begin += 8) {
        kernels::AppendBatch part;
        for (size_t i = begin; i < begin + 8; ++i) {
          part.sequences.push_back(slots[i]);
          part.positions.push_back(in_params.length(slots[i], layer));
          part.tokens.push_back(tokens[i]);
        }
        const int64_t part_rows = std::accumulate(part.tokens.begin(), part.tokens.end(), int64_t{0});
        part.keys = keys.data() + row * kScratchWidth;
        part.values = values.data() + row * kScratchWidth;
        in_params.append(layer, part);
        row += part_rows;
      }
    }
  }
  for (int64_t layer = 0; layer < 2; ++layer) {
    for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
      const kernels::TensorPoolCopy want = uploaded.copy_pools(layer, kind), got = in_params.copy_pools(layer, kind);
      EXPECT_EQ(got.pages, want.pages) << "layer " << layer;
      EXPECT_EQ(got.exact, want.exact) << "layer " << layer;
      EXPECT_EQ(got.outlier_pages, want.outlier_pages) << "layer " << layer;
    }
    const std::vector<float> queries(slots.size() * 4 * 64, 0.25f);
    std::vector<float> a(queries.size(), -1.0f), b(queries.size(), -2.0f);
    uploaded.decode_attention(layer, slots, queries.data(), a.data());
    in_params.decode_attention(layer, slots, queries.data(), b.data());
    EXPECT_EQ(a, b) << "layer " << layer;
    // The decode's arrays likewise: the 40 sequences' uploaded above, the
    // same sequences 8 at a time carried in the call.
    for (size_t begin = 0; begin < slots.size(); begin += 8) {
      std::vector<float> part(8 * 4 * 64, -3.0f);
      in_params.decode_attention(layer, std::span<const int32_t>(slots.data() + begin, 8), queries.data(), part.data());
      EXPECT_TRUE(std::equal(part.begin(), part.end(), a.begin() + static_cast<std::ptrdiff_t>(begin * 4 * 64)))
          << "layer " << layer << ", sequences " << begin << "..." << begin + 7;
    }
  }
}

// Which arrays a decode call hands its backend: a batch of at most
// kInlineBatchEntries sequences by value (InlineDecodeArrays; no pointers),
// a larger one by pointers to uploaded arrays; entry_slot and entry_length
// read either.
TEST(RuntimeKernelsCpuScratch, SmallDecodeBatchesCarryTheirArraysInTheCall) {
  kernels::CacheOptions options = scratch_options();
  options.max_sequences = 40;
  auto hooked = std::make_unique<testing::HookedCpuBackend>();
  testing::HookedCpuBackend& backend = *hooked;
  kernels::QuantizedKVCache cache(scratch_config(), small_dims(), options, std::move(hooked));
  std::vector<int32_t> slots;
  std::vector<float> rows(kScratchWidth * 3, 0.5f);
  for (int i = 0; i < 40; ++i) {
    slots.push_back(cache.add_sequence());
    cache.append(0, kernels::AppendBatch{{slots.back()}, {0}, {1 + i % 3}, rows.data(), rows.data()});
  }
  kernels::DecodeParams seen;
  backend.before_decode = [&](const kernels::DecodeParams& p) { seen = p; };
  const std::vector<float> queries(40 * 4 * 64, 0.25f);
  std::vector<float> output(queries.size());
  constexpr auto kInline = static_cast<size_t>(kernels::kInlineBatchEntries);
  for (const size_t count : {size_t{1}, kInline, kInline + 1}) {
    const std::span<const int32_t> batch(slots.data() + 40 - count, count);
    cache.decode_attention(0, batch, queries.data(), output.data());
    const bool inline_arrays = count <= static_cast<size_t>(kernels::kInlineBatchEntries);
    EXPECT_EQ(seen.batch.count, static_cast<int32_t>(count));
    EXPECT_EQ(seen.inline_arrays.count, inline_arrays ? static_cast<int32_t>(count) : 0) << count;
    EXPECT_EQ(seen.batch.slots == nullptr, inline_arrays) << count;
    EXPECT_EQ(seen.batch.lengths == nullptr, inline_arrays) << count;
    for (int32_t entry = 0; entry < seen.batch.count; ++entry) {
      EXPECT_EQ(kernels::entry_slot(seen, entry), batch[static_cast<size_t>(entry)]);
      EXPECT_EQ(kernels::entry_length(seen, entry), cache.length(batch[static_cast<size_t>(entry)], 0));
    }
  }
}

// A sequence twice in one append is refused (one line naming it) before
// anything is stored, and the refusal leaves no trace: the same sequences
// appended properly afterwards store what a fresh cache stores.
TEST(RuntimeKernelsCpuRefusals, ASequenceTwiceInOneAppendIsRefusedWithoutATrace) {
  kernels::QuantizedKVCache cache(scratch_config(), small_dims(), scratch_options());
  kernels::QuantizedKVCache fresh(scratch_config(), small_dims(), scratch_options());
  const int32_t a = cache.add_sequence(), b = cache.add_sequence();
  ASSERT_EQ(fresh.add_sequence(), a);
  ASSERT_EQ(fresh.add_sequence(), b);
  std::vector<float> rows(3 * kScratchWidth);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = 0.01f * static_cast<float>(i % 97) - 0.4f;
  kernels::AppendBatch twice;
  twice.sequences = {a, b, a};
  twice.positions = {0, 0, 0};
  twice.tokens = {1, 1, 1};
  twice.keys = twice.values = rows.data();
  try {
    cache.append(0, twice);
    ADD_FAILURE() << "a sequence twice in one batch was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_NE(what.find("sequence " + std::to_string(a) + " appears twice"), std::string::npos) << what;
  }
  EXPECT_EQ(cache.length(a, 0), 0);
  EXPECT_EQ(cache.length(b, 0), 0);
  for (kernels::QuantizedKVCache* c : {&cache, &fresh}) {
    kernels::AppendBatch once;
    once.sequences = {b, a};
    once.positions = {0, 0};
    once.tokens = {2, 1};
    once.keys = once.values = rows.data();
    c->append(0, once);
  }
  for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
    EXPECT_EQ(cache.copy_pools(0, kind).pages, fresh.copy_pools(0, kind).pages);
    EXPECT_EQ(cache.copy_pools(0, kind).exact, fresh.copy_pools(0, kind).exact);
  }
}

// decode_step on the CPU reference: the same pools, lengths and outputs as
// append then decode_attention, over prefill chunks and decoding steps of a
// layout with a sink and a window (sequences idle in some steps); the decode
// after the append in the backend's calls, at the lengths the append left.
// Rounds of one token per sequence go to the backend as one step
// (KernelBackend::decode_step, the CUDA backend's fused launch) with the
// same entries in the same order, unless fused_decode_step is off.
class RuntimeKernelsCpuDecodeStep : public ::testing::TestWithParam<bool> {};

TEST_P(RuntimeKernelsCpuDecodeStep, StoresAndAttendsAsAppendThenDecodeAttention) {
  const bool fused = GetParam();
  const QuantizerConfig c = windowed_small_rtn();
  kernels::CacheOptions options = two_sequence_options();
  options.fused_decode_step = fused;
  auto hooked = std::make_unique<testing::HookedCpuBackend>();
  testing::HookedCpuBackend& backend = *hooked;
  kernels::QuantizedKVCache stepped(c, small_dims(), options, std::move(hooked)), plain(c, small_dims(), options);
  std::vector<std::string> calls;
  std::vector<int64_t> decoded_lengths;
  backend.before_step = [&](const kernels::AppendParams& append, const kernels::DecodeParams& decode) {
    calls.push_back("step");
    // One token each, the decode's entries the append's, at one more token.
    ASSERT_EQ(append.batch.count, decode.batch.count);
    EXPECT_EQ(append.rows, append.batch.count);
    ASSERT_EQ(append.inline_arrays.count, decode.inline_arrays.count);
    for (int32_t i = 0; i < append.inline_arrays.count; ++i) {
      EXPECT_EQ(append.inline_arrays.slots[i], decode.inline_arrays.slots[i]);
      EXPECT_EQ(append.inline_arrays.lengths[i] + 1, decode.inline_arrays.lengths[i]);
      EXPECT_EQ(append.inline_arrays.token_offsets[i + 1], i + 1);
    }
  };
  backend.before_append = [&](const kernels::AppendParams&) { calls.push_back("append"); };
  backend.before_decode = [&](const kernels::DecodeParams& p) {
    calls.push_back("decode");
    decoded_lengths.clear();
    for (int32_t entry = 0; entry < p.batch.count; ++entry) decoded_lengths.push_back(kernels::entry_length(p, entry));
  };
  const at::Tensor keys = at::randn({40, 2, 64}, at::kFloat), values = at::randn({40, 2, 64}, at::kFloat);
  const int32_t a = stepped.add_sequence(), b = stepped.add_sequence();
  ASSERT_EQ(plain.add_sequence(), a);
  ASSERT_EQ(plain.add_sequence(), b);
  const std::vector<std::pair<int64_t, int64_t>> rounds = {{9, 3}, {1, 1}, {0, 1}, {1, 0}, {6, 1}, {1, 1}, {1, 1}};
  int64_t row = 0;
  for (size_t r = 0; r < rounds.size(); ++r) {
    for (int64_t layer = 0; layer < 2; ++layer) {
      kernels::AppendBatch batch{{a, b},
                                 {stepped.length(a, layer), stepped.length(b, layer)},
                                 {rounds[r].first, rounds[r].second},
                                 keys.data_ptr<float>() + row * 2 * 64,
                                 values.data_ptr<float>() + row * 2 * 64};
      const at::Tensor queries = at::randn({2, 4, 64}, at::kFloat);
      std::vector<float> want(2 * 4 * 64, -1.0f), got(2 * 4 * 64, -2.0f);
      plain.append(layer, batch);
      plain.decode_attention(layer, batch.sequences, queries.data_ptr<float>(), want.data());
      calls.clear();
      stepped.decode_step(layer, batch, queries.data_ptr<float>(), got.data());
      const bool one_each = rounds[r].first == 1 && rounds[r].second == 1;
      const std::vector<std::string> expected_calls =
          fused && one_each ? std::vector<std::string>{"step", "append", "decode"}
                            : std::vector<std::string>{"append", "decode"};
      EXPECT_EQ(calls, expected_calls) << "round " << r;
      EXPECT_EQ(decoded_lengths, (std::vector<int64_t>{plain.length(a, layer), plain.length(b, layer)}));
      EXPECT_EQ(got, want) << "round " << r << " layer " << layer;
      EXPECT_EQ(stepped.length(a, layer), plain.length(a, layer));
      EXPECT_EQ(stepped.length(b, layer), plain.length(b, layer));
      for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
        EXPECT_EQ(stepped.copy_pools(layer, kind).pages, plain.copy_pools(layer, kind).pages);
        EXPECT_EQ(stepped.copy_pools(layer, kind).exact, plain.copy_pools(layer, kind).exact);
      }
    }
    row += rounds[r].first + rounds[r].second;
  }
}

INSTANTIATE_TEST_SUITE_P(FusedOrNot, RuntimeKernelsCpuDecodeStep, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("Fused") : std::string("TwoCalls");
                         });

// step_token_place (kernels/step_append.h): where the CUDA kernels that
// append a step's token inside the decode put it (its position, its page,
// the page the step opens and that page's table index), from the params
// decode_step hands its backend, is where the reference append put it:
// the page table after the step holds that page at that index. Pages of 4
// tokens behind a sink of 2, three sequences at different lengths, two
// layers (the second finds the page the first opened in the table).
TEST(RuntimeKernelsCpuDecodeStepPlaces, StepTokenPlaceIsWhereTheAppendPutsTheToken) {
  QuantizerConfig c = small_rtn(2, 64);
  c.settings.sink_tokens = 2;
  kernels::CacheOptions options;
  options.page_size = 4;
  options.max_sequences = 3;
  options.max_context = 64;
  auto hooked = std::make_unique<testing::HookedCpuBackend>();
  testing::HookedCpuBackend& backend = *hooked;
  kernels::QuantizedKVCache cache(c, small_dims(), options, std::move(hooked));
  std::vector<kernels::StepTokenPlace> places;
  int64_t stride = 0;
  backend.before_step = [&](const kernels::AppendParams& a, const kernels::DecodeParams& d) {
    const kernels::StepAppendArgs step = kernels::step_append_args(a);
    stride = d.batch.page_table_stride;
    places.clear();
    for (int32_t i = 0; i < d.batch.count; ++i) {
      const int32_t slot = kernels::entry_slot(d, i);
      places.push_back(kernels::step_token_place(a.key_cache.layout.spec, step, i, slot, kernels::entry_length(d, i),
                                                 d.batch.page_table + slot * stride));
    }
  };
  const std::vector<int32_t> sequences = {cache.add_sequence(), cache.add_sequence(), cache.add_sequence()};
  std::vector<float> rows(64 * 2 * 64, 0.25f);
  for (int64_t layer = 0; layer < 2; ++layer) {  // prefills of 0, 3 and 5 tokens
    cache.append(layer, {sequences, {0, 0, 0}, {0, 3, 5}, rows.data(), rows.data()});
  }
  std::vector<float> queries(3 * 4 * 64, 0.5f), output(queries.size());
  int64_t pages_opened = 0;
  for (int step = 0; step < 12; ++step) {
    for (int64_t layer = 0; layer < 2; ++layer) {
      kernels::AppendBatch batch{sequences, {}, {1, 1, 1}, rows.data(), rows.data()};
      for (const int32_t s : sequences) batch.positions.push_back(cache.length(s, layer));
      cache.decode_step(layer, batch, queries.data(), output.data());
      ASSERT_EQ(places.size(), sequences.size()) << "step " << step << " layer " << layer;
      const std::vector<int32_t> table = cache.copy_page_table();
      for (size_t i = 0; i < sequences.size(); ++i) {
        const kernels::StepTokenPlace& place = places[i];
        const int32_t s = sequences[i];
        EXPECT_EQ(place.slot, s);
        EXPECT_EQ(place.token, cache.length(s, layer) - 1);
        const std::string where = "step " + std::to_string(step) + " layer " + std::to_string(layer) +
                                  " sequence " + std::to_string(s) + " token " + std::to_string(place.token);
        if (place.token < 2) {  // the sink: no page
          EXPECT_EQ(place.new_page_index, -1) << where;
          continue;
        }
        const int64_t index = (place.token - 2) / 4;
        EXPECT_EQ(place.page_id, table[static_cast<size_t>(s * stride + index)]) << where;
        // The first layer's step opens the token's page when the token is
        // its first; the second layer finds it in the table.
        const bool opens = layer == 0 && (place.token - 2) % 4 == 0;
        EXPECT_EQ(place.new_page_index, opens ? index : -1) << where;
        if (opens) {
          EXPECT_EQ(place.new_page, place.page_id) << where;
          ++pages_opened;
        }
      }
    }
  }
  EXPECT_GT(pages_opened, 6);
}

// A decode_step the append refuses (a position that is not the length, a
// sequence past max_context) or whose decode has nothing to attend is one
// line and leaves the cache as it was: no kernel ran.
TEST(RuntimeKernelsCpuDecodeStepRefusals, RefusedStepsAreOneLineAndRunNothing) {
  kernels::CacheOptions options;
  options.max_context = 40;
  options.max_sequences = 2;
  auto hooked = std::make_unique<testing::HookedCpuBackend>();
  testing::HookedCpuBackend& backend = *hooked;
  kernels::QuantizedKVCache cache(small_rtn(2, 64), small_dims(), options, std::move(hooked));
  int kernels_run = 0;
  backend.before_append = [&](const kernels::AppendParams&) { ++kernels_run; };
  backend.before_decode = [&](const kernels::DecodeParams&) { ++kernels_run; };
  const int32_t a = cache.add_sequence(), b = cache.add_sequence();
  std::vector<float> rows(50 * 2 * 64, 0.5f);
  float q[2 * 4 * 64] = {}, o[2 * 4 * 64];
  const auto refused = [&](kernels::AppendBatch batch, const std::string& expected) {
    try {
      cache.decode_step(0, batch, q, o);
      ADD_FAILURE() << "accepted; expected a refusal saying " << expected;
    } catch (const std::exception& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
      EXPECT_NE(what.find(expected), std::string::npos) << what;
    }
  };
  refused({{a}, {3}, {2}, rows.data(), rows.data()}, "expected its length 0");
  refused({{a, b}, {0, 0}, {41, 1}, rows.data(), rows.data()}, "max_context");
  refused({{a, b}, {0, 0}, {1, 0}, rows.data(), rows.data()}, "holds no tokens");
  refused({{a}, {0}, {}, rows.data(), rows.data()}, "differ in length");
  EXPECT_EQ(kernels_run, 0);
  EXPECT_EQ(cache.length(a, 0), 0);
  EXPECT_EQ(cache.length(b, 0), 0);
  cache.decode_step(0, {{a, b}, {0, 0}, {2, 1}, rows.data(), rows.data()}, q, o);
  EXPECT_EQ(kernels_run, 2);
  EXPECT_EQ(cache.length(a, 0), 2);
  EXPECT_EQ(cache.length(b, 0), 1);
}

}  // namespace
}  // namespace kvforge
