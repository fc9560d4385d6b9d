#pragma once
// Every kvforge subcommand in one table: main registers them on its CLI11
// app, and `kvforge run` registers them on a fresh app per stage, so a stage
// of the main job parses and runs exactly as the command a user would type.
#include <CLI/CLI.hpp>

#include <utility>
#include <vector>

#include "tools/commands.h"

namespace kvforge::cli {

// The registered subcommands in order, each with the function that runs it.
using CommandTable = std::vector<std::pair<CLI::App*, Command>>;

// Registers every job subcommand (not `run`) on `app`.
CommandTable add_job_commands(CLI::App& app);

// Runs the parsed subcommand of `table`; 1 when none was parsed.
int run_parsed(const CommandTable& table, const Invocation& invocation);

}  // namespace kvforge::cli
