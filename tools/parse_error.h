#pragma once
// Command-line errors as the README promises them: one line naming the flag
// and what was expected, exit code 2, for every kind of CLI11 parse error
// (unknown option, bad value, missing or excluded option, extra argument).
#include <CLI/CLI.hpp>

#include <string>

namespace kvforge::cli {

inline constexpr int kBadInputExitCode = 2;  // README: bad input exits 2, other failures 1

// "kvforge capture: --seq-len: Value 1 not in range 2 to 16777216 (kvforge capture --help)".
// `app` is the top-level app the error came from.
std::string parse_error_line(const CLI::App& app, const CLI::ParseError& error);

}  // namespace kvforge::cli
