// kvforge calibrate and kvforge inspect as a user runs them.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <bit>
#include <cmath>
#include <map>

#include "formats/activation_store.h"
#include "formats/artifact.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

std::string quoted(const std::filesystem::path& path) { return "'" + path.string() + "'"; }

// One small store shared by the tests of this file (2 windows x 96 tokens).
const std::filesystem::path& calibration_store() {
  static const std::filesystem::path path = [] {
    const auto dir = testing::scratch_dir("calibrate-cli");
    const auto store = dir / "acts.h5";
    const auto result = testing::run_kvforge(
        "capture --quiet --model " + quoted(testing::pyllama_dir()) + " --data " +
        quoted(testing::shared_dir() / "data" / "calib.txt") + " --samples 2 --seq-len 96 --out " + quoted(store));
    if (result.exit_code != 0) throw std::runtime_error("capture failed: " + result.stderr_text);
    return store;
  }();
  return path;
}

TEST(CalibrateCli, EveryMethodIntoOneArtifactThatInspectReads) {
  const auto dir = testing::scratch_dir("calibrate-all");
  const auto artifact_path = dir / "art.h5";
  const auto result = testing::run_kvforge("calibrate --quiet --acts " + quoted(calibration_store()) + " --out " +
                                           quoted(artifact_path) + " --method kvquant,kivi,int2-rot,rtn --bits 2");
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  const Artifact artifact = read_artifact(artifact_path);
  ASSERT_EQ(artifact.configs.size(), 4u);
  EXPECT_EQ(artifact.configs.front().name, "kvquant-2bit");
  EXPECT_EQ(artifact.model, ActivationStoreReader(calibration_store()).layout().model);
  EXPECT_EQ(artifact.calibration.calibration_tokens, 2 * 96);
  EXPECT_NE(artifact.command_line.find("calibrate"), std::string::npos);

  // --append adds a configuration and keeps the others.
  const auto appended = testing::run_kvforge("calibrate --quiet --append --acts " + quoted(calibration_store()) +
                                             " --out " + quoted(artifact_path) +
                                             " --method kvquant --bits 3 --name ablation --no-fisher --uniform");
  ASSERT_EQ(appended.exit_code, 0) << appended.stderr_text;
  const Artifact more = read_artifact(artifact_path);
  ASSERT_EQ(more.configs.size(), 5u);
  EXPECT_EQ(more.configs.back().name, "ablation");
  EXPECT_FALSE(more.configs.back().settings.fisher_weighted);
  EXPECT_FALSE(more.configs.back().settings.keys.non_uniform);

  const auto text = testing::run_kvforge("inspect " + quoted(artifact_path));
  ASSERT_EQ(text.exit_code, 0) << text.stderr_text;
  EXPECT_NE(text.stdout_text.find("kivi-2bit"), std::string::npos);
  EXPECT_NE(text.stdout_text.find("effective bits"), std::string::npos);

  const auto json = testing::run_kvforge("inspect --json " + quoted(artifact_path) + " --acts " + quoted(calibration_store()));
  ASSERT_EQ(json.exit_code, 0) << json.stderr_text;
  const auto summary = nlohmann::json::parse(json.stdout_text);
  ASSERT_EQ(summary.at("configs").size(), 5u);
  const auto& kvquant = summary.at("configs").at(0);
  EXPECT_EQ(kvquant.at("layers").size(), 5u);
  // Measured again on the calibration store itself, the held-out columns
  // reproduce the statistics calibrate recorded.
  double key_outliers = 0, value_outliers = 0;
  for (const auto& layer : kvquant.at("layers")) {
    EXPECT_NEAR(layer.at("heldout").at("key_relative_mse").get<double>(),
                layer.at("calibration").at("key_relative_mse").get<double>(), 1e-9);
    EXPECT_NEAR(layer.at("heldout").at("value_outlier_fraction").get<double>(),
                layer.at("calibration").at("value_outlier_fraction").get<double>(), 1e-9);
    key_outliers += layer.at("heldout").at("key_outlier_fraction").get<double>() / 5;
    value_outliers += layer.at("heldout").at("value_outlier_fraction").get<double>() / 5;
  }
  // Effective bits at the held-out outlier fractions (averaged over layers),
  // by hand at 131,072 tokens: pyllama-16m has 2 KV heads of 128 channels.
  // Keys: sink 1 exact, 2 bits + f_K (16 + 16) + 32/128 per quantized
  // element, 32 bits per channel over the context; values: 2 bits + one
  // scale/offset per token over 256 channels + f_V (16 + 16) + 32/256.
  const auto& held = kvquant.at("heldout_outlier_fraction");
  EXPECT_NEAR(held.at("keys").get<double>(), key_outliers, 1e-12);
  EXPECT_NEAR(held.at("values").get<double>(), value_outliers, 1e-12);
  const double t = 131072, q = (t - 1) / t;
  const double keys = 16 / t + q * (2 + key_outliers * 32 + 32.0 / 128) + 32 / t;
  const double values = 16 / t + q * (2 + 32.0 / 256 + value_outliers * 32 + 32.0 / 256);
  const auto& measured = kvquant.at("effective_bits_heldout");
  ASSERT_EQ(measured.size(), kvquant.at("effective_bits").size());
  EXPECT_EQ(measured.back().at("context").get<int64_t>(), 131072);
  EXPECT_NEAR(measured.back().at("bits").get<double>(), (keys + values) / 2, 1e-12);
  // KVQuant's values take a fixed count per token (k = 2 of 256 each way),
  // so the nominal value side is 4/256 too; the keys' thresholds select
  // about 1% on the data they were fitted on.
  EXPECT_NEAR(value_outliers, 4.0 / 256, 1e-12);
  const auto text_heldout = testing::run_kvforge("inspect " + quoted(artifact_path) + " --acts " + quoted(calibration_store()));
  ASSERT_EQ(text_heldout.exit_code, 0) << text_heldout.stderr_text;
  EXPECT_NE(text_heldout.stdout_text.find("effective bits (held-out outliers"), std::string::npos);
  EXPECT_NE(text_heldout.stdout_text.find("effective bits (nominal outliers)"), std::string::npos);
}

TEST(CalibrateCli, MaxTokensRecordsTheTokensFittedOn) {
  // 150 tokens of 96-token windows: the fit takes 1 whole window, 96 tokens.
  const auto dir = testing::scratch_dir("calibrate-max-tokens");
  const auto artifact_path = dir / "art.h5";
  const auto result = testing::run_kvforge("calibrate --quiet --acts " + quoted(calibration_store()) + " --out " +
                                           quoted(artifact_path) + " --method rtn --max-tokens 150");
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  EXPECT_EQ(read_artifact(artifact_path).calibration.calibration_tokens, 96);
  // More than the store holds: every window.
  ASSERT_EQ(testing::run_kvforge("calibrate --quiet --acts " + quoted(calibration_store()) + " --out " +
                                 quoted(artifact_path) + " --method rtn --max-tokens 100000")
                .exit_code,
            0);
  EXPECT_EQ(read_artifact(artifact_path).calibration.calibration_tokens, 2 * 96);
  // Fewer than a window: that many leading positions of one window.
  ASSERT_EQ(testing::run_kvforge("calibrate --quiet --acts " + quoted(calibration_store()) + " --out " +
                                 quoted(artifact_path) + " --method rtn --max-tokens 40")
                .exit_code,
            0);
  EXPECT_EQ(read_artifact(artifact_path).calibration.calibration_tokens, 40);
}

TEST(CalibrateCli, VariantsAreNamedBesideThePaperDefaults) {
  const auto dir = testing::scratch_dir("calibrate-variants");
  const auto artifact_path = dir / "art.h5";
  const std::string base = "calibrate --quiet --acts " + quoted(calibration_store()) + " --out " + quoted(artifact_path);
  ASSERT_EQ(testing::run_kvforge(base + " --method kvquant,kivi --bits 2").exit_code, 0);
  const auto variants = testing::run_kvforge(base + " --append --method kvquant,kivi --bits 2 --key-window sliding "
                                                    "--value-outliers tau --value-scaling head --q-norm iterated");
  ASSERT_EQ(variants.exit_code, 0) << variants.stderr_text;
  const Artifact artifact = read_artifact(artifact_path);
  std::map<std::string, QuantizerSettings> by_name;
  for (const auto& config : artifact.configs) by_name[config.name] = config.settings;
  ASSERT_EQ(by_name.size(), 4u);
  const auto& kvquant = by_name.at("kvquant-2bit");
  EXPECT_EQ(kvquant.values.grouping, Grouping::kPerTokenAllHeads);
  EXPECT_EQ(kvquant.values.outlier_rule, OutlierRule::kTokenTopBottom);
  EXPECT_EQ(kvquant.values.q_norm, QNorm::kAffine);
  const auto& kvquant_variant = by_name.at("kvquant-2bit-head-scaling-tau-qnorm-iterated");
  EXPECT_EQ(kvquant_variant.values.grouping, Grouping::kPerToken);
  EXPECT_EQ(kvquant_variant.values.outlier_rule, OutlierRule::kTokenTau);
  EXPECT_EQ(kvquant_variant.keys.q_norm, QNorm::kIterated);
  EXPECT_EQ(kvquant_variant.keys.residual_rule, kvquant.keys.residual_rule);  // the key window flag is kivi's
  EXPECT_EQ(by_name.at("kivi-2bit").keys.residual_rule, ResidualRule::kBlockFlush);
  EXPECT_EQ(by_name.at("kivi-2bit-keys-sliding").keys.residual_rule, ResidualRule::kSliding);
  // --help says which is the default and which the variant.
  const auto help = testing::run_kvforge("calibrate --help");
  for (const char* text : {"block_flush (default, KIVI", "sliding (kvforge variant", "top_bottom (default, KVQuant",
                           "tau (kvforge variant", "iterated (kvforge variant"}) {
    EXPECT_NE(help.stdout_text.find(text), std::string::npos) << text << "\n" << help.stdout_text;
  }
  // A variant that cannot run is refused before anything is written.
  const auto bad = testing::run_kvforge("calibrate --quiet --acts " + quoted(calibration_store()) + " --out " +
                                        quoted(dir / "bad.h5") + " --method kivi --residual 0");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.stderr_text.find("block_flush"), std::string::npos) << bad.stderr_text;
  EXPECT_FALSE(std::filesystem::exists(dir / "bad.h5"));
}

// The normalized Sylvester Hadamard matrix of order d (a power of 2) in
// float32: H[i][j] = (-1)^popcount(i & j) / sqrt(d), heads times.
Float32Array hadamard_matrices(int64_t heads, int64_t d) {
  const float entry = static_cast<float>(1 / std::sqrt(static_cast<double>(d)));
  Float32Array out{.shape = {heads, d, d}};
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d; ++i) {
      for (int64_t j = 0; j < d; ++j) out.values.push_back(std::popcount(static_cast<uint64_t>(i & j)) % 2 ? -entry : entry);
    }
  }
  return out;
}

TEST(CalibrateCli, InspectPrintsRotations) {
  const auto dir = testing::scratch_dir("inspect-rotation");
  const auto artifact_path = dir / "art.h5";
  ASSERT_EQ(testing::run_kvforge("calibrate --quiet --acts " + quoted(calibration_store()) + " --out " +
                                 quoted(artifact_path) + " --method rtn")
                .exit_code,
            0);
  Artifact artifact = read_artifact(artifact_path);
  QuantizerConfig rotated = artifact.configs.at(0);
  rotated.name = "rtn-hadamard";
  rotated.rotation = RotationSettings{.keys = RotationForm::kMatrix, .values = RotationForm::kMatrix,
                                      .key_centred = true, .steps = 10, .fit_samples = 2, .validation_samples = 1};
  const int64_t heads = artifact.model.num_kv_heads, d = artifact.model.head_dim;
  for (auto& layer : rotated.layers) {
    layer.rotation.keys = {.matrix = hadamard_matrices(heads, d),
                           .centre = {.shape = {heads, d}, .values = std::vector<float>(heads * d, 0.25f)},
                           .basis = std::vector<RotationBasis>(heads, RotationBasis::kHadamard),
                           .learned = std::vector<bool>(heads, false)};
    layer.rotation.keys.learned[0] = true;
    layer.rotation.values = {.matrix = hadamard_matrices(heads, d),
                             .basis = std::vector<RotationBasis>(heads, RotationBasis::kEigen),
                             .learned = std::vector<bool>(heads, true)};
    layer.rotation.loss.assign(heads, {.key_base = 0.5, .key_learned = 0.25, .value_base = 0.125, .value_learned = 0.0625});
  }
  artifact.configs.push_back(rotated);
  write_artifact(artifact_path, artifact);

  const auto json = testing::run_kvforge("inspect --json " + quoted(artifact_path) + " --acts " + quoted(calibration_store()));
  ASSERT_EQ(json.exit_code, 0) << json.stderr_text;
  const auto summary = nlohmann::json::parse(json.stdout_text);
  EXPECT_TRUE(summary.at("configs").at(0).at("rotation").is_null());
  const auto& config = summary.at("configs").at(1);
  const auto& r = config.at("rotation");
  EXPECT_EQ(r.at("keys_form"), "matrix");
  EXPECT_EQ(r.at("values_form"), "matrix");
  EXPECT_EQ(r.at("key_centred"), true);
  EXPECT_EQ(r.at("steps"), 10);
  ASSERT_EQ(r.at("layers").size(), static_cast<size_t>(artifact.model.num_layers));
  const auto& keys = r.at("layers").at(3).at("keys");
  EXPECT_EQ(keys.at("learned_heads"), 1);
  EXPECT_EQ(r.at("layers").at(3).at("values").at("learned_heads"), heads);
  EXPECT_EQ(r.at("layers").at(3).at("values").at("bases").at(0), "eigen");
  // H^T H = d s^2 I (s = float32(1/sqrt(d))), so ||H^T H - I||_F = |d s^2 - 1| sqrt(d). In float64 each
  // product s^2 is exact and each entry's d-term sum within d u sum|terms| = d u d s^2 ~ d u of exact: the
  // Frobenius norm of those errors over d^2 entries is within d^2 u.
  const double s = static_cast<float>(1 / std::sqrt(static_cast<double>(d)));
  const double expected = std::abs(static_cast<double>(d) * s * s - 1) * std::sqrt(static_cast<double>(d));
  EXPECT_NEAR(keys.at("orthogonality_error").get<double>(), expected, static_cast<double>(d * d) * 0x1p-53);
  const auto& mean = r.at("layers").at(0).at("validation_loss").at("mean");
  EXPECT_EQ(mean.at("key_base"), 0.5);
  EXPECT_EQ(mean.at("value_learned"), 0.0625);
  // Held-out measures of the rotated configuration are taken with its rotation applied (and undone): the
  // same rtn quantizer in the Hadamard basis makes another error than in the model's own.
  ASSERT_TRUE(config.at("layers").at(0).contains("heldout"));
  const auto& plain_heldout = summary.at("configs").at(0).at("layers").at(0).at("heldout");
  const auto& rotated_heldout = config.at("layers").at(0).at("heldout");
  EXPECT_GT(rotated_heldout.at("key_relative_mse").get<double>(), 0.0);
  EXPECT_NE(rotated_heldout.at("key_relative_mse").get<double>(), plain_heldout.at("key_relative_mse").get<double>());
  EXPECT_NE(rotated_heldout.at("value_relative_mse").get<double>(), plain_heldout.at("value_relative_mse").get<double>());

  const auto text = testing::run_kvforge("inspect " + quoted(artifact_path));
  ASSERT_EQ(text.exit_code, 0) << text.stderr_text;
  for (const char* line : {"rotation: keys matrix (centred), values matrix; 10 steps", "hadamard (1/2)", "eigen (2/2)",
                           "K 0.5 -> 0.25, V 0.125 -> 0.0625"}) {
    EXPECT_NE(text.stdout_text.find(line), std::string::npos) << line << "\n" << text.stdout_text;
  }
}

TEST(CalibrateCli, InspectSummarizesAStore) {
  const auto result = testing::run_kvforge("inspect --json " + quoted(calibration_store()));
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  const auto summary = nlohmann::json::parse(result.stdout_text);
  EXPECT_EQ(summary.at("schema"), "kvforge.activations");
  ASSERT_EQ(summary.at("statistics").at("k_pre").size(), 5u);
  const auto& layer1 = summary.at("statistics").at("k_pre").at(1);
  EXPECT_EQ(layer1.at("mean_abs").size(), 256u);  // 2 KV heads x 128
  EXPECT_GT(layer1.at("max_over_median_mean_abs").get<double>(), 2.0);  // the model README: outlier channels
  const auto text = testing::run_kvforge("inspect " + quoted(calibration_store()));
  EXPECT_EQ(text.exit_code, 0);
  EXPECT_NE(text.stdout_text.find("kurtosis"), std::string::npos);
}

TEST(CalibrateCli, MissingFisherFieldsAreNamed) {
  const auto dir = testing::scratch_dir("calibrate-nofisher");
  const auto store = dir / "acts.h5";
  ASSERT_EQ(testing::run_kvforge("capture --quiet --model " + quoted(testing::pyllama_dir()) + " --data " +
                                 quoted(testing::shared_dir() / "data" / "calib.txt") +
                                 " --samples 1 --seq-len 32 --fields q,k_pre,k_post,v --out " + quoted(store))
                .exit_code,
            0);
  const auto result = testing::run_kvforge("calibrate --quiet --acts " + quoted(store) + " --out " +
                                           quoted(dir / "art.h5") + " --method kvquant");
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.stderr_text.find("fisher_k"), std::string::npos) << result.stderr_text;
  EXPECT_FALSE(std::filesystem::exists(dir / "art.h5"));
  // Without Fisher weighting the same store calibrates.
  EXPECT_EQ(testing::run_kvforge("calibrate --quiet --acts " + quoted(store) + " --out " + quoted(dir / "art.h5") +
                                 " --method kvquant --no-fisher")
                .exit_code,
            0);
}

TEST(CalibrateCli, BadFilesAreOneLineErrors) {
  const auto dir = testing::scratch_dir("calibrate-bad");
  testing::write_file(dir / "junk.h5", "not an HDF5 file");
  const auto junk = testing::run_kvforge("inspect --quiet " + quoted(dir / "junk.h5"));
  EXPECT_EQ(junk.exit_code, 2);
  EXPECT_NE(junk.stderr_text.find("junk.h5"), std::string::npos) << junk.stderr_text;

  const auto artifact_path = dir / "art.h5";
  ASSERT_EQ(testing::run_kvforge("calibrate --quiet --acts " + quoted(calibration_store()) + " --out " +
                                 quoted(artifact_path) + " --method rtn")
                .exit_code,
            0);
  const std::string bytes = testing::read_file(artifact_path);
  testing::write_file(dir / "truncated.h5", bytes.substr(0, bytes.size() / 2));
  const auto truncated = testing::run_kvforge("inspect --quiet " + quoted(dir / "truncated.h5"));
  EXPECT_EQ(truncated.exit_code, 2);
  EXPECT_EQ(std::count(truncated.stderr_text.begin(), truncated.stderr_text.end(), '\n'), 1) << truncated.stderr_text;
  EXPECT_NE(truncated.stderr_text.find("truncated.h5"), std::string::npos) << truncated.stderr_text;

  const auto bad_bits = testing::run_kvforge("calibrate --quiet --acts " + quoted(calibration_store()) + " --out " +
                                             quoted(dir / "x.h5") + " --bits 5");
  EXPECT_NE(bad_bits.exit_code, 0);
  EXPECT_FALSE(std::filesystem::exists(dir / "x.h5"));
}

}  // namespace
}  // namespace kvforge
