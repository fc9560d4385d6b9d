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
  for (const char* command : {"info", "perplexity", "generate"}) {
    const auto help = run_kvforge(std::string(command) + " --help");
    EXPECT_EQ(help.exit_code, 0) << command;
    EXPECT_NE(help.stdout_text.find("--model"), std::string::npos) << command;
  }
  EXPECT_NE(run_kvforge("no-such-command").exit_code, 0);
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

}  // namespace
}  // namespace kvforge
