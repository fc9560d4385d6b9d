// calib/kv_rotation and the rotated simulation (formats/kv_rotation.h states
// the arithmetic): pair-angle matrices against an explicit float64
// construction, their commuting with RoPE (and a full matrix's not), rotate
// and unrotate with GQA sharing against a loop over heads, the orthogonality
// error on an analytic case, and quantize_dequantize_keys/values of rotated
// configurations against a float64 reference built here from
// simulate_quantization (rotate by hand, quantize, rotate back, add the centre).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "calib/kv_rotation.h"
#include "calib/quantize_simulation.h"
#include "calib/quantizer_fit.h"
#include "model/rope.h"

namespace kvforge {
namespace {

constexpr double kUnitRoundoff = 0x1p-53;  // float64
const at::TensorOptions kDouble = at::TensorOptions().dtype(at::kDouble);

double max_abs(const at::Tensor& t) { return t.abs().max().item<double>(); }

// A random orthogonal [heads, D, D] (QR of a Gaussian), float64.
at::Tensor random_orthogonal(int64_t heads, int64_t d) {
  return std::get<0>(at::linalg_qr(at::randn({heads, d, d}, kDouble)));
}

Float32Array float32_array(const at::Tensor& t) {
  const at::Tensor f = t.to(at::kFloat).contiguous();
  return {.shape = f.sizes().vec(), .values = std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel())};
}

// --- pair-angle matrices -------------------------------------------------------

// R[j][j] = R[j+P][j+P] = cos, R[j][j+P] = sin, R[j+P][j] = -sin, built entry by entry.
TEST(KvRotation, PairRotationMatricesMatchAnExplicitConstruction) {
  at::manual_seed(1);
  const int64_t heads = 3, d = 8, pairs = d / 2;
  const at::Tensor angles = at::rand({heads, pairs}, kDouble) * 6.4 - 3.2;
  const at::Tensor matrices = pair_rotation_matrices(angles);
  ASSERT_EQ(matrices.sizes().vec(), (std::vector<int64_t>{heads, d, d}));
  at::Tensor expected = at::zeros({heads, d, d}, kDouble);
  auto a = angles.accessor<double, 2>();
  auto e = expected.accessor<double, 3>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t j = 0; j < pairs; ++j) {
      e[h][j][j] = e[h][j + pairs][j + pairs] = std::cos(a[h][j]);
      e[h][j][j + pairs] = std::sin(a[h][j]);
      e[h][j + pairs][j] = -std::sin(a[h][j]);
    }
  }
  // at::cos and std::cos each within an ulp or so of the true value (|value| <= 1): 4 u apart at most.
  EXPECT_LE(max_abs(matrices - expected), 4 * kUnitRoundoff);

  // And x' = x R is the rotation formats/kv_rotation.h writes out per pair.
  const at::Tensor x = at::randn({heads, 1, d}, kDouble);
  const at::Tensor rotated = at::matmul(x, matrices);
  auto xs = x.accessor<double, 3>();
  auto r = rotated.accessor<double, 3>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t j = 0; j < pairs; ++j) {
      const double c = std::cos(a[h][j]), s = std::sin(a[h][j]);
      const double bound = 8 * kUnitRoundoff * (std::abs(xs[h][0][j]) + std::abs(xs[h][0][j + pairs]));
      EXPECT_NEAR(r[h][0][j], xs[h][0][j] * c - xs[h][0][j + pairs] * s, bound) << h << " " << j;
      EXPECT_NEAR(r[h][0][j + pairs], xs[h][0][j] * s + xs[h][0][j + pairs] * c, bound) << h << " " << j;
    }
  }
}

// RoPE(q R) . RoPE(k R) = RoPE(q) . RoPE(k) for pair-angle R: RoPE rotates
// the same pairs, and rotations of one plane commute. A full orthogonal
// matrix does not: the control shows the comparison can fail.
TEST(KvRotation, PairAnglesCommuteWithRope) {
  at::manual_seed(2);
  const int64_t heads = 2, tokens = 12, d = 16;
  const RotaryEmbedding rope(RopeConfig{}, d, c10::Device(c10::kCPU));
  const RopeTables tables = rope.tables(0, tokens, at::kDouble);
  const at::Tensor q = at::randn({1, heads, tokens, d}, kDouble);
  const at::Tensor k = at::randn({1, heads, tokens, d}, kDouble);
  auto scores = [&](const at::Tensor& matrices) {
    const at::Tensor qr = RotaryEmbedding::apply(rotate(q, matrices), tables);
    const at::Tensor kr = RotaryEmbedding::apply(rotate(k, matrices), tables);
    return at::matmul(qr, kr.transpose(-1, -2));
  };
  const at::Tensor reference =
      at::matmul(RotaryEmbedding::apply(q, tables), RotaryEmbedding::apply(k, tables).transpose(-1, -2));
  // Each score is a D-term dot of values each a few roundings from exact
  // (rotation: D terms, RoPE: 2): |error| <= c D u ||q|| ||k||, c = 8 generous.
  const double norms = (q.norm(2, -1).max() * k.norm(2, -1).max()).item<double>();
  const double tolerance = 8 * static_cast<double>(d) * kUnitRoundoff * norms;

  const at::Tensor pair = pair_rotation_matrices(at::rand({heads, d / 2}, kDouble) * 6.28);
  EXPECT_LE(max_abs(scores(pair) - reference), tolerance);
  // Elementwise too: RoPE(x R) = RoPE(x) R.
  EXPECT_LE(max_abs(RotaryEmbedding::apply(rotate(k, pair), tables) - rotate(RotaryEmbedding::apply(k, tables), pair)),
            tolerance);

  EXPECT_GT(max_abs(scores(random_orthogonal(heads, d)) - reference), 1e6 * tolerance);
}

// --- rotate and unrotate ---------------------------------------------------------

TEST(KvRotation, RotateAndUnrotateShareAKvHeadsMatrixAcrossItsQueryHeads) {
  at::manual_seed(3);
  const int64_t batch = 2, kv_heads = 2, group = 3, tokens = 5, d = 8;
  const at::Tensor matrices = at::randn({kv_heads, d, d}, kDouble);  // any matrices: the mapping is what is tested
  const at::Tensor x = at::randn({batch, kv_heads * group, tokens, d}, kDouble);
  const at::Tensor rotated = rotate(x, matrices), unrotated = unrotate(x, matrices);
  ASSERT_EQ(rotated.sizes(), x.sizes());
  const double tolerance = 4 * static_cast<double>(d) * kUnitRoundoff * max_abs(x) * max_abs(matrices) * d;
  for (int64_t g = 0; g < kv_heads * group; ++g) {
    const at::Tensor m = matrices[g / group];  // query head g belongs to KV head g / group
    const at::Tensor xg = x.select(1, g);
    EXPECT_LE(max_abs(rotated.select(1, g) - at::matmul(xg, m)), tolerance) << g;
    EXPECT_LE(max_abs(unrotated.select(1, g) - at::matmul(xg, m.transpose(0, 1))), tolerance) << g;
  }
  // One matrix per head: heads == kv_heads.
  const at::Tensor y = at::randn({batch, kv_heads, tokens, d}, kDouble);
  const at::Tensor orthogonal = random_orthogonal(kv_heads, d);
  EXPECT_LE(max_abs(unrotate(rotate(y, orthogonal), orthogonal) - y), 8 * d * kUnitRoundoff * max_abs(y) * d);
  EXPECT_THROW(rotate(at::randn({1, 3, tokens, d}, kDouble), matrices), std::invalid_argument);  // 3 heads, 2 KV heads
}

TEST(KvRotation, OrthogonalityErrorOfScaledIdentities) {
  // ||(s I)^T (s I) - I||_F = |s^2 - 1| sqrt(D): 0 for s = 1, 1.25 * 2 = 2.5 for s = 1.5 at D = 4; the largest head.
  const at::Tensor eye = at::eye(4, kDouble);
  EXPECT_EQ(orthogonality_error(at::stack({eye, eye})), 0.0);
  EXPECT_DOUBLE_EQ(orthogonality_error(at::stack({eye, 1.5 * eye})), 2.5);
  EXPECT_DOUBLE_EQ(orthogonality_error(at::stack({0.5 * eye, eye})), 1.5);  // |0.25 - 1| * 2
  EXPECT_LE(orthogonality_error(random_orthogonal(3, 16)), 16 * 16 * kUnitRoundoff * 4);
}

// --- the rotated simulation against a float64 reference ---------------------------

constexpr int64_t kKvHeads = 2, kHeadDim = 8, kTokens = 24;

// RTN-like per-token 2-bit quantization of keys and values (clip 0.9), with
// a sink and a residual window so that exact tokens pass through rotated and back.
QuantizerConfig plain_config() {
  QuantizerConfig config{.name = "rotated"};
  config.settings = {.method = QuantMethod::kInt2Rot,
                     .bits = 2,
                     .keys = {.grouping = Grouping::kPerToken, .group = 4},
                     .values = {.grouping = Grouping::kPerToken, .group = kHeadDim},
                     .sink_tokens = 2,
                     .residual_tokens = 3};
  LayerQuantizers layer;
  layer.keys.clip_ratio = 0.9f;
  layer.values.clip_ratio = 0.95f;
  config.layers = {layer};
  return config;
}

// x [..., heads, T, D] times float32-stored matrices, by a loop over heads in float64.
at::Tensor by_head(const at::Tensor& x, const at::Tensor& matrices, bool transpose) {
  std::vector<at::Tensor> heads;
  for (int64_t h = 0; h < x.size(-3); ++h) {
    const at::Tensor m = matrices[h].to(at::kDouble);
    heads.push_back(at::matmul(x.select(-3, h), transpose ? m.transpose(0, 1) : m));
  }
  return at::stack(heads, -3);
}

struct Reference {
  at::Tensor dequantized, outliers;
};

// quantize(x' = (x - c) R) rotated back: x'^ R^T + c, all in float64.
Reference rotated_reference(const QuantizerConfig& config, const TensorQuantizerSettings& tensor,
                            const TensorQuantizer& quantizer, const at::Tensor& matrices, const at::Tensor& centre,
                            const at::Tensor& x) {
  at::Tensor shifted = x.to(at::kDouble);
  if (centre.defined()) shifted = shifted - centre.to(at::kDouble).unsqueeze(1);
  const SimulatedTensor q = simulate_quantization(config.settings, tensor, quantizer, by_head(shifted, matrices, false));
  at::Tensor back = by_head(q.dequantized.to(at::kDouble), matrices, true);
  if (centre.defined()) back = back + centre.to(at::kDouble).unsqueeze(1);
  return {back, q.outliers};
}

// Rotations differ from the reference's by summation order only (float64, D
// terms): far below the 2-bit step, so every code is the same and the results
// agree to a few D u of the values' size.
double simulation_tolerance(const at::Tensor& x) {
  return 16 * static_cast<double>(kHeadDim) * kUnitRoundoff * (max_abs(x) + 1);
}

TEST(KvRotation, RotatedKeysAndValuesMatchAFloat64Reference) {
  at::manual_seed(4);
  QuantizerConfig config = plain_config();
  config.rotation = RotationSettings{.keys = RotationForm::kMatrix, .values = RotationForm::kMatrix, .key_centred = true};
  const at::Tensor key_matrices = random_orthogonal(kKvHeads, kHeadDim).to(at::kFloat);
  const at::Tensor value_matrices = random_orthogonal(kKvHeads, kHeadDim).to(at::kFloat);
  const at::Tensor centre = at::randn({kKvHeads, kHeadDim}).mul(3);
  LayerRotation& rotation = config.layers[0].rotation;
  rotation.keys = {.matrix = float32_array(key_matrices), .centre = float32_array(centre)};
  rotation.values = {.matrix = float32_array(value_matrices)};

  // Keys with a large offset per channel: what the centre is for.
  const at::Tensor keys = (at::randn({2, kKvHeads, kTokens, kHeadDim}, kDouble) + 5 * centre.to(at::kDouble).unsqueeze(1));
  const at::Tensor values = at::randn({2, kKvHeads, kTokens, kHeadDim}, kDouble);
  const SimulatedTensor k = quantize_dequantize_keys(config, 0, keys);
  const SimulatedTensor v = quantize_dequantize_values(config, 0, values);
  const Reference k_ref =
      rotated_reference(config, config.settings.keys, config.layers[0].keys, key_matrices, centre, keys);
  const Reference v_ref =
      rotated_reference(config, config.settings.values, config.layers[0].values, value_matrices, {}, values);
  EXPECT_LE(max_abs(k.dequantized - k_ref.dequantized), simulation_tolerance(keys));
  EXPECT_LE(max_abs(v.dequantized - v_ref.dequantized), simulation_tolerance(values));
  EXPECT_TRUE(at::equal(k.outliers, k_ref.outliers));
  // The sink and residual tokens come back as they were, up to the float32
  // matrices' distance from orthogonal: (k - c) R R^T + c - k = (k - c)(R R^T - I),
  // at most ||k - c||_2 ||R^T R - I||_F.
  const double orthogonality = orthogonality_error(key_matrices);
  const double largest_row = (keys - centre.to(at::kDouble).unsqueeze(1)).norm(2, -1).max().item<double>();
  for (const int64_t t : {int64_t{0}, int64_t{1}, kTokens - 3, kTokens - 1}) {
    EXPECT_LE(max_abs(k.dequantized.select(-2, t) - keys.select(-2, t)),
              largest_row * orthogonality + simulation_tolerance(keys))
        << t;
  }
  // The rotation changed what was quantized: without it the result differs.
  QuantizerConfig unrotated = plain_config();
  EXPECT_GT(max_abs(quantize_dequantize_keys(unrotated, 0, keys).dequantized - k.dequantized), 1e-3);
}

// measure_layer of a whole configuration takes its measures with the
// rotation applied and undone: its key and value errors are those of the
// float64 reference above, measured by hand.
TEST(KvRotation, MeasureLayerOfARotatedConfigurationUsesTheRotation) {
  at::manual_seed(5);
  QuantizerConfig config = plain_config();
  config.rotation = RotationSettings{.keys = RotationForm::kMatrix, .values = RotationForm::kMatrix};
  const at::Tensor key_matrices = random_orthogonal(kKvHeads, kHeadDim).to(at::kFloat);
  const at::Tensor value_matrices = random_orthogonal(kKvHeads, kHeadDim).to(at::kFloat);
  config.layers[0].rotation.keys = {.matrix = float32_array(key_matrices)};
  config.layers[0].rotation.values = {.matrix = float32_array(value_matrices)};
  LayerActivations activations;
  activations.keys = at::randn({2, kKvHeads, kTokens, kHeadDim}, kDouble);
  activations.values = at::randn({2, kKvHeads, kTokens, kHeadDim}, kDouble);
  const LayerCalibrationStats stats = measure_layer(config, 0, activations, nullptr);
  const auto relative = [](const at::Tensor& x, const at::Tensor& y) {
    return (x - y).pow(2).sum().item<double>() / x.pow(2).sum().item<double>();
  };
  const Reference k = rotated_reference(config, config.settings.keys, config.layers[0].keys, key_matrices, {},
                                        activations.keys);
  const Reference v = rotated_reference(config, config.settings.values, config.layers[0].values, value_matrices, {},
                                        activations.values);
  // The same codes; values within simulation_tolerance (~1e-14 here) of each
  // other, so the relative errors (~0.1) agree to ~1e-12.
  EXPECT_NEAR(stats.key_relative_mse, relative(activations.keys, k.dequantized), 1e-10);
  EXPECT_NEAR(stats.value_relative_mse, relative(activations.values, v.dequantized), 1e-10);
  // Not the unrotated configuration's measures.
  const LayerCalibrationStats plain = measure_layer(config.settings, config.layers[0], activations, nullptr);
  EXPECT_GT(std::abs(plain.key_relative_mse - stats.key_relative_mse), 1e-4);
}

// Pre-RoPE keys rotated within their RoPE pairs: the reference builds R from
// the angles entry by entry.
TEST(KvRotation, PairAngleKeysMatchAFloat64Reference) {
  at::manual_seed(5);
  QuantizerConfig config = plain_config();
  config.settings.keys_pre_rope = true;
  config.rotation = RotationSettings{.keys = RotationForm::kPairAngles};
  const at::Tensor angles = (at::rand({kKvHeads, kHeadDim / 2}) * 6.28 - 3.14);
  config.layers[0].rotation.keys = {.angles = float32_array(angles)};
  at::Tensor matrices = at::zeros({kKvHeads, kHeadDim, kHeadDim}, kDouble);
  const int64_t pairs = kHeadDim / 2;
  auto a = angles.accessor<float, 2>();
  auto m = matrices.accessor<double, 3>();
  for (int64_t h = 0; h < kKvHeads; ++h) {
    for (int64_t j = 0; j < pairs; ++j) {
      const double theta = a[h][j];
      m[h][j][j] = m[h][j + pairs][j + pairs] = std::cos(theta);
      m[h][j][j + pairs] = std::sin(theta);
      m[h][j + pairs][j] = -std::sin(theta);
    }
  }
  const at::Tensor keys = at::randn({1, kKvHeads, kTokens, kHeadDim}, kDouble);
  const SimulatedTensor k = quantize_dequantize_keys(config, 0, keys);
  const Reference ref = rotated_reference(config, config.settings.keys, config.layers[0].keys, matrices, {}, keys);
  EXPECT_LE(max_abs(k.dequantized - ref.dequantized), simulation_tolerance(keys));
  // Values are not rotated in this configuration: exactly the unrotated simulation.
  const at::Tensor values = at::randn({1, kKvHeads, kTokens, kHeadDim}, kDouble);
  EXPECT_TRUE(at::equal(quantize_dequantize_values(config, 0, values).dequantized,
                        simulate_quantization(config.settings, config.settings.values, config.layers[0].values, values)
                            .dequantized));
}

// A rotation by the identity (a matrix, or zero angles) changes nothing: x I
// and x' I^T are exact in float64, so the results are bit for bit the
// unrotated configuration's, in the input's dtype.
TEST(KvRotation, IdentityRotationEqualsTheUnrotatedConfigurationExactly) {
  at::manual_seed(6);
  const QuantizerConfig unrotated = plain_config();
  const at::Tensor eye = at::eye(kHeadDim).expand({kKvHeads, kHeadDim, kHeadDim});
  QuantizerConfig matrix = plain_config();
  matrix.rotation = RotationSettings{.keys = RotationForm::kMatrix, .values = RotationForm::kMatrix};
  matrix.layers[0].rotation.keys = {.matrix = float32_array(eye)};
  matrix.layers[0].rotation.values = {.matrix = float32_array(eye)};
  QuantizerConfig angles = plain_config();
  angles.rotation = RotationSettings{.keys = RotationForm::kPairAngles};
  angles.layers[0].rotation.keys = {.angles = float32_array(at::zeros({kKvHeads, kHeadDim / 2}))};
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    const at::Tensor keys = at::randn({2, kKvHeads, kTokens, kHeadDim}).to(dtype);
    const at::Tensor values = at::randn({2, kKvHeads, kTokens, kHeadDim}).to(dtype);
    const SimulatedTensor k = quantize_dequantize_keys(unrotated, 0, keys);
    const SimulatedTensor v = quantize_dequantize_values(unrotated, 0, values);
    for (const QuantizerConfig* config : {&matrix, &angles}) {
      const SimulatedTensor kr = quantize_dequantize_keys(*config, 0, keys);
      EXPECT_EQ(kr.dequantized.scalar_type(), dtype);
      EXPECT_TRUE(at::equal(kr.dequantized, k.dequantized)) << max_abs(kr.dequantized - k.dequantized);
      EXPECT_TRUE(at::equal(kr.outliers, k.outliers));
      EXPECT_TRUE(at::equal(quantize_dequantize_values(*config, 0, values).dequantized, v.dequantized));
    }
  }
}

}  // namespace
}  // namespace kvforge
