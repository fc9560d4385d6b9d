// Quantizer fitting and simulation: the simulated quantize-dequantize of every
// method and grouping against float64 loops written here from the documented
// arithmetic, outlier thresholds, Q-Norm and Fisher weighting on activations
// captured from pyllama-16m, effective bits, and the RoPE settings parser.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "capture/activation_recorder.h"
#include "calib/calibration_stats.h"
#include "calib/effective_bits.h"
#include "calib/fingerprint_rope.h"
#include "calib/float32_array.h"
#include "calib/group_quantizer.h"
#include "calib/outlier_thresholds.h"
#include "calib/quantize_simulation.h"
#include "calib/quantizer_fit.h"
#include "formats/input_error.h"
#include "formats/model_fingerprint.h"
#include "formats/safetensors.h"
#include "formats/sha256.h"
#include "model/rope.h"
#include "model/tokenizer.h"
#include "model/transformer.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

// A stored array is float32, row-major in the tensor's logical order (a
// transposed view included) and keeps the shape: what the artifact's
// readers index by.
TEST(Float32Array, IsRowMajorFloat32OfTheLogicalShape) {
  const at::Tensor t = at::arange(6, at::kDouble).reshape({2, 3}).t() + 0.25;  // [3, 2], not contiguous
  const Float32Array a = float32_array(t);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(a.values, (std::vector<float>{0.25f, 3.25f, 1.25f, 4.25f, 2.25f, 5.25f}));
  EXPECT_EQ(float32_array(at::ones({0, 4})).values.size(), 0u);
}

// ---- float64 references ---------------------------------------------------

// Index of the level nearest to n, the lower one on a tie.
double reference_level(const std::vector<float>& grid, double n) {
  size_t best = 0;
  for (size_t i = 1; i < grid.size(); ++i) {
    if (std::abs(n - static_cast<double>(grid[i])) < std::abs(n - static_cast<double>(grid[best]))) best = i;
  }
  return grid[best];
}

// One element of a group with bounds lo < hi.
double reference_round(double x, double lo, double hi, int bits, const std::vector<float>& grid) {
  if (grid.empty()) {
    const double top = std::ldexp(1.0, bits) - 1;
    const double scale = (hi - lo) / top;
    const double code = std::clamp(std::nearbyint((x - lo) / scale), 0.0, top);  // ties to even
    return lo + code * scale;
  }
  const double center = (lo + hi) / 2, half = (hi - lo) / 2;
  return center + half * reference_level(grid, (x - center) / half);
}

struct Slab {
  int64_t heads = 0, tokens = 0, dim = 0;
  std::vector<double> x;  // [heads][tokens][dim]
  double& at(int64_t h, int64_t t, int64_t c) { return x[static_cast<size_t>((h * tokens + t) * dim + c)]; }
  double at(int64_t h, int64_t t, int64_t c) const { return x[static_cast<size_t>((h * tokens + t) * dim + c)]; }
};

struct Reference {
  Slab out;
  std::vector<bool> outlier;
};

// The simulation of one window, element by element.
Reference reference_simulation(const QuantizerSettings& s, const TensorQuantizerSettings& t, const TensorQuantizer& q,
                               const Slab& x) {
  Reference ref{x, std::vector<bool>(x.x.size(), false)};
  const int64_t begin = std::min(s.sink_tokens, x.tokens);
  int64_t end = std::max(begin, x.tokens - s.residual_tokens);
  if (t.grouping == Grouping::kPerChannelTokens) end = begin + (end - begin) / t.group * t.group;
  const auto flag = [&](int64_t h, int64_t tok, int64_t c) -> std::vector<bool>::reference {
    return ref.outlier[static_cast<size_t>((h * x.tokens + tok) * x.dim + c)];
  };
  for (int64_t h = 0; h < x.heads; ++h) {
    if (t.grouping == Grouping::kPerChannelOffline) {
      for (int64_t tok = begin; tok < end; ++tok) {
        for (int64_t c = 0; c < x.dim; ++c) {
          const size_t i = static_cast<size_t>(h * x.dim + c);
          const double v = x.at(h, tok, c);
          if (t.outlier_fraction > 0 && (v < q.outlier_low.values[i] || v > q.outlier_high.values[i])) {
            flag(h, tok, c) = true;
            continue;
          }
          const double offset = q.channel_offset.values[i], scale = q.channel_scale.values[i];
          const double n = (v - offset) / scale;
          double level;
          if (!q.grid.empty()) {
            level = reference_level(q.grid, n);
          } else {
            const double top = std::ldexp(1.0, s.bits) - 1;
            level = std::clamp(std::nearbyint((n + 1) * top / 2), 0.0, top) * 2 / top - 1;
          }
          ref.out.at(h, tok, c) = offset + scale * level;
        }
      }
    } else if (t.grouping == Grouping::kPerToken) {
      for (int64_t tok = begin; tok < end; ++tok) {
        if (t.outlier_fraction > 0) {
          double mean = 0, var = 0;
          for (int64_t c = 0; c < x.dim; ++c) mean += x.at(h, tok, c) / static_cast<double>(x.dim);
          for (int64_t c = 0; c < x.dim; ++c) var += std::pow(x.at(h, tok, c) - mean, 2) / static_cast<double>(x.dim);
          for (int64_t c = 0; c < x.dim; ++c) {
            flag(h, tok, c) = std::abs(x.at(h, tok, c) - mean) > q.outlier_tau * std::sqrt(var);
          }
        }
        for (int64_t g = 0; g < x.dim; g += t.group) {
          double mn = std::numeric_limits<double>::infinity(), mx = -mn;
          for (int64_t c = g; c < g + t.group; ++c) {
            if (flag(h, tok, c)) continue;
            mn = std::min(mn, x.at(h, tok, c));
            mx = std::max(mx, x.at(h, tok, c));
          }
          const double lo = q.clip_ratio * mn, hi = q.clip_ratio * mx;
          if (!(hi > lo)) continue;
          for (int64_t c = g; c < g + t.group; ++c) {
            if (!flag(h, tok, c)) ref.out.at(h, tok, c) = reference_round(x.at(h, tok, c), lo, hi, s.bits, q.grid);
          }
        }
      }
    } else {
      for (int64_t tok = begin; tok < end && t.outlier_fraction > 0; ++tok) {
        double mean = 0, var = 0;
        for (int64_t c = 0; c < x.dim; ++c) mean += x.at(h, tok, c) / static_cast<double>(x.dim);
        for (int64_t c = 0; c < x.dim; ++c) var += std::pow(x.at(h, tok, c) - mean, 2) / static_cast<double>(x.dim);
        for (int64_t c = 0; c < x.dim; ++c) {
          flag(h, tok, c) = std::abs(x.at(h, tok, c) - mean) > q.outlier_tau * std::sqrt(var);
        }
      }
      for (int64_t c = 0; c < x.dim; ++c) {
        for (int64_t g = begin; g < end; g += t.group) {
          double mn = std::numeric_limits<double>::infinity(), mx = -mn;
          for (int64_t tok = g; tok < g + t.group; ++tok) {
            if (flag(h, tok, c)) continue;
            mn = std::min(mn, x.at(h, tok, c));
            mx = std::max(mx, x.at(h, tok, c));
          }
          const double lo = q.clip_ratio * mn, hi = q.clip_ratio * mx;
          if (!(hi > lo)) continue;
          for (int64_t tok = g; tok < g + t.group; ++tok) {
            if (!flag(h, tok, c)) ref.out.at(h, tok, c) = reference_round(x.at(h, tok, c), lo, hi, s.bits, q.grid);
          }
        }
      }
    }
  }
  return ref;
}

at::Tensor to_tensor(const Slab& slab) {
  return at::tensor(at::ArrayRef<double>(slab.x)).view({slab.heads, slab.tokens, slab.dim}).to(at::kFloat);
}

// Float32 data as the simulation sees it (the reference takes the same values).
Slab random_slab(int64_t heads, int64_t tokens, int64_t dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Slab slab{heads, tokens, dim, {}};
  for (int64_t i = 0; i < heads * tokens * dim; ++i) slab.x.push_back(normal(rng));
  // A few large values, as outlier channels and tokens have.
  for (int i = 0; i < 6; ++i) slab.x[rng() % slab.x.size()] = (i % 2 ? -1 : 1) * (6.0f + static_cast<float>(i));
  return slab;
}

void expect_simulation_matches(const QuantizerSettings& s, const TensorQuantizerSettings& t,
                               const TensorQuantizer& q, const Slab& x, const char* what) {
  const Reference ref = reference_simulation(s, t, q, x);
  const SimulatedTensor sim = simulate_quantization(s, t, q, to_tensor(x));
  ASSERT_EQ(sim.dequantized.scalar_type(), at::kFloat) << what;
  const at::Tensor expected = at::tensor(at::ArrayRef<double>(ref.out.x)).view(sim.dequantized.sizes());
  const double error = (sim.dequantized.to(at::kDouble) - expected).abs().max().item<double>();
  EXPECT_LT(error, 1e-6) << what;
  std::vector<uint8_t> flags(ref.outlier.begin(), ref.outlier.end());
  const at::Tensor expected_outliers =
      at::tensor(at::ArrayRef<uint8_t>(flags)).view(sim.outliers.sizes()).to(at::kBool);
  EXPECT_TRUE(sim.outliers.equal(expected_outliers)) << what;
  // Batched input gives the same per window.
  const SimulatedTensor batched = simulate_quantization(s, t, q, to_tensor(x).unsqueeze(0).expand({2, -1, -1, -1}));
  EXPECT_TRUE(batched.dequantized[1].equal(sim.dequantized)) << what;
}

Float32Array array(int64_t heads, int64_t dim, const std::vector<float>& values) { return {{heads, dim}, values}; }

// ---- uniform and grid rounding --------------------------------------------

TEST(GroupQuantizer, UniformRoundsHalfToEvenAndKeepsConstantGroups) {
  // Group 0: lo 0, hi 3, scale 1; 0.5 -> 0 and 2.5 -> 2 (ties to even), 1.5 -> 2.
  // Group 1: constant, kept exact.
  const at::Tensor x = at::tensor({0.0, 0.5, 2.5, 3.0, 1.5, 1.5, 1.5, 1.5}, at::kDouble).view({1, 8});
  const at::Tensor y = quantize_dequantize_grouped(x, Grouping::kPerToken, 4, {2, 1.0, {}});
  const std::vector<double> expected = {0, 0, 2, 3, 1.5, 1.5, 1.5, 1.5};
  for (int i = 0; i < 8; ++i) EXPECT_DOUBLE_EQ(y[0][i].item<double>(), expected[static_cast<size_t>(i)]) << i;
  const at::Tensor z = quantize_dequantize_grouped(at::tensor({0.0, 1.5, 0.4, 3.0}, at::kDouble).view({1, 4}),
                                                   Grouping::kPerToken, 4, {2, 1.0, {}});
  EXPECT_DOUBLE_EQ(z[0][1].item<double>(), 2.0);
}

TEST(GroupQuantizer, GridRoundsToTheNearestLevelTiesDown) {
  const std::vector<float> grid = {-1.0f, -0.5f, 0.25f, 1.0f};
  const at::Tensor n = at::tensor({-0.75, 0.625, -0.74, 0.626, -2.0, 2.0, 0.25}, at::kDouble);
  const at::Tensor level = nearest_level(n, grid);
  const std::vector<double> expected = {-1.0, 0.25, -0.5, 1.0, -1.0, 1.0, 0.25};
  for (int i = 0; i < 7; ++i) EXPECT_DOUBLE_EQ(level[i].item<double>(), expected[static_cast<size_t>(i)]) << i;
}

// ---- the simulation per method and grouping ---------------------------------

// Per-channel thresholds stored in float32 keep their inliers inside the
// grid's range [-1, 1] even when a channel's range is narrow against its
// magnitude (few samples: two tokens past a long sink), where float32 moves
// the midpoint by up to half an ulp of the offset: the artifact's validator
// would refuse the artifact otherwise.
TEST(ChannelThresholds, StoredOffsetAndScaleKeepTheThresholdsInsideTheGrid) {
  std::mt19937 generator(7);
  std::uniform_real_distribution<double> magnitude(-3000.0, 3000.0), width(1e-6, 1e-2);
  const int64_t heads = 2, dim = 64;
  at::Tensor x = at::empty({1, heads, 2, dim}, at::kFloat);  // two samples per channel
  auto a = x.accessor<float, 4>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < dim; ++d) {
      const double centre = magnitude(generator), w = width(generator) * std::max(1.0, std::abs(centre));
      a[0][h][0][d] = static_cast<float>(centre - w / 2);
      a[0][h][1][d] = static_cast<float>(centre + w / 2);
    }
  }
  for (const double fraction : {0.0, 0.01}) {
    const ChannelThresholds t = fit_channel_thresholds(x, fraction);
    const auto low = t.low.accessor<float, 2>(), high = t.high.accessor<float, 2>();
    const auto offset = t.offset.accessor<float, 2>(), scale = t.scale.accessor<float, 2>();
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t d = 0; d < dim; ++d) {
        const double lo = (static_cast<double>(low[h][d]) - offset[h][d]) / scale[h][d];
        const double hi = (static_cast<double>(high[h][d]) - offset[h][d]) / scale[h][d];
        EXPECT_GE(lo, -1.0) << h << "," << d;
        EXPECT_LE(hi, 1.0) << h << "," << d;
        // and no wider than needed: the scale exceeds the half range by at
        // most the offset's float32 rounding (|offset| 2^-24) and its own
        // (one ulp, 2^-23 relative), so the thresholds still span
        // 2 half / (half + |offset| 2^-24) (1 - 2^-23) of [-1, 1].
        const double half = (static_cast<double>(high[h][d]) - low[h][d]) / 2;
        const double spread = 2 * half / (half + std::abs(static_cast<double>(offset[h][d])) * std::ldexp(1.0, -24)) *
                              (1 - std::ldexp(1.0, -23));
        EXPECT_GE(hi - lo, spread)
            << h << "," << d;
      }
    }
  }
}

// The calibration values the channel thresholds are chosen from, by the rule
// of calib/outlier_thresholds.h written out with counts over each channel in
// float64: which elements are outliers (those below `low` or above `high`),
// before the thresholds are moved off the samples. channels[h * D + d] holds
// channel d of head h, in the order whose shortfalls carry on.
struct ChosenSamples {
  std::vector<double> low, high;
};

ChosenSamples chosen_samples_by_counting(const std::vector<std::vector<double>>& channels, double fraction) {
  ChosenSamples chosen;
  double wanted_low = 0, wanted_high = 0;
  for (const std::vector<double>& values : channels) {
    const auto n = static_cast<int64_t>(values.size());
    const auto count = [&](auto&& keep) { return static_cast<int64_t>(std::count_if(values.begin(), values.end(), keep)); };
    std::vector<double> s = values;
    std::sort(s.begin(), s.end());
    const int64_t middle = (n - 1) / 2;
    wanted_low += static_cast<double>(n) * fraction / 2;
    wanted_high += static_cast<double>(n) * fraction / 2;
    // Low: s[j] selects #{x < s[j]}; the next larger value, #{x <= s[j]}, when
    // that stays within the lower half and is nearer the running target.
    double low = s[static_cast<size_t>(std::clamp<int64_t>(std::llround(wanted_low), 0, middle))];
    int64_t below = count([&](double x) { return x < low; });
    const int64_t through = count([&](double x) { return x <= low; });
    if (through <= middle && std::abs(static_cast<double>(through) - wanted_low) <
                                 std::abs(static_cast<double>(below) - wanted_low)) {
      low = s[static_cast<size_t>(through)];
      below = through;
    }
    // High, mirrored.
    double high = s[static_cast<size_t>(n - 1 - std::clamp<int64_t>(std::llround(wanted_high), 0, middle))];
    int64_t above = count([&](double x) { return x > high; });
    const int64_t from = count([&](double x) { return x >= high; });
    if (n - from >= n - middle && std::abs(static_cast<double>(from) - wanted_high) <
                                      std::abs(static_cast<double>(above) - wanted_high)) {
      high = s[static_cast<size_t>(n - from - 1)];
      above = from;
    }
    wanted_low -= static_cast<double>(below);
    wanted_high -= static_cast<double>(above);
    chosen.low.push_back(low);
    chosen.high.push_back(high);
  }
  return chosen;
}

// x: [B, H, T, D] float32 -> per channel (h * D + d) its B T values.
std::vector<std::vector<double>> channel_values(const at::Tensor& x) {
  const auto a = x.accessor<float, 4>();
  std::vector<std::vector<double>> channels(static_cast<size_t>(x.size(1) * x.size(3)));
  for (int64_t h = 0; h < x.size(1); ++h) {
    for (int64_t d = 0; d < x.size(3); ++d) {
      for (int64_t b = 0; b < x.size(0); ++b) {
        for (int64_t t = 0; t < x.size(2); ++t) channels[static_cast<size_t>(h * x.size(3) + d)].push_back(a[b][h][t][d]);
      }
    }
  }
  return channels;
}

// Random channels whose values repeat (a few values drawn many times, as
// layer-0 keys repeat with their token) so that ties fall on the quantiles,
// mixed with distinct values, constant channels and channels of two adjacent
// float32 values.
at::Tensor channels_with_ties(uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 4);
  const int64_t batch = 2, heads = 2, tokens = 41, dim = 24;
  at::Tensor x = at::empty({batch, heads, tokens, dim}, at::kFloat);
  auto a = x.accessor<float, 4>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < dim; ++d) {
      const float magnitude = std::ldexp(1.0f, static_cast<int>(d % 7) - 3);
      std::vector<float> pool(5);
      for (float& v : pool) v = magnitude * normal(generator);
      const float adjacent = std::nextafter(pool[0], 1e30f);
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t t = 0; t < tokens; ++t) {
          float& v = a[b][h][t][d];
          switch (d % 6) {
            case 0: v = pool[static_cast<size_t>(pick(generator))]; break;                  // ties only
            case 1: v = pick(generator) < 2 ? pool[0] : magnitude * normal(generator); break;  // ties and distinct
            case 2: v = magnitude * normal(generator); break;                                 // distinct
            case 3: v = pool[0]; break;                                                       // constant
            case 4: v = pick(generator) < 2 ? pool[0] : adjacent; break;                      // adjacent float32s
            default: v = pick(generator) < 4 ? pool[0] : magnitude * normal(generator);       // heavy ties
          }
        }
      }
    }
  }
  return x;
}

// The float32 the rule puts between a chosen sample and the next distinct
// calibration value beyond it: their midpoint rounded, the sample when no
// float32 lies between them.
float expected_threshold(double sample, double beyond) {
  const auto s = static_cast<float>(sample);
  if (std::nextafter(s, static_cast<float>(beyond)) == static_cast<float>(beyond)) return s;
  return static_cast<float>((sample + beyond) / 2);
}

TEST(ChannelThresholds, SelectTheChosenSamplesOutliersWithNoCalibrationValueOnAThreshold) {
  for (const uint32_t seed : {1u, 2u, 3u}) {
    const at::Tensor x = channels_with_ties(seed);
    const std::vector<std::vector<double>> channels = channel_values(x);
    for (const double fraction : {0.0, 0.01, 0.05, 0.2, 0.6, 0.95}) {
      SCOPED_TRACE("seed " + std::to_string(seed) + ", fraction " + std::to_string(fraction));
      const ChosenSamples chosen = chosen_samples_by_counting(channels, fraction);
      const ChannelThresholds t = fit_channel_thresholds(x, fraction);
      const at::Tensor low = t.low.reshape({-1}).to(at::kDouble), high = t.high.reshape({-1}).to(at::kDouble);
      const at::Tensor offset = t.offset.reshape({-1}).to(at::kDouble), scale = t.scale.reshape({-1}).to(at::kDouble);
      int64_t moved = 0, outliers = 0;
      for (size_t c = 0; c < channels.size(); ++c) {
        const std::vector<double>& values = channels[c];
        const auto i = static_cast<int64_t>(c);
        const double lo = low[i].item<double>(), hi = high[i].item<double>();
        // The same calibration elements are outliers as with the chosen samples.
        for (const double v : values) {
          const bool before = v < chosen.low[c] || v > chosen.high[c];
          ASSERT_EQ(v < lo || v > hi, before) << "channel " << c << " value " << v;
          outliers += before;
        }
        // Each threshold lies strictly between the chosen sample and the next
        // distinct value beyond it (their midpoint in float32), so no value
        // equals it; with nothing beyond, or no float32 between, it is the sample.
        double below = -std::numeric_limits<double>::infinity(), above = -below;
        for (const double v : values) {
          if (v < chosen.low[c]) below = std::max(below, v);
          if (v > chosen.high[c]) above = std::min(above, v);
        }
        if (std::isinf(below)) {
          EXPECT_EQ(lo, chosen.low[c]) << "channel " << c;
        } else {
          EXPECT_EQ(lo, expected_threshold(chosen.low[c], below)) << "channel " << c;
          EXPECT_TRUE(below < lo && lo <= chosen.low[c]) << "channel " << c;
          if (lo < chosen.low[c]) {
            ++moved;
            EXPECT_EQ(std::count(values.begin(), values.end(), lo), 0) << "channel " << c;
          }
        }
        if (std::isinf(above)) {
          EXPECT_EQ(hi, chosen.high[c]) << "channel " << c;
        } else {
          EXPECT_EQ(hi, expected_threshold(chosen.high[c], above)) << "channel " << c;
          EXPECT_TRUE(chosen.high[c] <= hi && hi < above) << "channel " << c;
          if (hi > chosen.high[c]) {
            ++moved;
            EXPECT_EQ(std::count(values.begin(), values.end(), hi), 0) << "channel " << c;
          }
        }
        // The stored offset and scale still map both thresholds into [-1, 1].
        EXPECT_GE((lo - offset[i].item<double>()) / scale[i].item<double>(), -1.0) << "channel " << c;
        EXPECT_LE((hi - offset[i].item<double>()) / scale[i].item<double>(), 1.0) << "channel " << c;
      }
      // The cases above are all exercised: thresholds moved wherever anything
      // was selected, except in the channels of adjacent float32 values.
      if (fraction >= 0.05) {
        EXPECT_GT(moved, 0);
        EXPECT_GT(outliers, 0);
      }
    }
  }
}

// One channel's thresholds: x holds its values, [1, 1, n, 1].
std::pair<float, float> one_channel_thresholds(const std::vector<float>& values, double fraction) {
  const at::Tensor x = at::tensor(at::ArrayRef<float>(values)).view({1, 1, -1, 1});
  const ChannelThresholds t = fit_channel_thresholds(x, fraction);
  return {t.low.item<float>(), t.high.item<float>()};
}

TEST(ChannelThresholds, EdgeCasesByHand) {
  // All equal: nothing beyond either side; both thresholds are the value, and
  // the scale is the constant channel's max(|offset|, 1) 2^-20.
  {
    const at::Tensor x = at::full({1, 1, 10, 1}, 0.75f);
    const ChannelThresholds t = fit_channel_thresholds(x, 0.5);
    EXPECT_EQ(t.low.item<float>(), 0.75f);
    EXPECT_EQ(t.high.item<float>(), 0.75f);
    EXPECT_EQ(t.offset.item<float>(), 0.75f);
    EXPECT_EQ(t.scale.item<float>(), std::ldexp(1.0f, -20));
  }
  // Fewer samples than asked for: n = 2, f = 0.9 asks for 0.9 per side, but
  // each side may take at most (n - 1) / 2 = 0: the minimum and the maximum.
  EXPECT_EQ(one_channel_thresholds({3.0f, -1.0f}, 0.9), std::make_pair(-1.0f, 3.0f));
  // n = 3, f = 0.9: 1.35 per side, at most 1: -2 and 4 are outliers, the
  // thresholds the midpoints of each with the middle value 0.5.
  EXPECT_EQ(one_channel_thresholds({4.0f, -2.0f, 0.5f}, 0.9), std::make_pair(-0.75f, 2.25f));
  // f = 0: the minimum and the maximum are the chosen samples with nothing
  // beyond; they stay.
  EXPECT_EQ(one_channel_thresholds({0.25f, -1.5f, 7.0f, 2.0f}, 0.0), std::make_pair(-1.5f, 7.0f));
  // Ties at the quantile: n = 10, f = 0.4, 2 per side. Low: s[2] = 0 selects
  // nothing, the next value 1 selects the three zeros, nearer 2 by 1 than 0
  // by 2, so 1 is chosen, and the threshold is between 0 and 1. High: s[7] =
  // 5 selects 6 and 7; the threshold is between 5 and 6.
  EXPECT_EQ(one_channel_thresholds({0, 0, 0, 1, 2, 3, 4, 5, 6, 7}, 0.4), std::make_pair(0.5f, 5.5f));
  // Adjacent float32 values: n = 3, f = 0.9, 1 per side. Below the low sample
  // 1 + 2^-23 lies 1, with no float32 between: the sample stays (1 is still
  // an outlier). The high side's midpoint 3 + 2^-24 rounds to 3.
  const float above_one = std::nextafter(1.0f, 2.0f);
  EXPECT_EQ(one_channel_thresholds({1.0f, above_one, 5.0f}, 0.9), std::make_pair(above_one, 3.0f));
}

TEST(Simulation, PerTokenUniformWithClipSinkAndResidual) {
  QuantizerSettings s;
  s.method = QuantMethod::kInt2Rot;
  s.bits = 2;
  s.keys = {Grouping::kPerToken, 8};
  s.sink_tokens = 2;
  s.residual_tokens = 3;
  TensorQuantizer q;
  q.clip_ratio = 0.9f;
  const Slab x = random_slab(2, 9, 8, 1);
  expect_simulation_matches(s, s.keys, q, x, "int2-rot keys");
  // Positions 0, 1 and 6..8 exact; the rest changed.
  const SimulatedTensor sim = simulate_quantization(s, s.keys, q, to_tensor(x));
  const at::Tensor exact = to_tensor(x);
  EXPECT_TRUE(sim.dequantized.narrow(1, 0, 2).equal(exact.narrow(1, 0, 2)));
  EXPECT_TRUE(sim.dequantized.narrow(1, 6, 3).equal(exact.narrow(1, 6, 3)));
  EXPECT_FALSE(sim.dequantized.narrow(1, 2, 4).equal(exact.narrow(1, 2, 4)));

  QuantizerSettings rtn;
  rtn.bits = 3;
  rtn.values = {Grouping::kPerToken, 4};
  expect_simulation_matches(rtn, rtn.values, TensorQuantizer{}, random_slab(2, 6, 8, 2), "rtn values, group 4");
}

TEST(Simulation, KiviKeepsIncompleteGroupsAndTheResidualExact) {
  QuantizerSettings s;
  s.method = QuantMethod::kKivi;
  s.keys = {Grouping::kPerChannelTokens, 4};
  s.values = {Grouping::kPerToken, 4};
  s.residual_tokens = 3;
  // 13 tokens: [0, 10) before the residual; two whole groups [0, 8); 8, 9 exact.
  EXPECT_EQ(quantized_tokens(s, s.keys, 13).end, 8);
  EXPECT_EQ(quantized_tokens(s, s.values, 13).end, 10);
  const Slab x = random_slab(2, 13, 8, 3);
  expect_simulation_matches(s, s.keys, TensorQuantizer{}, x, "kivi keys");
  expect_simulation_matches(s, s.values, TensorQuantizer{}, x, "kivi values");
  // Per-channel token groups with runtime outliers, a grid and clipping.
  TensorQuantizerSettings with_outliers = s.keys;
  with_outliers.outlier_fraction = 0.05;
  with_outliers.outlier_rule = OutlierRule::kTokenTau;  // the variant; the reference finds tau outliers
  with_outliers.non_uniform = true;
  TensorQuantizer q;
  q.outlier_tau = 1.5f;
  q.grid = {-1.0f, -0.25f, 0.5f, 1.0f};
  q.clip_ratio = 0.9f;
  expect_simulation_matches(s, with_outliers, q, x, "per_channel_tokens, outliers, grid, clip");
  // A per-token group of head_dim or more is the whole head.
  TensorQuantizerSettings whole = s.values;
  whole.group = 64;
  TensorQuantizerSettings exact = s.values;
  exact.group = 8;
  EXPECT_TRUE(simulate_quantization(s, whole, {}, to_tensor(x)).dequantized.equal(
      simulate_quantization(s, exact, {}, to_tensor(x)).dequantized));
  const SimulatedTensor sim = simulate_quantization(s, s.keys, TensorQuantizer{}, to_tensor(x));
  EXPECT_TRUE(sim.dequantized.narrow(1, 8, 5).equal(to_tensor(x).narrow(1, 8, 5)));
  EXPECT_FALSE(sim.dequantized.narrow(1, 4, 4).equal(to_tensor(x).narrow(1, 4, 4)));
}

TEST(Simulation, WindowsShorterThanSinkAndResidualStayExact) {
  QuantizerSettings s;
  s.keys = {Grouping::kPerToken, 8};
  s.sink_tokens = 64;
  s.residual_tokens = 256;
  const Slab x = random_slab(1, 300, 8, 4);
  EXPECT_EQ(quantized_tokens(s, s.keys, 300).size(), 0);
  EXPECT_EQ(quantized_tokens(s, s.keys, 321).size(), 1);
  EXPECT_TRUE(simulate_quantization(s, s.keys, {}, to_tensor(x)).dequantized.equal(to_tensor(x)));
}

TEST(Simulation, KvquantKeysPerChannelOutliersAndGridTies) {
  QuantizerSettings s;
  s.method = QuantMethod::kKvquant;
  s.keys_pre_rope = true;
  s.keys = {Grouping::kPerChannelOffline, 0, true, 0.01};
  s.sink_tokens = 1;
  const int64_t heads = 2, dim = 4;
  TensorQuantizer q;
  q.grid = {-1.0f, -0.5f, 0.25f, 1.0f};
  q.channel_offset = array(heads, dim, {0, 0.5f, -1, 2, 0.25f, 0, 0, 1});
  q.channel_scale = array(heads, dim, {1, 2, 0.5f, 1.5f, 1, 3, 1, 0.25f});
  std::vector<float> low, high;
  for (size_t i = 0; i < 8; ++i) {
    low.push_back(q.channel_offset.values[i] - q.channel_scale.values[i]);
    high.push_back(q.channel_offset.values[i] + q.channel_scale.values[i]);
  }
  q.outlier_low = array(heads, dim, low);
  q.outlier_high = array(heads, dim, high);
  Slab x = random_slab(heads, 7, dim, 5);
  // Channel (0, 0): offset 0, scale 1; ties at midpoints -0.75 and 0.625.
  x.at(0, 1, 0) = -0.75;
  x.at(0, 2, 0) = 0.625;
  x.at(0, 3, 0) = 1.5;  // above high = 1: an outlier
  expect_simulation_matches(s, s.keys, q, x, "kvquant keys");
  const SimulatedTensor sim = simulate_quantization(s, s.keys, q, to_tensor(x));
  EXPECT_EQ(sim.dequantized[0][1][0].item<float>(), -1.0f);
  EXPECT_EQ(sim.dequantized[0][2][0].item<float>(), 0.25f);
  EXPECT_EQ(sim.dequantized[0][3][0].item<float>(), 1.5f);
  EXPECT_TRUE(sim.outliers[0][3][0].item<bool>());
  EXPECT_FALSE(sim.outliers.select(1, 0).any().item<bool>());  // the sink is exact, not an outlier

  // Uniform levels in the normalized domain (the non_uniform=false ablation).
  TensorQuantizer uniform = q;
  uniform.grid.clear();
  expect_simulation_matches(s, s.keys, uniform, x, "kvquant keys, uniform");
}

TEST(Simulation, KvquantValuesPerHeadTauVariantOutliersAndGrid) {
  QuantizerSettings s;
  s.method = QuantMethod::kKvquant;
  s.values = {Grouping::kPerToken, 8, true, 0.01, OutlierRule::kTokenTau};
  s.sink_tokens = 1;
  TensorQuantizer q;
  q.grid = {-1.0f, -0.5f, 0.25f, 1.0f};
  q.outlier_tau = 2.0f;
  Slab x = random_slab(2, 6, 8, 6);
  // Token 2 of head 0: inliers span exactly [-1, 1]; -0.75 and 0.625 tie.
  const std::vector<double> token = {-1, 1, -0.75, 0.625, 0, 0.1, -0.2, 0.3};
  for (int64_t c = 0; c < 8; ++c) x.at(0, 2, c) = token[static_cast<size_t>(c)];
  expect_simulation_matches(s, s.values, q, x, "kvquant values");
  const SimulatedTensor sim = simulate_quantization(s, s.values, q, to_tensor(x));
  EXPECT_EQ(sim.dequantized[0][2][2].item<float>(), -1.0f);
  EXPECT_EQ(sim.dequantized[0][2][3].item<float>(), 0.25f);
  EXPECT_GT(sim.outliers.sum().item<int64_t>(), 0);

  // Per-token groups smaller than head_dim with outliers and a clip ratio.
  s.values.group = 4;
  q.clip_ratio = 0.95f;
  expect_simulation_matches(s, s.values, q, x, "per-token group 4, grid, clip, outliers");
}

TEST(Simulation, ConfigEntryPointsPickTheLayer) {
  QuantizerConfig config;
  config.settings.bits = 4;
  config.layers.resize(2);
  config.layers[1].keys.clip_ratio = 0.5f;
  const Slab x = random_slab(2, 5, 128, 7);
  const auto keys = quantize_dequantize_keys(config, 1, to_tensor(x));
  EXPECT_TRUE(keys.dequantized.equal(simulate_quantization(config.settings, config.settings.keys,
                                                           config.layers[1].keys, to_tensor(x)).dequantized));
  EXPECT_FALSE(keys.dequantized.equal(quantize_dequantize_keys(config, 0, to_tensor(x)).dequantized));
  EXPECT_THROW(quantize_dequantize_values(config, 2, to_tensor(x)), std::out_of_range);
}

TEST(CalibrationStats, LogitErrorOverCausalPairsWithGqa) {
  const at::Tensor q = to_tensor(random_slab(4, 5, 4, 8)).unsqueeze(0);
  const at::Tensor k = to_tensor(random_slab(2, 5, 4, 9)).unsqueeze(0);
  const at::Tensor k_hat = k + 0.1 * to_tensor(random_slab(2, 5, 4, 10)).unsqueeze(0);
  double err = 0, ref = 0;
  for (int64_t h = 0; h < 4; ++h) {
    for (int64_t i = 0; i < 5; ++i) {
      for (int64_t j = 0; j <= i; ++j) {
        double a = 0, b = 0;
        for (int64_t c = 0; c < 4; ++c) {
          a += q[0][h][i][c].item<double>() * k[0][h / 2][j][c].item<double>() / 2;
          b += q[0][h][i][c].item<double>() * k_hat[0][h / 2][j][c].item<double>() / 2;
        }
        err += (a - b) * (a - b);
        ref += a * a;
      }
    }
  }
  EXPECT_NEAR(logit_error(q, k, k_hat).relative(), err / ref, 1e-12);
}

// ---- the papers' rules, from the papers' streaming and sorting ---------------

// KIVI's cache, token by token, as its reference code runs it (float64): a
// prefill of P tokens, then single appended tokens up to T. Keys: the
// prefill quantizes its first floor(P' / R) * R tokens (P' = tokens past the
// sink) per channel in groups of G tokens and keeps the rest in a 16-bit
// buffer; each append goes to the buffer, which is quantized whole (per
// channel, G-token groups) when it holds R tokens. Values: the prefill
// quantizes all but the newest R per token in groups of G channels; each
// append that leaves more than R in the buffer quantizes the oldest one.
// The first `sink` positions are never quantized.
struct StreamedCache {
  Slab out;
  std::vector<bool> quantized;  // per token
};

void quantize_key_block(const Slab& x, Slab& out, int64_t first, int64_t count, int64_t group, int bits) {
  for (int64_t h = 0; h < x.heads; ++h) {
    for (int64_t c = 0; c < x.dim; ++c) {
      for (int64_t g = first; g < first + count; g += group) {
        double mn = std::numeric_limits<double>::infinity(), mx = -mn;
        for (int64_t t = g; t < g + group; ++t) {
          mn = std::min(mn, x.at(h, t, c));
          mx = std::max(mx, x.at(h, t, c));
        }
        if (!(mx > mn)) continue;
        for (int64_t t = g; t < g + group; ++t) out.at(h, t, c) = reference_round(x.at(h, t, c), mn, mx, bits, {});
      }
    }
  }
}

void quantize_value_token(const Slab& x, Slab& out, int64_t t, int64_t group, int bits) {
  for (int64_t h = 0; h < x.heads; ++h) {
    for (int64_t g = 0; g < x.dim; g += group) {
      double mn = std::numeric_limits<double>::infinity(), mx = -mn;
      for (int64_t c = g; c < g + group; ++c) {
        mn = std::min(mn, x.at(h, t, c));
        mx = std::max(mx, x.at(h, t, c));
      }
      if (!(mx > mn)) continue;
      for (int64_t c = g; c < g + group; ++c) out.at(h, t, c) = reference_round(x.at(h, t, c), mn, mx, bits, {});
    }
  }
}

StreamedCache stream_kivi_keys(const Slab& x, int64_t prefill, int64_t tokens, int64_t sink, int64_t residual,
                               int64_t group, int bits) {
  StreamedCache cache{x, std::vector<bool>(static_cast<size_t>(tokens), false)};
  const auto flush = [&](int64_t first, int64_t count) {
    quantize_key_block(x, cache.out, first, count, group, bits);
    for (int64_t t = first; t < first + count; ++t) cache.quantized[static_cast<size_t>(t)] = true;
  };
  const int64_t begin = std::min(sink, prefill);
  const int64_t prefix = (prefill - begin) / residual * residual;  // KIVI: key_states[:, :, :-(L % R)]
  if (prefix > 0) flush(begin, prefix);
  int64_t buffer_start = begin + prefix;
  for (int64_t t = prefill; t < tokens; ++t) {
    if (t < sink) {
      buffer_start = t + 1;
      continue;
    }
    if (t + 1 - buffer_start == residual) {  // the buffer reached R tokens
      flush(buffer_start, residual);
      buffer_start = t + 1;
    }
  }
  return cache;
}

StreamedCache stream_kivi_values(const Slab& x, int64_t prefill, int64_t tokens, int64_t sink, int64_t residual,
                                 int64_t group, int bits) {
  StreamedCache cache{x, std::vector<bool>(static_cast<size_t>(tokens), false)};
  const auto quantize = [&](int64_t t) {
    quantize_value_token(x, cache.out, t, group, bits);
    cache.quantized[static_cast<size_t>(t)] = true;
  };
  std::vector<int64_t> buffer;  // 16-bit tokens past the sink, oldest first
  for (int64_t t = std::min(sink, prefill); t < prefill; ++t) buffer.push_back(t);
  while (static_cast<int64_t>(buffer.size()) > residual) {  // prefill: all but the newest R
    quantize(buffer.front());
    buffer.erase(buffer.begin());
  }
  for (int64_t t = prefill; t < tokens; ++t) {
    if (t < sink) continue;
    buffer.push_back(t);
    if (static_cast<int64_t>(buffer.size()) > residual) {
      quantize(buffer.front());
      buffer.erase(buffer.begin());
    }
  }
  return cache;
}

Slab first_tokens(const Slab& x, int64_t tokens) {
  Slab out{x.heads, tokens, x.dim, {}};
  for (int64_t h = 0; h < x.heads; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t c = 0; c < x.dim; ++c) out.x.push_back(x.at(h, t, c));
    }
  }
  return out;
}

void expect_stream_matches(const QuantizerSettings& s, const TensorQuantizerSettings& t, const Slab& x,
                           const StreamedCache& cache, const std::string& what) {
  const SimulatedTensor sim = simulate_quantization(s, t, {}, to_tensor(x));
  const TokenSpan span = quantized_tokens(s, t, x.tokens);
  for (int64_t tok = 0; tok < x.tokens; ++tok) {
    ASSERT_EQ(cache.quantized[static_cast<size_t>(tok)], tok >= span.begin && tok < span.end) << what << " token " << tok;
  }
  const at::Tensor expected = at::tensor(at::ArrayRef<double>(cache.out.x)).view(sim.dequantized.sizes());
  // Float32 output of values below 16 in magnitude: rounding error < 16 * 2^-24 = 1e-6.
  ASSERT_LT((sim.dequantized.to(at::kDouble) - expected).abs().max().item<double>(), 1e-6) << what;
}

TEST(PaperRules, KiviWindowsEqualKivisStreamingForEveryPrefill) {
  FitOptions options;
  options.method = QuantMethod::kKivi;
  QuantizerSettings s = resolve_settings(options, 8);
  ASSERT_EQ(s.keys.residual_rule, ResidualRule::kBlockFlush);
  ASSERT_EQ(s.values.residual_rule, ResidualRule::kSliding);
  ASSERT_EQ(s.residual_tokens, 128);
  ASSERT_EQ(s.keys.group, 32);
  ASSERT_EQ(s.values.group, 32);
  // The same rules at a scale a loop can stream: R = 8, G = 4 (R a multiple of G).
  s.residual_tokens = 8;
  s.keys.group = 4;
  s.values.group = 4;
  const Slab x = random_slab(2, 41, 8, 21);
  for (const int64_t sink : {0, 3}) {
    s.sink_tokens = sink;
    for (int64_t tokens = 1; tokens <= x.tokens; tokens += (tokens < 20 ? 1 : 3)) {
      const Slab window = first_tokens(x, tokens);
      for (int64_t prefill = 0; prefill <= tokens; ++prefill) {
        const std::string what = "sink " + std::to_string(sink) + " T " + std::to_string(tokens) + " P " +
                                 std::to_string(prefill);
        expect_stream_matches(s, s.keys, window, stream_kivi_keys(window, prefill, tokens, sink, 8, 4, s.bits),
                              "keys " + what);
        expect_stream_matches(s, s.values, window, stream_kivi_values(window, prefill, tokens, sink, 8, 4, s.bits),
                              "values " + what);
      }
    }
  }
  // T mod R keys exact at the artifact's scale: 131,072 + 100 tokens, R 128.
  const QuantizerSettings kivi = resolve_settings(options, 128);
  EXPECT_EQ(quantized_tokens(kivi, kivi.keys, 131072 + 100).end, 131072);
  EXPECT_EQ(quantized_tokens(kivi, kivi.values, 131072 + 100).end, 131072 + 100 - 128);
  // kvforge's former key window, the sliding variant: R + (T - R) mod G exact.
  TensorQuantizerSettings sliding = kivi.keys;
  sliding.residual_rule = ResidualRule::kSliding;
  EXPECT_EQ(quantized_tokens(kivi, sliding, 131072 + 100).end, (131072 + 100 - 128) / 32 * 32);
  TensorQuantizerSettings misfit = kivi.keys;
  misfit.group = 48;  // 128 is not a multiple of 48
  EXPECT_THROW(quantized_tokens(kivi, misfit, 1000), std::invalid_argument);
}

// KVQuant's count: k = n - ceil((n - 1)(1 - f/2)) in exact arithmetic, with f
// = p / 10000, as integers: ceil((n - 1)(20000 - p) / 20000).
int64_t exact_top_bottom_count(int64_t n, int64_t p) {
  const int64_t numerator = (n - 1) * (20000 - p);
  return n - (numerator + 19999) / 20000;
}

// torch.quantile(w, q) (linear interpolation) and `w >= upper`, on distinct values.
int64_t quantile_count(std::vector<double> w, double q) {
  std::sort(w.begin(), w.end());
  const double rank = q * static_cast<double>(w.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(rank)), hi = static_cast<size_t>(std::ceil(rank));
  const double upper = w[lo] + (rank - static_cast<double>(lo)) * (w[hi] - w[lo]);
  return std::count_if(w.begin(), w.end(), [&](double v) { return v >= upper; });
}

TEST(PaperRules, KvquantTopBottomCount) {
  EXPECT_EQ(top_bottom_count(4096, 0.01), 21);
  EXPECT_EQ(top_bottom_count(256, 0.01), 2);
  std::mt19937 rng(5);
  std::normal_distribution<double> normal;
  for (const int64_t n : {int64_t{256}, int64_t{4096}}) {
    std::vector<double> w(static_cast<size_t>(n));
    for (double& v : w) v = normal(rng);
    EXPECT_EQ(top_bottom_count(n, 0.01), quantile_count(w, 1 - 0.01 / 2)) << n;
  }
  for (int64_t n = 1; n <= 2100; n += 1) {
    for (const int64_t p : {int64_t{0}, int64_t{100}, int64_t{200}, int64_t{500}, int64_t{1000}}) {
      ASSERT_EQ(top_bottom_count(n, static_cast<double>(p) / 10000), exact_top_bottom_count(n, p))
          << "n " << n << " f " << p << "/10000";
    }
  }
}

// The outliers of one token's row (n elements, channel index = position in
// the row) by sorting, as the rule states: the k largest (descending value,
// lower index first) and the k smallest (ascending value, lower index first).
std::vector<bool> reference_top_bottom(const std::vector<double>& row, int64_t k) {
  const size_t n = row.size();
  std::vector<bool> outlier(n, false);
  if (2 * k >= static_cast<int64_t>(n)) return std::vector<bool>(n, true);
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::vector<size_t> largest = order, smallest = order;
  std::sort(largest.begin(), largest.end(), [&](size_t a, size_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  std::sort(smallest.begin(), smallest.end(), [&](size_t a, size_t b) { return row[a] < row[b] || (row[a] == row[b] && a < b); });
  for (int64_t i = 0; i < k; ++i) {
    outlier[largest[static_cast<size_t>(i)]] = true;
    outlier[smallest[static_cast<size_t>(i)]] = true;
  }
  return outlier;
}

// Index of the level nearest to n, the lower one on a tie.
size_t reference_code(const std::vector<float>& levels, double n) {
  size_t best = 0;
  for (size_t i = 1; i < levels.size(); ++i) {
    if (std::abs(n - static_cast<double>(levels[i])) < std::abs(n - static_cast<double>(levels[best]))) best = i;
  }
  return best;
}

// KVQuant's values: per token, over all heads' channels (h * D + c): the
// top/bottom outliers, then one min/max scaling over the row's inliers and
// grid[nearest encode level] (or uniform levels).
Reference reference_all_heads(const QuantizerSettings& s, const TensorQuantizerSettings& t, const TensorQuantizer& q,
                              const Slab& x) {
  Reference ref{x, std::vector<bool>(x.x.size(), false)};
  const int64_t begin = std::min(s.sink_tokens, x.tokens);
  const int64_t end = std::max(begin, x.tokens - s.residual_tokens);
  const int64_t n = x.heads * x.dim;
  const int64_t k = t.outlier_fraction > 0 ? top_bottom_count(n, t.outlier_fraction) : 0;
  const auto index = [&](int64_t i, int64_t tok) { return static_cast<size_t>(((i / x.dim) * x.tokens + tok) * x.dim + i % x.dim); };
  for (int64_t tok = begin; tok < end; ++tok) {
    std::vector<double> row;
    for (int64_t i = 0; i < n; ++i) row.push_back(x.x[index(i, tok)]);
    const std::vector<bool> outlier = k > 0 ? reference_top_bottom(row, k) : std::vector<bool>(static_cast<size_t>(n), false);
    double mn = std::numeric_limits<double>::infinity(), mx = -mn;
    for (int64_t i = 0; i < n; ++i) {
      ref.outlier[index(i, tok)] = outlier[static_cast<size_t>(i)];
      if (outlier[static_cast<size_t>(i)]) continue;
      mn = std::min(mn, row[static_cast<size_t>(i)]);
      mx = std::max(mx, row[static_cast<size_t>(i)]);
    }
    const double lo = q.clip_ratio * mn, hi = q.clip_ratio * mx;
    if (!(hi > lo)) continue;
    for (int64_t i = 0; i < n; ++i) {
      if (outlier[static_cast<size_t>(i)]) continue;
      double v;
      if (q.grid.empty()) {
        v = reference_round(row[static_cast<size_t>(i)], lo, hi, s.bits, {});
      } else {
        const double center = (lo + hi) / 2, half = (hi - lo) / 2;
        const auto& encode = q.encode_grid.empty() ? q.grid : q.encode_grid;
        v = center + half * q.grid[reference_code(encode, (row[static_cast<size_t>(i)] - center) / half)];
      }
      ref.out.x[index(i, tok)] = v;
    }
  }
  return ref;
}

void expect_matches(const Reference& ref, const SimulatedTensor& sim, const std::string& what) {
  const at::Tensor expected = at::tensor(at::ArrayRef<double>(ref.out.x)).view(sim.dequantized.sizes());
  EXPECT_LT((sim.dequantized.to(at::kDouble) - expected).abs().max().item<double>(), 1e-6) << what;
  std::vector<uint8_t> flags(ref.outlier.begin(), ref.outlier.end());
  const at::Tensor expected_outliers = at::tensor(at::ArrayRef<uint8_t>(flags)).view(sim.outliers.sizes()).to(at::kBool);
  EXPECT_TRUE(sim.outliers.equal(expected_outliers)) << what;
}

TEST(PaperRules, KvquantValuesTopBottomPerTokenAcrossHeads) {
  FitOptions options;
  options.method = QuantMethod::kKvquant;
  const QuantizerSettings defaults = resolve_settings(options, 16);
  ASSERT_EQ(defaults.values.grouping, Grouping::kPerTokenAllHeads);
  ASSERT_EQ(defaults.values.outlier_rule, OutlierRule::kTokenTopBottom);
  ASSERT_EQ(defaults.values.outlier_fraction, 0.01);
  ASSERT_EQ(defaults.keys.outlier_rule, OutlierRule::kChannelThresholds);

  QuantizerSettings s = defaults;
  s.sink_tokens = 1;
  // 4 heads x 16 channels: n = 64; f = 0.08 gives k = 64 - ceil(63 * 0.96 = 60.48) = 3.
  s.values.outlier_fraction = 0.08;
  ASSERT_EQ(top_bottom_count(64, 0.08), 3);
  Slab x = random_slab(4, 7, 16, 31);
  // Token 2: ties among the largest across heads (the lower channel index
  // wins) and among the smallest.
  // (random_slab's planted values reach 11 in magnitude: 20 stays the largest.)
  for (const auto& [h, c] : {std::pair{0, 5}, std::pair{1, 2}, std::pair{2, 9}, std::pair{3, 0}}) x.at(h, 2, c) = 20.0;
  for (const auto& [h, c] : {std::pair{0, 1}, std::pair{3, 3}, std::pair{1, 7}, std::pair{2, 2}}) x.at(h, 2, c) = -20.0;
  // Token 4: constant across every head: the first k in channel order are
  // both the largest and the smallest.
  for (int64_t h = 0; h < 4; ++h) {
    for (int64_t c = 0; c < 16; ++c) x.at(h, 4, c) = 0.5;
  }
  TensorQuantizer q;
  for (const bool grid : {false, true}) {
    if (grid) {
      s.values.non_uniform = true;
      q.encode_grid = {-1.0f, -0.3f, 0.2f, 1.0f};  // codes: the nearest of these
      q.grid = {-0.9f, -0.25f, 0.3f, 1.1f};        // values: these (Q-Norm affine's split)
    }
    const Reference ref = reference_all_heads(s, s.values, q, x);
    const SimulatedTensor sim = simulate_quantization(s, s.values, q, to_tensor(x));
    expect_matches(ref, sim, grid ? "all heads, encode grid" : "all heads, uniform");
    // A batched input gives the same per window.
    const SimulatedTensor batched = simulate_quantization(s, s.values, q, to_tensor(x).unsqueeze(0).expand({2, -1, -1, -1}));
    EXPECT_TRUE(batched.dequantized[1].equal(sim.dequantized));
  }
  const SimulatedTensor sim = simulate_quantization(s, s.values, q, to_tensor(x));
  // Token 2's outliers: 20 at (0,5), (1,2), (2,9) (channels 5, 18, 41 of 64)
  // and -20 at (0,1), (1,7), (2,2); (3,0) and (3,3) lose the ties.
  EXPECT_TRUE(sim.outliers[0][2][5].item<bool>() && sim.outliers[1][2][2].item<bool>() && sim.outliers[2][2][9].item<bool>());
  EXPECT_FALSE(sim.outliers[3][2][0].item<bool>());
  EXPECT_FALSE(sim.outliers[3][2][3].item<bool>());
  EXPECT_EQ(sim.outliers.select(1, 2).sum().item<int64_t>(), 6);
  EXPECT_EQ(sim.outliers.select(1, 4).sum().item<int64_t>(), 3);  // channels 0, 1, 2 of head 0
  // A fixed count per token: 2k for tokens without ties, none in the sink.
  EXPECT_EQ(sim.outliers.select(1, 0).sum().item<int64_t>(), 0);
  EXPECT_EQ(sim.outliers.select(1, 5).sum().item<int64_t>(), 6);

  // One head's span (per_token groupings with the top/bottom rule): n = D.
  TensorQuantizerSettings per_head{Grouping::kPerToken, 16, false, 0.08, OutlierRule::kTokenTopBottom};
  const SimulatedTensor head = simulate_quantization(s, per_head, {}, to_tensor(x));
  for (int64_t h = 0; h < 4; ++h) {
    Slab one{1, x.tokens, x.dim, {}};
    for (int64_t t = 0; t < x.tokens; ++t) {
      for (int64_t c = 0; c < x.dim; ++c) one.x.push_back(x.at(h, t, c));
    }
    TensorQuantizerSettings all = per_head;
    all.grouping = Grouping::kPerTokenAllHeads;
    expect_matches(reference_all_heads(s, all, {}, one),
                   simulate_quantization(s, per_head, {}, to_tensor(one)), "per head " + std::to_string(h));
    EXPECT_TRUE(head.dequantized[h].equal(simulate_quantization(s, per_head, {}, to_tensor(one)).dequantized[0]));
  }
}

// ---- effective bits ---------------------------------------------------------

TEST(EffectiveBits, ByHandAt131072Tokens) {
  const auto settings = [](QuantMethod method, int bits = 2) {
    FitOptions options;
    options.method = method;
    options.bits = bits;
    return resolve_settings(options, 128);
  };
  const int64_t kv_heads = 8, dim = 128;  // a Llama-3-8B layer
  const double t = 131072;
  // RTN per token, group 128: 2 + 32/128 at every context.
  EXPECT_DOUBLE_EQ(effective_bits(settings(QuantMethod::kRtn), kv_heads, dim, 131072), 2.25);
  // INT2 (OptR), group 128, sink 64 + residual 256 in 16 bits; 2.32 at 64K.
  EXPECT_NEAR(effective_bits(settings(QuantMethod::kInt2Rot), kv_heads, dim, 131072),
              (16.0 * 320 + (t - 320) * 2.25) / t, 1e-12);
  EXPECT_NEAR(effective_bits(settings(QuantMethod::kInt2Rot), kv_heads, dim, 65536), 2.32, 0.01);
  // KIVI-2, G 32, R 128: keys flushed in blocks of 128, so none exact at
  // 131072 = 1024 x 128 (3 bits each); values: the newest 128 exact.
  const double kivi_values = (16.0 * 128 + (t - 128) * 3) / t;
  EXPECT_NEAR(effective_bits(settings(QuantMethod::kKivi), kv_heads, dim, 131072), (3 + kivi_values) / 2, 1e-12);
  // 100 tokens later: 100 keys exact.
  const double t2 = 131172;
  EXPECT_NEAR(effective_bits(settings(QuantMethod::kKivi), kv_heads, dim, 131172),
              ((16.0 * 100 + (t2 - 100) * 3) / t2 + (16.0 * 128 + (t2 - 128) * 3) / t2) / 2, 1e-12);
  // KVQuant-2: the sink token exact. Keys: 2 bits + outliers 1% x (16-bit
  // value + 16-bit index into the token's 128 channels) + a 32-bit row
  // pointer per token and head (32/128), + 32 bits per channel (scale and
  // offset) over the context. Values: one scale and offset per token over
  // 8 x 128 = 1024 channels (32/1024), k = 1024 - ceil(1023 x 0.995) = 6
  // largest and 6 smallest (12/1024 x 32) + a row pointer (32/1024).
  const double q = (t - 1) / t;
  const double keys = 16 / t + q * (2 + 0.01 * 32 + 32.0 / 128) + 32 / t;
  const double values = 16 / t + q * (2 + 32.0 / 1024 + 12.0 / 1024 * 32 + 32.0 / 1024);
  EXPECT_NEAR(effective_bits(settings(QuantMethod::kKvquant), kv_heads, dim, 131072), (keys + values) / 2, 1e-12);
  // At measured outlier fractions (2% of keys, 0.5% of values).
  const double keys_measured = 16 / t + q * (2 + 0.02 * 32 + 32.0 / 128) + 32 / t;
  const double values_measured = 16 / t + q * (2 + 32.0 / 1024 + 0.005 * 32 + 32.0 / 1024);
  EXPECT_NEAR(effective_bits(settings(QuantMethod::kKvquant), kv_heads, dim, 131072, OutlierFractions{0.02, 0.005}),
              (keys_measured + values_measured) / 2, 1e-12);
  // A token span over 65536 elements needs 32-bit indices: 1024 heads x 128,
  // k = 131072 - ceil(131071 x 0.995) = 656.
  const QuantizerSettings kvquant = settings(QuantMethod::kKvquant);
  const double wide = 16 / t + q * (2 + 32.0 / 131072 + 1312.0 / 131072 * (16 + 32) + 32.0 / 131072);
  EXPECT_NEAR(tensor_effective_bits(kvquant, kvquant.values, 1024, dim, 131072), wide, 1e-12);
  // Windows longer than the context: everything 16 bits.
  EXPECT_DOUBLE_EQ(effective_bits(settings(QuantMethod::kInt2Rot), kv_heads, dim, 300), 16.0);
}

TEST(PaperRules, MethodDefaultsAndVariants) {
  FitOptions options;
  options.method = QuantMethod::kKvquant;
  for (const int bits : {2, 3, 4}) {
    options.bits = bits;
    const QuantizerSettings s = resolve_settings(options, 128);
    const QNorm expected = bits == 2 ? QNorm::kAffine : QNorm::kNone;
    EXPECT_EQ(s.keys.q_norm, expected) << bits;
    EXPECT_EQ(s.values.q_norm, expected) << bits;
    EXPECT_EQ(s.values.group, 0);
  }
  options.bits = 2;
  options.q_norm = QNorm::kIterated;
  options.value_outlier_rule = OutlierRule::kTokenTau;
  options.value_grouping = Grouping::kPerToken;
  const QuantizerSettings variant = resolve_settings(options, 128);
  EXPECT_EQ(variant.values.q_norm, QNorm::kIterated);
  EXPECT_EQ(variant.values.outlier_rule, OutlierRule::kTokenTau);
  EXPECT_EQ(variant.values.grouping, Grouping::kPerToken);
  EXPECT_EQ(variant.values.group, 128);
  EXPECT_EQ(variant.keys.outlier_rule, OutlierRule::kChannelThresholds);
  // tau alone implies per-head scaling (tau is per head); with all-heads
  // scaling asked for explicitly it is refused.
  options.q_norm.reset();
  options.value_grouping.reset();
  const QuantizerSettings tau_alone = resolve_settings(options, 128);
  EXPECT_EQ(tau_alone.values.grouping, Grouping::kPerToken);
  EXPECT_EQ(tau_alone.values.group, 128);
  options.value_grouping = Grouping::kPerTokenAllHeads;
  EXPECT_THROW(resolve_settings(options, 128), std::invalid_argument);
  options.outlier_fraction = 0;
  EXPECT_EQ(resolve_settings(options, 128).values.outlier_rule, OutlierRule::kNone);
  FitOptions kivi;
  kivi.method = QuantMethod::kKivi;
  kivi.key_residual_rule = ResidualRule::kSliding;
  EXPECT_EQ(resolve_settings(kivi, 128).keys.residual_rule, ResidualRule::kSliding);
  kivi.key_residual_rule.reset();
  kivi.residual_tokens = 0;  // block_flush needs R > 0
  EXPECT_THROW(resolve_settings(kivi, 128), std::invalid_argument);
}

// ---- RoPE settings from the fingerprint -------------------------------------

TEST(FingerprintRope, ParsesWhatFingerprintsWrite) {
  RopeConfig llama3;
  llama3.type = RopeType::kLlama3;
  llama3.theta = 500000;
  llama3.factor = 8;
  llama3.low_freq_factor = 1;
  llama3.high_freq_factor = 4;
  llama3.original_max_position_embeddings = 8192;
  RopeConfig linear;
  linear.type = RopeType::kLinear;
  linear.factor = 2;
  for (const RopeConfig& rope : {RopeConfig{}, linear, llama3}) {
    const RopeConfig parsed = parse_rope_json(rope_json(rope), "a.h5");
    EXPECT_EQ(parsed.type, rope.type);
    EXPECT_EQ(parsed.theta, rope.theta);
    EXPECT_EQ(parsed.factor, rope.factor);
    EXPECT_EQ(parsed.low_freq_factor, rope.low_freq_factor);
    EXPECT_EQ(parsed.high_freq_factor, rope.high_freq_factor);
    EXPECT_EQ(parsed.original_max_position_embeddings, rope.original_max_position_embeddings);
  }
  EXPECT_THROW(parse_rope_json("{\"type\":\"yarn\",\"theta\":1}", "a.h5"), InputError);
  EXPECT_THROW(parse_rope_json("{\"type\":\"default\"}", "a.h5"), InputError);
  EXPECT_THROW(parse_rope_json("not json", "a.h5"), InputError);
}

// ---- fitting on captured activations ----------------------------------------

constexpr int64_t kWindows = 4;
constexpr int64_t kSeqLen = 512;

// A small store recorded from pyllama-16m over calib.txt: 4 windows of 512
// positions (BOS + 511 text tokens), every field.
class CapturedStore : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const auto dir = testing::scratch_dir("quantizers");
    path_ = new std::filesystem::path(dir / "acts.h5");
    const auto model_dir = testing::pyllama_dir();
    const ModelConfig config = load_model_config(model_dir);
    const Tokenizer tokenizer = Tokenizer::from_file(model_dir / "tokenizer.json");
    std::string text = testing::read_file(testing::shared_dir() / "data" / "calib.txt");
    text.resize(text.rfind('\n', 120000) + 1);
    const std::vector<int32_t> stream = tokenizer.encode(text);
    ASSERT_GT(stream.size(), static_cast<size_t>(kWindows * 4000));

    ActivationStoreLayout layout;
    layout.model = fingerprint_model(config, Checkpoint(model_dir), tokenizer.sha256());
    auto& p = layout.provenance;
    p.data_file = "calib.txt";
    p.data_sha256 = sha256_hex(text);
    p.data_tokens = static_cast<int64_t>(stream.size());
    p.samples = kWindows;
    p.seq_len = kSeqLen;
    p.seed = 0;
    p.bos = true;
    p.compute_dtype = "fp32";
    p.device = "cpu";
    p.tool_version = "test";
    p.command_line = "test_quantizers";
    layout.fields = all_activation_fields();
    layout.compression_level = 0;
    ActivationStoreWriter writer = ActivationStoreWriter::create(*path_, layout);

    std::vector<int64_t> ids;
    for (int64_t w = 0; w < kWindows; ++w) {
      const int64_t start = w * 4000;
      std::vector<int32_t> tokens = {0};
      tokens.insert(tokens.end(), stream.begin() + start, stream.begin() + start + kSeqLen - 1);
      writer.write_tokens(w, start, tokens);
      ids.insert(ids.end(), tokens.begin(), tokens.end());
    }
    const Transformer model = Transformer::load(model_dir, {c10::Device(c10::kCPU), c10::kFloat});
    const at::Tensor input = at::tensor(at::ArrayRef<int64_t>(ids)).view({kWindows, kSeqLen});
    record_activations(model, input, {all_activation_fields(), 1024},
                       [&](ActivationField field, int64_t layer, const at::Tensor& values) {
                         const at::Tensor cpu = values.detach().to(at::kCPU, at::kFloat);
                         for (int64_t w = 0; w < kWindows; ++w) {
                           const at::Tensor one = cpu[w].contiguous();
                           writer.write(field, layer, w, {one.data_ptr<float>(), static_cast<size_t>(one.numel())});
                         }
                       });
    for (int64_t w = 0; w < kWindows; ++w) writer.commit_sample(w);
    writer.close();
    store_ = new ActivationStoreReader(*path_);
  }
  static void TearDownTestSuite() {
    delete store_;
    if (path_ != nullptr) std::filesystem::remove_all(path_->parent_path());
    delete path_;
  }

  // [kWindows, kv_heads, T, D] float32, read here without the code under test.
  static at::Tensor read(ActivationField field, int64_t layer) {
    const auto& model = store_->layout().model;
    const int64_t heads = uses_query_heads(field) ? model.num_heads : model.num_kv_heads;
    std::vector<at::Tensor> per_head;
    for (int64_t h = 0; h < heads; ++h) {
      const std::vector<float> data = store_->read_head(field, layer, h, 0, kWindows);
      per_head.push_back(at::tensor(at::ArrayRef<float>(data)).view({kWindows, kSeqLen, model.head_dim}));
    }
    return at::stack(per_head, 1);
  }

  static FitOptions kvquant() {
    FitOptions options;
    options.method = QuantMethod::kKvquant;
    return options;
  }
  // kvforge's former KVQuant: per-head value scaling, tau outliers, iterated Q-Norm.
  static FitOptions kvforge_variant() {
    FitOptions options = kvquant();
    options.value_grouping = Grouping::kPerToken;
    options.value_outlier_rule = OutlierRule::kTokenTau;
    options.q_norm = QNorm::kIterated;
    return options;
  }

  static std::filesystem::path* path_;
  static ActivationStoreReader* store_;
};
std::filesystem::path* CapturedStore::path_ = nullptr;
ActivationStoreReader* CapturedStore::store_ = nullptr;

// The normalized inliers of one layer (positions past the sink) as float64
// values, written out: keys by their channel's offset and scale, values by
// their token's inlier min and max.
struct Normalized {
  std::vector<double> values, weights;
};

Normalized normalized_keys(const TensorQuantizer& q, const at::Tensor& keys, const at::Tensor& fisher) {
  Normalized n;
  const auto k = keys.accessor<float, 4>();
  const auto f = fisher.accessor<float, 4>();
  const int64_t dim = keys.size(3);
  for (int64_t w = 0; w < keys.size(0); ++w) {
    for (int64_t h = 0; h < keys.size(1); ++h) {
      for (int64_t t = 1; t < keys.size(2); ++t) {
        for (int64_t c = 0; c < dim; ++c) {
          const size_t i = static_cast<size_t>(h * dim + c);
          const double x = k[w][h][t][c];
          if (x < q.outlier_low.values[i] || x > q.outlier_high.values[i]) continue;
          n.values.push_back((x - q.channel_offset.values[i]) / q.channel_scale.values[i]);
          n.weights.push_back(f[w][h][t][c]);
        }
      }
    }
  }
  return n;
}

Normalized normalized_values(const TensorQuantizer& q, const at::Tensor& values, const at::Tensor& fisher) {
  Normalized n;
  const auto v = values.accessor<float, 4>();
  const auto f = fisher.accessor<float, 4>();
  const int64_t dim = values.size(3);
  for (int64_t w = 0; w < values.size(0); ++w) {
    for (int64_t h = 0; h < values.size(1); ++h) {
      for (int64_t t = 1; t < values.size(2); ++t) {
        double mean = 0, var = 0;
        for (int64_t c = 0; c < dim; ++c) mean += v[w][h][t][c] / static_cast<double>(dim);
        for (int64_t c = 0; c < dim; ++c) var += std::pow(v[w][h][t][c] - mean, 2) / static_cast<double>(dim);
        std::vector<bool> inlier(static_cast<size_t>(dim));
        double mn = std::numeric_limits<double>::infinity(), mx = -mn;
        for (int64_t c = 0; c < dim; ++c) {
          inlier[static_cast<size_t>(c)] = !(std::abs(v[w][h][t][c] - mean) > q.outlier_tau * std::sqrt(var));
          if (!inlier[static_cast<size_t>(c)]) continue;
          mn = std::min<double>(mn, v[w][h][t][c]);
          mx = std::max<double>(mx, v[w][h][t][c]);
        }
        if (!(mx > mn)) continue;
        for (int64_t c = 0; c < dim; ++c) {
          if (!inlier[static_cast<size_t>(c)]) continue;
          n.values.push_back((v[w][h][t][c] - (mn + mx) / 2) / ((mx - mn) / 2));
          n.weights.push_back(f[w][h][t][c]);
        }
      }
    }
  }
  return n;
}

double weighted_error(const Normalized& n, const std::vector<float>& grid) {
  double total = 0;
  for (size_t i = 0; i < n.values.size(); ++i) {
    total += n.weights[i] * std::pow(n.values[i] - reference_level(grid, n.values[i]), 2);
  }
  return total;
}

TEST_F(CapturedStore, KvquantOutliersSelectTheRequestedFraction) {
  const QuantizerConfig config = fit_quantizers(*store_, kvquant());
  const QuantizerConfig tau_variant = fit_quantizers(*store_, kvforge_variant());
  ASSERT_EQ(config.layers.size(), 5u);
  EXPECT_EQ(config.name, "kvquant");
  EXPECT_TRUE(config.settings.keys_pre_rope);
  for (int64_t layer = 0; layer < 5; ++layer) {
    const LayerQuantizers& lq = config.layers[static_cast<size_t>(layer)];
    ASSERT_EQ(lq.keys.grid.size(), 4u);
    ASSERT_EQ(lq.values.grid.size(), 4u);
    // Keys: per-channel thresholds over positions past the sink.
    const at::Tensor keys = read(ActivationField::kKeysPreRope, layer);
    const auto k = keys.accessor<float, 4>();
    int64_t selected = 0, total = 0;
    for (int64_t w = 0; w < kWindows; ++w) {
      for (int64_t h = 0; h < keys.size(1); ++h) {
        for (int64_t t = 1; t < kSeqLen; ++t) {
          for (int64_t c = 0; c < keys.size(3); ++c) {
            const size_t i = static_cast<size_t>(h * keys.size(3) + c);
            selected += k[w][h][t][c] < lq.keys.outlier_low.values[i] || k[w][h][t][c] > lq.keys.outlier_high.values[i];
            ++total;
          }
        }
      }
    }
    const double key_share = static_cast<double>(selected) / static_cast<double>(total);
    EXPECT_NEAR(key_share, 0.01, 0.001) << "layer " << layer;
    EXPECT_NEAR(lq.stats.key_outlier_fraction, key_share, 1e-12) << "layer " << layer;
    // No calibration key lies on a threshold (layer 0's keys repeat with their
    // token), except a threshold that is its channel's minimum or maximum.
    for (int64_t h = 0; h < keys.size(1); ++h) {
      for (int64_t c = 0; c < keys.size(3); ++c) {
        const size_t i = static_cast<size_t>(h * keys.size(3) + c);
        const at::Tensor channel = keys.select(1, h).narrow(1, 1, kSeqLen - 1).select(2, c);
        const float low = lq.keys.outlier_low.values[i], high = lq.keys.outlier_high.values[i];
        if (low != channel.min().item<float>()) {
          EXPECT_EQ(channel.eq(low).sum().item<int64_t>(), 0) << "layer " << layer << " [" << h << ", " << c << "]";
        }
        if (high != channel.max().item<float>()) {
          EXPECT_EQ(channel.eq(high).sum().item<int64_t>(), 0) << "layer " << layer << " [" << h << ", " << c << "]";
        }
      }
    }
    // Values: KVQuant's per-token rule over both heads' 256 channels: the 2
    // largest and 2 smallest of each token past the sink, k = 256 -
    // ceil(255 x 0.995) = 2 (no ties within a row in these activations).
    EXPECT_NEAR(lq.stats.value_outlier_fraction, 4.0 / 256, 1e-12) << "layer " << layer;
    // kvforge's variant: |x - mean_t| > tau std_t per token and head, tau
    // fitted to select the requested fraction.
    const LayerQuantizers& vq = tau_variant.layers[static_cast<size_t>(layer)];
    const at::Tensor values = read(ActivationField::kValues, layer);
    const auto v = values.accessor<float, 4>();
    selected = total = 0;
    for (int64_t w = 0; w < kWindows; ++w) {
      for (int64_t h = 0; h < values.size(1); ++h) {
        for (int64_t t = 1; t < kSeqLen; ++t) {
          double mean = 0, var = 0;
          const int64_t dim = values.size(3);
          for (int64_t c = 0; c < dim; ++c) mean += v[w][h][t][c] / static_cast<double>(dim);
          for (int64_t c = 0; c < dim; ++c) var += std::pow(v[w][h][t][c] - mean, 2) / static_cast<double>(dim);
          for (int64_t c = 0; c < dim; ++c) {
            selected += std::abs(v[w][h][t][c] - mean) > vq.values.outlier_tau * std::sqrt(var);
            ++total;
          }
        }
      }
    }
    const double value_share = static_cast<double>(selected) / static_cast<double>(total);
    EXPECT_NEAR(value_share, 0.01, 0.001) << "layer " << layer;
    EXPECT_NEAR(vq.stats.value_outlier_fraction, value_share, 1e-5) << "layer " << layer;
    // Quantized keys and values are worse than nothing but far from useless.
    EXPECT_GT(lq.stats.key_relative_mse, 0);
    EXPECT_LT(lq.stats.key_relative_mse, 0.2);
    EXPECT_LT(lq.stats.value_relative_mse, 0.3);
    EXPECT_GT(lq.stats.logit_relative_mse, 0);
    EXPECT_LT(lq.stats.logit_relative_mse, 0.3);
  }
  ASSERT_EQ(config.effective_bits.size(), 5u);
  EXPECT_EQ(config.effective_bits[3].first, 65536);
}

TEST_F(CapturedStore, QNormIteratedVariantKeepsMeanAndStdOfTheNormalizedData) {
  const QuantizerConfig config = fit_quantizers(*store_, kvforge_variant());
  EXPECT_EQ(config.settings.values.q_norm, QNorm::kIterated);
  EXPECT_TRUE(config.layers[0].values.encode_grid.empty());
  for (int64_t layer = 0; layer < 5; ++layer) {
    const LayerQuantizers& lq = config.layers[static_cast<size_t>(layer)];
    const Normalized keys = normalized_keys(lq.keys, read(ActivationField::kKeysPreRope, layer),
                                            read(ActivationField::kFisherKeys, layer));
    const Normalized values = normalized_values(lq.values, read(ActivationField::kValues, layer),
                                                read(ActivationField::kFisherValues, layer));
    for (const auto& [n, grid, what] : {std::tuple{&keys, &lq.keys.grid, "keys"},
                                        std::tuple{&values, &lq.values.grid, "values"}}) {
      double mean = 0, mean_hat = 0;
      for (const double x : n->values) {
        mean += x;
        mean_hat += reference_level(*grid, x);
      }
      mean /= static_cast<double>(n->values.size());
      mean_hat /= static_cast<double>(n->values.size());
      double var = 0, var_hat = 0;
      for (const double x : n->values) {
        var += (x - mean) * (x - mean);
        var_hat += std::pow(reference_level(*grid, x) - mean_hat, 2);
      }
      const double std = std::sqrt(var / static_cast<double>(n->values.size()));
      const double std_hat = std::sqrt(var_hat / static_cast<double>(n->values.size()));
      EXPECT_NEAR(mean_hat, mean, 1e-3) << what << " layer " << layer;
      EXPECT_NEAR(std_hat, std, 1e-3) << what << " layer " << layer;
    }
  }
}

// The normalized inliers of KVQuant's values (positions past the sink), as
// float64 values written out: per token over both heads' channels, the
// top/bottom outliers dropped, by the row's inlier min and max.
Normalized normalized_values_all_heads(const at::Tensor& values, const at::Tensor& fisher, double fraction) {
  Normalized n;
  const auto v = values.accessor<float, 4>();
  const auto f = fisher.accessor<float, 4>();
  const int64_t heads = values.size(1), dim = values.size(3), width = heads * dim;
  const int64_t k = exact_top_bottom_count(width, std::llround(fraction * 10000));
  for (int64_t w = 0; w < values.size(0); ++w) {
    for (int64_t t = 1; t < values.size(2); ++t) {
      std::vector<double> row;
      for (int64_t i = 0; i < width; ++i) row.push_back(v[w][i / dim][t][i % dim]);
      const std::vector<bool> outlier = reference_top_bottom(row, k);
      double mn = std::numeric_limits<double>::infinity(), mx = -mn;
      for (int64_t i = 0; i < width; ++i) {
        if (outlier[static_cast<size_t>(i)]) continue;
        mn = std::min(mn, row[static_cast<size_t>(i)]);
        mx = std::max(mx, row[static_cast<size_t>(i)]);
      }
      if (!(mx > mn)) continue;
      for (int64_t i = 0; i < width; ++i) {
        if (outlier[static_cast<size_t>(i)]) continue;
        n.values.push_back((row[static_cast<size_t>(i)] - (mn + mx) / 2) / ((mx - mn) / 2));
        n.weights.push_back(f[w][i / dim][t][i % dim]);
      }
    }
  }
  return n;
}

TEST_F(CapturedStore, QNormAffineKeepsTheKmeansCodesAndMatchesMeanAndStd) {
  // KVQuant's default at 2 bits: codes by the k-means levels, dequantized
  // through their affine image.
  const QuantizerConfig config = fit_quantizers(*store_, kvquant());
  EXPECT_EQ(config.settings.keys.q_norm, QNorm::kAffine);
  EXPECT_EQ(config.settings.values.q_norm, QNorm::kAffine);
  for (const int64_t layer : {0, 2, 4}) {
    const LayerQuantizers& lq = config.layers[static_cast<size_t>(layer)];
    const Normalized keys = normalized_keys(lq.keys, read(ActivationField::kKeysPreRope, layer),
                                            read(ActivationField::kFisherKeys, layer));
    const Normalized values = normalized_values_all_heads(read(ActivationField::kValues, layer),
                                                          read(ActivationField::kFisherValues, layer), 0.01);
    for (const auto& [n, q, what] : {std::tuple{&keys, &lq.keys, "keys"}, std::tuple{&values, &lq.values, "values"}}) {
      ASSERT_EQ(q->encode_grid.size(), 4u) << what;
      ASSERT_EQ(q->grid.size(), 4u) << what;
      // grid = a c + b: one a and b for every level (float levels: ~1e-7).
      const double a = (q->grid[3] - q->grid[0]) / (q->encode_grid[3] - q->encode_grid[0]);
      const double b = q->grid[0] - a * q->encode_grid[0];
      EXPECT_GT(a, 0) << what;
      for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(q->grid[i], a * q->encode_grid[i] + b, 1e-6) << what;
      // Fisher-weighted moments (the fit's weighting) of the data and of its
      // dequantized values grid[nearest k-means level].
      double total = 0, mean = 0, mean_hat = 0;
      for (size_t i = 0; i < n->values.size(); ++i) {
        const double x = n->values[i], w = n->weights[i];
        total += w;
        mean += w * x;
        mean_hat += w * q->grid[reference_code(q->encode_grid, x)];
      }
      mean /= total;
      mean_hat /= total;
      double var = 0, var_hat = 0;
      for (size_t i = 0; i < n->values.size(); ++i) {
        const double x = n->values[i], w = n->weights[i];
        var += w * (x - mean) * (x - mean);
        var_hat += w * std::pow(q->grid[reference_code(q->encode_grid, x)] - mean_hat, 2);
      }
      const double std = std::sqrt(var / total), std_hat = std::sqrt(var_hat / total);
      // The map makes them equal in exact arithmetic; the levels are rounded
      // to float (|error| <= 2^-24 |level|, levels within ~2: 1.2e-7) and
      // the fit sees float32 normalized values (relative 6e-8), so the
      // moments agree to a few 1e-7; 2e-6 leaves room for a code flipped
      // exactly at a midpoint by that rounding.
      EXPECT_NEAR(mean_hat, mean, 2e-6) << what << " layer " << layer;
      EXPECT_NEAR(std_hat, std, 2e-6) << what << " layer " << layer;
      // And the simulation encodes by the k-means levels: on the fit set it
      // dequantizes to exactly these grid values (checked element-wise by
      // PaperRules.KvquantValuesTopBottomPerTokenAcrossHeads).
    }
  }
}

TEST_F(CapturedStore, FisherWeightingLowersTheFisherWeightedError) {
  // The per-head tau variant, whose normalized values normalized_values writes out.
  FitOptions weighted = kvforge_variant(), plain = kvforge_variant();
  weighted.q_norm = plain.q_norm = QNorm::kNone;
  plain.fisher = false;
  const QuantizerConfig a = fit_quantizers(*store_, weighted);
  const QuantizerConfig b = fit_quantizers(*store_, plain);
  EXPECT_TRUE(a.settings.fisher_weighted);
  EXPECT_FALSE(b.settings.fisher_weighted);
  double total_a = 0, total_b = 0;
  for (int64_t layer = 0; layer < 5; ++layer) {
    const auto& la = a.layers[static_cast<size_t>(layer)];
    const auto& lb = b.layers[static_cast<size_t>(layer)];
    ASSERT_EQ(la.keys.channel_offset, lb.keys.channel_offset);
    const Normalized keys = normalized_keys(la.keys, read(ActivationField::kKeysPreRope, layer),
                                            read(ActivationField::kFisherKeys, layer));
    const Normalized values = normalized_values(la.values, read(ActivationField::kValues, layer),
                                                read(ActivationField::kFisherValues, layer));
    for (const auto& [n, ga, gb] : {std::tuple{&keys, &la.keys.grid, &lb.keys.grid},
                                    std::tuple{&values, &la.values.grid, &lb.values.grid}}) {
      const double ea = weighted_error(*n, *ga), eb = weighted_error(*n, *gb);
      // The histogram (4096 bins) makes the weighted optimum approximate.
      EXPECT_LE(ea, eb * (1 + 1e-3)) << "layer " << layer;
      total_a += ea;
      total_b += eb;
    }
  }
  EXPECT_LT(total_a, 0.99 * total_b);
}

TEST_F(CapturedStore, PreRopeKeysAreRotatedForTheLogitStatistic) {
  // Nothing quantized (the sink covers the window): the logits of rotated
  // pre-RoPE keys equal those of the stored post-RoPE keys.
  FitOptions options = kvquant();
  options.sink_tokens = kSeqLen - 16;
  const QuantizerConfig config = fit_quantizers(*store_, options);
  FitOptions rtn;
  rtn.sink_tokens = kSeqLen;
  const QuantizerConfig exact = fit_quantizers(*store_, rtn);
  for (const auto& layer : exact.layers) {
    EXPECT_EQ(layer.stats.key_relative_mse, 0.0);
    EXPECT_EQ(layer.stats.logit_relative_mse, 0.0);
  }
  for (const auto& layer : config.layers) {
    // 16 of 512 positions quantized: a small error, the rotation adding none.
    EXPECT_GT(layer.stats.logit_relative_mse, 0);
    EXPECT_LT(layer.stats.logit_relative_mse, 0.02);
  }
  // And a reference: layer 2's logit error computed here with RoPE applied
  // to the simulated keys by the model's rotary embedding.
  const at::Tensor q = read(ActivationField::kQueries, 2);
  const at::Tensor k_post = read(ActivationField::kKeysPostRope, 2);
  const at::Tensor k_hat = quantize_dequantize_keys(config, 2, read(ActivationField::kKeysPreRope, 2)).dequantized;
  const RotaryEmbedding rope(parse_rope_json(store_->layout().model.rope, "store"), 128, c10::Device(c10::kCPU));
  const at::Tensor rotated = RotaryEmbedding::apply(k_hat.to(at::kDouble), rope.tables(0, kSeqLen, at::kDouble));
  double err = 0, ref = 0;
  const at::Tensor causal = at::ones({kSeqLen, kSeqLen}, at::kBool).tril();
  for (int64_t w = 0; w < kWindows; ++w) {
    for (int64_t h = 0; h < 4; ++h) {
      const at::Tensor qh = q[w][h].to(at::kDouble) / std::sqrt(128.0);
      const at::Tensor s = at::matmul(qh, k_post[w][h / 2].to(at::kDouble).t()).masked_select(causal);
      const at::Tensor s_hat = at::matmul(qh, rotated[w][h / 2].t()).masked_select(causal);
      err += (s - s_hat).square().sum().item<double>();
      ref += s.square().sum().item<double>();
    }
  }
  EXPECT_NEAR(config.layers[2].stats.logit_relative_mse, err / ref, 1e-9 * err / ref);
}

TEST_F(CapturedStore, Int2RotClipRatiosMinimizeTheCalibrationError) {
  FitOptions options;
  options.method = QuantMethod::kInt2Rot;
  const QuantizerConfig config = fit_quantizers(*store_, options);
  EXPECT_EQ(config.settings.sink_tokens, 64);
  EXPECT_EQ(config.settings.residual_tokens, 256);
  for (const int64_t layer : {0, 3}) {
    const LayerQuantizers& lq = config.layers[static_cast<size_t>(layer)];
    for (const auto& [field, chosen] : {std::pair{ActivationField::kKeysPostRope, lq.keys.clip_ratio},
                                        std::pair{ActivationField::kValues, lq.values.clip_ratio}}) {
      const at::Tensor x = read(field, layer);
      const auto a = x.accessor<float, 4>();
      double best = std::numeric_limits<double>::infinity(), at_chosen = 0;
      for (int i = 100; i >= 50; --i) {
        const double r = i / 100.0;
        double sse = 0;
        for (int64_t w = 0; w < kWindows; ++w) {
          for (int64_t h = 0; h < 2; ++h) {
            for (int64_t t = 64; t < kSeqLen; ++t) {  // fitting skips the sink only
              double mn = a[w][h][t][0], mx = mn;
              for (int64_t c = 1; c < 128; ++c) {
                mn = std::min<double>(mn, a[w][h][t][c]);
                mx = std::max<double>(mx, a[w][h][t][c]);
              }
              for (int64_t c = 0; c < 128; ++c) {
                sse += std::pow(a[w][h][t][c] - reference_round(a[w][h][t][c], r * mn, r * mx, 2, {}), 2);
              }
            }
          }
        }
        best = std::min(best, sse);
        if (std::abs(r - chosen) < 1e-6) at_chosen = sse;
      }
      EXPECT_LE(at_chosen, best * (1 + 1e-9)) << field_name(field) << " layer " << layer << " clip " << chosen;
      EXPECT_LT(chosen, 1.0f);
    }
    // Quantized positions [64, 256) of each 512-token window; the rest exact.
    EXPECT_EQ(lq.stats.key_outlier_fraction, 0.0);
    EXPECT_GT(lq.stats.key_relative_mse, 0.0);
  }
}

TEST_F(CapturedStore, MaxCalibrationTokensTakesLeadingWholeWindows) {
  // 1100 tokens of 512-token windows: the first 2 windows.
  FitOptions options;
  options.bits = 3;
  options.max_calibration_tokens = 1100;
  const QuantizerConfig config = fit_quantizers(*store_, options);
  const at::Tensor values = read(ActivationField::kValues, 1).narrow(0, 0, 2);
  double err = 0, ref = 0;
  for (int64_t w = 0; w < 2; ++w) {
    Slab slab{2, kSeqLen, 128, {}};
    const at::Tensor window = values[w].to(at::kDouble).contiguous();
    slab.x.assign(window.data_ptr<double>(), window.data_ptr<double>() + window.numel());
    const Reference r = reference_simulation(config.settings, config.settings.values, {}, slab);
    for (size_t i = 0; i < slab.x.size(); ++i) {
      err += std::pow(slab.x[i] - static_cast<double>(static_cast<float>(r.out.x[i])), 2);
      ref += slab.x[i] * slab.x[i];
    }
  }
  EXPECT_NEAR(config.layers[1].stats.value_relative_mse, err / ref, 1e-9);
}

TEST_F(CapturedStore, MissingFieldsAreNamed) {
  // A store of the same model with only k_pre and v.
  const auto dir = testing::scratch_dir("quantizers-fields");
  ActivationStoreLayout layout = store_->layout();
  layout.fields = {ActivationField::kKeysPreRope, ActivationField::kValues};
  layout.provenance.samples = 1;
  layout.provenance.seq_len = 64;
  {
    ActivationStoreWriter writer = ActivationStoreWriter::create(dir / "kv.h5", layout);
    writer.write_tokens(0, 0, std::vector<int32_t>(64, 5));
    for (int64_t layer = 0; layer < 5; ++layer) {
      for (const auto field : layout.fields) {
        const at::Tensor data = read(field, layer)[0].narrow(1, 0, 64).contiguous();
        writer.write(field, layer, 0, {data.data_ptr<float>(), static_cast<size_t>(data.numel())});
      }
    }
    writer.commit_sample(0);
  }
  const ActivationStoreReader small(dir / "kv.h5");
  try {
    fit_quantizers(small, kvquant());
    ADD_FAILURE() << "expected an InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("fisher_k"), std::string::npos) << e.what();
  }
  FitOptions unweighted = kvquant();
  unweighted.fisher = false;
  const QuantizerConfig config = fit_quantizers(small, unweighted);
  EXPECT_EQ(config.layers[0].stats.logit_relative_mse, 0.0);  // no queries: not measured
  EXPECT_GT(config.layers[0].stats.key_relative_mse, 0.0);
  FitOptions rtn;  // post-RoPE keys
  EXPECT_THROW(fit_quantizers(small, rtn), InputError);
  std::filesystem::remove_all(dir);
}

TEST_F(CapturedStore, KiviAndRtnFitNothingAndNeedNoFisher) {
  for (const QuantMethod method : {QuantMethod::kKivi, QuantMethod::kRtn}) {
    FitOptions options;
    options.method = method;
    const QuantizerConfig config = fit_quantizers(*store_, options);
    EXPECT_FALSE(config.settings.keys_pre_rope);
    for (const auto& layer : config.layers) {
      EXPECT_TRUE(layer.keys == TensorQuantizer{});
      EXPECT_TRUE(layer.values == TensorQuantizer{});
      EXPECT_GT(layer.stats.logit_relative_mse, 0.0);
    }
    // Per-channel key groups beat per-token ones on keys with outlier channels.
    if (method == QuantMethod::kKivi) {
      EXPECT_EQ(config.settings.keys.grouping, Grouping::kPerChannelTokens);
      EXPECT_EQ(config.settings.keys.group, 32);
      EXPECT_EQ(config.settings.residual_tokens, 128);
    }
  }
  // KIVI with runtime outliers (an ablation): KVQuant's per-token top/bottom
  // rule by default, k = 128 - ceil(127 x 0.995) = 1 of each token's 128
  // channels each way: 2/128 of the quantized elements.
  FitOptions outliers;
  outliers.method = QuantMethod::kKivi;
  outliers.outlier_fraction = 0.01;
  const QuantizerConfig config = fit_quantizers(*store_, outliers);
  EXPECT_EQ(config.settings.keys.outlier_rule, OutlierRule::kTokenTopBottom);
  EXPECT_EQ(config.settings.keys.residual_rule, ResidualRule::kBlockFlush);
  for (const auto& layer : config.layers) {
    EXPECT_EQ(layer.keys.outlier_tau, 0.0f);
    EXPECT_TRUE(layer.keys.outlier_low.empty());
    EXPECT_NEAR(layer.stats.key_outlier_fraction, 2.0 / 128, 1e-12);
  }
  // The tau variant: tau per token, as kvforge had it.
  outliers.value_outlier_rule = OutlierRule::kTokenTau;
  const QuantizerConfig tau = fit_quantizers(*store_, outliers);
  for (const auto& layer : tau.layers) {
    EXPECT_GT(layer.keys.outlier_tau, 0.0f);
    // Fitted on all 512 positions, measured on the quantized [0, 384).
    EXPECT_NEAR(layer.stats.key_outlier_fraction, 0.01, 0.0025);
  }
  FitOptions bad;
  bad.value_group = 48;
  EXPECT_THROW(fit_quantizers(*store_, bad), std::invalid_argument);
}

// calib's fit runs on the activations' device (kvforge rotate refits on the
// GPU). The device computes the same float64 normalizations and sorts; only
// the order of floating-point sums differs (clip-search errors, moments of
// Q-Norm, the statistics), so parameters agree to a few float32 ulps, clip
// ratios to one candidate step (two candidates whose errors tie within
// rounding may swap), and the statistics to 1e-9 relative (float64 sums of
// ~1e5 terms: n * 2^-52 ~ 2e-11, with room for the cancellation of the
// logit error's difference of keys). Pre-RoPE keys (kvquant) are rotated for
// the logit statistic with RoPE tables made on the device, whose float32
// pow and float64 sin/cos are not correctly rounded (CUDA: up to 2 ulp,
// 2.4e-7 relative in a float32 frequency): the statistic then agrees to
// 1e-6 relative (measured 2e-8 on the H200).
TEST_F(CapturedStore, CudaFitEqualsTheCpuFit) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const ModelConfig model = load_model_config(testing::pyllama_dir());
  const RopeConfig rope = model.rope;
  const auto to_cuda = [](LayerActivations a) {
    for (at::Tensor* t : {&a.keys, &a.values, &a.fisher_keys, &a.fisher_values, &a.queries, &a.keys_post_rope}) {
      if (t->defined()) *t = t->to(c10::Device(c10::kCUDA));
    }
    return a;
  };
  const auto near = [](const Float32Array& a, const Float32Array& b, const std::string& what) {
    ASSERT_EQ(a.values.size(), b.values.size()) << what;
    for (size_t i = 0; i < a.values.size(); ++i) {
      EXPECT_NEAR(a.values[i], b.values[i], 4e-6 * std::max(1.0f, std::abs(a.values[i]))) << what << " [" << i << "]";
    }
  };
  const auto near_grid = [](const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 4e-6) << what << " level " << i;
  };
  std::vector<std::pair<std::string, FitOptions>> cases;
  FitOptions kvquant;
  kvquant.method = QuantMethod::kKvquant;
  cases.emplace_back("kvquant", kvquant);
  FitOptions tau = kvquant;
  tau.value_outlier_rule = OutlierRule::kTokenTau;
  cases.emplace_back("kvquant-tau", tau);
  FitOptions int2;
  int2.method = QuantMethod::kInt2Rot;
  cases.emplace_back("int2-rot", int2);
  for (const auto& [name, options] : cases) {
    const QuantizerSettings settings = resolve_settings(options, model.head_dim);
    const LayerActivations cpu = read_layer_activations(*store_, settings, 1, kWindows, kSeqLen,
                                                        settings.fisher_weighted, true);
    const LayerQuantizers on_cpu = fit_layer(settings, cpu, options, &rope);
    const LayerQuantizers on_gpu = fit_layer(settings, to_cuda(cpu), options, &rope);
    for (const auto& [tensor, a, b] : {std::tuple{"keys", &on_cpu.keys, &on_gpu.keys},
                                       std::tuple{"values", &on_cpu.values, &on_gpu.values}}) {
      const std::string what = name + " " + tensor;
      near(a->channel_offset, b->channel_offset, what + " offset");
      near(a->channel_scale, b->channel_scale, what + " scale");
      near(a->outlier_low, b->outlier_low, what + " outlier_low");
      near(a->outlier_high, b->outlier_high, what + " outlier_high");
      near_grid(a->grid, b->grid, what + " grid");
      near_grid(a->encode_grid, b->encode_grid, what + " encode grid");
      EXPECT_NEAR(a->outlier_tau, b->outlier_tau, 4e-6 * std::max(1.0f, a->outlier_tau)) << what;
      EXPECT_NEAR(a->clip_ratio, b->clip_ratio, 0.0100001) << what;
    }
    const auto relative = [](double a, double b) { return std::abs(a - b) / std::max(std::abs(a), 1e-300); };
    EXPECT_LT(relative(on_cpu.stats.key_relative_mse, on_gpu.stats.key_relative_mse), 1e-9) << name;
    EXPECT_LT(relative(on_cpu.stats.value_relative_mse, on_gpu.stats.value_relative_mse), 1e-9) << name;
    EXPECT_LT(relative(on_cpu.stats.logit_relative_mse, on_gpu.stats.logit_relative_mse),
              settings.keys_pre_rope ? 1e-6 : 1e-9)
        << name;
    EXPECT_EQ(on_cpu.stats.key_outlier_fraction, on_gpu.stats.key_outlier_fraction) << name;
    EXPECT_EQ(on_cpu.stats.value_outlier_fraction, on_gpu.stats.value_outlier_fraction) << name;
  }
}

}  // namespace
}  // namespace kvforge
