// rotation/rotation_fit.h on synthetic layers: keys and values with a few
// outlier channels under per-token INT2, where Hadamard beats identity and
// learning beats Hadamard on the validation windows; learned rotations stay
// orthogonal and change nothing where nothing is quantized; keep-if-improves
// falls back to the base when learning cannot help.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "calib/kv_rotation.h"
#include "calib/quantizer_fit.h"
#include "rotation/attention_objective.h"
#include "rotation/rotation_fit.h"

namespace kvforge {
namespace {

const at::TensorOptions kFloat = at::TensorOptions().dtype(at::kFloat);
constexpr int64_t kWindows = 8, kHeads = 4, kKvHeads = 2, kTokens = 96, kDim = 32, kHidden = 64;

// Channels 3 and 17 of keys (and 5 of values) large and offset, as real
// keys' outlier channels: they set every token's INT2 range.
RotationLayerData outlier_layer(uint64_t seed) {
  at::manual_seed(seed);
  RotationLayerData data;
  at::Tensor key_scale = at::ones({kDim}, kFloat), key_offset = at::zeros({kDim}, kFloat);
  key_scale[3] = 8;
  key_offset[3] = 6;
  key_scale[17] = 5;
  key_offset[17] = -4;
  at::Tensor value_scale = at::ones({kDim}, kFloat);
  value_scale[5] = 10;
  data.queries = at::randn({kWindows, kHeads, kTokens, kDim}, kFloat);
  data.keys = at::randn({kWindows, kKvHeads, kTokens, kDim}, kFloat) * key_scale + key_offset;
  data.values = at::randn({kWindows, kKvHeads, kTokens, kDim}, kFloat) * value_scale;
  data.o_proj = at::randn({kHidden, kHeads * kDim}, kFloat) / std::sqrt(static_cast<double>(kHeads * kDim));
  return data;
}

QuantizerSettings per_token_int2() {
  FitOptions fit;
  fit.method = QuantMethod::kRtn;
  return resolve_settings(fit, kDim);  // keys and values per token over the head, no windows
}

RotationOptions quick_options() {
  RotationOptions o;
  o.fixed_bases = {RotationBasis::kIdentity, RotationBasis::kHadamard};
  o.steps = 60;
  o.learning_rate = 5e-3;
  o.last_queries = 32;
  o.patience = 30;
  return o;
}

struct Means {
  double key_base = 0, key_learned = 0, value_base = 0, value_learned = 0;
};
Means means(const LayerQuantizers& q) {
  Means m;
  for (const HeadRotationLoss& l : q.rotation.loss) {
    m.key_base += l.key_base / kKvHeads;
    m.key_learned += l.key_learned / kKvHeads;
    m.value_base += l.value_base / kKvHeads;
    m.value_learned += l.value_learned / kKvHeads;
  }
  return m;
}

at::Tensor key_matrices(const LayerQuantizers& q) {
  return rotation_matrices(q.rotation.keys, RotationForm::kMatrix, kKvHeads, kDim, kFloat);
}
at::Tensor value_matrices(const LayerQuantizers& q) {
  return rotation_matrices(q.rotation.values, RotationForm::kMatrix, kKvHeads, kDim, kFloat);
}

class RotationFitTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_ = new RotationLayerData(outlier_layer(21));
    result_ = new LayerRotationFit(fit_layer_rotation(per_token_int2(), data_->windows_slice(0, 6),
                                                      data_->windows_slice(6, 2), quick_options()));
  }
  static void TearDownTestSuite() {
    delete result_;
    delete data_;
  }
  static RotationLayerData* data_;
  static LayerRotationFit* result_;
};
RotationLayerData* RotationFitTest::data_ = nullptr;
LayerRotationFit* RotationFitTest::result_ = nullptr;

TEST_F(RotationFitTest, HadamardBeatsIdentityAndLearningBeatsHadamard) {
  ASSERT_EQ(result_->bases.size(), 2u);
  const Means identity = means(result_->bases[0].quantizers), hadamard = means(result_->bases[1].quantizers),
              learned = means(result_->learned);
  std::printf("validation key term: identity %.4g hadamard %.4g learned %.4g (%lld steps)\n", identity.key_base,
              hadamard.key_base, learned.key_learned, static_cast<long long>(result_->key_steps));
  std::printf("validation value term: identity %.4g hadamard %.4g learned %.4g (%lld steps)\n", identity.value_base,
              hadamard.value_base, learned.value_learned, static_cast<long long>(result_->value_steps));
  // A base's record is its own loss at base and "learned".
  EXPECT_EQ(identity.key_base, identity.key_learned);
  EXPECT_DOUBLE_EQ(learned.key_base, hadamard.key_base);  // learning started from Hadamard
  EXPECT_LT(hadamard.key_base, identity.key_base);
  EXPECT_LT(hadamard.value_base, identity.value_base);
  EXPECT_LT(learned.key_learned, hadamard.key_base);
  EXPECT_LT(learned.value_learned, hadamard.value_base);
  for (const bool kept : result_->learned.rotation.keys.learned) EXPECT_TRUE(kept);
  // Keys are centred (int2-rot's form) and the bases recorded.
  EXPECT_EQ(result_->learned.rotation.keys.centre.shape, (std::vector<int64_t>{kKvHeads, kDim}));
  EXPECT_EQ(result_->learned.rotation.keys.basis, std::vector<RotationBasis>(kKvHeads, RotationBasis::kHadamard));
}

TEST_F(RotationFitTest, LearnedRotationsAreOrthogonalAndExactWithoutQuantization) {
  const at::Tensor keys = key_matrices(result_->learned), values = value_matrices(result_->learned);
  EXPECT_LT(orthogonality_error(keys), 1e-5);
  EXPECT_LT(orthogonality_error(values), 1e-5);
  // The learned rotation moved away from Hadamard.
  EXPECT_GT((keys - key_matrices(result_->bases[1].quantizers)).abs().max().item<double>(), 1e-3);
  // Settings that quantize nothing (the sink covers the window): rotating,
  // "quantizing" and rotating back must leave attention unchanged.
  QuantizerSettings exact = per_token_int2();
  exact.sink_tokens = kTokens;
  const RotationLayerData validation = data_->windows_slice(6, 2);
  const AttentionObjective objective(validation, 32);
  const at::Tensor centre = rotation_centre(result_->learned.rotation.keys, kKvHeads, kDim, kFloat);
  const at::Tensor k = quantize_through_rotation(exact, exact.keys, result_->learned.keys, validation.keys, keys, centre);
  const at::Tensor v = quantize_through_rotation(exact, exact.values, result_->learned.values, validation.values, values, {});
  // The terms are squared relative errors: sqrt < 1e-5 (float32 rotations
  // of O(10) keys round at ~1e-6 relative).
  EXPECT_LT(std::sqrt(objective.key_terms(k).output.max().item<double>()), 1e-5);
  EXPECT_LT(std::sqrt(objective.value_term(v, objective.exact_probabilities()).max().item<double>()), 1e-5);
}

TEST(RotationFit, FallsBackToTheBaseWhenLearningCannotHelp) {
  const RotationLayerData data = outlier_layer(22);
  for (const double rate : {0.0, 5e-3}) {
    RotationOptions o = quick_options();
    o.fixed_bases = {RotationBasis::kHadamard};
    o.learning_rate = rate;
    o.steps = rate == 0 ? 4 : 0;  // a rate of 0, or no steps
    const LayerRotationFit fit = fit_layer_rotation(per_token_int2(), data.windows_slice(0, 6),
                                                    data.windows_slice(6, 2), o);
    for (const bool kept : fit.learned.rotation.keys.learned) EXPECT_FALSE(kept) << rate;
    for (const bool kept : fit.learned.rotation.values.learned) EXPECT_FALSE(kept) << rate;
    EXPECT_TRUE(at::equal(key_matrices(fit.learned), key_matrices(fit.bases[0].quantizers)));
    EXPECT_TRUE(at::equal(value_matrices(fit.learned), value_matrices(fit.bases[0].quantizers)));
    for (const HeadRotationLoss& l : fit.learned.rotation.loss) {
      EXPECT_EQ(l.key_learned, l.key_base);
      EXPECT_EQ(l.value_learned, l.value_base);
    }
  }
}

TEST(RotationFit, PreRopeKeysLearnPairAngles) {
  RotationLayerData data = outlier_layer(23);
  data.rope = RopeConfig{};
  FitOptions fit;
  fit.method = QuantMethod::kKvquant;
  fit.fisher = false;
  QuantizerSettings settings = resolve_settings(fit, kDim);
  RotationOptions o = quick_options();
  o.key_basis = RotationBasis::kIdentity;
  o.steps = 8;  // kvquant's refits (k-means grids) dominate: keep the test short
  o.refit_interval = 4;
  o.refit = fit;
  const LayerRotationFit result =
      fit_layer_rotation(settings, data.windows_slice(0, 6), data.windows_slice(6, 2), o);
  const TensorRotation& keys = result.learned.rotation.keys;
  EXPECT_TRUE(keys.matrix.empty());
  EXPECT_TRUE(keys.centre.empty());  // pair angles take no centre
  ASSERT_EQ(keys.angles.shape, (std::vector<int64_t>{kKvHeads, kDim / 2}));
  for (const HeadRotationLoss& l : result.learned.rotation.loss) {
    EXPECT_TRUE(std::isfinite(l.key_learned));
    EXPECT_TRUE(std::isfinite(l.value_learned));
  }
  // Every fixed base keeps pre-RoPE keys unrotated (angles 0).
  for (const BaseRotation& b : result.bases) {
    for (const float angle : b.quantizers.rotation.keys.angles.values) EXPECT_EQ(angle, 0.0f);
  }
  std::printf("kvquant-like: key term %.4g -> %.4g, value term %.4g -> %.4g\n", means(result.learned).key_base,
              means(result.learned).key_learned, means(result.learned).value_base, means(result.learned).value_learned);
}

}  // namespace
}  // namespace kvforge

namespace kvforge {
namespace {

// The whole layer fit on the GPU: the same conclusions as on the CPU
// (Hadamard below identity, learned below Hadamard, orthogonal), and the
// fixed bases' validation losses equal to the CPU's up to float32 rounding
// of the rotated data (the quantizer refits run on the host in both cases;
// 2% allows a clip ratio one grid step away where two candidates tie).
TEST(RotationFit, CudaReachesTheCpuResults) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const RotationLayerData data = outlier_layer(21);
  RotationOptions cpu_options = quick_options(), gpu_options = quick_options();
  gpu_options.device = at::Device(at::kCUDA);
  const LayerRotationFit cpu =
      fit_layer_rotation(per_token_int2(), data.windows_slice(0, 6), data.windows_slice(6, 2), cpu_options);
  const RotationLayerData on_gpu = data.to(gpu_options.device, at::kFloat);
  const LayerRotationFit gpu =
      fit_layer_rotation(per_token_int2(), on_gpu.windows_slice(0, 6), on_gpu.windows_slice(6, 2), gpu_options);
  const Means identity = means(gpu.bases[0].quantizers), hadamard = means(gpu.bases[1].quantizers),
              learned = means(gpu.learned);
  EXPECT_LT(hadamard.key_base, identity.key_base);
  EXPECT_LT(learned.key_learned, hadamard.key_base);
  EXPECT_LT(learned.value_learned, hadamard.value_base);
  EXPECT_LT(orthogonality_error(key_matrices(gpu.learned)), 1e-5);
  EXPECT_LT(orthogonality_error(value_matrices(gpu.learned)), 1e-5);
  for (size_t b = 0; b < 2; ++b) {
    const Means c = means(cpu.bases[b].quantizers), g = means(gpu.bases[b].quantizers);
    EXPECT_NEAR(g.key_base, c.key_base, 0.02 * c.key_base) << b;
    EXPECT_NEAR(g.value_base, c.value_base, 0.02 * c.value_base) << b;
  }
}

}  // namespace
}  // namespace kvforge
