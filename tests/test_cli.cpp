// The kvforge binary as a user runs it: outputs, exit codes, one-line errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <sstream>
#include <nlohmann/json.hpp>

#include "tests/test_paths.h"

namespace kvforge {
namespace {

using testing::run_kvforge;

std::string quoted(const std::filesystem::path& path) { return "'" + path.string() + "'"; }

int count_lines(const std::string& text) {
  return static_cast<int>(std::count(text.begin(), text.end(), '\n'));
}

// A copy of pyllama-16m (symlinked shards) in which one file can be broken.
std::filesystem::path model_copy(const std::string& name) {
  const auto dir = testing::scratch_dir(name);
  for (const auto& entry : std::filesystem::directory_iterator(testing::pyllama_dir())) {
    std::filesystem::create_symlink(entry.path(), dir / entry.path().filename());
  }
  return dir;
}

void replace_file(const std::filesystem::path& path, const std::string& bytes) {
  std::filesystem::remove(path);
  testing::write_file(path, bytes);
}

TEST(Cli, VersionAndHelp) {
  const auto version = run_kvforge("--version");
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_NE(version.stdout_text.find("kvforge "), std::string::npos);
  EXPECT_EQ(run_kvforge("--help").exit_code, 0);
  for (const char* command : {"info", "perplexity", "generate", "capture"}) {
    const auto help = run_kvforge(std::string(command) + " --help");
    EXPECT_EQ(help.exit_code, 0) << command;
    EXPECT_NE(help.stdout_text.find("--model"), std::string::npos) << command;
  }
  for (const char* command : {"calibrate", "inspect"}) {
    const auto help = run_kvforge(std::string(command) + " --help");
    EXPECT_EQ(help.exit_code, 0) << command;
    EXPECT_NE(help.stdout_text.find("--acts"), std::string::npos) << command;
  }
}

// README: bad input is one line on stderr naming the flag and what was
// expected, exit 2 -- for CLI11's parse errors as for kvforge's own checks.
TEST(Cli, BadCommandLineValuesAreOneLineAndExitTwo) {
  const std::string model = " --model " + quoted(testing::pyllama_dir());
  const std::string data = " --data " + quoted(testing::shared_dir() / "data" / "heldout.txt");
  const auto out = testing::scratch_dir("bad_values") / "acts.h5";
  const std::string capture = "capture" + model + data + " --out " + quoted(out);
  struct Case {
    std::string args;
    std::string named;  // the flag or argument the line must name
  };
  const std::vector<Case> cases = {
      {"no-such-command", "got \"no-such-command\""},               // unknown command
      {"", "expected a command: info, perplexity, generate, capture, calibrate, rotate, eval, inspect, run"},
      {"info", "--model"},                                           // missing required
      {"info" + model + " --ctx many", "--ctx"},                     // not a number
      {"perplexity" + model + data + " --ctx 1", "--ctx"},           // out of range
      {"perplexity" + model + data + " --batch 0", "--batch: expected a positive integer, got \"0\""},
      {"perplexity --model /no/such/dir" + data, "--model"},         // no such directory
      {"perplexity" + model, "--data"},                              // missing required
      {"generate" + model + " --prompt hi --max-new x", "--max-new: expected a positive integer, got \"x\""},
      {capture + " --samples 1.5", "--samples: expected a positive integer, got \"1.5\""},
      {"generate" + model + " --prompt hi --temperature 2", "--temperature"},  // unknown option
      {"capture" + model + data, "--out"},
      {capture + " --seq-len 1", "--seq-len"},
      {capture + " --compression 12", "--compression"},
      {capture + " --loss-chunk -5", "--loss-chunk"},
      {capture + " stray", "stray"},                                 // extra positional
      {capture + " --merge " + quoted(testing::pyllama_dir() / "config.json") + " " +
           quoted(testing::pyllama_dir() / "config.json"),
       "--merge"},                                                   // excluded options
      {capture + " --fields q,zz", "--fields zz"},                   // kvforge's own check
      {capture + " --device gpu", "--device gpu"},
      {capture + " --dtype fp8", "--dtype"},
      {"calibrate --acts /no/such.h5 --out x.h5", "--acts"},
      {"calibrate --acts " + quoted(testing::pyllama_dir() / "config.json") + " --out x.h5 --bits 5", "--bits"},
      {"inspect /no/such.h5", "/no/such.h5"},
      {"inspect " + quoted(testing::pyllama_dir() / "config.json") + " --samples some", "--samples"},
      {"--quiet info" + model + " --ctx", "--ctx"},                  // value missing
  };
  for (const auto& c : cases) {
    const auto result = run_kvforge(c.args);
    EXPECT_EQ(result.exit_code, 2) << c.args << "\n" << result.stderr_text;
    EXPECT_EQ(count_lines(result.stderr_text), 1) << c.args << "\n" << result.stderr_text;
    EXPECT_NE(result.stderr_text.find(c.named), std::string::npos) << c.args << "\n" << result.stderr_text;
  }
  EXPECT_FALSE(std::filesystem::exists(out));
  EXPECT_FALSE(std::filesystem::exists(out.string() + ".partial"));
}

TEST(Cli, InfoReportsArchitectureAndKvBytes) {
  const auto result = run_kvforge("info --json --model " + quoted(testing::pyllama_dir()));
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  const auto info = nlohmann::json::parse(result.stdout_text);
  EXPECT_EQ(info.at("architecture"), "LlamaForCausalLM");
  EXPECT_EQ(info.at("parameters"), 15996416);  // the model README's count
  EXPECT_EQ(info.at("layers"), 5);
  EXPECT_EQ(info.at("kv_heads"), 2);
  EXPECT_EQ(info.at("head_dim"), 128);
  // 2 (K, V) x 5 layers x 2 KV heads x 128 dims x bits / 8
  EXPECT_DOUBLE_EQ(info.at("kv_cache").at("16bit").at("bytes_per_token").get<double>(), 5120.0);
  EXPECT_DOUBLE_EQ(info.at("kv_cache").at("4bit").at("bytes_per_token").get<double>(), 1280.0);
  EXPECT_DOUBLE_EQ(info.at("kv_cache").at("2bit").at("bytes_per_token").get<double>(), 640.0);
  const auto text = run_kvforge("info --model " + quoted(testing::pyllama_dir()));
  EXPECT_EQ(text.exit_code, 0);
  EXPECT_NE(text.stdout_text.find("5.00 KiB/token"), std::string::npos) << text.stdout_text;
}

TEST(Cli, PerplexityEndsWithPerplexityLine) {
  const auto result = run_kvforge("perplexity --model " + quoted(testing::pyllama_dir()) + " --data " +
                                  quoted(testing::shared_dir() / "data" / "heldout.txt") +
                                  " --ctx 256 --max-windows 2 --quiet");
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  const auto last_line_start = result.stdout_text.rfind("perplexity: ");
  ASSERT_NE(last_line_start, std::string::npos) << result.stdout_text;
  const double ppl = std::stod(result.stdout_text.substr(last_line_start + 12));
  EXPECT_GT(ppl, 1.0);
  EXPECT_LT(ppl, 50.0);
}

TEST(Cli, LogJsonWritesOneObjectPerLine) {
  const auto result = run_kvforge("--log-json perplexity --model " + quoted(testing::pyllama_dir()) + " --data " +
                                  quoted(testing::shared_dir() / "data" / "heldout.txt") + " --ctx 64 --max-windows 2");
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  std::istringstream lines(result.stderr_text);
  int count = 0;
  for (std::string line; std::getline(lines, line); ++count) {
    const auto object = nlohmann::json::parse(line);  // throws on a malformed line
    EXPECT_TRUE(object.contains("level") && object.contains("msg") && object.contains("time")) << line;
  }
  EXPECT_GE(count, 2);  // tokenizing, loading, progress
  const auto quiet = run_kvforge("perplexity --quiet --model " + quoted(testing::pyllama_dir()) + " --data " +
                                 quoted(testing::shared_dir() / "data" / "heldout.txt") + " --ctx 64 --max-windows 2");
  EXPECT_EQ(quiet.stderr_text, "");
}

TEST(Cli, GenerateJsonStreamsIds) {
  const auto result = run_kvforge("generate --json --max-new 6 --model " + quoted(testing::pyllama_dir()) +
                                  " --prompt 'def fibonacci(n):\n'");
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  const auto out = nlohmann::json::parse(result.stdout_text);
  EXPECT_EQ(out.at("generated_ids").size(), 6u);
  EXPECT_EQ(out.at("prompt_ids").at(0), 0);  // <|bos|> prepended
}

TEST(Cli, CudaWithoutGpuIsAClearError) {
  const auto result = run_kvforge("perplexity --quiet --device cuda --model " + quoted(testing::pyllama_dir()) +
                                  " --data " + quoted(testing::shared_dir() / "data" / "heldout.txt"));
  if (result.exit_code == 0) GTEST_SKIP() << "this machine has a CUDA device";
  EXPECT_EQ(count_lines(result.stderr_text), 1) << result.stderr_text;
  EXPECT_NE(result.stderr_text.find("--device cuda"), std::string::npos) << result.stderr_text;
  EXPECT_NE(result.stderr_text.find("no CUDA device"), std::string::npos) << result.stderr_text;
}

TEST(Cli, TruncatedShardIsAOneLineErrorNamingTheFile) {
  const auto dir = model_copy("truncated");
  const auto shard = dir / "model-00002-of-00004.safetensors";
  const std::string bytes = testing::read_file(shard);
  replace_file(shard, bytes.substr(0, bytes.size() / 2));
  const auto result = run_kvforge("info --quiet --model " + quoted(dir));
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_EQ(count_lines(result.stderr_text), 1) << result.stderr_text;
  EXPECT_NE(result.stderr_text.find("model-00002-of-00004.safetensors"), std::string::npos) << result.stderr_text;
}

TEST(Cli, UnknownArchitectureIsNamed) {
  const auto dir = model_copy("arch");
  std::string config = testing::read_file(dir / "config.json");
  config.replace(config.find("LlamaForCausalLM"), 16, "GPTNeoXForCausalLM");
  replace_file(dir / "config.json", config);
  const auto result = run_kvforge("info --quiet --model " + quoted(dir));
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_EQ(count_lines(result.stderr_text), 1) << result.stderr_text;
  EXPECT_NE(result.stderr_text.find("GPTNeoXForCausalLM"), std::string::npos) << result.stderr_text;
  EXPECT_NE(result.stderr_text.find("config.json"), std::string::npos) << result.stderr_text;
}

TEST(Cli, MalformedTokenizerIsNamed) {
  const auto dir = model_copy("tokenizer");
  replace_file(dir / "tokenizer.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": ");
  const auto result = run_kvforge("generate --quiet --model " + quoted(dir) + " --prompt hi --max-new 1");
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_EQ(count_lines(result.stderr_text), 1) << result.stderr_text;
  EXPECT_NE(result.stderr_text.find("tokenizer.json"), std::string::npos) << result.stderr_text;
}

TEST(Cli, MissingTensorIsNamed) {
  // The tiny Llama fixture declared as Qwen2, whose q/k/v biases it lacks.
  const auto dir = testing::scratch_dir("missing");
  const auto llama = testing::fixtures_dir() / "models" / "llama3";
  std::filesystem::create_symlink(llama / "model.safetensors", dir / "model.safetensors");
  std::filesystem::create_symlink(testing::pyllama_dir() / "tokenizer.json", dir / "tokenizer.json");
  auto config = nlohmann::json::parse(testing::read_file(llama / "config.json"));
  config["architectures"] = {"Qwen2ForCausalLM"};
  config["model_type"] = "qwen2";
  config.erase("rope_scaling");
  config["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  testing::write_file(dir / "config.json", config.dump());
  const auto result = run_kvforge("generate --quiet --model " + quoted(dir) + " --prompt hi --max-new 1");
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_EQ(count_lines(result.stderr_text), 1) << result.stderr_text;
  EXPECT_NE(result.stderr_text.find("model.layers.0.self_attn.q_proj.bias"), std::string::npos)
      << result.stderr_text;
}

// A copy of pyllama-16m that declares only `positions` positions.
std::filesystem::path model_with_max_positions(const std::string& name, int64_t positions) {
  const auto dir = model_copy(name);
  auto config = nlohmann::json::parse(testing::read_file(dir / "config.json"));
  config["max_position_embeddings"] = positions;
  replace_file(dir / "config.json", config.dump());
  return dir;
}

bool no_store_written(const std::filesystem::path& out) {
  return !std::filesystem::exists(out) && !std::filesystem::exists(out.string() + ".partial");
}

TEST(Cli, CaptureRefusesWindowsPastTheModelsPositions) {
  const std::string data = " --data " + quoted(testing::shared_dir() / "data" / "calib.txt");
  const auto out = testing::scratch_dir("long_context") / "acts.h5";
  // The case: 100000 positions on a 4096-position model.
  const auto refused = run_kvforge("capture --model " + quoted(testing::pyllama_dir()) + data + " --seq-len 100000" +
                                   " --out " + quoted(out));
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_EQ(count_lines(refused.stderr_text), 1) << refused.stderr_text;
  for (const char* part : {"--seq-len 100000", "max_position_embeddings (4096", "config.json", "--allow-long-context"}) {
    EXPECT_NE(refused.stderr_text.find(part), std::string::npos) << part << ": " << refused.stderr_text;
  }
  EXPECT_TRUE(no_store_written(out));

  // One past a declared maximum of 32: refused, then allowed with a warning.
  const auto model = model_with_max_positions("max_positions", 32);
  const std::string args = "capture --model " + quoted(model) + data + " -n 1 --fields q,v --seq-len 33 --out " +
                           quoted(out);
  const auto at_limit = run_kvforge("--quiet capture --model " + quoted(model) + data +
                                    " -n 1 --fields q,v --seq-len 32 --out " + quoted(out));
  EXPECT_EQ(at_limit.exit_code, 0) << at_limit.stderr_text;
  EXPECT_EQ(at_limit.stderr_text, "");
  std::filesystem::remove(out);
  const auto past = run_kvforge(args);
  EXPECT_EQ(past.exit_code, 2);
  EXPECT_NE(past.stderr_text.find("max_position_embeddings (32"), std::string::npos) << past.stderr_text;
  EXPECT_TRUE(no_store_written(out));
  const auto allowed = run_kvforge(args + " --allow-long-context");
  EXPECT_EQ(allowed.exit_code, 0) << allowed.stderr_text;
  EXPECT_NE(allowed.stderr_text.find("exceeds the model's max_position_embeddings (32"), std::string::npos)
      << allowed.stderr_text;
  EXPECT_NE(allowed.stderr_text.find("memory estimate on cpu: "), std::string::npos) << allowed.stderr_text;
  EXPECT_TRUE(std::filesystem::exists(out));
}

TEST(Cli, CaptureRefusesWhatCannotFitInMemory) {
  const auto out = testing::scratch_dir("memory") / "acts.h5";
  // 2^24 positions: petabytes of attention scores, more than any machine has.
  const std::string args = "--quiet capture --model " + quoted(testing::pyllama_dir()) + " --data " +
                           quoted(testing::shared_dir() / "data" / "calib.txt") +
                           " --seq-len 16777216 --allow-long-context --out " + quoted(out);
  const auto refused = run_kvforge(args);
  EXPECT_EQ(refused.exit_code, 2);
  // The context warning, then the one-line refusal.
  ASSERT_EQ(count_lines(refused.stderr_text), 2) << refused.stderr_text;
  const std::string last = refused.stderr_text.substr(refused.stderr_text.find('\n') + 1);
  for (const char* part : {"--seq-len 16777216", "needs about", "GiB on cpu", "available", "--skip-memory-check"}) {
    EXPECT_NE(last.find(part), std::string::npos) << part << ": " << last;
  }
  EXPECT_TRUE(no_store_written(out));
  // Forced past the estimate, the capture stops at the next check (the data
  // hold fewer tokens than one window) before allocating or writing.
  const auto forced = run_kvforge(args + " --skip-memory-check");
  EXPECT_EQ(forced.exit_code, 2);
  EXPECT_NE(forced.stderr_text.find("trying anyway (--skip-memory-check)"), std::string::npos) << forced.stderr_text;
  EXPECT_NE(forced.stderr_text.find("calib.txt: expected at least one window of 16777215 text tokens"),
            std::string::npos)
      << forced.stderr_text;
  EXPECT_TRUE(no_store_written(out));
}

}  // namespace
}  // namespace kvforge
