// rotation/model_rotation.h end to end on pyllama-16m captures (a small
// slice: the first layers, a few windows, 512 tokens): the int2-rot
// configuration rotated, learned no worse than its base on the validation
// windows per head and better on average, orthogonal, and its terms
// measured again by measure_attention_terms with the float64 simulation.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "calib/kv_rotation.h"
#include "calib/quantizer_fit.h"
#include "rotation/model_rotation.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

std::string quoted(const std::filesystem::path& path) { return "'" + path.string() + "'"; }

// Captures of calib.txt by kvforge capture: 4 windows of 512 positions,
// the fields rotate reads (made once per test binary).
std::filesystem::path calibration_store() {
  static const std::filesystem::path store = [] {
    const std::filesystem::path path = testing::scratch_dir("rotation_model") / "calib.h5";
    const testing::CommandResult result = testing::run_kvforge(
        "capture --quiet --model " + quoted(testing::pyllama_dir()) + " --data " +
        quoted(testing::shared_dir() / "data" / "calib.txt") +
        " --samples 4 --seq-len 512 --fields q,k_pre,k_post,v --out " + quoted(path));
    if (result.exit_code != 0) throw std::runtime_error("capture failed: " + result.stderr_text);
    return path;
  }();
  return store;
}

TEST(RotationModel, Int2RotOnPyllamaLearnsBelowItsBase) {
  const ActivationStoreReader store(calibration_store());
  FitOptions fit;
  fit.method = QuantMethod::kInt2Rot;
  const QuantizerSettings settings = resolve_settings(fit, store.layout().model.head_dim);
  ModelRotationOptions options;
  options.name = "int2-rot-2bit-rot";
  options.max_samples = 4;  // 3 fit windows, 1 validation window
  options.max_tokens = 512;  // past sink 64 and before the 256 residual: 192 quantized tokens
  options.max_layers = 2;
  options.rotation.steps = 30;
  options.rotation.patience = 10;
  const ModelRotation result = rotate_model(store, testing::pyllama_dir(), settings, options);

  ASSERT_EQ(result.rotated.layers.size(), 2u);
  ASSERT_EQ(result.bases.size(), 3u);
  EXPECT_EQ(result.bases[1].name, "int2-rot-2bit-rot-hadamard");
  ASSERT_TRUE(result.rotated.rotation.has_value());
  EXPECT_EQ(result.rotated.rotation->fit_samples, 3);
  EXPECT_EQ(result.rotated.rotation->validation_samples, 1);
  double base = 0, learned = 0;
  for (size_t layer = 0; layer < 2; ++layer) {
    const LayerRotation& r = result.rotated.layers[layer].rotation;
    const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
    EXPECT_LT(orthogonality_error(rotation_matrices(r.keys, RotationForm::kMatrix, 2, 128, f32)), 1e-5);
    EXPECT_LT(orthogonality_error(rotation_matrices(r.values, RotationForm::kMatrix, 2, 128, f32)), 1e-5);
    for (size_t h = 0; h < r.loss.size(); ++h) {
      const HeadRotationLoss& l = r.loss[h];
      std::printf("layer %zu head %zu: key %.4g -> %.4g, value %.4g -> %.4g (learned %d/%d)\n", layer, h, l.key_base,
                  l.key_learned, l.value_base, l.value_learned, static_cast<int>(r.keys.learned[h]),
                  static_cast<int>(r.values.learned[h]));
      // A head keeps learning only where it beat the base on validation, but
      // the losses recorded are after the layer's final refit: its shared
      // clip ratios refitted to every head's kept rotation, and the value
      // loss weighted by the learned keys' probabilities (the base's by the
      // base keys'). So a head's recorded loss is not the one its keep
      // decision saw and may end above its base: by up to 3.8% (layer 0's
      // value head 1 on an AVX2 machine, 2026-12-02; under 2% on the
      // machines before). No per-head bound follows from the fit; this one
      // catches a kept rotation that is grossly worse, the sum below is the
      // claim.
      EXPECT_LE(l.key_learned, l.key_base * 1.1);
      EXPECT_LE(l.value_learned, l.value_base * 1.1);
      base += l.key_base + l.value_base;
      learned += l.key_learned + l.value_learned;
    }
  }
  EXPECT_LT(learned, base);

  // The float64 simulation of the stored rotation on the same windows: the
  // validation window (the 4th) gives the fit's own validation terms up to
  // float32 rounding of the fit's path.
  AttentionTermOptions measure;
  measure.max_samples = 4;
  measure.max_tokens = 512;
  measure.max_layers = 2;
  const std::vector<LayerAttentionTerms> terms =
      measure_attention_terms(store, testing::pyllama_dir(), result.rotated, measure);
  ASSERT_EQ(terms.size(), 2u);
  for (const LayerAttentionTerms& t : terms) {
    ASSERT_EQ(t.key.size(), 2u);
    for (size_t h = 0; h < 2; ++h) {
      EXPECT_GT(t.key[h], 0);
      EXPECT_NEAR(t.key[h], t.key_kl[h] + t.key_output[h], 1e-6 * t.key[h]);  // summed in float32
      EXPECT_GT(t.value[h], 0);
    }
  }
}

}  // namespace
}  // namespace kvforge
