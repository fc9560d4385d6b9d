// The calibration artifact: a round trip of configurations of all four
// methods, refusal to write degenerate parameters (leaving no file behind),
// refusal of corrupt files crafted with the HDF5 C API (each naming the
// object), the model check, and an independent h5py reader
// (tests/check_artifact.py) that must agree with ours.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
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

LayerCalibrationStats make_stats(std::mt19937& rng, double key_outliers, double value_outliers) {
  std::uniform_real_distribution<double> mse(0.01, 0.2);
  return {.key_relative_mse = mse(rng),
          .value_relative_mse = mse(rng),
          .key_outlier_fraction = key_outliers,
          .value_outlier_fraction = value_outliers,
          .logit_relative_mse = mse(rng) / 10};
}

QuantizerConfig kvquant_config(std::mt19937& rng) {
  QuantizerConfig config{.name = "kvquant"};
  auto& s = config.settings;
  s.method = QuantMethod::kKvquant;
  s.bits = 2;
  s.keys_pre_rope = true;
  s.keys = {.grouping = Grouping::kPerChannelOffline,
            .group = 0,
            .non_uniform = true,
            .outlier_fraction = 0.01};  // group unused
  s.values = {.grouping = Grouping::kPerToken, .group = kHeadDim, .non_uniform = true, .outlier_fraction = 0.01};
  s.sink_tokens = 1;
  s.fisher_weighted = true;
  s.q_norm = true;
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    LayerQuantizers l;
    l.keys = kvquant_keys(s.bits, rng);
    l.values.grid = make_grid(s.bits, rng);
    l.values.outlier_tau = 3.0f + 0.25f * static_cast<float>(layer);
    l.stats = make_stats(rng, 0.0101, 0.0098);
    config.layers.push_back(l);
  }
  // docs/artifact.md's counting with D = 8 (per-token metadata and row pointers weigh a lot at so small a head_dim).
  config.effective_bits = {{4096, 6.33017578125}, {32768, 6.32127197265625}, {131072, 6.320317993164062}};
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
  const TensorQuantizerSettings g32 = {.grouping = Grouping::kPerToken, .group = 32};
  artifact.configs.push_back(
      runtime_config("kivi", QuantMethod::kKivi, {.grouping = Grouping::kPerChannelTokens, .group = 32}, g32, 0, 128,
                     1.0f, 1.0f, {{4096, 4.859375}, {32768, 4.544921875}, {131072, 4.51123046875}}, rng));
  const TensorQuantizerSettings g8 = {.grouping = Grouping::kPerToken, .group = kHeadDim};
  artifact.configs.push_back(runtime_config("int2-rot", QuantMethod::kInt2Rot, g8, g8, 64, 256, 0.96f, 0.92f,
                                            {{4096, 6.78125}, {32768, 6.09765625}, {131072, 6.0244140625}}, rng));
  artifact.configs.push_back(
      runtime_config("rtn", QuantMethod::kRtn, g8, g8, 0, 0, 1.0f, 1.0f, {{4096, 6.0}, {131072, 6.0}}, rng));
  return artifact;
}

QuantizerConfig& config_named(Artifact& artifact, const std::string& name) {
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
  ASSERT_EQ(read.configs.size(), 4u);
  for (size_t i = 0; i < read.configs.size(); ++i) {
    SCOPED_TRACE(artifact.configs[i].name);
    EXPECT_EQ(read.configs[i].name, artifact.configs[i].name);  // order kept, not alphabetical
    EXPECT_EQ(read.configs[i].settings, artifact.configs[i].settings);
    EXPECT_EQ(read.configs[i].layers, artifact.configs[i].layers);
    EXPECT_EQ(read.configs[i].effective_bits, artifact.configs[i].effective_bits);
  }
  // Rewriting replaces the file whole.
  Artifact changed = artifact;
  changed.configs.pop_back();
  write_artifact(path, changed);
  EXPECT_EQ(read_artifact(path), changed);
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
                   kKvquantKeys1 + "/outlier_high", "missing: required when keys_outlier_fraction is 0.01"},
        Degenerate{"tau_zero_with_value_outliers",
                   [](Artifact& a) { config_named(a, "kvquant").layers[1].values.outlier_tau = 0; },
                   "/configs/kvquant/layers/1/values@outlier_tau", "expected > 0"},
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
                   "expected YYYY-MM-DDTHH:MM:SSZ"}),
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
            [](const fs::path& p) { edit_hdf5(p, [](hid_t f) { set_int_attribute(f, "/", "schema_version", 2); }); },
            "/@schema_version", "expected 1 (the version this kvforge reads), got 2"},
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
                  edit_hdf5(p, [](hid_t f) { set_int_attribute(f, "/configs/kvquant", "values_non_uniform", 0); });
                },
                "/configs/kvquant/layers/0/values/grid", "expected none: values_non_uniform is 0"},
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
                "/configs", "expected exactly the 4 groups listed in /configs@names, got 5"},
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
  const auto script = testing::fixtures_dir().parent_path() / "check_artifact.py";
  const std::string command = "python3 '" + script.string() + "' '" + path.string() + "' 2>&1";
  Output output;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "cannot run " << command;
    return output;
  }
  char buffer[4096];
  while (const size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) output.text.append(buffer, n);
  const int status = ::pclose(pipe);
  output.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return output;
}

double sum_of(const std::vector<float>& values) {
  double sum = 0;
  for (const float v : values) sum += v;
  return sum;
}

// Per layer sums of keys' or values' array `member`, or null when the configuration has none.
template <class Get>
nlohmann::json layer_sums(const QuantizerConfig& config, Get get) {
  nlohmann::json sums = nlohmann::json::array();
  for (const auto& layer : config.layers) {
    const std::vector<float>& values = get(layer);
    if (values.empty()) return nullptr;
    sums.push_back(sum_of(values));
  }
  return sums;
}

void expect_sums_near(const nlohmann::json& theirs, const nlohmann::json& ours, const std::string& what) {
  if (ours.is_null()) {
    EXPECT_TRUE(theirs.is_null()) << what << ": " << theirs.dump();
    return;
  }
  ASSERT_EQ(theirs.size(), ours.size()) << what;
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_NEAR(theirs[i].get<double>(), ours[i].get<double>(), 1e-9) << what << " layer " << i;
  }
}

TEST(Artifact, IndependentH5pyReaderAgrees) {
  KVFORGE_REQUIRE_H5PY();
  const auto dir = scratch_dir("artifact-h5py");
  const auto path = dir / "a.h5";
  write_artifact(path, make_artifact());
  const Artifact artifact = read_artifact(path);
  const Output output = run_checker(path);
  ASSERT_EQ(output.exit_code, 0) << output.text;
  const auto report = nlohmann::json::parse(output.text);

  EXPECT_EQ(report.at("schema_version").get<int>(), kArtifactVersion);
  EXPECT_EQ(report.at("num_layers").get<int64_t>(), artifact.model.num_layers);
  EXPECT_EQ(report.at("sources").get<size_t>(), artifact.calibration.sources.size());
  EXPECT_EQ(report.at("calibration_tokens").get<int64_t>(), artifact.calibration.calibration_tokens);
  std::vector<std::string> names;
  for (const auto& config : artifact.configs) names.push_back(config.name);
  EXPECT_EQ(report.at("configs").get<std::vector<std::string>>(), names);
  for (const auto& config : artifact.configs) {
    SCOPED_TRACE(config.name);
    EXPECT_EQ(report.at("methods").at(config.name).get<std::string>(), method_name(config.settings.method));
    EXPECT_EQ(report.at("bits").at(config.name).get<int>(), config.settings.bits);
    const auto& grids = report.at("grid_sums").at(config.name);
    expect_sums_near(grids.at("keys"),
                     layer_sums(
                         config, [](const auto& l) -> const auto& { return l.keys.grid; }),
                     "keys grid");
    expect_sums_near(grids.at("values"),
                     layer_sums(
                         config, [](const auto& l) -> const auto& { return l.values.grid; }),
                     "values grid");
    const auto& scales = report.at("channel_scale_sums").at(config.name);
    expect_sums_near(scales.at("keys"),
                     layer_sums(
                         config, [](const auto& l) -> const auto& { return l.keys.channel_scale.values; }),
                     "keys channel_scale");
    expect_sums_near(scales.at("values"),
                     layer_sums(
                         config, [](const auto& l) -> const auto& { return l.values.channel_scale.values; }),
                     "values channel_scale");
    const auto rows = report.at("effective_bits").at(config.name);
    ASSERT_EQ(rows.size(), config.effective_bits.size());
    for (size_t j = 0; j < rows.size(); ++j) {
      EXPECT_EQ(rows[j][0].get<int64_t>(), config.effective_bits[j].first);
      EXPECT_EQ(rows[j][1].get<double>(), config.effective_bits[j].second);  // float64 both ways: exact
    }
  }
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
      {"version", [](hid_t f) { set_int_attribute(f, "/", "schema_version", 2); }, "/@schema_version"},
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
