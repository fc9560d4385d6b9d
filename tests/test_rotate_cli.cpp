// kvforge rotate end to end through the binary: capture -> calibrate ->
// rotate on pyllama-16m (a small slice, a few steps), the artifact read back
// by our reader and by the independent h5py checker, the held-out JSON, and
// bad input refused with one line and no output file.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <set>
#include <string>
#include <sys/wait.h>

#include "formats/artifact.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

namespace fs = std::filesystem;

std::string quoted(const fs::path& path) { return "'" + path.string() + "'"; }

// Captures of calib.txt (4 windows of 384 positions: past int2-rot's sink of
// 64 and residual of 256 that leaves 64 quantized tokens per window) and an
// artifact with int2-rot and kvquant at 2 bits, made once per binary.
struct Inputs {
  fs::path dir, store, artifact;
};

const Inputs& inputs() {
  static const Inputs made = [] {
    Inputs in;
    in.dir = testing::scratch_dir("rotate_cli");
    in.store = in.dir / "calib.h5";
    in.artifact = in.dir / "artifact.h5";
    const auto capture = testing::run_kvforge(
        "capture --quiet --model " + quoted(testing::pyllama_dir()) + " --data " +
        quoted(testing::shared_dir() / "data" / "calib.txt") + " --samples 4 --seq-len 384 --out " + quoted(in.store));
    if (capture.exit_code != 0) throw std::runtime_error("capture: " + capture.stderr_text);
    const auto calibrate = testing::run_kvforge("calibrate --quiet --acts " + quoted(in.store) + " --out " +
                                                quoted(in.artifact) + " --method int2-rot,kvquant --bits 2");
    if (calibrate.exit_code != 0) throw std::runtime_error("calibrate: " + calibrate.stderr_text);
    return in;
  }();
  return made;
}

std::string rotate_flags(const fs::path& out, int steps = 3) {
  const Inputs& in = inputs();
  return "rotate --quiet --acts " + quoted(in.store) + " --model " + quoted(testing::pyllama_dir()) +
         " --artifact " + quoted(in.artifact) + " --out " + quoted(out) + " --steps " + std::to_string(steps) + " --patience 3";
}

TEST(RotateCli, AddsTheLearnedAndBaseConfigurationsAndComparesThemOnHeldOutCaptures) {
  const Inputs& in = inputs();
  const fs::path out = in.dir / "rotated.h5", json = in.dir / "heldout.json";
  const auto result = testing::run_kvforge(rotate_flags(out) + " --config int2-rot-2bit --write-bases --heldout-acts " +
                                           quoted(in.store) + " --json " + quoted(json));
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;

  const Artifact artifact = read_artifact(out);  // validated: orthogonal matrices, shapes, presence
  std::set<std::string> names;
  for (const QuantizerConfig& c : artifact.configs) names.insert(c.name);
  for (const char* name : {"int2-rot-2bit", "kvquant-2bit", "int2-rot-2bit-optr", "int2-rot-2bit-identity",
                           "int2-rot-2bit-hadamard", "int2-rot-2bit-eigen"}) {
    EXPECT_TRUE(names.count(name)) << name;
  }
  for (const QuantizerConfig& c : artifact.configs) {
    if (c.name == "int2-rot-2bit-optr") {
      ASSERT_TRUE(c.rotation.has_value());
      EXPECT_EQ(c.rotation->keys, RotationForm::kMatrix);
      EXPECT_EQ(c.rotation->values, RotationForm::kMatrix);
      EXPECT_EQ(c.rotation->steps, 3);
      EXPECT_EQ(c.rotation->fit_samples + c.rotation->validation_samples, 4);
      ASSERT_EQ(c.layers.size(), static_cast<size_t>(artifact.model.num_layers));
      EXPECT_EQ(c.layers[0].rotation.loss.size(), static_cast<size_t>(artifact.model.num_kv_heads));
      EXPECT_FALSE(c.effective_bits.empty());
    }
    if (c.name == "int2-rot-2bit-hadamard") {
      ASSERT_TRUE(c.rotation.has_value());
      for (const LayerQuantizers& layer : c.layers) {
        for (RotationBasis b : layer.rotation.keys.basis) EXPECT_EQ(b, RotationBasis::kHadamard);
        for (bool learned : layer.rotation.keys.learned) EXPECT_FALSE(learned);
      }
    }
    if (c.name == "kvquant-2bit") EXPECT_FALSE(c.rotation.has_value());  // not asked for
  }

  const auto report = nlohmann::json::parse(testing::read_file(json));
  ASSERT_EQ(report.at("heldout").size(), 1u);
  const auto& rows = report.at("heldout").at(0).at("rows");
  std::vector<std::string> kinds;
  for (const auto& row : rows) kinds.push_back(row.at("rotation"));
  EXPECT_EQ(kinds, (std::vector<std::string>{"none", "identity", "hadamard", "eigen", "learned"}));
  for (const auto& row : rows) {
    ASSERT_EQ(row.at("layers").size(), static_cast<size_t>(artifact.model.num_layers));
    for (const auto& layer : row.at("layers")) {
      for (const char* term : {"key", "value", "key_kl", "key_output"}) {
        ASSERT_EQ(layer.at(term).size(), static_cast<size_t>(artifact.model.num_kv_heads)) << term;
        for (double v : layer.at(term)) EXPECT_GE(v, 0.0) << term;
      }
    }
  }

  KVFORGE_REQUIRE_H5PY();
  const std::string command = "python3 '" + (testing::fixtures_dir().parent_path() / "check_artifact.py").string() +
                              "' '" + out.string() + "' 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string text;
  char buffer[4096];
  while (const size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) text.append(buffer, n);
  const int status = ::pclose(pipe);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << text;
  const auto checked = nlohmann::json::parse(text);
  EXPECT_EQ(checked.at("schema_version"), 3);
  EXPECT_FALSE(checked.at("rotation").at("int2-rot-2bit-optr").is_null());
}

TEST(RotateCli, KvquantGetsRopeCommutingKeyAnglesAndFreeValueMatrices) {
  const Inputs& in = inputs();
  const fs::path out = in.dir / "kvquant-rotated.h5";
  const auto result = testing::run_kvforge(rotate_flags(out) + " --config kvquant-2bit --name kvq-rot");
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  const Artifact artifact = read_artifact(out);
  const auto found = std::find_if(artifact.configs.begin(), artifact.configs.end(),
                                  [](const QuantizerConfig& c) { return c.name == "kvq-rot"; });
  ASSERT_NE(found, artifact.configs.end());
  ASSERT_TRUE(found->rotation.has_value());
  EXPECT_EQ(found->rotation->keys, RotationForm::kPairAngles);
  EXPECT_EQ(found->rotation->values, RotationForm::kMatrix);
  EXPECT_TRUE(found->settings.keys_pre_rope);
  EXPECT_EQ(found->layers[0].rotation.keys.angles.shape,
            (std::vector<int64_t>{artifact.model.num_kv_heads, artifact.model.head_dim / 2}));
}

TEST(RotateCli, RefusesUnknownOrRotatedConfigurationsWithOneLineAndNoOutput) {
  const Inputs& in = inputs();
  const fs::path out = in.dir / "never.h5";
  const auto unknown = testing::run_kvforge(rotate_flags(out) + " --config nope");
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_NE(unknown.stderr_text.find("/configs/nope"), std::string::npos) << unknown.stderr_text;
  EXPECT_NE(unknown.stderr_text.find(in.artifact.string()), std::string::npos) << unknown.stderr_text;
  EXPECT_EQ(std::count(unknown.stderr_text.begin(), unknown.stderr_text.end(), '\n'), 1) << unknown.stderr_text;
  EXPECT_FALSE(fs::exists(out));

  const auto bad_flag = testing::run_kvforge(rotate_flags(out) + " --key-basis diagonal");
  EXPECT_EQ(bad_flag.exit_code, 2) << bad_flag.stderr_text;
  EXPECT_FALSE(fs::exists(out));

  // A configuration already rotated is refused by name.
  const fs::path rotated = in.dir / "once.h5";
  ASSERT_EQ(testing::run_kvforge(rotate_flags(rotated, 0) + " --config int2-rot-2bit").exit_code, 0);
  const auto again = testing::run_kvforge("rotate --quiet --acts " + quoted(in.store) + " --model " +
                                          quoted(testing::pyllama_dir()) + " --artifact " + quoted(rotated) +
                                          " --out " + quoted(out) + " --config int2-rot-2bit-optr");
  EXPECT_NE(again.exit_code, 0);
  EXPECT_NE(again.stderr_text.find("rotated already"), std::string::npos) << again.stderr_text;
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace kvforge
