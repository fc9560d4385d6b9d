#pragma once
// Where tests find their inputs: ../shared (KVFORGE_SHARED), the committed
// fixtures (KVFORGE_FIXTURES) and the kvforge binary (KVFORGE_BIN).
#include <filesystem>
#include <string>

namespace kvforge::testing {

std::filesystem::path shared_dir();
std::filesystem::path fixtures_dir();
std::filesystem::path kvforge_binary();
std::filesystem::path pyllama_dir();       // shared_dir()/models/pyllama-16m
std::filesystem::path scratch_dir(const std::string& name);  // fresh, under the temp dir
std::string read_file(const std::filesystem::path& path);
void write_file(const std::filesystem::path& path, const std::string& bytes);

struct CommandResult {
  int exit_code;
  std::string stdout_text;
  std::string stderr_text;
  long max_rss_kb = 0;  // peak resident memory of the command
};
// Runs the kvforge binary with `args` (shell-quoted by the caller);
// `environment` is prepended to the command line ("NAME=value ...").
CommandResult run_kvforge(const std::string& args, const std::string& environment = "");

}  // namespace kvforge::testing
