// kvforge eval end to end through the binary on pyllama-16m: the 16-bit
// cache's perplexity equals `kvforge perplexity`'s, a configuration that
// zeroes the cache fails the gate with exit status 3 while the 16-bit cache
// passes it, the JSON and the report are written, and bad input is refused
// with one line and no output file.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "formats/artifact.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

namespace fs = std::filesystem;

std::string quoted(const fs::path& path) { return "'" + path.string() + "'"; }

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// An artifact with kivi and rtn at 2 bits (captures of 4 x 384 tokens of
// calib.txt), and `zeroed-2bit`: rtn with every clip ratio at 1e-30, so
// every cached key and value dequantizes to within 1e-30 of its group's
// range times 0: the cache holds (numerically) nothing.
struct Inputs {
  fs::path dir, artifact;
};

const Inputs& inputs() {
  static const Inputs made = [] {
    Inputs in;
    in.dir = testing::scratch_dir("eval_cli");
    const fs::path store = in.dir / "calib.h5";
    in.artifact = in.dir / "artifact.h5";
    const auto capture = testing::run_kvforge(
        "capture --quiet --model " + quoted(testing::pyllama_dir()) + " --data " +
        quoted(testing::shared_dir() / "data" / "calib.txt") + " --samples 4 --seq-len 384 --out " + quoted(store));
    if (capture.exit_code != 0) throw std::runtime_error("capture: " + capture.stderr_text);
    const fs::path fitted = in.dir / "fitted.h5";
    const auto calibrate = testing::run_kvforge("calibrate --quiet --acts " + quoted(store) + " --out " +
                                                quoted(fitted) + " --method kivi,rtn --bits 2");
    if (calibrate.exit_code != 0) throw std::runtime_error("calibrate: " + calibrate.stderr_text);
    Artifact artifact = read_artifact(fitted);
    QuantizerConfig zeroed;
    for (const QuantizerConfig& config : artifact.configs) {
      if (config.name == "rtn-2bit") zeroed = config;
    }
    zeroed.name = "zeroed-2bit";
    zeroed.settings.sink_tokens = 0;
    zeroed.settings.residual_tokens = 0;
    for (LayerQuantizers& layer : zeroed.layers) layer.keys.clip_ratio = layer.values.clip_ratio = 1e-30f;
    artifact.configs.push_back(zeroed);
    write_artifact(in.artifact, artifact);
    return in;
  }();
  return made;
}

std::string eval_flags(const std::string& extra) {
  return "eval --quiet --model " + quoted(testing::pyllama_dir()) + " --data " +
         quoted(testing::shared_dir() / "data" / "heldout.txt") + " --artifact " + quoted(inputs().artifact) + " " +
         extra;
}

TEST(EvalCli, FullPrecisionPerplexityEqualsKvforgePerplexity) {
  const fs::path json = inputs().dir / "ppl_eval.json";
  const auto perplexity = testing::run_kvforge("perplexity --quiet --model " + quoted(testing::pyllama_dir()) +
                                               " --data " + quoted(testing::shared_dir() / "data" / "heldout.txt") +
                                               " --ctx 256 --max-windows 2 --json");
  ASSERT_EQ(perplexity.exit_code, 0) << perplexity.stderr_text;
  const double expected = nlohmann::json::parse(perplexity.stdout_text).at("perplexity").get<double>();
  // One pass per window (chunk = ctx): the same forward pass and the same
  // float32 log-softmax as `kvforge perplexity`, so the same number.
  // Chunked (64): the attention over a cache in four passes sums in another
  // order; eval/cache_perplexity's test bounds the logits' difference by
  // 2 L sqrt(K) u max|logit| (4.3e-4 for this model), so the mean NLL moves
  // by at most twice that and the perplexity by 1e-3 relative.
  for (const auto& [chunk, tolerance] : {std::pair{256, 1e-12}, std::pair{64, 1e-3}}) {
    const auto eval = testing::run_kvforge(eval_flags("--configs kivi-2bit --no-needles --ctx 256 --max-windows 2 --chunk " +
                                                      std::to_string(chunk) + " --json " + quoted(json)));
    ASSERT_EQ(eval.exit_code, 0) << eval.stderr_text;
    const nlohmann::json result = read_json(json);
    const nlohmann::json& fp16 = result.at("configurations").at(0);
    EXPECT_EQ(fp16.at("name"), "fp16");
    const double got = fp16.at("perplexity").at("perplexity").get<double>();
    EXPECT_NEAR(got, expected, expected * tolerance) << "chunk " << chunk;
    EXPECT_EQ(fp16.at("perplexity").at("kl_mean").get<double>(), 0.0);
    EXPECT_EQ(fp16.at("perplexity").at("top1_agreement").get<double>(), 1.0);
    const nlohmann::json& kivi = result.at("configurations").at(1);
    EXPECT_EQ(kivi.at("name"), "kivi-2bit");
    EXPECT_GT(kivi.at("perplexity").at("kl_mean").get<double>(), 0.0);
    // The table on stdout names both rows.
    EXPECT_NE(eval.stdout_text.find("kivi-2bit"), std::string::npos) << eval.stdout_text;
  }
}

TEST(EvalCli, AZeroedCacheFailsTheGateWithExit3AndThe16BitCachePasses) {
  const fs::path json = inputs().dir / "gate.json", report = inputs().dir / "gate.html";
  const std::string gate = " --gate 'needle>=0.98*fp16,ppl<=1.03*fp16,top1>=0.9'";
  const std::string common = "--configs zeroed-2bit --ctx 256 --max-windows 1 --chunk 64 --needle-contexts 256 "
                             "--needle-depths 0.5 --needle-probes 4";
  const auto failed = testing::run_kvforge(eval_flags(common + gate + " --json " + quoted(json) + " --report " +
                                                      quoted(report)));
  EXPECT_EQ(failed.exit_code, 3) << failed.stderr_text;
  for (const char* clause : {"zeroed-2bit: needle", "zeroed-2bit: ppl", "zeroed-2bit: top1"}) {
    EXPECT_NE(failed.stderr_text.find(clause), std::string::npos) << failed.stderr_text;
  }
  // The outputs are written before the gate decides.
  const nlohmann::json result = read_json(json);
  const nlohmann::json& zeroed = result.at("configurations").at(1);
  EXPECT_EQ(zeroed.at("name"), "zeroed-2bit");
  EXPECT_GT(zeroed.at("perplexity").at("perplexity").get<double>(),
            2 * result.at("configurations").at(0).at("perplexity").at("perplexity").get<double>());
  EXPECT_TRUE(fs::exists(report));

  const auto passed = testing::run_kvforge(eval_flags(common + gate + " --gate-configs fp16"));
  EXPECT_EQ(passed.exit_code, 0) << passed.stderr_text;
  // No artifact: the 16-bit cache is checked against itself.
  const auto alone = testing::run_kvforge("eval --quiet --model " + quoted(testing::pyllama_dir()) + " --data " +
                                          quoted(testing::shared_dir() / "data" / "heldout.txt") +
                                          " --ctx 256 --max-windows 1 --no-needles --gate 'ppl<=1.0*fp16'");
  EXPECT_EQ(alone.exit_code, 0) << alone.stderr_text;
}

// --through-kernels on the CPU runs the runtime kernels' CPU reference
// (kernels/cpu_reference.h; the CUDA kernels equal it, tests/
// test_*_cuda.cpp): perplexity with every token a decoding step equals the
// simulated cache's at --chunk 1. The two compute attention in float32 in
// different orders (split-K flash decoding against the model's attention over
// dequantized keys and values) and dequantize with float32 fma against the
// float64 simulation rounded once: the logits differ by a few float32 ulps
// (u = 6e-8 relative), so the mean NLL by ~1e-6 and the perplexity by well
// under 1e-5 relative (measured 3e-7).
TEST(EvalCli, ThroughTheKernelsPerplexityEqualsTheSimulatedCacheAtChunkOne) {
  const fs::path simulated = inputs().dir / "simulated.json", kernels = inputs().dir / "kernels.json";
  const std::string common = "--configs kivi-2bit,rtn-2bit --no-needles --ctx 192 --max-windows 1 --chunk 1 --json ";
  const auto a = testing::run_kvforge(eval_flags(common + quoted(simulated)));
  ASSERT_EQ(a.exit_code, 0) << a.stderr_text;
  const auto b = testing::run_kvforge(eval_flags(common + quoted(kernels) + " --through-kernels"));
  ASSERT_EQ(b.exit_code, 0) << b.stderr_text;
  const nlohmann::json x = read_json(simulated), y = read_json(kernels);
  ASSERT_EQ(x.at("configurations").size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const double p = x.at("configurations").at(i).at("perplexity").at("perplexity").get<double>();
    const double q = y.at("configurations").at(i).at("perplexity").at("perplexity").get<double>();
    EXPECT_NEAR(q, p, 1e-5 * p) << x.at("configurations").at(i).at("name");
  }
}

TEST(EvalCli, BadInputIsOneLineAndLeavesNoOutput) {
  const fs::path json = inputs().dir / "bad.json", report = inputs().dir / "bad.html";
  const std::string outputs = " --json " + quoted(json) + " --report " + quoted(report);
  struct Case {
    std::string flags, says;
  };
  for (const Case& c : {Case{"--configs nope-2bit", "nope-2bit"},
                        Case{"--gate 'needle>>1'", "--gate"},
                        Case{"--gate 'tasks>=0.9*fp16' --no-needles --max-windows 1 --ctx 256", "tasks"},
                        Case{"--needle-template " + quoted(inputs().artifact), "artifact.h5: not JSON"}}) {
    fs::remove(json);
    fs::remove(report);
    const auto result = testing::run_kvforge(eval_flags(c.flags + outputs));
    EXPECT_EQ(result.exit_code, 2) << c.flags << "\n" << result.stderr_text;
    EXPECT_NE(result.stderr_text.find(c.says), std::string::npos) << result.stderr_text;
    EXPECT_EQ(std::count(result.stderr_text.begin(), result.stderr_text.end(), '\n'), 1) << result.stderr_text;
    EXPECT_FALSE(fs::exists(json)) << c.flags;
    EXPECT_FALSE(fs::exists(report)) << c.flags;
  }
}

}  // namespace
}  // namespace kvforge
