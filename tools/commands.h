#pragma once
// Each kvforge subcommand registers its flags on the CLI11 app and returns
// the function that runs it. The functions only parse flags and call the
// libraries; they return the process exit code.
#include <CLI/CLI.hpp>

#include <functional>

namespace kvforge::cli {

using Command = std::function<int()>;

Command add_info_command(CLI::App& app);
Command add_perplexity_command(CLI::App& app);
Command add_generate_command(CLI::App& app);

}  // namespace kvforge::cli
