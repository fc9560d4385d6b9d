#include "tests/test_paths.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <set>

namespace kvforge::testing {
namespace {

std::filesystem::path env_path(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return (value == nullptr || *value == '\0') ? fallback : value;
}

// The scratch folders this process made, removed when it exits (ctest runs
// every test as a process of its own, so right after the test): left behind,
// a suite's stores and caches piled up in the temp dir, hundreds of
// megabytes per run of the capture tests alone. KVFORGE_KEEP_SCRATCH=1 keeps
// them to look at. A forked child that exits normally leaves its parent's.
class ScratchFolders {
 public:
  ScratchFolders() : owner_(::getpid()) {}
  ~ScratchFolders() {
    const char* keep = std::getenv("KVFORGE_KEEP_SCRATCH");
    if (::getpid() != owner_ || (keep != nullptr && *keep != '\0' && std::string(keep) != "0")) return;
    for (const auto& folder : folders_) {
      std::error_code ignored;  // a test may have removed it already
      std::filesystem::remove_all(folder, ignored);
    }
  }
  ScratchFolders(const ScratchFolders&) = delete;
  ScratchFolders& operator=(const ScratchFolders&) = delete;
  void add(const std::filesystem::path& folder) { folders_.insert(folder); }

 private:
  pid_t owner_;
  std::set<std::filesystem::path> folders_;  // run_kvforge asks for the same "cmd" folder every call
};

ScratchFolders& scratch_folders() {
  static ScratchFolders folders;
  return folders;
}

}  // namespace

std::filesystem::path shared_dir() { return env_path("KVFORGE_SHARED", KVFORGE_SHARED_DEFAULT); }
std::filesystem::path fixtures_dir() { return env_path("KVFORGE_FIXTURES", KVFORGE_FIXTURES_DEFAULT); }
std::filesystem::path kvforge_binary() { return env_path("KVFORGE_BIN", KVFORGE_BIN_DEFAULT); }
std::filesystem::path pyllama_dir() { return shared_dir() / "models" / "pyllama-16m"; }

bool running_under_ci() {
  const char* value = std::getenv("CI");
  if (value == nullptr) return false;
  const std::string text = value;
  return !text.empty() && text != "false" && text != "0";
}

bool python_has_h5py() { return std::system("python3 -c 'import h5py, numpy' >/dev/null 2>&1") == 0; }
bool python_has_numpy() { return std::system("python3 -c 'import numpy' >/dev/null 2>&1") == 0; }

std::filesystem::path scratch_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("kvforge-test-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  scratch_folders().add(dir);
  return dir;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

CommandResult run_command(const std::string& program, const std::string& args, const std::string& environment) {
  const auto dir = scratch_dir("cmd");
  const auto out_path = dir / "stdout";
  const auto err_path = dir / "stderr";
  // exec: the shell becomes the program, so wait4's peak RSS is its own.
  const std::string command = "exec env " + environment + " " + program + " " + args + " >'" + out_path.string() +
                              "' 2>'" + err_path.string() + "' </dev/null";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  struct rusage usage {};
  ::wait4(pid, &status, 0, &usage);
  CommandResult result{WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status),
                       read_file(out_path), read_file(err_path), usage.ru_maxrss};
  std::filesystem::remove_all(dir);
  return result;
}

CommandResult run_kvforge(const std::string& args, const std::string& environment) {
  return run_command("'" + kvforge_binary().string() + "'", args, environment);
}

CommandResult run_python(const std::filesystem::path& script, const std::filesystem::path& argument) {
  return run_command("python3", "'" + script.string() + "' '" + argument.string() + "'");
}

}  // namespace kvforge::testing
