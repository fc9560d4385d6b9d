#pragma once
// Where tests find their inputs: ../shared (KVFORGE_SHARED), the committed
// fixtures (KVFORGE_FIXTURES) and the kvforge binary (KVFORGE_BIN).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

namespace kvforge::testing {

std::filesystem::path shared_dir();
std::filesystem::path fixtures_dir();
std::filesystem::path kvforge_binary();
std::filesystem::path pyllama_dir();       // shared_dir()/models/pyllama-16m
// A fresh folder under the temp dir, removed when the test process exits
// (KVFORGE_KEEP_SCRATCH=1 keeps it).
std::filesystem::path scratch_dir(const std::string& name);
std::string read_file(const std::filesystem::path& path);
void write_file(const std::filesystem::path& path, const std::string& bytes);

// Whether a continuous-integration run is going on: the CI variable is set
// and not "false" or "0" (CI systems set CI=true). Under CI, tools that a
// test would otherwise skip without (h5py) are required.
bool running_under_ci();

// python3 can import h5py and numpy (the independent HDF5 readers).
bool python_has_h5py();
// python3 can import numpy (the independent reader of the runtime pages).
bool python_has_numpy();

struct CommandResult {
  int exit_code;
  std::string stdout_text;
  std::string stderr_text;
  long max_rss_kb = 0;  // peak resident memory of the command
};
// Runs `program` with `args` (both shell-quoted by the caller: a path in
// single quotes), stdin empty; `environment` is prepended to the command
// line ("NAME=value ...").
CommandResult run_command(const std::string& program, const std::string& args, const std::string& environment = "");
// run_command of the kvforge binary.
CommandResult run_kvforge(const std::string& args, const std::string& environment = "");
// run_command of `python3 'script' 'argument'` (the independent readers).
CommandResult run_python(const std::filesystem::path& script, const std::filesystem::path& argument);

}  // namespace kvforge::testing

// In a test body: skip when `available` is false (python3 lacks `modules`),
// or fail under CI, where a missing reader must not pass unnoticed.
#define KVFORGE_REQUIRE_PYTHON_MODULES(available, modules)                                   \
  do {                                                                                       \
    if (!(available)) {                                                                      \
      if (::kvforge::testing::running_under_ci()) FAIL() << "CI is set and python3 lacks " modules; \
      GTEST_SKIP() << "python3 with " modules " is not installed";                           \
    }                                                                                        \
  } while (false)
#define KVFORGE_REQUIRE_H5PY() KVFORGE_REQUIRE_PYTHON_MODULES(::kvforge::testing::python_has_h5py(), "h5py and numpy")
#define KVFORGE_REQUIRE_NUMPY() KVFORGE_REQUIRE_PYTHON_MODULES(::kvforge::testing::python_has_numpy(), "numpy")
