// kvforge eval end to end through the binary on pyllama-16m: the 16-bit
// cache's perplexity equals `kvforge perplexity`'s, a configuration that
// zeroes the cache fails the gate with exit status 3 while the 16-bit cache
// passes it, the JSON and the report are written, and bad input is refused
// with one line and no output file.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <utility>
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
// under 1e-5 relative (measured 3e-7), as long as every code is the same.
// But a layer's keys and values come from the layers below, whose attention
// the two compute in different orders, so they too differ by ulps, and an
// element that close to a rounding boundary takes the other code in one of
// them: a whole level at 2 bits. Over this run's ~0.5M quantized elements
// per configuration that happens about once in several runs (never on the
// machines before; on an AVX2 machine, 2026-12-02, rtn-2bit's perplexity
// moved by 7.5e-5 relative, 250 times the ulp-level difference, while
// kivi-2bit's stayed within 1e-5). The quantized configurations so get
// 1e-3, about a dozen such flips, which a semantic difference between the
// two (a grouping, a clip, a window) exceeds many times over; the 16-bit
// cache, which quantizes nothing, keeps 1e-5.
TEST(EvalCli, ThroughTheKernelsPerplexityEqualsTheSimulatedCacheAtChunkOne) {
  const fs::path simulated = inputs().dir / "simulated.json", kernels = inputs().dir / "kernels.json";
  const std::string common = "--configs kivi-2bit,rtn-2bit --no-needles --ctx 192 --max-windows 1 --chunk 1 --json ";
  const auto a = testing::run_kvforge(eval_flags(common + quoted(simulated)));
  ASSERT_EQ(a.exit_code, 0) << a.stderr_text;
  const auto b = testing::run_kvforge(eval_flags(common + quoted(kernels) + " --through-kernels"));
  ASSERT_EQ(b.exit_code, 0) << b.stderr_text;
  const nlohmann::json x = read_json(simulated), y = read_json(kernels);
  ASSERT_EQ(x.at("configurations").size(), 3u);
  EXPECT_EQ(x.at("configurations").at(0).at("name"), "fp16");
  for (size_t i = 0; i < 3; ++i) {
    const double p = x.at("configurations").at(i).at("perplexity").at("perplexity").get<double>();
    const double q = y.at("configurations").at(i).at("perplexity").at("perplexity").get<double>();
    const double tolerance = i == 0 ? 1e-5 : 1e-3;  // configurations[0]: the 16-bit cache
    EXPECT_EQ(x.at("configurations").at(i).at("name"), y.at("configurations").at(i).at("name"));
    EXPECT_NEAR(q, p, tolerance * p) << x.at("configurations").at(i).at("name");
  }
}

fs::path compare_script() {
  return testing::fixtures_dir().parent_path().parent_path() / "scripts" / "compare_eval_runs.py";
}

// scripts/compare_eval_runs.py A B: its exit status, stdout and stderr in one text.
std::pair<int, std::string> compare_runs(const fs::path& a, const fs::path& b, const std::string& flags = "") {
  const fs::path output = inputs().dir / "compare.txt";
  const std::string command = "python3 " + quoted(compare_script()) + " " + quoted(a) + " " + quoted(b) + " " + flags +
                              " > " + quoted(output) + " 2>&1";
  const int status = std::system(command.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, testing::read_file(output)};
}

void write_json(const fs::path& path, const nlohmann::json& document) { testing::write_file(path, document.dump(1)); }

// Issue 9's comparison on the CPU, as the GPU script runs it with --device
// cuda: the simulated cache and the runtime kernels (CPU reference) on the
// same windows and needle probes, every token a decoding step, compared by
// scripts/compare_eval_runs.py: perplexity within 0.5% (it is within 1e-5:
// ThroughTheKernelsPerplexityEqualsTheSimulatedCacheAtChunkOne) and every
// needle answer the same. The two store the same codes for the same inputs
// and attend within a few float32 ulps, so an answer can differ only where a
// float32 difference flips a quantization decision (a near-tie, or a value
// on a calibrated threshold, docs/evaluation.md); these probes have none.
// Then the script itself: a changed answer fails (exit 1) unless both
// margins are below --allow-margin, a 1% perplexity change fails, and
// probes that do not match are refused (exit 2).
TEST(EvalCli, ThroughTheKernelsAgreesWithTheSimulatedCacheOnEveryNeedle) {
  const fs::path simulated = inputs().dir / "agree_simulated.json", kernels = inputs().dir / "agree_kernels.json";
  const std::string needles = "--needle-contexts 160 --needle-depths 0,1 --needle-probes 2 --prefill-chunk 1 ";
  const std::string common = "--configs kivi-2bit,rtn-2bit --ctx 192 --max-windows 1 --chunk 1 " + needles + "--json ";
  const auto a = testing::run_kvforge(eval_flags(common + quoted(simulated)));
  ASSERT_EQ(a.exit_code, 0) << a.stderr_text;
  const auto b = testing::run_kvforge(eval_flags(common + quoted(kernels) + " --through-kernels"));
  ASSERT_EQ(b.exit_code, 0) << b.stderr_text;
  const auto [status, text] = compare_runs(simulated, kernels);
  EXPECT_EQ(status, 0) << text;
  for (const char* line : {"fp16: perplexity", "kivi-2bit: perplexity", "rtn-2bit: perplexity", "needles agree 4/4"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " in\n" << text;
  }
  const nlohmann::json x = read_json(simulated);
  for (const auto& configuration : x.at("configurations")) {
    ASSERT_EQ(configuration.at("needle_probes").size(), 4u) << configuration.at("name");
    for (const auto& probe : configuration.at("needle_probes")) EXPECT_GE(probe.at("margin").get<double>(), 0.0);
  }

  // The needle probes do not depend on whether perplexity is measured
  // (BOS is prepended either way): the 16-bit cache's margins are the same.
  const fs::path alone = inputs().dir / "agree_no_perplexity.json";
  const auto c = testing::run_kvforge("eval --quiet --model " + quoted(testing::pyllama_dir()) + " --data " +
                                      quoted(testing::shared_dir() / "data" / "heldout.txt") + " --no-perplexity " +
                                      needles + "--json " + quoted(alone));
  ASSERT_EQ(c.exit_code, 0) << c.stderr_text;
  EXPECT_EQ(read_json(alone).at("configurations")[0].at("needle_probes"),
            x.at("configurations")[0].at("needle_probes"));

  // A disagreeing answer: failed, or reported as a near-tie when both of
  // its margins are below --allow-margin.
  nlohmann::json changed = read_json(kernels);
  nlohmann::json& probe = changed["configurations"][1]["needle_probes"][0];
  probe["answer"] = "zz";
  probe["correct"] = false;
  probe["margin"] = 2e-6;
  const fs::path changed_path = inputs().dir / "agree_changed.json";
  write_json(changed_path, changed);
  const double margin = x.at("configurations")[1].at("needle_probes")[0].at("margin").get<double>();
  const auto [failed, failed_text] = compare_runs(simulated, changed_path);
  EXPECT_EQ(failed, 1) << failed_text;
  EXPECT_NE(failed_text.find("needles agree 3/4"), std::string::npos) << failed_text;
  EXPECT_NE(failed_text.find("'zz'"), std::string::npos) << failed_text;
  const auto [tied, tied_text] = compare_runs(simulated, changed_path, "--allow-margin " + std::to_string(margin * 2));
  EXPECT_EQ(tied, 0) << tied_text;
  EXPECT_NE(tied_text.find("near-tie"), std::string::npos) << tied_text;

  // Perplexity 1% off fails at the default 0.5%, passes at 2%.
  nlohmann::json shifted = read_json(kernels);
  nlohmann::json& perplexity = shifted["configurations"][2]["perplexity"]["perplexity"];
  perplexity = perplexity.get<double>() * 1.01;
  const fs::path shifted_path = inputs().dir / "agree_shifted.json";
  write_json(shifted_path, shifted);
  EXPECT_EQ(compare_runs(simulated, shifted_path).first, 1);
  EXPECT_EQ(compare_runs(simulated, shifted_path, "--ppl-tolerance 0.02").first, 0);

  // Probes that do not match (another grid) cannot be compared: exit 2.
  nlohmann::json fewer = read_json(kernels);
  fewer["configurations"][1]["needle_probes"].erase(3);
  const fs::path fewer_path = inputs().dir / "agree_fewer.json";
  write_json(fewer_path, fewer);
  const auto [refused, refused_text] = compare_runs(simulated, fewer_path);
  EXPECT_EQ(refused, 2) << refused_text;
  EXPECT_NE(refused_text.find("missing here"), std::string::npos) << refused_text;
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
