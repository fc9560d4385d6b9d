// kvforge run end to end through the binary on a small slice of
// pyllama-16m: every stage runs, the folder holds the artifact (with the
// rotated configuration), the evaluation's JSON, the report and the log, and
// a failing gate ends the job with exit status 3 after writing them.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "formats/artifact.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

namespace fs = std::filesystem;

std::string quoted(const fs::path& path) { return "'" + path.string() + "'"; }

std::string run_flags(const fs::path& out) {
  return "run --model " + quoted(testing::pyllama_dir()) + " --calib " +
         quoted(testing::shared_dir() / "data" / "calib.txt") + " --heldout " +
         quoted(testing::shared_dir() / "data" / "heldout.txt") + " --out " + quoted(out) +
         " --method kivi,int2-rot --rotate int2-rot --samples 4 --heldout-samples 2 --seq-len 384 --steps 2"
         " --ctx 256 --max-windows 1 --chunk 32 --needle-probes 1 --needle-contexts 256";
}

TEST(RunCli, RunsEveryStageIntoOneFolder) {
  const fs::path out = testing::scratch_dir("run_cli") / "job";
  const auto result = testing::run_kvforge(run_flags(out));
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  for (const char* file : {"artifact.h5", "eval.json", "report.html", "run.log", "calib_acts.h5", "heldout_acts.h5"}) {
    EXPECT_TRUE(fs::exists(out / file)) << file;
  }
  std::set<std::string> names;
  for (const QuantizerConfig& c : read_artifact(out / "artifact.h5").configs) names.insert(c.name);
  EXPECT_EQ(names, (std::set<std::string>{"kivi-2bit", "int2-rot-2bit", "int2-rot-2bit-optr"}));

  std::ifstream in(out / "eval.json");
  const nlohmann::json evaluation = nlohmann::json::parse(in);
  const nlohmann::json& configurations = evaluation.at("configurations");
  ASSERT_EQ(configurations.size(), 4u);
  EXPECT_EQ(configurations.at(0).at("name"), "fp16");
  for (size_t i = 1; i < configurations.size(); ++i) {
    const nlohmann::json& c = configurations.at(i);
    EXPECT_TRUE(c.at("perplexity").is_object()) << c.at("name");
    EXPECT_EQ(c.at("needles").size(), 7u) << c.at("name");  // one context x the 7 default depths
    EXPECT_EQ(c.at("attention").size(), 5u) << c.at("name");  // pyllama-16m's layers
  }
  // The log holds every stage as the command that reruns it.
  std::ifstream log_file(out / "run.log");
  const std::string log((std::istreambuf_iterator<char>(log_file)), std::istreambuf_iterator<char>());
  for (const char* stage : {"$ kvforge capture", "$ kvforge calibrate", "$ kvforge rotate", "$ kvforge eval",
                            "stage 5/5 evaluate", "kvforge run: done"}) {
    EXPECT_NE(log.find(stage), std::string::npos) << stage;
  }
}

TEST(RunCli, AFailingGateEndsTheJobWithExit3AfterItsOutputs) {
  const fs::path out = testing::scratch_dir("run_cli") / "gated";
  const auto result = testing::run_kvforge(run_flags(out) + " --no-rotate --gate 'ppl<=0.5*fp16'");
  EXPECT_EQ(result.exit_code, 3) << result.stderr_text;
  EXPECT_NE(result.stderr_text.find("fails ppl<=0.5*fp16"), std::string::npos) << result.stderr_text;
  EXPECT_TRUE(fs::exists(out / "report.html"));
  EXPECT_TRUE(fs::exists(out / "eval.json"));
}

TEST(RunCli, BadFlagsAreRefusedBeforeAnyStage) {
  const fs::path out = testing::scratch_dir("run_cli") / "refused";
  const auto result = testing::run_kvforge(run_flags(out) + " --rotate nope");
  EXPECT_EQ(result.exit_code, 2) << result.stderr_text;
  EXPECT_NE(result.stderr_text.find("--rotate nope"), std::string::npos) << result.stderr_text;
  EXPECT_FALSE(fs::exists(out / "calib_acts.h5"));
}

}  // namespace
}  // namespace kvforge
