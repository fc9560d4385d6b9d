#pragma once
// Each kvforge subcommand registers its flags on the CLI11 app and returns
// the function that runs it. The functions only parse flags and call the
// libraries; they return the process exit code.
#include <CLI/CLI.hpp>

#include <functional>
#include <string>

namespace kvforge::cli {

// What every command may need to know about how it was started.
struct Invocation {
  std::string command_line;  // argv joined with spaces, for provenance records
};

using Command = std::function<int(const Invocation&)>;

Command add_info_command(CLI::App& app);
Command add_perplexity_command(CLI::App& app);
Command add_generate_command(CLI::App& app);
Command add_capture_command(CLI::App& app);
Command add_calibrate_command(CLI::App& app);
Command add_inspect_command(CLI::App& app);
Command add_rotate_command(CLI::App& app);
Command add_eval_command(CLI::App& app);
Command add_run_command(CLI::App& app);  // registered by main only: it runs the others

}  // namespace kvforge::cli
