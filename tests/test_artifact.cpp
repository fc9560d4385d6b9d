// The calibration artifact: a round trip of configurations of all four
// methods and of rotated ones (matrix keys with a centre and matrix values;
// pair-angle keys), refusal to write degenerate parameters (leaving no file behind),
// refusal of corrupt files crafted with the HDF5 C API (each naming the
// object), the model check, and an independent h5py reader
// (tests/check_artifact.py) that must agree with ours.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "formats/artifact.h"
#include "formats/input_error.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

namespace fs = std::filesystem;
using testing::read_file;
using testing::scratch_dir;
using testing::write_file;

// --- a plausible artifact --------------------------------------------------------

constexpr int64_t kLayers = 2, kKvHeads = 2, kHeadDim = 8;

ModelFingerprint small_model() {
  return {.architecture = "LlamaForCausalLM",
          .num_layers = kLayers,
          .num_heads = 4,
          .num_kv_heads = kKvHeads,
          .head_dim = kHeadDim,
          .hidden_size = 32,
          .vocab_size = 1000,
          .rope = R"({"theta":10000.0,"type":"default"})",
          .kvo_sha256 = std::string(64, 'a'),
          .tokenizer_sha256 = std::string(64, 'b')};
}

CaptureProvenance capture(const std::string& data_file, uint64_t seed) {
  return {.data_file = data_file,
          .data_sha256 = std::string(64, 'c'),
          .data_tokens = 50000,
          .samples = 16,
          .seq_len = 2048,
          .seed = seed,
          .bos = true,
          .compute_dtype = "bf16",
          .device = "cuda",
          .tool_version = "0.1.0",
          .command_line = "kvforge capture --samples 16"};
}

// A fitted-looking grid: 2^bits ascending levels in [-1, 1], different per salt.
std::vector<float> make_grid(int bits, std::mt19937& rng) {
  std::uniform_real_distribution<float> jitter(-0.05f, 0.05f);
  const int levels = 1 << bits;
  std::vector<float> grid;
  for (int k = 0; k < levels; ++k) grid.push_back(-0.9f + 1.8f * static_cast<float>(k) / (levels - 1) + jitter(rng));
  return grid;
}

Float32Array head_array(std::vector<float> values) {
  return {.shape = {kKvHeads, kHeadDim}, .values = std::move(values)};
}

// KVQuant keys: thresholds per channel, and the scale/offset mapping [low, high] onto [-1, 1].
TensorQuantizer kvquant_keys(int bits, std::mt19937& rng) {
  std::uniform_real_distribution<float> center(-0.5f, 0.5f), spread(0.5f, 3.0f);
  std::vector<float> low, high, scale, offset;
  for (int64_t i = 0; i < kKvHeads * kHeadDim; ++i) {
    const float c = center(rng), r = spread(rng);
    low.push_back(c - r);
    high.push_back(c + r);
    scale.push_back((high.back() - low.back()) / 2);
    offset.push_back((high.back() + low.back()) / 2);
  }
  TensorQuantizer q;
  q.grid = make_grid(bits, rng);
  q.channel_scale = head_array(scale);
  q.channel_offset = head_array(offset);
  q.outlier_low = head_array(low);
  q.outlier_high = head_array(high);
  return q;
}

// Q-Norm affine: the k-means levels stay for encoding, the stored grid is their affine image.
void make_affine(TensorQuantizer& q, float a, float b) {
  q.encode_grid = q.grid;
  for (float& level : q.grid) level = a * level + b;
}

LayerCalibrationStats make_stats(std::mt19937& rng, double key_outliers, double value_outliers) {
  std::uniform_real_distribution<double> mse(0.01, 0.2);
  return {.key_relative_mse = mse(rng),
          .value_relative_mse = mse(rng),
          .key_outlier_fraction = key_outliers,
          .value_outlier_fraction = value_outliers,
          .logit_relative_mse = mse(rng) / 10};
}

// KVQuant's recipe at 2 bits: per-channel pre-RoPE keys with offline
// thresholds, per-token values over all KV heads with top/bottom outliers,
// Q-Norm affine on both grids.
QuantizerConfig kvquant_config(std::mt19937& rng) {
  QuantizerConfig config{.name = "kvquant"};
  auto& s = config.settings;
  s.method = QuantMethod::kKvquant;
  s.bits = 2;
  s.keys_pre_rope = true;
  s.keys = {.grouping = Grouping::kPerChannelOffline,
            .group = 0,  // unused
            .non_uniform = true,
            .outlier_fraction = 0.01,
            .outlier_rule = OutlierRule::kChannelThresholds,
            .q_norm = QNorm::kAffine};
  s.values = {.grouping = Grouping::kPerTokenAllHeads,
              .group = 0,  // unused
              .non_uniform = true,
              .outlier_fraction = 0.01,
              .outlier_rule = OutlierRule::kTokenTopBottom,
              .q_norm = QNorm::kAffine};
  s.sink_tokens = 1;
  s.fisher_weighted = true;
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    LayerQuantizers l;
    l.keys = kvquant_keys(s.bits, rng);
    make_affine(l.keys, 0.93f, 0.011f * static_cast<float>(layer + 1));
    l.values.grid = make_grid(s.bits, rng);
    make_affine(l.values, 1.04f, -0.02f);
    l.stats = make_stats(rng, 0.0101, 0.125);
    config.layers.push_back(l);
  }
  // docs/artifact.md's counting at Hkv = 2, D = 8 (values: n = 16, k = 1, f_eff = 2/16; metadata weighs a lot
  // at so small a model).
  config.effective_bits = {{4096, 8.1658203125}, {32768, 8.1607275390625}, {131072, 8.160181884765626}};
  return config;
}

// kvforge's named variants of KVQuant at 3 bits: Q-Norm iterated (no
// encode_grid), values per token and head with the tau rule.
QuantizerConfig kvquant_variants_config(std::mt19937& rng) {
  QuantizerConfig config{.name = "kvquant-variants"};
  auto& s = config.settings;
  s.method = QuantMethod::kKvquant;
  s.bits = 3;
  s.keys_pre_rope = true;
  s.keys = {.grouping = Grouping::kPerChannelOffline,
            .group = 0,
            .non_uniform = true,
            .outlier_fraction = 0.01,
            .outlier_rule = OutlierRule::kChannelThresholds,
            .q_norm = QNorm::kIterated};
  s.values = {.grouping = Grouping::kPerToken,
              .group = kHeadDim,
              .non_uniform = true,
              .outlier_fraction = 0.01,
              .outlier_rule = OutlierRule::kTokenTau,
              .q_norm = QNorm::kIterated};
  s.sink_tokens = 1;
  s.fisher_weighted = true;
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    LayerQuantizers l;
    l.keys = kvquant_keys(s.bits, rng);
    l.values.grid = make_grid(s.bits, rng);
    l.values.outlier_tau = 3.0f + 0.25f * static_cast<float>(layer);
    l.stats = make_stats(rng, 0.0101, 0.0098);
    config.layers.push_back(l);
  }
  config.effective_bits = {{4096, 9.325537109375}, {32768, 9.320692138671875}, {131072, 9.320173034667969}};
  return config;
}

// Runtime-grouped uniform quantizers: only clip ratios are fitted.
QuantizerConfig runtime_config(const std::string& name, QuantMethod method, TensorQuantizerSettings keys,
                               TensorQuantizerSettings values, int64_t sink, int64_t residual, float key_clip,
                               float value_clip, std::vector<std::pair<int64_t, double>> effective_bits,
                               std::mt19937& rng) {
  QuantizerConfig config{.name = name};
  config.settings = {
      .method = method, .bits = 2, .keys = keys, .values = values, .sink_tokens = sink, .residual_tokens = residual};
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    LayerQuantizers l;
    l.keys.clip_ratio = key_clip;
    l.values.clip_ratio = value_clip;
    l.stats = make_stats(rng, 0, 0);
    config.layers.push_back(l);
  }
  config.effective_bits = std::move(effective_bits);
  return config;
}

// A random orthogonal D x D matrix (row-major): Gram-Schmidt of a Gaussian
// matrix in float64, then rounded to float32 as the file stores it.
std::vector<float> random_orthogonal(int64_t d, std::mt19937& rng) {
  std::normal_distribution<double> gauss;
  const auto n = static_cast<size_t>(d);
  std::vector<double> q(n * n);
  for (double& x : q) x = gauss(rng);
  for (size_t j = 0; j < n; ++j) {  // column j against the columns before it (modified Gram-Schmidt, twice)
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t i = 0; i < j; ++i) {
        double dot = 0;
        for (size_t k = 0; k < n; ++k) dot += q[k * n + i] * q[k * n + j];
        for (size_t k = 0; k < n; ++k) q[k * n + j] -= dot * q[k * n + i];
      }
    }
    double norm = 0;
    for (size_t k = 0; k < n; ++k) norm += q[k * n + j] * q[k * n + j];
    for (size_t k = 0; k < n; ++k) q[k * n + j] /= std::sqrt(norm);
  }
  return {q.begin(), q.end()};
}

Float32Array random_rotations(std::mt19937& rng) {
  Float32Array matrices{.shape = {kKvHeads, kHeadDim, kHeadDim}};
  for (int64_t h = 0; h < kKvHeads; ++h) {
    const std::vector<float> r = random_orthogonal(kHeadDim, rng);
    matrices.values.insert(matrices.values.end(), r.begin(), r.end());
  }
  return matrices;
}

// int2-rot with learned rotations: post-RoPE keys by a matrix with a centre,
// values by a matrix, validation losses per head.
QuantizerConfig rotated_matrix_config(std::mt19937& rng) {
  const TensorQuantizerSettings g8 = {.grouping = Grouping::kPerToken, .group = kHeadDim};
  QuantizerConfig config = runtime_config("int2-rot-learned", QuantMethod::kInt2Rot, g8, g8, 64, 256, 0.95f, 0.9f,
                                          {{4096, 6.78125}, {131072, 6.0244140625}}, rng);
  config.rotation = RotationSettings{.keys = RotationForm::kMatrix,
                                     .values = RotationForm::kMatrix,
                                     .key_centred = true,
                                     .key_basis = RotationBasis::kHadamard,
                                     .value_basis = RotationBasis::kEigen,
                                     .key_output_weight = 0.5,
                                     .steps = 80,
                                     .learning_rate = 0.01,
                                     .gradient = "smoothed",
                                     .last_queries = 64,
                                     .fit_samples = 12,
                                     .validation_samples = 4};
  std::uniform_real_distribution<float> centre(-2.0f, 2.0f);
  std::uniform_real_distribution<double> loss(0.01, 0.5);
  for (auto& layer : config.layers) {
    LayerRotation& r = layer.rotation;
    r.keys.matrix = random_rotations(rng);
    std::vector<float> c;
    for (int64_t i = 0; i < kKvHeads * kHeadDim; ++i) c.push_back(centre(rng));
    r.keys.centre = head_array(c);
    r.keys.basis = {RotationBasis::kHadamard, RotationBasis::kHadamard};
    r.keys.learned = {true, false};
    r.values.matrix = random_rotations(rng);
    r.values.basis = {RotationBasis::kEigen, RotationBasis::kHadamard};  // head 1 fell back to the Hadamard base
    r.values.learned = {true, true};
    for (int64_t h = 0; h < kKvHeads; ++h) {
      const double key_base = loss(rng), value_base = loss(rng);
      r.loss.push_back({.key_base = key_base, .key_learned = key_base * 0.7, .value_base = value_base,
                        .value_learned = value_base * 0.8});
    }
  }
  return config;
}

// KVQuant's pre-RoPE keys rotated within their RoPE pairs (folded into the
// weights), values unrotated, no losses measured.
QuantizerConfig rotated_pair_angles_config(std::mt19937& rng) {
  QuantizerConfig config = kvquant_config(rng);
  config.name = "kvquant-pair-angles";
  config.rotation = RotationSettings{.keys = RotationForm::kPairAngles,
                                     .values = RotationForm::kNone,
                                     .folded = true,
                                     .key_basis = RotationBasis::kIdentity,
                                     .steps = 40,
                                     .fit_samples = 8};
  std::uniform_real_distribution<float> angle(-3.14f, 3.14f);
  for (auto& layer : config.layers) {
    layer.rotation.keys.angles.shape = {kKvHeads, kHeadDim / 2};
    for (int64_t i = 0; i < kKvHeads * kHeadDim / 2; ++i) layer.rotation.keys.angles.values.push_back(angle(rng));
    layer.rotation.keys.basis = {RotationBasis::kIdentity, RotationBasis::kRandom};
    layer.rotation.keys.learned = {true, false};
  }
  return config;
}

Artifact make_artifact() {
  std::mt19937 rng(7);
  Artifact artifact;
  artifact.model = small_model();
  artifact.calibration = {.sources = {capture("calib.txt", 1), capture("more.txt", 2)},
                          .calibration_tokens = 65536,
                          .store_file = "acts.h5"};
  artifact.tool_version = "0.1.0";
  artifact.command_line = "kvforge calibrate --store acts.h5 --methods kvquant,kivi,int2-rot,rtn";
  artifact.created_utc = "2026-11-30T07:04:38Z";
  artifact.configs.push_back(kvquant_config(rng));
  artifact.configs.push_back(kvquant_variants_config(rng));
  // KIVI: keys flushed in blocks of residual_tokens, values in a sliding window.
  const TensorQuantizerSettings g32 = {.grouping = Grouping::kPerToken, .group = 32};
  artifact.configs.push_back(
      runtime_config("kivi", QuantMethod::kKivi,
                     {.grouping = Grouping::kPerChannelTokens, .group = 32, .residual_rule = ResidualRule::kBlockFlush},
                     g32, 0, 128, 1.0f, 1.0f, {{4096, 4.65625}, {32768, 4.51953125}, {131072, 4.5048828125}}, rng));
  const TensorQuantizerSettings g8 = {.grouping = Grouping::kPerToken, .group = kHeadDim};
  artifact.configs.push_back(runtime_config("int2-rot", QuantMethod::kInt2Rot, g8, g8, 64, 256, 0.96f, 0.92f,
                                            {{4096, 6.78125}, {32768, 6.09765625}, {131072, 6.0244140625}}, rng));
  artifact.configs.push_back(
      runtime_config("rtn", QuantMethod::kRtn, g8, g8, 0, 0, 1.0f, 1.0f, {{4096, 6.0}, {131072, 6.0}}, rng));
  artifact.configs.push_back(rotated_matrix_config(rng));
  artifact.configs.push_back(rotated_pair_angles_config(rng));
  return artifact;
}

// What version 2 could store: the configurations without rotations.
Artifact unrotated(Artifact artifact) {
  std::erase_if(artifact.configs, [](const QuantizerConfig& c) { return c.rotation.has_value(); });
  return artifact;
}

// QuantizerConfig& or const QuantizerConfig&, as `artifact` is.
template <class AnyArtifact>
auto& config_named(AnyArtifact& artifact, const std::string& name) {
  for (auto& config : artifact.configs) {
    if (config.name == name) return config;
  }
  throw std::logic_error("no configuration " + name);
}

// Runs `body` and returns the InputError it throws (failing the test if none).
InputError input_error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const InputError& error) {
    return error;
  }
  ADD_FAILURE() << "no InputError was thrown";
  return InputError("", "", "");
}

// --- round trip ------------------------------------------------------------------

TEST(Artifact, RoundTripsEveryMethod) {
  const auto dir = scratch_dir("artifact-roundtrip");
  const auto path = dir / "a.h5";
  const Artifact artifact = make_artifact();
  write_artifact(path, artifact);
  EXPECT_FALSE(fs::exists(dir / "a.h5.tmp"));
  const Artifact read = read_artifact(path);
  EXPECT_EQ(read, artifact);
  // Pieces too, so a failure says which.
  EXPECT_EQ(read.model, artifact.model);
  EXPECT_EQ(read.calibration, artifact.calibration);
  ASSERT_EQ(read.configs.size(), 7u);
  for (size_t i = 0; i < read.configs.size(); ++i) {
    SCOPED_TRACE(artifact.configs[i].name);
    EXPECT_EQ(read.configs[i].name, artifact.configs[i].name);  // order kept, not alphabetical
    EXPECT_EQ(read.configs[i].settings, artifact.configs[i].settings);
    EXPECT_EQ(read.configs[i].layers, artifact.configs[i].layers);
    EXPECT_EQ(read.configs[i].effective_bits, artifact.configs[i].effective_bits);
    EXPECT_EQ(read.configs[i].rotation, artifact.configs[i].rotation);
  }
  // Rewriting replaces the file whole.
  Artifact changed = artifact;
  changed.configs.pop_back();
  write_artifact(path, changed);
  EXPECT_EQ(read_artifact(path), changed);
}

// The round trip above covers every value of every enum the schema stores.
TEST(Artifact, TestArtifactUsesEveryValueOfVersion2) {
  std::set<std::string> seen;
  for (const auto& config : make_artifact().configs) {
    for (const TensorQuantizerSettings* s : {&config.settings.keys, &config.settings.values}) {
      seen.insert("grouping " + std::string(grouping_name(s->grouping)));
      seen.insert("outlier_rule " + std::string(outlier_rule_name(s->outlier_rule)));
      seen.insert("residual_rule " + std::string(residual_rule_name(s->residual_rule)));
      seen.insert("q_norm " + std::string(q_norm_name(s->q_norm)));
    }
  }
  for (const Grouping g :
       {Grouping::kPerToken, Grouping::kPerChannelTokens, Grouping::kPerChannelOffline, Grouping::kPerTokenAllHeads}) {
    EXPECT_TRUE(seen.contains("grouping " + std::string(grouping_name(g)))) << grouping_name(g);
  }
  for (const OutlierRule r :
       {OutlierRule::kNone, OutlierRule::kChannelThresholds, OutlierRule::kTokenTopBottom, OutlierRule::kTokenTau}) {
    EXPECT_TRUE(seen.contains("outlier_rule " + std::string(outlier_rule_name(r)))) << outlier_rule_name(r);
  }
  for (const ResidualRule r : {ResidualRule::kSliding, ResidualRule::kBlockFlush}) {
    EXPECT_TRUE(seen.contains("residual_rule " + std::string(residual_rule_name(r)))) << residual_rule_name(r);
  }
  for (const QNorm q : {QNorm::kNone, QNorm::kAffine, QNorm::kIterated}) {
    EXPECT_TRUE(seen.contains("q_norm " + std::string(q_norm_name(q)))) << q_norm_name(q);
  }
}

// The rotated configurations land where docs/artifact.md says, as version 3.
TEST(Artifact, RotationsAreStoredWhereTheDocsSay) {
  const auto dir = scratch_dir("artifact-rotation-layout");
  const auto path = dir / "a.h5";
  const Artifact artifact = make_artifact();
  write_artifact(path, artifact);
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(file, 0);
  int64_t version = 0;
  const hid_t attribute = H5Aopen(file, "schema_version", H5P_DEFAULT);
  EXPECT_GE(H5Aread(attribute, H5T_NATIVE_INT64, &version), 0);
  H5Aclose(attribute);
  EXPECT_EQ(version, 3);
  auto exists = [&](const std::string& object) { return H5Lexists(file, object.c_str(), H5P_DEFAULT) > 0; };
  const std::string learned = "/configs/int2-rot-learned";
  EXPECT_TRUE(exists(learned + "/rotation"));
  for (const char* layer : {"/layers/0", "/layers/1"}) {
    for (const char* child : {"/rotation/keys/matrix", "/rotation/keys/centre", "/rotation/keys/learned",
                              "/rotation/values/matrix", "/rotation/values/learned", "/rotation/loss_key_base",
                              "/rotation/loss_key_learned", "/rotation/loss_value_base", "/rotation/loss_value_learned"}) {
      EXPECT_TRUE(exists(learned + layer + child)) << learned + layer + child;
    }
    EXPECT_FALSE(exists(learned + layer + "/rotation/values/centre"));
    EXPECT_FALSE(exists(learned + layer + "/rotation/keys/angles"));
    EXPECT_GT(H5Aexists_by_name(file, (learned + layer + "/rotation/keys").c_str(), "basis", H5P_DEFAULT), 0);
  }
  const std::string pair = "/configs/kvquant-pair-angles/layers/1/rotation";
  EXPECT_TRUE(exists(pair + "/keys/angles"));
  EXPECT_FALSE(exists(pair + "/keys/matrix"));
  EXPECT_FALSE(exists(pair + "/values"));
  EXPECT_FALSE(exists(pair + "/loss_key_base"));
  EXPECT_FALSE(exists("/configs/rtn/rotation"));
  EXPECT_FALSE(exists("/configs/rtn/layers/0/rotation"));
  H5Fclose(file);
}

// ... and every rotation form and basis version 3 stores.
TEST(Artifact, TestArtifactUsesEveryRotationFormAndBasis) {
  std::set<std::string> seen;
  for (const auto& config : make_artifact().configs) {
    if (!config.rotation) continue;
    seen.insert("form " + std::string(rotation_form_name(config.rotation->keys)));
    seen.insert("form " + std::string(rotation_form_name(config.rotation->values)));
    for (const auto& layer : config.layers) {
      for (const TensorRotation* t : {&layer.rotation.keys, &layer.rotation.values}) {
        for (const RotationBasis b : t->basis) seen.insert("basis " + std::string(basis_name(b)));
      }
    }
  }
  for (const RotationForm f : {RotationForm::kNone, RotationForm::kMatrix, RotationForm::kPairAngles}) {
    EXPECT_TRUE(seen.contains("form " + std::string(rotation_form_name(f)))) << rotation_form_name(f);
  }
  for (const RotationBasis b :
       {RotationBasis::kIdentity, RotationBasis::kHadamard, RotationBasis::kEigen, RotationBasis::kRandom}) {
    EXPECT_TRUE(seen.contains("basis " + std::string(basis_name(b)))) << basis_name(b);
  }
}

TEST(Artifact, TimestampHasTheStoredFormat) {
  Artifact artifact = make_artifact();
  artifact.created_utc = current_utc_timestamp();
  const auto dir = scratch_dir("artifact-timestamp");
  write_artifact(dir / "a.h5", artifact);
  EXPECT_EQ(read_artifact(dir / "a.h5").created_utc, artifact.created_utc);
}

// --- the writer refuses degenerate parameters ----------------------------------

struct Degenerate {
  const char* name;
  std::function<void(Artifact&)> damage;
  std::string field;     // the InputError's field: the object the value would be stored in
  std::string expected;  // a part of its message
};

class WriteRefuses : public ::testing::TestWithParam<Degenerate> {};

TEST_P(WriteRefuses, NamingTheObjectAndLeavingNoFile) {
  const auto dir = scratch_dir(std::string("artifact-write-") + GetParam().name);
  Artifact artifact = make_artifact();
  GetParam().damage(artifact);
  const auto error = input_error_of([&] { write_artifact(dir / "a.h5", artifact); });
  EXPECT_EQ(error.file(), (dir / "a.h5").string()) << error.what();
  EXPECT_EQ(error.field(), GetParam().field) << error.what();
  EXPECT_NE(std::string(error.what()).find(GetParam().expected), std::string::npos) << error.what();
  EXPECT_FALSE(fs::exists(dir / "a.h5"));
  EXPECT_FALSE(fs::exists(dir / "a.h5.tmp"));

  // A good artifact already there stays as it was.
  const Artifact good = make_artifact();
  write_artifact(dir / "b.h5", good);
  EXPECT_THROW(write_artifact(dir / "b.h5", artifact), InputError);
  EXPECT_EQ(read_artifact(dir / "b.h5"), good);
  EXPECT_FALSE(fs::exists(dir / "b.h5.tmp"));
}

const std::string kKvquantKeys0 = "/configs/kvquant/layers/0/keys";
const std::string kKvquantKeys1 = "/configs/kvquant/layers/1/keys";
const std::string kKvquantValues0 = "/configs/kvquant/layers/0/values";
const std::string kLearnedRotation0 = "/configs/int2-rot-learned/layers/0/rotation";
const std::string kLearnedRotation1 = "/configs/int2-rot-learned/layers/1/rotation";

INSTANTIATE_TEST_SUITE_P(
    Degenerate, WriteRefuses,
    ::testing::Values(
        Degenerate{"scale_zero",
                   [](Artifact& a) { config_named(a, "kvquant").layers[1].keys.channel_scale.values[11] = 0.0f; },
                   kKvquantKeys1 + "/channel_scale", "expected values > 0, element [1, 3] is 0"},
        Degenerate{"scale_negative",
                   [](Artifact& a) { config_named(a, "kvquant").layers[0].keys.channel_scale.values[0] = -0.5f; },
                   kKvquantKeys0 + "/channel_scale", "expected values > 0, element [0, 0] is -0.5"},
        Degenerate{"scales_all_one",
                   [](Artifact& a) {
                     auto& keys = config_named(a, "kvquant").layers[0].keys;
                     std::fill(keys.channel_scale.values.begin(), keys.channel_scale.values.end(), 1.0f);
                   },
                   kKvquantKeys0 + "/channel_scale", "1.0 for every channel"},
        Degenerate{"scales_copied_across_layers",
                   [](Artifact& a) {
                     auto& layers = config_named(a, "kvquant").layers;
                     layers[1].keys = layers[0].keys;
                   },
                   kKvquantKeys1 + "/channel_scale", "the same as layer 0's"},
        Degenerate{"nan_in_grid",
                   [](Artifact& a) {
                     config_named(a, "kvquant").layers[0].values.grid[2] = std::numeric_limits<float>::quiet_NaN();
                   },
                   kKvquantValues0 + "/grid", "expected finite levels, element [2] is nan"},
        Degenerate{"unsorted_grid",
                   [](Artifact& a) {
                     auto& grid = config_named(a, "kvquant").layers[1].keys.grid;
                     std::swap(grid[1], grid[2]);
                   },
                   kKvquantKeys1 + "/grid", "expected strictly ascending levels, element [2]"},
        Degenerate{"repeated_grid_level",
                   [](Artifact& a) {
                     auto& grid = config_named(a, "kvquant").layers[0].keys.grid;
                     grid[3] = grid[2];
                   },
                   kKvquantKeys0 + "/grid", "strictly ascending"},
        Degenerate{"wrong_grid_size",
                   [](Artifact& a) { config_named(a, "kvquant").layers[0].keys.grid.push_back(1.5f); },
                   kKvquantKeys0 + "/grid", "expected 2^bits = 4 levels (bits is 2), got 5"},
        Degenerate{"grid_for_uniform",
                   [](Artifact& a) {
                     config_named(a, "kivi").layers[0].keys.grid = {-1, -0.3f, 0.3f, 1};
                   },
                   "/configs/kivi/layers/0/keys/grid", "expected none: keys_non_uniform is 0"},
        Degenerate{"low_above_high",
                   [](Artifact& a) {
                     auto& keys = config_named(a, "kvquant").layers[0].keys;
                     keys.outlier_low.values[5] = keys.outlier_high.values[5] + 0.5f;
                   },
                   kKvquantKeys0 + "/outlier_low", "expected low <= high, element [0, 5]"},
        Degenerate{"thresholds_outside_scales",
                   [](Artifact& a) {
                     auto& keys = config_named(a, "kvquant").layers[0].keys;
                     keys.outlier_high.values[9] += keys.channel_scale.values[9];  // maps to 2
                   },
                   kKvquantKeys0 + "/outlier_high", "<= 1 (inliers inside the grid's range), element [1, 1] maps to"},
        Degenerate{"clip_above_one", [](Artifact& a) { config_named(a, "int2-rot").layers[0].keys.clip_ratio = 1.5f; },
                   "/configs/int2-rot/layers/0/keys@clip_ratio", "expected a ratio in (0, 1], got 1.5"},
        Degenerate{"clip_zero", [](Artifact& a) { config_named(a, "int2-rot").layers[1].values.clip_ratio = 0.0f; },
                   "/configs/int2-rot/layers/1/values@clip_ratio", "(0, 1]"},
        Degenerate{"clip_for_offline_scales",
                   [](Artifact& a) { config_named(a, "kvquant").layers[0].keys.clip_ratio = 0.9f; },
                   kKvquantKeys0 + "@clip_ratio", "expected 1 (unused"},
        Degenerate{"wrong_layer_count", [](Artifact& a) { config_named(a, "kivi").layers.pop_back(); },
                   "/configs/kivi/layers", "expected 2 layers (/model@num_layers), got 1"},
        Degenerate{"missing_channel_scale",
                   [](Artifact& a) { config_named(a, "kvquant").layers[0].keys.channel_scale = {}; },
                   kKvquantKeys0 + "/channel_scale", "missing: required when keys_grouping is per_channel_offline"},
        Degenerate{"channel_scale_of_another_model",
                   [](Artifact& a) {
                     auto& scale = config_named(a, "kvquant").layers[0].keys.channel_scale;
                     scale.shape = {3, kHeadDim};
                     scale.values.resize(3 * kHeadDim, 1.5f);
                   },
                   kKvquantKeys0 + "/channel_scale",
                   "expected shape [2, 8] ([num_kv_heads, head_dim] of /model), got [3, 8]"},
        Degenerate{"missing_thresholds",
                   [](Artifact& a) { config_named(a, "kvquant").layers[1].keys.outlier_high = {}; },
                   kKvquantKeys1 + "/outlier_high", "missing: required when keys_outlier_rule is channel_thresholds"},
        Degenerate{"tau_zero_with_token_tau",
                   [](Artifact& a) { config_named(a, "kvquant-variants").layers[1].values.outlier_tau = 0; },
                   "/configs/kvquant-variants/layers/1/values@outlier_tau",
                   "expected > 0 when values_outlier_rule is token_tau, got 0"},
        // --- version 2's rules -------------------------------------------------------
        Degenerate{"tau_with_token_top_bottom",
                   [](Artifact& a) { config_named(a, "kvquant").layers[0].values.outlier_tau = 2.5f; },
                   kKvquantValues0 + "@outlier_tau",
                   "expected 0 (unused: values_outlier_rule is token_top_bottom), got 2.5"},
        Degenerate{"tau_with_channel_thresholds",
                   [](Artifact& a) { config_named(a, "kvquant").layers[1].keys.outlier_tau = 1.0f; },
                   kKvquantKeys1 + "@outlier_tau", "expected 0 (unused: keys_outlier_rule is channel_thresholds), got 1"},
        Degenerate{"outlier_rule_without_outliers",
                   [](Artifact& a) { config_named(a, "kivi").settings.values.outlier_rule = OutlierRule::kTokenTau; },
                   "/configs/kivi@values_outlier_rule", "expected none when values_outlier_fraction is 0, got token_tau"},
        Degenerate{"outliers_without_rule",
                   [](Artifact& a) { config_named(a, "rtn").settings.keys.outlier_fraction = 0.02; },
                   "/configs/rtn@keys_outlier_rule",
                   "expected token_top_bottom or token_tau when keys_outlier_fraction is 0.02 (> 0) and keys_grouping "
                   "is per_token, got none"},
        Degenerate{"channel_thresholds_at_runtime",
                   [](Artifact& a) {
                     config_named(a, "kvquant-variants").settings.values.outlier_rule = OutlierRule::kChannelThresholds;
                   },
                   "/configs/kvquant-variants@values_outlier_rule", "got channel_thresholds"},
        Degenerate{"token_rule_for_offline_scales",
                   [](Artifact& a) { config_named(a, "kvquant").settings.keys.outlier_rule = OutlierRule::kTokenTopBottom; },
                   "/configs/kvquant@keys_outlier_rule",
                   "expected channel_thresholds when keys_outlier_fraction is 0.01 (> 0) and keys_grouping is "
                   "per_channel_offline, got token_top_bottom"},
        Degenerate{"token_tau_over_all_heads",
                   [](Artifact& a) {
                     auto& config = config_named(a, "kvquant");
                     config.settings.values.outlier_rule = OutlierRule::kTokenTau;
                     for (auto& layer : config.layers) layer.values.outlier_tau = 3.0f;
                   },
                   "/configs/kvquant@values_outlier_rule",
                   "expected token_top_bottom when values_outlier_fraction is 0.01 (> 0) and values_grouping is "
                   "per_token_all_heads, got token_tau"},
        Degenerate{"group_for_all_heads", [](Artifact& a) { config_named(a, "kvquant").settings.values.group = kHeadDim; },
                   "/configs/kvquant@values_group",
                   "expected 0 (unused: per_token_all_heads scales each token over all KV heads), got 8"},
        Degenerate{"block_flush_without_residual",
                   [](Artifact& a) { config_named(a, "kivi").settings.residual_tokens = 0; },
                   "/configs/kivi@keys_residual_rule",
                   "expected residual_tokens > 0 when keys_residual_rule is block_flush, got 0"},
        Degenerate{"block_flush_not_tiled_by_groups",
                   [](Artifact& a) { config_named(a, "kivi").settings.residual_tokens = 100; },
                   "/configs/kivi@keys_residual_rule",
                   "expected residual_tokens (100) a multiple of keys_group (32) when keys_residual_rule is "
                   "block_flush and keys_grouping is per_channel_tokens"},
        Degenerate{"q_norm_for_uniform", [](Artifact& a) { config_named(a, "rtn").settings.values.q_norm = QNorm::kIterated; },
                   "/configs/rtn@values_q_norm",
                   "expected none when values_non_uniform is 0 (Q-Norm corrects fitted grids), got iterated"},
        Degenerate{"encode_grid_missing", [](Artifact& a) { config_named(a, "kvquant").layers[0].values.encode_grid = {}; },
                   kKvquantValues0 + "/encode_grid", "missing: required when values_q_norm is affine"},
        Degenerate{"encode_grid_for_iterated",
                   [](Artifact& a) {
                     auto& keys = config_named(a, "kvquant-variants").layers[1].keys;
                     keys.encode_grid = keys.grid;
                   },
                   "/configs/kvquant-variants/layers/1/keys/encode_grid",
                   "expected none: keys_q_norm is iterated (codes are the nearest level of grid)"},
        Degenerate{"encode_grid_unsorted",
                   [](Artifact& a) {
                     auto& levels = config_named(a, "kvquant").layers[1].keys.encode_grid;
                     std::swap(levels[0], levels[1]);
                   },
                   kKvquantKeys1 + "/encode_grid", "expected strictly ascending levels, element [1]"},
        Degenerate{"encode_grid_nan",
                   [](Artifact& a) {
                     config_named(a, "kvquant").layers[0].keys.encode_grid[3] = std::numeric_limits<float>::infinity();
                   },
                   kKvquantKeys0 + "/encode_grid", "expected finite levels, element [3] is inf"},
        Degenerate{"encode_grid_wrong_size",
                   [](Artifact& a) { config_named(a, "kvquant").layers[0].values.encode_grid.pop_back(); },
                   kKvquantValues0 + "/encode_grid", "expected 2^bits = 4 levels (bits is 2), got 3"},
        Degenerate{"thresholds_for_token_rule",
                   [](Artifact& a) {
                     auto& layer = config_named(a, "kvquant").layers[0];
                     layer.values.outlier_low = layer.keys.outlier_low;
                   },
                   kKvquantValues0 + "/outlier_low",
                   "expected none: values_outlier_rule is token_top_bottom (thresholds belong to channel_thresholds)"},
        Degenerate{"nan_stat",
                   [](Artifact& a) {
                     config_named(a, "rtn").layers[0].stats.logit_relative_mse =
                         std::numeric_limits<double>::quiet_NaN();
                   },
                   "/configs/rtn/layers/0@logit_relative_mse", "expected a finite value"},
        Degenerate{"bits_five", [](Artifact& a) { config_named(a, "rtn").settings.bits = 5; }, "/configs/rtn@bits",
                   "expected 2, 3 or 4, got 5"},
        Degenerate{"group_not_tiling_heads", [](Artifact& a) { config_named(a, "rtn").settings.values.group = 3; },
                   "/configs/rtn@values_group", "expected a divisor of head_dim (8) or >= head_dim, got 3"},
        Degenerate{"runtime_group_zero", [](Artifact& a) { config_named(a, "kivi").settings.keys.group = 0; },
                   "/configs/kivi@keys_group", "expected a positive integer, got 0"},
        Degenerate{"no_effective_bits", [](Artifact& a) { config_named(a, "kivi").effective_bits.clear(); },
                   "/configs/kivi/effective_bits", "at least one"},
        Degenerate{"infinite_effective_bits",
                   [](Artifact& a) {
                     config_named(a, "kivi").effective_bits[1].second = std::numeric_limits<double>::infinity();
                   },
                   "/configs/kivi/effective_bits", "expected finite positive bits, row 1 has inf"},
        Degenerate{"zero_effective_bits", [](Artifact& a) { config_named(a, "rtn").effective_bits[0].second = 0; },
                   "/configs/rtn/effective_bits", "expected finite positive bits, row 0 has 0"},
        Degenerate{"duplicate_name", [](Artifact& a) { a.configs[3].name = "kivi"; }, "/configs@names",
                   "expected unique names, got \"kivi\" twice"},
        Degenerate{"name_with_slash", [](Artifact& a) { a.configs[0].name = "a/b"; }, "/configs@names", "a/b"},
        Degenerate{"no_configs", [](Artifact& a) { a.configs.clear(); }, "/configs@names", "at least one"},
        Degenerate{"model_kv_heads", [](Artifact& a) { a.model.num_kv_heads = 3; }, "/model@num_kv_heads",
                   "a divisor of num_heads (4), got 3"},
        Degenerate{"no_calibration_tokens", [](Artifact& a) { a.calibration.calibration_tokens = 0; },
                   "/calibration@calibration_tokens", "expected a positive integer, got 0"},
        Degenerate{"bad_timestamp", [](Artifact& a) { a.created_utc = "yesterday"; }, "/@created_utc",
                   "expected YYYY-MM-DDTHH:MM:SSZ"},
        // --- version 3's rotations -----------------------------------------------------
        Degenerate{"matrix_not_orthogonal",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").layers[0].rotation.keys.matrix.values[3] += 1e-3f; },
                   kLearnedRotation0 + "/keys/matrix", "expected orthogonal matrices (||R^T R - I||_F <= 1.9073"},
        // Just outside the tolerance (4 u D = 1.9e-6 at D = 8): R (1 + 1e-6) is off by 2e-6 sqrt(8) = 5.7e-6.
        Degenerate{"matrix_scaled_past_tolerance",
                   [](Artifact& a) {
                     auto& m = config_named(a, "int2-rot-learned").layers[1].rotation.values.matrix.values;
                     for (size_t i = kHeadDim * kHeadDim; i < m.size(); ++i) m[i] *= 1.000001f;
                   },
                   kLearnedRotation1 + "/values/matrix", "head 1 has 5."},
        Degenerate{"matrix_wrong_shape",
                   [](Artifact& a) {
                     auto& m = config_named(a, "int2-rot-learned").layers[0].rotation.keys.matrix;
                     m.shape = {kKvHeads, kHeadDim, kHeadDim / 2};
                     m.values.resize(kKvHeads * kHeadDim * kHeadDim / 2);
                   },
                   kLearnedRotation0 + "/keys/matrix",
                   "expected shape [2, 8, 8] ([num_kv_heads, head_dim, head_dim] of /model), got [2, 8, 4]"},
        Degenerate{"matrix_keys_pre_rope",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").settings.keys_pre_rope = true; },
                   "/configs/int2-rot-learned/rotation@keys_form",
                   "expected none or pair_angles when /configs/int2-rot-learned@keys_pre_rope is 1 (a full matrix "
                   "does not commute with RoPE), got matrix"},
        Degenerate{"pair_angles_values",
                   [](Artifact& a) { config_named(a, "kvquant-pair-angles").rotation->values = RotationForm::kPairAngles; },
                   "/configs/kvquant-pair-angles/rotation@values_form", "expected none or matrix"},
        Degenerate{"nothing_rotated",
                   [](Artifact& a) {
                     auto& r = *config_named(a, "kvquant-pair-angles").rotation;
                     r.keys = RotationForm::kNone;
                   },
                   "/configs/kvquant-pair-angles/rotation@keys_form", "other than none"},
        Degenerate{"missing_layer_rotation",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").layers[1].rotation = {}; },
                   kLearnedRotation1 + "/keys",
                   "missing: required when /configs/int2-rot-learned/rotation@keys_form is matrix"},
        Degenerate{"rotation_in_unrotated_config",
                   [](Artifact& a) {
                     config_named(a, "rtn").layers[0].rotation = config_named(a, "int2-rot-learned").layers[0].rotation;
                   },
                   "/configs/rtn/layers/0/rotation", "expected none: the configuration has no /configs/rtn/rotation"},
        Degenerate{"tensor_rotation_for_form_none",
                   [](Artifact& a) {
                     auto& config = config_named(a, "kvquant-pair-angles");
                     config.layers[0].rotation.values = config_named(a, "int2-rot-learned").layers[0].rotation.values;
                   },
                   "/configs/kvquant-pair-angles/layers/0/rotation/values",
                   "expected none: /configs/kvquant-pair-angles/rotation@values_form is none"},
        Degenerate{"centre_without_key_centred",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").rotation->key_centred = false; },
                   kLearnedRotation0 + "/keys/centre", "expected none: /configs/int2-rot-learned/rotation@key_centred is 0"},
        Degenerate{"centre_missing",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").layers[1].rotation.keys.centre = {}; },
                   kLearnedRotation1 + "/keys/centre", "missing: required when"},
        Degenerate{"centre_for_values",
                   [](Artifact& a) {
                     auto& r = config_named(a, "int2-rot-learned").layers[0].rotation;
                     r.values.centre = r.keys.centre;
                   },
                   kLearnedRotation0 + "/values/centre", "expected none: values have no centre"},
        Degenerate{"centre_for_pair_angles",
                   [](Artifact& a) { config_named(a, "kvquant-pair-angles").rotation->key_centred = true; },
                   "/configs/kvquant-pair-angles/rotation@key_centred", "(a centre belongs to matrix keys)"},
        Degenerate{"folded_matrix_keys",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").rotation->folded = true; },
                   "/configs/int2-rot-learned/rotation@folded", "nothing to fold into"},
        Degenerate{"angles_nan",
                   [](Artifact& a) {
                     config_named(a, "kvquant-pair-angles").layers[1].rotation.keys.angles.values[6] =
                         std::numeric_limits<float>::quiet_NaN();
                   },
                   "/configs/kvquant-pair-angles/layers/1/rotation/keys/angles", "expected finite values, element [1, 2] is nan"},
        Degenerate{"angles_wrong_shape",
                   [](Artifact& a) {
                     auto& angles = config_named(a, "kvquant-pair-angles").layers[0].rotation.keys.angles;
                     angles.shape = {kKvHeads, kHeadDim};
                     angles.values.resize(kKvHeads * kHeadDim);
                   },
                   "/configs/kvquant-pair-angles/layers/0/rotation/keys/angles",
                   "expected shape [2, 4] ([num_kv_heads, head_dim / 2] of /model), got [2, 8]"},
        Degenerate{"angles_for_matrix_form",
                   [](Artifact& a) {
                     config_named(a, "int2-rot-learned").layers[0].rotation.values.angles =
                         config_named(a, "kvquant-pair-angles").layers[0].rotation.keys.angles;
                   },
                   kLearnedRotation0 + "/values/angles", "expected none: /configs/int2-rot-learned/rotation@values_form is matrix"},
        Degenerate{"basis_per_head",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").layers[0].rotation.values.basis.pop_back(); },
                   kLearnedRotation0 + "/values@basis", "expected one name per KV head (2, /model@num_kv_heads), got 1"},
        Degenerate{"learned_per_head",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").layers[1].rotation.keys.learned.push_back(true); },
                   kLearnedRotation1 + "/keys/learned", "expected one flag per KV head (2, /model@num_kv_heads), got 3"},
        Degenerate{"learned_without_steps",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").rotation->steps = 0; },
                   kLearnedRotation0 + "/keys/learned",
                   "expected 0 for every head when /configs/int2-rot-learned/rotation@steps is 0 (nothing was learned), "
                   "element [0] is 1"},
        Degenerate{"loss_negative",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").layers[0].rotation.loss[1].value_learned = -1; },
                   kLearnedRotation0 + "/loss_value_learned", "expected finite values >= 0, element [1] is -1"},
        Degenerate{"loss_per_head",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").layers[1].rotation.loss.pop_back(); },
                   kLearnedRotation1 + "/loss_key_base", "expected one loss per KV head (2"},
        Degenerate{"unknown_gradient",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").rotation->gradient = "adam"; },
                   "/configs/int2-rot-learned/rotation@gradient",
                   "expected straight_through or smoothed, got \"adam\""},
        Degenerate{"learning_rate_nan",
                   [](Artifact& a) {
                     config_named(a, "int2-rot-learned").rotation->learning_rate = std::numeric_limits<double>::quiet_NaN();
                   },
                   "/configs/int2-rot-learned/rotation@learning_rate", "expected a finite value >= 0, got nan"},
        Degenerate{"no_queries",
                   [](Artifact& a) { config_named(a, "int2-rot-learned").rotation->last_queries = 0; },
                   "/configs/int2-rot-learned/rotation@last_queries", "expected >= 1, got 0"}),
    [](const auto& info) { return std::string(info.param.name); });

// --- the reader refuses corrupt files --------------------------------------------

void edit_hdf5(const fs::path& path, const std::function<void(hid_t file)>& edit) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(file, 0);
  edit(file);
  ASSERT_GE(H5Fclose(file), 0);
}

void set_int_attribute(hid_t file, const char* object, const char* name, int64_t value) {
  const hid_t group = H5Oopen(file, object, H5P_DEFAULT);
  ASSERT_GE(group, 0);
  if (H5Aexists(group, name) > 0) H5Adelete(group, name);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t attribute = H5Acreate2(group, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
  EXPECT_GE(H5Awrite(attribute, H5T_NATIVE_INT64, &value), 0);
  H5Aclose(attribute);
  H5Sclose(space);
  H5Oclose(group);
}

void set_string_attribute(hid_t file, const char* object, const char* name, const std::string& value) {
  const hid_t group = H5Oopen(file, object, H5P_DEFAULT);
  ASSERT_GE(group, 0);
  if (H5Aexists(group, name) > 0) H5Adelete(group, name);
  const hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, H5T_VARIABLE);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t attribute = H5Acreate2(group, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
  const char* text = value.c_str();
  EXPECT_GE(H5Awrite(attribute, type, &text), 0);
  H5Aclose(attribute);
  H5Sclose(space);
  H5Tclose(type);
  H5Oclose(group);
}

// Reads a float32 dataset, lets `change` edit the values, writes them back.
void edit_floats(hid_t file, const char* name, const std::function<void(std::vector<float>&)>& change) {
  const hid_t dataset = H5Dopen2(file, name, H5P_DEFAULT);
  ASSERT_GE(dataset, 0);
  const hid_t space = H5Dget_space(dataset);
  std::vector<float> values(static_cast<size_t>(H5Sget_simple_extent_npoints(space)));
  ASSERT_GE(H5Dread(dataset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), 0);
  change(values);
  ASSERT_GE(H5Dwrite(dataset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), 0);
  H5Sclose(space);
  H5Dclose(dataset);
}

// Replaces a dataset by one of `type` and `shape` filled with `fill`.
void replace_dataset(hid_t file, const char* name, hid_t type, std::vector<hsize_t> shape, float fill) {
  ASSERT_GE(H5Ldelete(file, name, H5P_DEFAULT), 0);
  const hid_t space = H5Screate_simple(static_cast<int>(shape.size()), shape.data(), nullptr);
  const hid_t dataset = H5Dcreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(dataset, 0);
  hsize_t count = 1;
  for (const hsize_t dim : shape) count *= dim;
  const std::vector<float> values(count, fill);
  ASSERT_GE(H5Dwrite(dataset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), 0);
  H5Dclose(dataset);
  H5Sclose(space);
}

void set_strings_attribute(hid_t file, const char* object, const char* name, const std::vector<const char*>& values) {
  const hid_t group = H5Oopen(file, object, H5P_DEFAULT);
  ASSERT_GE(group, 0);
  if (H5Aexists(group, name) > 0) H5Adelete(group, name);
  const hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, H5T_VARIABLE);
  const hsize_t count = values.size();
  const hid_t space = H5Screate_simple(1, &count, nullptr);
  const hid_t attribute = H5Acreate2(group, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
  EXPECT_GE(H5Awrite(attribute, type, values.data()), 0);
  H5Aclose(attribute);
  H5Sclose(space);
  H5Tclose(type);
  H5Oclose(group);
}

struct Corrupt {
  const char* name;
  std::function<void(const fs::path&)> damage;
  std::string field;     // the InputError's field
  std::string expected;  // a part of its message
};

class ReadRefuses : public ::testing::TestWithParam<Corrupt> {};

TEST_P(ReadRefuses, NamingFileAndObject) {
  const auto dir = scratch_dir(std::string("artifact-read-") + GetParam().name);
  const auto path = dir / "a.h5";
  write_artifact(path, make_artifact());
  GetParam().damage(path);
  const auto error = input_error_of([&] { read_artifact(path); });
  EXPECT_EQ(error.file(), path.string()) << error.what();
  EXPECT_EQ(error.field(), GetParam().field) << error.what();
  EXPECT_NE(std::string(error.what()).find(GetParam().expected), std::string::npos) << error.what();
}

INSTANTIATE_TEST_SUITE_P(
    Corrupt, ReadRefuses,
    ::testing::Values(
        Corrupt{"truncated",
                [](const fs::path& p) {
                  const std::string bytes = read_file(p);
                  write_file(p, bytes.substr(0, bytes.size() / 2));
                },
                "", "truncated"},
        Corrupt{"not_hdf5", [](const fs::path& p) { write_file(p, "kvquant,2\n"); }, "", "not an HDF5 file"},
        Corrupt{"missing_file", [](const fs::path& p) { fs::remove(p); }, "", "no such file"},
        Corrupt{"wrong_schema",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { set_string_attribute(f, "/", "schema", "kvforge.activations"); });
                },
                "/@schema", "expected \"kvforge.artifact\", got \"kvforge.activations\""},
        Corrupt{
            "other_version",
            [](const fs::path& p) { edit_hdf5(p, [](hid_t f) { set_int_attribute(f, "/", "schema_version", 4); }); },
            "/@schema_version", "expected 1 to 3 (the versions this kvforge reads), got 4"},
        Corrupt{
            "version_zero",
            [](const fs::path& p) { edit_hdf5(p, [](hid_t f) { set_int_attribute(f, "/", "schema_version", 0); }); },
            "/@schema_version", "expected 1 to 3 (the versions this kvforge reads), got 0"},
        Corrupt{"unknown_outlier_rule",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    set_string_attribute(f, "/configs/kvquant", "values_outlier_rule", "top_k");
                  });
                },
                "/configs/kvquant@values_outlier_rule",
                "expected none, channel_thresholds, token_top_bottom or token_tau, got \"top_k\""},
        Corrupt{"unknown_residual_rule",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { set_string_attribute(f, "/configs/kivi", "keys_residual_rule", "flush"); });
                },
                "/configs/kivi@keys_residual_rule", "expected sliding or block_flush, got \"flush\""},
        Corrupt{"q_norm_as_bool",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { set_int_attribute(f, "/configs/kvquant", "keys_q_norm", 1); });
                },
                "/configs/kvquant@keys_q_norm", "expected a string"},
        Corrupt{"missing_q_norm",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    ASSERT_GE(H5Adelete_by_name(f, "/configs/rtn", "values_q_norm", H5P_DEFAULT), 0);
                  });
                },
                "/configs/rtn@values_q_norm", "missing"},
        Corrupt{"rule_changed_to_token_tau",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    set_string_attribute(f, "/configs/kvquant", "values_outlier_rule", "token_tau");
                  });
                },
                "/configs/kvquant@values_outlier_rule", "per_token_all_heads, got token_tau"},
        Corrupt{"encode_grid_missing",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    ASSERT_GE(H5Ldelete(f, "/configs/kvquant/layers/1/values/encode_grid", H5P_DEFAULT), 0);
                  });
                },
                "/configs/kvquant/layers/1/values/encode_grid", "missing"},
        Corrupt{"encode_grid_for_iterated",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    ASSERT_GE(H5Ocopy(f, "/configs/kvquant-variants/layers/0/values/grid", f,
                                      "/configs/kvquant-variants/layers/0/values/encode_grid", H5P_DEFAULT, H5P_DEFAULT),
                              0);
                  });
                },
                "/configs/kvquant-variants/layers/0/values/encode_grid", "expected none: values_q_norm is iterated"},
        Corrupt{"encode_grid_unsorted",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    edit_floats(f, "/configs/kvquant/layers/0/keys/encode_grid", [](auto& v) { std::swap(v[2], v[3]); });
                  });
                },
                "/configs/kvquant/layers/0/keys/encode_grid", "expected strictly ascending levels, element [3]"},
        Corrupt{"encode_grid_float64",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    replace_dataset(f, "/configs/kvquant/layers/0/keys/encode_grid", H5T_IEEE_F64LE, {4}, 0.5f);
                  });
                },
                "/configs/kvquant/layers/0/keys/encode_grid", "expected float32, got float64"},
        Corrupt{"all_heads_group_set",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { set_int_attribute(f, "/configs/kvquant", "values_group", 16); });
                },
                "/configs/kvquant@values_group", "expected 0 (unused"},
        Corrupt{"nan_in_grid",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    edit_floats(f, "/configs/kvquant/layers/1/keys/grid",
                                [](auto& v) { v[1] = std::numeric_limits<float>::quiet_NaN(); });
                  });
                },
                "/configs/kvquant/layers/1/keys/grid", "expected finite levels, element [1] is nan"},
        Corrupt{"unsorted_grid",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    edit_floats(f, "/configs/kvquant/layers/0/values/grid", [](auto& v) { std::swap(v[0], v[3]); });
                  });
                },
                "/configs/kvquant/layers/0/values/grid", "strictly ascending"},
        Corrupt{"shape_of_another_model",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    replace_dataset(f, "/configs/kvquant/layers/0/keys/channel_scale", H5T_IEEE_F32LE, {3, 8}, 0.5f);
                  });
                },
                "/configs/kvquant/layers/0/keys/channel_scale",
                "expected shape [2, 8] ([num_kv_heads, head_dim] of /model), got [3, 8]"},
        Corrupt{"float64_grid",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    replace_dataset(f, "/configs/kvquant/layers/0/keys/grid", H5T_IEEE_F64LE, {4}, 0.5f);
                  });
                },
                "/configs/kvquant/layers/0/keys/grid", "expected float32, got float64"},
        Corrupt{"missing_dataset",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    ASSERT_GE(H5Ldelete(f, "/configs/kvquant/layers/1/keys/outlier_high", H5P_DEFAULT), 0);
                  });
                },
                "/configs/kvquant/layers/1/keys/outlier_high", "missing"},
        Corrupt{"missing_effective_bits",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { ASSERT_GE(H5Ldelete(f, "/configs/rtn/effective_bits", H5P_DEFAULT), 0); });
                },
                "/configs/rtn/effective_bits", "missing"},
        Corrupt{"thresholds_inconsistent_with_scales",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    edit_floats(f, "/configs/kvquant/layers/0/keys/channel_scale", [](auto& v) { v[4] *= 0.5f; });
                  });
                },
                "/configs/kvquant/layers/0/keys/outlier_low", "expected (low - channel_offset) / channel_scale >= -1"},
        Corrupt{"scale_zero",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    edit_floats(f, "/configs/kvquant/layers/1/keys/channel_scale", [](auto& v) { v[15] = 0; });
                  });
                },
                "/configs/kvquant/layers/1/keys/channel_scale", "expected values > 0, element [1, 7] is 0"},
        Corrupt{"scales_copied_across_layers",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    for (const char* name : {"channel_scale", "channel_offset", "outlier_low", "outlier_high"}) {
                      ASSERT_GE(
                          H5Ldelete(f, ("/configs/kvquant/layers/1/keys/" + std::string(name)).c_str(), H5P_DEFAULT),
                          0);
                      ASSERT_GE(H5Ocopy(f, ("/configs/kvquant/layers/0/keys/" + std::string(name)).c_str(), f,
                                        ("/configs/kvquant/layers/1/keys/" + std::string(name)).c_str(), H5P_DEFAULT,
                                        H5P_DEFAULT),
                                0);
                    }
                  });
                },
                "/configs/kvquant/layers/1/keys/channel_scale", "the same as layer 0's"},
        Corrupt{"missing_attribute",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    ASSERT_GE(H5Adelete_by_name(f, "/configs/kivi", "keys_group", H5P_DEFAULT), 0);
                  });
                },
                "/configs/kivi@keys_group", "missing"},
        Corrupt{"string_for_float",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    set_string_attribute(f, "/configs/int2-rot/layers/1/values", "clip_ratio", "0.92");
                  });
                },
                "/configs/int2-rot/layers/1/values@clip_ratio", "expected a float, got string"},
        Corrupt{"unknown_grouping",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { set_string_attribute(f, "/configs/kivi", "keys_grouping", "per_head"); });
                },
                "/configs/kivi@keys_grouping", "got \"per_head\""},
        Corrupt{"grid_for_uniform_settings",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    set_int_attribute(f, "/configs/kvquant", "values_non_uniform", 0);
                    set_string_attribute(f, "/configs/kvquant", "values_q_norm", "none");
                  });
                },
                "/configs/kvquant/layers/0/values/grid", "expected none: values_non_uniform is 0"},
        Corrupt{"q_norm_for_uniform_settings",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { set_int_attribute(f, "/configs/kvquant", "values_non_uniform", 0); });
                },
                "/configs/kvquant@values_q_norm", "expected none when values_non_uniform is 0"},
        Corrupt{"missing_layer",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { ASSERT_GE(H5Ldelete(f, "/configs/kivi/layers/1", H5P_DEFAULT), 0); });
                },
                "/configs/kivi/layers", "expected 2 layers (/model@num_layers), got 1"},
        Corrupt{"unlisted_config",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    ASSERT_GE(H5Ocopy(f, "/configs/rtn", f, "/configs/rtn2", H5P_DEFAULT, H5P_DEFAULT), 0);
                  });
                },
                "/configs", "expected exactly the 7 groups listed in /configs@names, got 8"},
        // --- version 3's rotations -----------------------------------------------------
        Corrupt{"matrix_not_orthogonal",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    edit_floats(f, (kLearnedRotation0 + "/keys/matrix").c_str(), [](auto& v) { v[70] += 0.01f; });
                  });
                },
                kLearnedRotation0 + "/keys/matrix", "expected orthogonal matrices"},
        Corrupt{"matrix_heads_of_another_model",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    replace_dataset(f, (kLearnedRotation1 + "/values/matrix").c_str(), H5T_IEEE_F32LE, {4, 8, 8}, 0);
                  });
                },
                kLearnedRotation1 + "/values/matrix",
                "expected shape [2, 8, 8] ([num_kv_heads, head_dim, head_dim] of /model), got [4, 8, 8]"},
        Corrupt{"matrix_float64",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    replace_dataset(f, (kLearnedRotation0 + "/keys/matrix").c_str(), H5T_IEEE_F64LE, {2, 8, 8}, 0);
                  });
                },
                kLearnedRotation0 + "/keys/matrix", "expected float32, got float64"},
        Corrupt{"missing_layer_rotation",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { ASSERT_GE(H5Ldelete(f, kLearnedRotation1.c_str(), H5P_DEFAULT), 0); });
                },
                kLearnedRotation1, "missing"},
        Corrupt{"missing_angles",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    ASSERT_GE(H5Ldelete(f, "/configs/kvquant-pair-angles/layers/0/rotation/keys/angles", H5P_DEFAULT),
                              0);
                  });
                },
                "/configs/kvquant-pair-angles/layers/0/rotation/keys/angles", "missing"},
        Corrupt{"rotation_in_unrotated_layer",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    ASSERT_GE(H5Ocopy(f, kLearnedRotation0.c_str(), f, "/configs/rtn/layers/1/rotation", H5P_DEFAULT,
                                      H5P_DEFAULT),
                              0);
                  });
                },
                "/configs/rtn/layers/1/rotation", "expected none: the configuration has no /configs/rtn/rotation"},
        Corrupt{"matrix_keys_made_pre_rope",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { set_int_attribute(f, "/configs/int2-rot-learned", "keys_pre_rope", 1); });
                },
                "/configs/int2-rot-learned/rotation@keys_form", "(a full matrix does not commute with RoPE)"},
        Corrupt{"unknown_form",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    set_string_attribute(f, "/configs/int2-rot-learned/rotation", "values_form", "householder");
                  });
                },
                "/configs/int2-rot-learned/rotation@values_form",
                "expected none, matrix or pair_angles, got \"householder\""},
        Corrupt{"unknown_head_basis",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    set_strings_attribute(f, (kLearnedRotation0 + "/values").c_str(), "basis", {"eigen", "walsh"});
                  });
                },
                kLearnedRotation0 + "/values@basis",
                "expected identity, hadamard, eigen or random, element [1] is \"walsh\""},
        Corrupt{"learned_out_of_range",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    replace_dataset(f, (kLearnedRotation0 + "/keys/learned").c_str(), H5T_STD_U8LE, {2}, 2);
                  });
                },
                kLearnedRotation0 + "/keys/learned", "expected 0 or 1, element [0] is 2"},
        Corrupt{"learned_per_head",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    replace_dataset(f, (kLearnedRotation0 + "/keys/learned").c_str(), H5T_STD_U8LE, {3}, 1);
                  });
                },
                kLearnedRotation0 + "/keys/learned", "expected shape [2] (num_kv_heads of /model), got [3]"},
        Corrupt{"centre_without_key_centred",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    set_int_attribute(f, "/configs/int2-rot-learned/rotation", "key_centred", 0);
                  });
                },
                kLearnedRotation0 + "/keys/centre", "expected none"},
        Corrupt{"loss_partly_missing",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) {
                    ASSERT_GE(H5Ldelete(f, (kLearnedRotation1 + "/loss_value_base").c_str(), H5P_DEFAULT), 0);
                  });
                },
                kLearnedRotation1 + "/loss_value_base", "missing"},
        Corrupt{"bits_changed",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { set_int_attribute(f, "/configs/kvquant", "bits", 3); });
                },
                "/configs/kvquant/layers/0/keys/grid", "expected shape [8] (2^bits levels), got [4]"},
        Corrupt{"bool_out_of_range",
                [](const fs::path& p) {
                  edit_hdf5(p, [](hid_t f) { set_int_attribute(f, "/configs/kvquant", "keys_pre_rope", 2); });
                },
                "/configs/kvquant@keys_pre_rope", "expected 0 or 1, got 2"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Artifact, ReaderIgnoresUnknownAttributes) {
  const auto dir = scratch_dir("artifact-extra");
  const auto path = dir / "a.h5";
  const Artifact artifact = make_artifact();
  write_artifact(path, artifact);
  edit_hdf5(path, [](hid_t f) {
    set_string_attribute(f, "/", "future_note", "added by a later minor revision");
    set_int_attribute(f, "/configs/kivi", "kernel_hint", 3);
    set_int_attribute(f, "/configs/kvquant/layers/1/keys", "fit_iterations", 40);
  });
  EXPECT_EQ(read_artifact(path), artifact);
}

// --- version 1 files ----------------------------------------------------------------
//
// A version 1 file as kvforge wrote it before version 2: the same layout
// without the per-tensor rules (X_outlier_rule, X_residual_rule, X_q_norm),
// with one configuration-level bool `q_norm`, no encode_grid, and
// schema_version 1. Made here with the HDF5 C API from a version 2 file of
// settings version 1 could express.

// What version 1 could store: kvforge's old rules (outliers by thresholds or
// tau, sliding windows, Q-Norm iterated on every fitted grid or on none).
Artifact version_1_artifact() {
  Artifact artifact = unrotated(make_artifact());
  std::erase_if(artifact.configs, [](const QuantizerConfig& c) { return c.name == "kvquant"; });
  config_named(artifact, "kivi").settings.keys.residual_rule = ResidualRule::kSliding;
  return artifact;
}

void delete_attribute(hid_t file, const std::string& object, const std::string& name) {
  ASSERT_GE(H5Adelete_by_name(file, object.c_str(), name.c_str(), H5P_DEFAULT), 0) << object << "@" << name;
}

void set_uint8_attribute(hid_t file, const std::string& object, const char* name, uint8_t value) {
  const hid_t group = H5Oopen(file, object.c_str(), H5P_DEFAULT);
  ASSERT_GE(group, 0);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t attribute = H5Acreate2(group, name, H5T_STD_U8LE, space, H5P_DEFAULT, H5P_DEFAULT);
  EXPECT_GE(H5Awrite(attribute, H5T_NATIVE_UINT8, &value), 0);
  H5Aclose(attribute);
  H5Sclose(space);
  H5Oclose(group);
}

// Rewrites a version 2 file of `artifact` (which version 1 can express) as version 1;
// `q_norm` gives each configuration's version 1 bool.
void make_version_1(const fs::path& path, const Artifact& artifact,
                    const std::function<bool(const QuantizerConfig&)>& q_norm) {
  edit_hdf5(path, [&](hid_t f) {
    set_int_attribute(f, "/", "schema_version", 1);
    for (const auto& config : artifact.configs) {
      const std::string object = "/configs/" + config.name;
      for (const char* kind : {"keys", "values"}) {
        for (const char* rule : {"_outlier_rule", "_residual_rule", "_q_norm"}) {
          delete_attribute(f, object, std::string(kind) + rule);
        }
      }
      set_uint8_attribute(f, object, "q_norm", q_norm(config) ? 1 : 0);
    }
  });
}

bool has_iterated_grid(const QuantizerConfig& config) {
  return config.settings.keys.q_norm == QNorm::kIterated || config.settings.values.q_norm == QNorm::kIterated;
}

TEST(Artifact, ReadsVersion1FilesAsVersion2Values) {
  const auto dir = scratch_dir("artifact-version-1");
  const auto path = dir / "v1.h5";
  const Artifact artifact = version_1_artifact();
  write_artifact(path, artifact);
  make_version_1(path, artifact, has_iterated_grid);
  const Artifact read = read_artifact(path);
  EXPECT_EQ(read, artifact);
  // The mapping, spelled out.
  const auto& variants = config_named(read, "kvquant-variants").settings;
  EXPECT_EQ(variants.keys.outlier_rule, OutlierRule::kChannelThresholds);
  EXPECT_EQ(variants.values.outlier_rule, OutlierRule::kTokenTau);
  EXPECT_EQ(variants.keys.q_norm, QNorm::kIterated);
  EXPECT_EQ(variants.values.q_norm, QNorm::kIterated);
  EXPECT_EQ(config_named(read, "kivi").settings.keys.residual_rule, ResidualRule::kSliding);
  EXPECT_EQ(config_named(read, "rtn").settings.keys.outlier_rule, OutlierRule::kNone);

  // Writing what was read writes version 3, which reads back the same.
  write_artifact(dir / "v2.h5", read);
  EXPECT_EQ(read_artifact(dir / "v2.h5"), artifact);
  const hid_t file = H5Fopen((dir / "v2.h5").c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(file, 0);
  const hid_t attribute = H5Aopen(file, "schema_version", H5P_DEFAULT);
  int64_t version = 0;
  EXPECT_GE(H5Aread(attribute, H5T_NATIVE_INT64, &version), 0);
  EXPECT_EQ(version, kArtifactVersion);
  EXPECT_GT(H5Aexists_by_name(file, "/configs/kivi", "keys_residual_rule", H5P_DEFAULT), 0);
  EXPECT_EQ(H5Aexists_by_name(file, "/configs/kivi", "q_norm", H5P_DEFAULT), 0);
  H5Aclose(attribute);
  H5Fclose(file);
}

TEST(Artifact, Version1QNormAppliesToFittedGridsOnly) {
  const auto dir = scratch_dir("artifact-version-1-q-norm");
  const auto path = dir / "v1.h5";
  // q_norm 1 on every configuration: uniform tensors (kivi, int2-rot, rtn) still get none.
  Artifact artifact = version_1_artifact();
  write_artifact(path, artifact);
  make_version_1(path, artifact, [](const QuantizerConfig&) { return true; });
  EXPECT_EQ(read_artifact(path), artifact);
  // q_norm 0: the fitted grids were not corrected.
  write_artifact(path, artifact);
  make_version_1(path, artifact, [](const QuantizerConfig&) { return false; });
  for (auto& config : artifact.configs) config.settings.keys.q_norm = config.settings.values.q_norm = QNorm::kNone;
  const Artifact read = read_artifact(path);
  EXPECT_EQ(read, artifact);
  EXPECT_EQ(config_named(read, "kvquant-variants").settings.values.q_norm, QNorm::kNone);
}

TEST(Artifact, Version1FilesRefuseWhatVersion1Lacks) {
  const auto dir = scratch_dir("artifact-version-1-refuses");
  const auto path = dir / "v1.h5";
  const Artifact artifact = version_1_artifact();
  // A grouping version 1 did not have.
  write_artifact(path, artifact);
  make_version_1(path, artifact, has_iterated_grid);
  edit_hdf5(path, [](hid_t f) { set_string_attribute(f, "/configs/rtn", "values_grouping", "per_token_all_heads"); });
  auto error = input_error_of([&] { read_artifact(path); });
  EXPECT_EQ(error.field(), "/configs/rtn@values_grouping") << error.what();
  EXPECT_NE(std::string(error.what())
                .find("expected per_token, per_channel_tokens or per_channel_offline, got \"per_token_all_heads\""),
            std::string::npos)
      << error.what();
  // Version 1's q_norm is required there.
  write_artifact(path, artifact);
  make_version_1(path, artifact, has_iterated_grid);
  edit_hdf5(path, [](hid_t f) { delete_attribute(f, "/configs/kivi", "q_norm"); });
  error = input_error_of([&] { read_artifact(path); });
  EXPECT_EQ(error.field(), "/configs/kivi@q_norm") << error.what();
  EXPECT_NE(std::string(error.what()).find("missing"), std::string::npos) << error.what();
  // Version 1 rules still hold: runtime outliers need their tau.
  write_artifact(path, artifact);
  make_version_1(path, artifact, has_iterated_grid);
  edit_hdf5(path, [](hid_t f) {
    const hid_t group = H5Oopen(f, "/configs/kvquant-variants/layers/0/values", H5P_DEFAULT);
    ASSERT_GE(group, 0);
    H5Adelete(group, "outlier_tau");
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t attribute = H5Acreate2(group, "outlier_tau", H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT);
    const float zero = 0;
    EXPECT_GE(H5Awrite(attribute, H5T_NATIVE_FLOAT, &zero), 0);
    H5Aclose(attribute);
    H5Sclose(space);
    H5Oclose(group);
  });
  error = input_error_of([&] { read_artifact(path); });
  EXPECT_EQ(error.field(), "/configs/kvquant-variants/layers/0/values@outlier_tau") << error.what();
  // An encode_grid in a version 1 file is a dataset version 1 does not know: ignored.
  write_artifact(path, artifact);
  make_version_1(path, artifact, has_iterated_grid);
  edit_hdf5(path, [](hid_t f) {
    ASSERT_GE(H5Ocopy(f, "/configs/kvquant-variants/layers/0/keys/grid", f,
                      "/configs/kvquant-variants/layers/0/keys/encode_grid", H5P_DEFAULT, H5P_DEFAULT),
              0);
  });
  EXPECT_EQ(read_artifact(path), artifact);
}

// --- version 2 files ----------------------------------------------------------------
//
// A version 2 file is a version 3 file without rotations (docs/artifact.md):
// made here by writing the configurations version 2 could store and setting
// schema_version to 2.

TEST(Artifact, ReadsVersion2FilesWithoutRotations) {
  const auto dir = scratch_dir("artifact-version-2");
  const auto path = dir / "v2.h5";
  const Artifact artifact = unrotated(make_artifact());
  write_artifact(path, artifact);
  edit_hdf5(path, [](hid_t f) { set_int_attribute(f, "/", "schema_version", 2); });
  const Artifact read = read_artifact(path);
  EXPECT_EQ(read, artifact);
  for (const auto& config : read.configs) EXPECT_FALSE(config.rotation.has_value()) << config.name;
}

// Rotation groups in a version 2 file are items version 2 does not know:
// ignored, as the compatibility rules say of unknown groups.
TEST(Artifact, Version2FilesIgnoreRotationGroups) {
  const auto dir = scratch_dir("artifact-version-2-rotation");
  const auto path = dir / "v2.h5";
  Artifact artifact = make_artifact();
  write_artifact(path, artifact);
  edit_hdf5(path, [](hid_t f) { set_int_attribute(f, "/", "schema_version", 2); });
  for (auto& config : artifact.configs) {
    config.rotation.reset();
    for (auto& layer : config.layers) layer.rotation = {};
  }
  EXPECT_EQ(read_artifact(path), artifact);
}

// --- the model check ---------------------------------------------------------------

TEST(Artifact, CheckMatchesNamesTheDifferingFingerprintField) {
  const Artifact artifact = make_artifact();
  EXPECT_NO_THROW(check_artifact_matches(artifact, small_model(), "a.h5"));
  ModelFingerprint other = small_model();
  other.kvo_sha256 = "9c1e" + std::string(60, '0');
  auto error = input_error_of([&] { check_artifact_matches(artifact, other, "a.h5"); });
  EXPECT_EQ(error.file(), "a.h5");
  EXPECT_EQ(error.field(), "model.kvo_sha256");
  EXPECT_NE(std::string(error.what()).find("calibrated for a model with aaaaaaaaaaaa..., got 9c1e00000000..."),
            std::string::npos)
      << error.what();
  other = small_model();
  other.num_kv_heads = 4;
  EXPECT_EQ(input_error_of([&] { check_artifact_matches(artifact, other, "a.h5"); }).field(), "model.num_kv_heads");
  other = small_model();
  other.rope = R"({"theta":500000.0,"type":"default"})";
  EXPECT_EQ(input_error_of([&] { check_artifact_matches(artifact, other, "a.h5"); }).field(), "model.rope");
}

// --- the independent h5py reader ---------------------------------------------------

struct Output {
  int exit_code = -1;
  std::string text;  // stdout, then stderr
};

Output run_checker(const fs::path& path) {
  const testing::CommandResult result =
      testing::run_python(testing::fixtures_dir().parent_path() / "check_artifact.py", path);
  return {result.exit_code, result.stdout_text + result.stderr_text};
}

// --- comparing the h5py reader's report with what we wrote ---------------------------
//
// The report (tests/check_artifact.py's docstring) gives, per configuration,
// the settings, and per layer and tensor the scalars and, for every dataset,
// a position-weighted checksum sum_i v_i * (1 + i) over the flat row-major
// index i and the values at a few indices: a sum alone would not see two
// heads, channels or levels trade places.

// Flat indices the report samples: 0, 1, n / 2 and n - 1 (ascending, once each).
std::vector<size_t> sampled_indices(size_t n) {
  std::vector<size_t> indices;
  for (const size_t i : {size_t{0}, size_t{1}, n / 2, n - 1}) {
    if (i < n && (indices.empty() || i > indices.back())) indices.push_back(i);
  }
  return indices;
}

struct Checksum {
  double value = 0;      // sum_i v_i * (1 + i), summed in index order
  double tolerance = 0;  // how far another float64 summation order may land from it
};

// Each product v_i * (1 + i) is exact in float64 (a 24-bit float32 mantissa
// times an integer below 2^29), so the only rounding is the summation's:
// any order of summing n terms is within (n - 1) u sum_i |t_i| of the exact
// sum (u = 2^-53; numpy sums pairwise, we sum in order), hence two orders are
// within 2 (n - 1) u sum_i |t_i| of each other.
Checksum position_weighted(const std::vector<float>& values) {
  Checksum checksum;
  double magnitude = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const double term = static_cast<double>(values[i]) * static_cast<double>(i + 1);
    checksum.value += term;
    magnitude += std::abs(term);
  }
  const double n = static_cast<double>(values.size());
  checksum.tolerance = 2 * std::max(n - 1, 0.0) * std::ldexp(1.0, -53) * magnitude;
  return checksum;
}

// Appends to `problems` each way `theirs` (one dataset's report entry, or null) differs from `ours`.
void compare_dataset(const nlohmann::json& theirs, const std::vector<float>& ours, const std::string& what,
                     std::vector<std::string>& problems) {
  if (ours.empty()) {
    if (!theirs.is_null()) problems.push_back(what + ": reported " + theirs.dump() + ", we wrote none");
    return;
  }
  if (theirs.is_null()) {
    problems.push_back(what + ": not reported, we wrote " + std::to_string(ours.size()) + " values");
    return;
  }
  const Checksum checksum = position_weighted(ours);
  const double reported = theirs.at("checksum").get<double>();
  if (!(std::abs(reported - checksum.value) <= checksum.tolerance)) {
    problems.push_back(what + ": checksum " + std::to_string(reported) + ", ours " + std::to_string(checksum.value));
  }
  const std::vector<size_t> indices = sampled_indices(ours.size());
  const auto& elements = theirs.at("elements");
  if (elements.size() != indices.size()) {
    problems.push_back(what + ": " + std::to_string(elements.size()) + " sampled elements, expected " +
                       std::to_string(indices.size()));
    return;
  }
  for (size_t j = 0; j < indices.size(); ++j) {
    // float32 -> float64 -> JSON (Python's shortest repr) -> float64: exact.
    if (elements[j].at(0).get<size_t>() != indices[j] ||
        elements[j].at(1).get<double>() != static_cast<double>(ours[indices[j]])) {
      problems.push_back(what + ": element " + elements[j].dump() + ", ours [" + std::to_string(indices[j]) + ", " +
                         std::to_string(ours[indices[j]]) + "]");
    }
  }
}

template <class T>
void compare_value(const nlohmann::json& theirs, const T& ours, const std::string& what,
                   std::vector<std::string>& problems) {
  if (theirs.get<T>() != ours) problems.push_back(what + ": reported " + theirs.dump());
}

// The rotation of `config` against the report's entry for it (null when unrotated).
void compare_rotation(const nlohmann::json& theirs, const QuantizerConfig& config, std::vector<std::string>& problems) {
  const std::string& name = config.name;
  if (!config.rotation) {
    if (!theirs.is_null()) problems.push_back(name + "/rotation: reported, we wrote none");
    return;
  }
  if (theirs.is_null()) {
    problems.push_back(name + "/rotation: not reported");
    return;
  }
  const RotationSettings& r = *config.rotation;
  const auto& settings = theirs.at("settings");
  const std::string at = name + "/rotation@";
  compare_value(settings.at("keys_form"), std::string(rotation_form_name(r.keys)), at + "keys_form", problems);
  compare_value(settings.at("values_form"), std::string(rotation_form_name(r.values)), at + "values_form", problems);
  compare_value(settings.at("keys_basis"), std::string(basis_name(r.key_basis)), at + "keys_basis", problems);
  compare_value(settings.at("values_basis"), std::string(basis_name(r.value_basis)), at + "values_basis", problems);
  compare_value(settings.at("key_centred"), r.key_centred, at + "key_centred", problems);
  compare_value(settings.at("folded"), r.folded, at + "folded", problems);
  compare_value(settings.at("gradient"), r.gradient, at + "gradient", problems);
  // float64 both ways: exact.
  compare_value(settings.at("key_kl_weight"), r.key_kl_weight, at + "key_kl_weight", problems);
  compare_value(settings.at("key_output_weight"), r.key_output_weight, at + "key_output_weight", problems);
  compare_value(settings.at("value_output_weight"), r.value_output_weight, at + "value_output_weight", problems);
  compare_value(settings.at("learning_rate"), r.learning_rate, at + "learning_rate", problems);
  compare_value(settings.at("steps"), r.steps, at + "steps", problems);
  compare_value(settings.at("last_queries"), r.last_queries, at + "last_queries", problems);
  compare_value(settings.at("fit_samples"), r.fit_samples, at + "fit_samples", problems);
  compare_value(settings.at("validation_samples"), r.validation_samples, at + "validation_samples", problems);
  const auto& layers = theirs.at("layers");
  if (layers.size() != config.layers.size()) {
    problems.push_back(name + "/rotation: " + std::to_string(layers.size()) + " layers reported");
    return;
  }
  for (size_t i = 0; i < config.layers.size(); ++i) {
    const LayerRotation& ours = config.layers[i].rotation;
    const std::string layer = name + "/layers/" + std::to_string(i) + "/rotation";
    for (const auto& [kind, t, form] :
         {std::tuple<std::string, const TensorRotation&, RotationForm>{"keys", ours.keys, r.keys},
          std::tuple<std::string, const TensorRotation&, RotationForm>{"values", ours.values, r.values}}) {
      const auto& entry = layers[i].at(kind);
      const std::string what = layer + "/" + kind;
      if (form == RotationForm::kNone) {
        if (!entry.is_null()) problems.push_back(what + ": reported, we wrote none");
        continue;
      }
      compare_dataset(entry.at("matrix"), t.matrix.values, what + "/matrix", problems);
      compare_dataset(entry.at("angles"), t.angles.values, what + "/angles", problems);
      compare_dataset(entry.at("centre"), t.centre.values, what + "/centre", problems);
      std::vector<std::string> bases;
      for (const RotationBasis b : t.basis) bases.emplace_back(basis_name(b));
      compare_value(entry.at("basis"), bases, what + "@basis", problems);
      std::vector<int> learned;
      for (const bool flag : t.learned) learned.push_back(flag ? 1 : 0);
      compare_value(entry.at("learned"), learned, what + "/learned", problems);
      // numpy's float64 ||R^T R - I||_F of our float32-rounded orthogonal matrices: within the documented
      // bound 2 (2u + u^2) D.
      const double u = std::ldexp(1.0, -24);
      if (form == RotationForm::kMatrix && !(entry.at("orthogonality").get<double>() <= 2 * (2 * u + u * u) * kHeadDim)) {
        problems.push_back(what + "/matrix: orthogonality " + entry.at("orthogonality").dump());
      }
    }
    const auto& loss = layers[i].at("loss");
    if (ours.loss.empty()) {
      if (!loss.is_null()) problems.push_back(layer + ": losses reported, we wrote none");
      continue;
    }
    if (loss.is_null()) {
      problems.push_back(layer + ": losses not reported");
      continue;
    }
    for (const auto& [field, member] : {std::pair<const char*, double HeadRotationLoss::*>{"loss_key_base", &HeadRotationLoss::key_base},
                                        {"loss_key_learned", &HeadRotationLoss::key_learned},
                                        {"loss_value_base", &HeadRotationLoss::value_base},
                                        {"loss_value_learned", &HeadRotationLoss::value_learned}}) {
      // float64 values: the checksum within two summation orders' bound (as position_weighted), the
      // sampled elements exact through JSON.
      const auto& entry = loss.at(field);
      double checksum = 0, magnitude = 0;
      for (size_t h = 0; h < ours.loss.size(); ++h) {
        checksum += ours.loss[h].*member * static_cast<double>(h + 1);
        magnitude += std::abs(ours.loss[h].*member) * static_cast<double>(h + 1);
      }
      const double n = static_cast<double>(ours.loss.size());
      // Products v (h + 1) of float64 values are rounded too: one more u per term.
      const double tolerance = (2 * (n - 1) + 2) * std::ldexp(1.0, -53) * magnitude;
      const double reported = entry.at("checksum").get<double>();
      if (!(std::abs(reported - checksum) <= tolerance)) {
        problems.push_back(layer + "/" + field + ": checksum " + std::to_string(reported));
      }
      for (const auto& element : entry.at("elements")) {
        const auto h = element.at(0).get<size_t>();
        if (h >= ours.loss.size() || element.at(1).get<double>() != ours.loss[h].*member) {
          problems.push_back(layer + "/" + field + ": element " + element.dump());
        }
      }
    }
  }
}

// Every difference between the h5py reader's report and `artifact` (empty: they agree).
// `version`: the file's schema version (the report maps version 1 files onto version 2 settings, as we do).
std::vector<std::string> report_differences(const nlohmann::json& report, const Artifact& artifact,
                                            int version = kArtifactVersion) {
  std::vector<std::string> problems;
  compare_value(report.at("schema_version"), version, "schema_version", problems);
  compare_value(report.at("num_layers"), artifact.model.num_layers, "num_layers", problems);
  compare_value(report.at("sources"), artifact.calibration.sources.size(), "sources", problems);
  compare_value(report.at("calibration_tokens"), artifact.calibration.calibration_tokens, "calibration_tokens",
                problems);
  std::vector<std::string> names;
  for (const auto& config : artifact.configs) names.push_back(config.name);
  compare_value(report.at("configs"), names, "configs", problems);
  for (const auto& config : artifact.configs) {
    const std::string& name = config.name;
    const QuantizerSettings& s = config.settings;
    const auto& settings = report.at("settings").at(name);
    compare_value(settings.at("method"), std::string(method_name(s.method)), name + "@method", problems);
    compare_value(settings.at("bits"), s.bits, name + "@bits", problems);
    compare_value(settings.at("keys_pre_rope"), s.keys_pre_rope, name + "@keys_pre_rope", problems);
    compare_value(settings.at("fisher_weighted"), s.fisher_weighted, name + "@fisher_weighted", problems);
    compare_value(settings.at("sink_tokens"), s.sink_tokens, name + "@sink_tokens", problems);
    compare_value(settings.at("residual_tokens"), s.residual_tokens, name + "@residual_tokens", problems);
    for (const auto& [kind, t] : {std::pair<std::string, const TensorQuantizerSettings&>{"keys", s.keys},
                                  std::pair<std::string, const TensorQuantizerSettings&>{"values", s.values}}) {
      const auto& theirs = settings.at(kind);
      const std::string at = name + "@" + kind + "_";
      compare_value(theirs.at("grouping"), std::string(grouping_name(t.grouping)), at + "grouping", problems);
      compare_value(theirs.at("group"), t.group, at + "group", problems);
      compare_value(theirs.at("non_uniform"), t.non_uniform, at + "non_uniform", problems);
      compare_value(theirs.at("outlier_fraction"), t.outlier_fraction, at + "outlier_fraction", problems);
      compare_value(theirs.at("outlier_rule"), std::string(outlier_rule_name(t.outlier_rule)), at + "outlier_rule",
                    problems);
      compare_value(theirs.at("residual_rule"), std::string(residual_rule_name(t.residual_rule)), at + "residual_rule",
                    problems);
      compare_value(theirs.at("q_norm"), std::string(q_norm_name(t.q_norm)), at + "q_norm", problems);
    }
    const auto& layers = report.at("layers").at(name);
    if (layers.size() != config.layers.size()) {
      problems.push_back(name + ": " + std::to_string(layers.size()) + " layers reported");
      continue;
    }
    for (size_t i = 0; i < config.layers.size(); ++i) {
      for (const auto& [kind, q] :
           {std::pair<std::string, const TensorQuantizer&>{"keys", config.layers[i].keys},
            std::pair<std::string, const TensorQuantizer&>{"values", config.layers[i].values}}) {
        const auto& theirs = layers[i].at(kind);
        const std::string at = name + "/layers/" + std::to_string(i) + "/" + kind;
        // float32 attributes: exact through float64 and JSON.
        compare_value(theirs.at("clip_ratio"), static_cast<double>(q.clip_ratio), at + "@clip_ratio", problems);
        compare_value(theirs.at("outlier_tau"), static_cast<double>(q.outlier_tau), at + "@outlier_tau", problems);
        const auto& datasets = theirs.at("datasets");
        compare_dataset(datasets.at("grid"), q.grid, at + "/grid", problems);
        compare_dataset(datasets.at("encode_grid"), q.encode_grid, at + "/encode_grid", problems);
        compare_dataset(datasets.at("channel_scale"), q.channel_scale.values, at + "/channel_scale", problems);
        compare_dataset(datasets.at("channel_offset"), q.channel_offset.values, at + "/channel_offset", problems);
        compare_dataset(datasets.at("outlier_low"), q.outlier_low.values, at + "/outlier_low", problems);
        compare_dataset(datasets.at("outlier_high"), q.outlier_high.values, at + "/outlier_high", problems);
      }
    }
    compare_rotation(report.at("rotation").at(name), config, problems);
    const auto& rows = report.at("effective_bits").at(name);
    if (rows.size() != config.effective_bits.size()) {
      problems.push_back(name + "/effective_bits: " + std::to_string(rows.size()) + " rows reported");
      continue;
    }
    for (size_t j = 0; j < rows.size(); ++j) {
      compare_value(rows[j][0], config.effective_bits[j].first, name + "/effective_bits context", problems);
      // float64 both ways: exact.
      compare_value(rows[j][1], config.effective_bits[j].second, name + "/effective_bits bits", problems);
    }
  }
  return problems;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string text;
  for (const auto& line : lines) text += line + "\n";
  return text;
}

TEST(Artifact, IndependentH5pyReaderAgrees) {
  KVFORGE_REQUIRE_H5PY();
  const auto dir = scratch_dir("artifact-h5py");
  const auto path = dir / "a.h5";
  write_artifact(path, make_artifact());
  const Artifact artifact = read_artifact(path);
  const Output output = run_checker(path);
  ASSERT_EQ(output.exit_code, 0) << output.text;
  const std::vector<std::string> differences = report_differences(nlohmann::json::parse(output.text), artifact);
  EXPECT_TRUE(differences.empty()) << joined(differences);
}

// Swaps KV heads 0 and 1 of every [Hkv, D] dataset of one tensor group in the
// file: still a valid artifact, with the same per-dataset sums, but not the one written.
void swap_heads(hid_t file, const std::string& tensor) {
  for (const char* name : {"channel_scale", "channel_offset", "outlier_low", "outlier_high"}) {
    edit_floats(file, (tensor + "/" + name).c_str(),
                [](std::vector<float>& v) { std::swap_ranges(v.begin(), v.begin() + kHeadDim, v.begin() + kHeadDim); });
  }
}

TEST(Artifact, ComparisonWithTheH5pyReaderSeesSwappedHeads) {
  KVFORGE_REQUIRE_H5PY();
  const auto dir = scratch_dir("artifact-h5py-swapped");
  const auto path = dir / "a.h5";
  const Artifact written = make_artifact();
  write_artifact(path, written);
  edit_hdf5(path, [](hid_t f) { swap_heads(f, kKvquantKeys0); });
  const Artifact swapped = read_artifact(path);  // valid: the thresholds moved with their scales
  const auto& ours = config_named(written, "kvquant").layers[0].keys.channel_scale.values;
  const auto& theirs = config_named(swapped, "kvquant").layers[0].keys.channel_scale.values;
  ASSERT_NE(theirs, ours);
  // What a plain sum would have compared: equal (up to the order of float64 additions).
  double sum_ours = 0, sum_theirs = 0;
  for (size_t i = 0; i < ours.size(); ++i) sum_ours += ours[i], sum_theirs += theirs[i];
  EXPECT_NEAR(sum_theirs, sum_ours, 1e-12 * std::abs(sum_ours) + 1e-12);

  const Output output = run_checker(path);
  ASSERT_EQ(output.exit_code, 0) << output.text;
  const std::vector<std::string> differences = report_differences(nlohmann::json::parse(output.text), written);
  const std::string text = joined(differences);
  for (const char* name : {"channel_scale", "channel_offset", "outlier_low", "outlier_high"}) {
    EXPECT_NE(text.find("kvquant/layers/0/keys/" + std::string(name) + ": checksum"), std::string::npos) << name << "\n"
                                                                                                         << text;
  }
  EXPECT_EQ(text.find("layers/1"), std::string::npos) << text;  // nothing else differs
  // And against what the file now holds, they agree.
  EXPECT_TRUE(report_differences(nlohmann::json::parse(output.text), swapped).empty());
}

// The same for rotations: KV heads of a rotation matrix trading places keep
// the file valid (each is orthogonal) but change what the report says.
TEST(Artifact, ComparisonWithTheH5pyReaderSeesSwappedRotationHeads) {
  KVFORGE_REQUIRE_H5PY();
  const auto dir = scratch_dir("artifact-h5py-swapped-rotation");
  const auto path = dir / "a.h5";
  const Artifact written = make_artifact();
  write_artifact(path, written);
  edit_hdf5(path, [](hid_t f) {
    edit_floats(f, (kLearnedRotation1 + "/values/matrix").c_str(), [](std::vector<float>& v) {
      std::swap_ranges(v.begin(), v.begin() + kHeadDim * kHeadDim, v.begin() + kHeadDim * kHeadDim);
    });
  });
  const Artifact swapped = read_artifact(path);
  ASSERT_NE(swapped, written);
  const Output output = run_checker(path);
  ASSERT_EQ(output.exit_code, 0) << output.text;
  const std::string text = joined(report_differences(nlohmann::json::parse(output.text), written));
  EXPECT_NE(text.find("int2-rot-learned/layers/1/rotation/values/matrix: checksum"), std::string::npos) << text;
  EXPECT_TRUE(report_differences(nlohmann::json::parse(output.text), swapped).empty());
}

TEST(Artifact, IndependentH5pyReaderMapsVersion1AsWeDo) {
  KVFORGE_REQUIRE_H5PY();
  const auto dir = scratch_dir("artifact-h5py-version-1");
  const auto path = dir / "v1.h5";
  const Artifact artifact = version_1_artifact();
  write_artifact(path, artifact);
  make_version_1(path, artifact, [](const QuantizerConfig&) { return true; });
  const Output output = run_checker(path);
  ASSERT_EQ(output.exit_code, 0) << output.text;
  const std::vector<std::string> differences =
      report_differences(nlohmann::json::parse(output.text), read_artifact(path), 1);
  EXPECT_TRUE(differences.empty()) << joined(differences);
}

TEST(Artifact, IndependentH5pyReaderRefusesWhatWeRefuse) {
  KVFORGE_REQUIRE_H5PY();
  const auto dir = scratch_dir("artifact-h5py-refuses");
  struct Case {
    const char* name;
    std::function<void(hid_t)> damage;
    std::string object;
  };
  const std::vector<Case> cases = {
      {"nan_grid",
       [](hid_t f) {
         edit_floats(f, "/configs/kvquant/layers/1/keys/grid",
                     [](auto& v) { v[1] = std::numeric_limits<float>::quiet_NaN(); });
       },
       "/configs/kvquant/layers/1/keys/grid"},
      {"thresholds",
       [](hid_t f) { edit_floats(f, "/configs/kvquant/layers/0/keys/outlier_high", [](auto& v) { v[2] += 100; }); },
       "/configs/kvquant/layers/0/keys/outlier_high"},
      {"version", [](hid_t f) { set_int_attribute(f, "/", "schema_version", 4); }, "/@schema_version"},
      {"matrix_not_orthogonal",
       [](hid_t f) { edit_floats(f, (kLearnedRotation1 + "/values/matrix").c_str(), [](auto& v) { v[9] *= 1.01f; }); },
       kLearnedRotation1 + "/values/matrix"},
      {"matrix_shape",
       [](hid_t f) { replace_dataset(f, (kLearnedRotation0 + "/keys/matrix").c_str(), H5T_IEEE_F32LE, {2, 8, 4}, 0); },
       kLearnedRotation0 + "/keys/matrix"},
      {"matrix_keys_pre_rope",
       [](hid_t f) {
         delete_attribute(f, "/configs/int2-rot-learned", "keys_pre_rope");
         set_uint8_attribute(f, "/configs/int2-rot-learned", "keys_pre_rope", 1);
       },
       "/configs/int2-rot-learned/rotation@keys_form"},
      {"pair_angles_values",
       [](hid_t f) { set_string_attribute(f, "/configs/int2-rot-learned/rotation", "values_form", "pair_angles"); },
       "/configs/int2-rot-learned/rotation@values_form"},
      {"missing_layer_rotation", [](hid_t f) { ASSERT_GE(H5Ldelete(f, kLearnedRotation1.c_str(), H5P_DEFAULT), 0); },
       kLearnedRotation1},
      {"rotation_in_unrotated_layer",
       [](hid_t f) {
         ASSERT_GE(H5Ocopy(f, kLearnedRotation0.c_str(), f, "/configs/kivi/layers/0/rotation", H5P_DEFAULT, H5P_DEFAULT),
                   0);
       },
       "/configs/kivi/layers/0/rotation"},
      {"centre_without_key_centred",
       [](hid_t f) {
         delete_attribute(f, "/configs/int2-rot-learned/rotation", "key_centred");
         set_uint8_attribute(f, "/configs/int2-rot-learned/rotation", "key_centred", 0);
       },
       kLearnedRotation0 + "/keys/centre"},
      {"angles_nan",
       [](hid_t f) {
         edit_floats(f, "/configs/kvquant-pair-angles/layers/1/rotation/keys/angles",
                     [](auto& v) { v[5] = std::numeric_limits<float>::infinity(); });
       },
       "/configs/kvquant-pair-angles/layers/1/rotation/keys/angles"},
      {"learned_out_of_range",
       [](hid_t f) { replace_dataset(f, (kLearnedRotation0 + "/values/learned").c_str(), H5T_STD_U8LE, {2}, 3); },
       kLearnedRotation0 + "/values/learned"},
      {"unknown_head_basis",
       [](hid_t f) { set_strings_attribute(f, (kLearnedRotation0 + "/keys").c_str(), "basis", {"hadamard", "dct"}); },
       kLearnedRotation0 + "/keys@basis"},
      {"encode_grid_unsorted",
       [](hid_t f) {
         edit_floats(f, "/configs/kvquant/layers/1/values/encode_grid", [](auto& v) { std::swap(v[0], v[3]); });
       },
       "/configs/kvquant/layers/1/values/encode_grid"},
      {"encode_grid_missing",
       [](hid_t f) { ASSERT_GE(H5Ldelete(f, "/configs/kvquant/layers/0/keys/encode_grid", H5P_DEFAULT), 0); },
       "/configs/kvquant/layers/0/keys/encode_grid"},
      {"encode_grid_for_iterated",
       [](hid_t f) {
         ASSERT_GE(H5Ocopy(f, "/configs/kvquant-variants/layers/1/keys/grid", f,
                           "/configs/kvquant-variants/layers/1/keys/encode_grid", H5P_DEFAULT, H5P_DEFAULT),
                   0);
       },
       "/configs/kvquant-variants/layers/1/keys/encode_grid"},
      {"token_tau_over_all_heads",
       [](hid_t f) { set_string_attribute(f, "/configs/kvquant", "values_outlier_rule", "token_tau"); },
       "/configs/kvquant@values_outlier_rule"},
      {"rule_without_outliers",
       [](hid_t f) { set_string_attribute(f, "/configs/rtn", "keys_outlier_rule", "token_top_bottom"); },
       "/configs/rtn@keys_outlier_rule"},
      {"thresholds_rule_at_runtime",
       [](hid_t f) {
         set_string_attribute(f, "/configs/kvquant-variants", "values_outlier_rule", "channel_thresholds");
       },
       "/configs/kvquant-variants@values_outlier_rule"},
      {"block_flush_not_tiled", [](hid_t f) { set_int_attribute(f, "/configs/kivi", "residual_tokens", 80); },
       "/configs/kivi@keys_residual_rule"},
      {"block_flush_without_residual",
       [](hid_t f) {
         set_int_attribute(f, "/configs/rtn", "residual_tokens", 0);
         set_string_attribute(f, "/configs/rtn", "values_residual_rule", "block_flush");
       },
       "/configs/rtn@values_residual_rule"},
      {"q_norm_for_uniform", [](hid_t f) { set_string_attribute(f, "/configs/int2-rot", "keys_q_norm", "affine"); },
       "/configs/int2-rot@keys_q_norm"},
      {"group_for_all_heads", [](hid_t f) { set_int_attribute(f, "/configs/kvquant", "values_group", 8); },
       "/configs/kvquant@values_group"},
      {"unknown_q_norm", [](hid_t f) { set_string_attribute(f, "/configs/kvquant", "keys_q_norm", "yes"); },
       "/configs/kvquant@keys_q_norm"},
      {"shape",
       [](hid_t f) {
         replace_dataset(f, "/configs/kvquant/layers/0/keys/channel_scale", H5T_IEEE_F32LE, {3, 8}, 0.5f);
       },
       "/configs/kvquant/layers/0/keys/channel_scale"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto path = dir / (std::string(c.name) + ".h5");
    write_artifact(path, make_artifact());
    edit_hdf5(path, c.damage);
    EXPECT_EQ(input_error_of([&] { read_artifact(path); }).field(), c.object);
    const Output output = run_checker(path);
    EXPECT_EQ(output.exit_code, 1) << output.text;
    EXPECT_NE(output.text.find(path.string() + ": " + c.object + ":"), std::string::npos) << output.text;
  }
}

}  // namespace
}  // namespace kvforge
