// kvforge: make 2-bit KV caches safe to ship. One subcommand per job.
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <exception>
#include <iostream>
#include <stdexcept>
#include <string>

#include "formats/input_error.h"
#include "kvforge/version.h"
#include "log/log.h"
#include "tools/command_table.h"
#include "tools/parse_error.h"

int main(int argc, char** argv) {
  CLI::App app{"kvforge: calibrate, rotate and evaluate 2-bit KV caches for Llama-family models", "kvforge"};
  app.require_subcommand(1);
  app.fallthrough();  // --quiet and friends also work after the subcommand
  app.set_version_flag("--version", std::string("kvforge ") + kvforge::kVersion);
  bool quiet = false;
  bool verbose = false;
  bool log_json = false;
  app.add_flag("-q,--quiet", quiet, "Log warnings and errors only");
  app.add_flag("-v,--verbose", verbose, "Log debug details");
  app.add_flag("--log-json", log_json, "Log one JSON object per line on stderr");

  kvforge::cli::CommandTable commands = kvforge::cli::add_job_commands(app);
  {  // `run` drives the job commands, so it is not one of them.
    const size_t before = app.get_subcommands({}).size();
    kvforge::cli::Command run = kvforge::cli::add_run_command(app);
    commands.emplace_back(app.get_subcommands({}).at(before), std::move(run));
  }

  const auto configure_log = [&] {
    kvforge::log::configure({.level = quiet     ? kvforge::log::Level::kWarn
                                      : verbose ? kvforge::log::Level::kDebug
                                                : kvforge::log::Level::kInfo,
                             .json = log_json});
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);  // --help, --version
    configure_log();
    kvforge::log::error(kvforge::cli::parse_error_line(app, e));
    return kvforge::cli::kBadInputExitCode;
  }
  configure_log();
  kvforge::cli::Invocation invocation;
  for (int i = 0; i < argc; ++i) invocation.command_line += (i ? " " : "") + std::string(argv[i]);
  try {
    return kvforge::cli::run_parsed(commands, invocation);
  } catch (const kvforge::InputError& e) {
    kvforge::log::error(e.what());
    return kvforge::cli::kBadInputExitCode;
  } catch (const std::invalid_argument& e) {
    // The libraries' word for a bad flag value (--device, --fields, ...).
    kvforge::log::error(e.what());
    return kvforge::cli::kBadInputExitCode;
  } catch (const c10::Error& e) {
    // torch's own message without its C++ backtrace: one line for the user.
    const std::string message = e.what_without_backtrace();
    kvforge::log::error(message.substr(0, message.find('\n')));
    return 1;
  } catch (const std::exception& e) {
    kvforge::log::error(e.what());
    return 1;
  }
  return 1;
}
