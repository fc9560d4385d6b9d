#include "tools/parse_error.h"

#include <algorithm>

namespace kvforge::cli {

std::string parse_error_line(const CLI::App& app, const CLI::ParseError& error) {
  // The innermost subcommand seen on the command line, so the user is sent
  // to the right --help.
  std::string command = app.get_name();
  for (const CLI::App* current = &app;;) {
    const auto parsed = current->get_subcommands();
    if (parsed.empty()) break;
    current = parsed.front();
    command += " " + current->get_name();
  }
  std::string message = error.what();
  std::replace(message.begin(), message.end(), '\n', ' ');  // CLI11 lists choices on several lines
  if (app.get_subcommands().empty()) {
    // CLI11 says only "A subcommand is required": name the choices and what was given.
    std::string names;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    message += "; expected a command: " + names;
    const std::vector<std::string> rest = app.remaining();
    if (!rest.empty()) message += "; got \"" + rest.front() + "\"";
  }
  return command + ": " + message + " (" + command + " --help)";
}

}  // namespace kvforge::cli
