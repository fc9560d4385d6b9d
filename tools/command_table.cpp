#include "tools/command_table.h"

namespace kvforge::cli {

CommandTable add_job_commands(CLI::App& app) {
  CommandTable table;
  const auto add = [&](auto adder) {
    const size_t before = app.get_subcommands({}).size();
    Command run = adder(app);
    table.emplace_back(app.get_subcommands({}).at(before), std::move(run));
  };
  add(add_info_command);
  add(add_perplexity_command);
  add(add_generate_command);
  add(add_capture_command);
  add(add_calibrate_command);
  add(add_rotate_command);
  add(add_eval_command);
  add(add_inspect_command);
  return table;
}

int run_parsed(const CommandTable& table, const Invocation& invocation) {
  for (const auto& [subcommand, run] : table) {
    if (subcommand->parsed()) return run(invocation);
  }
  return 1;
}

}  // namespace kvforge::cli
