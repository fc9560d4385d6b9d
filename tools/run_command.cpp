// kvforge run: the main job in one command: capture calibration and
// held-out text, calibrate every method, rotate, evaluate, leaving the
// artifact, the report, the evaluation's JSON and a log in one folder. Each
// stage is the kvforge command a user would type (logged as such, so any
// stage can be rerun alone), parsed and run in this process.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "eval/rollout_gate.h"
#include "formats/input_error.h"
#include "log/log.h"
#include "log/progress.h"
#include "model/device.h"
#include "tools/command_table.h"
#include "tools/commands.h"
#include "tools/flag_checks.h"

namespace kvforge::cli {
namespace {

struct RunFlags {
  std::string model_dir, calib, heldout, out;
  std::string device = "cpu";
  std::string dtype;
  std::vector<std::string> methods = {"kvquant", "kivi", "int2-rot", "rtn"};
  std::vector<int> bits = {2};
  std::vector<std::string> rotate = {"int2-rot", "kvquant"};
  bool no_rotate = false;
  int64_t samples = 0, seq_len = 0, heldout_samples = 0;  // 0: by device
  int64_t steps = 80;
  int64_t context = 0, chunk = 0, max_windows = 0, needle_probes = 0;  // 0: by device
  std::vector<int64_t> needle_contexts;
  std::string tasks, gate, needle_template;
};

// Smaller defaults on the CPU, so that the job takes minutes there.
struct DeviceDefaults {
  int64_t samples, seq_len, heldout_samples, context, chunk, max_windows, needle_probes, batch;
};
DeviceDefaults defaults_for(const std::string& device) {
  if (device.rfind("cuda", 0) == 0) return {16, 2048, 8, 2048, 1, 8, 10, 8};
  return {8, 512, 4, 512, 1, 8, 4, 1};
}

std::string joined(const std::vector<std::string>& items, const char* separator = ",") {
  std::string text;
  for (const std::string& item : items) text += (text.empty() ? "" : separator) + item;
  return text;
}
template <typename T>
std::string joined_numbers(const std::vector<T>& items) {
  std::vector<std::string> text;
  for (const T& item : items) text.push_back(std::to_string(item));
  return joined(text);
}

std::string shell_quoted(const std::string& arg) {
  if (!arg.empty() && arg.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:,=")
                          == std::string::npos) {
    return arg;
  }
  std::string quoted = "'";
  for (const char c : arg) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// One stage: a kvforge command line, run in this process through the same
// table of commands as main. Returns its exit status.
int run_stage(const std::vector<std::string>& args) {
  std::vector<std::string> quoted;
  for (const std::string& arg : args) quoted.push_back(shell_quoted(arg));
  const std::string command_line = "kvforge " + joined(quoted, " ");
  log::info("$ ", command_line);
  CLI::App app{"kvforge", "kvforge"};
  app.require_subcommand(1);
  const CommandTable table = add_job_commands(app);
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes them last first
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    throw InputError("kvforge run", args.front(), std::string("a valid stage command (") + e.what() + ")");
  }
  return run_parsed(table, Invocation{command_line});
}

std::vector<std::string> rotated_configs(const RunFlags& flags) {
  std::vector<std::string> names;
  for (const std::string& method : flags.rotate) {
    if (std::find(flags.methods.begin(), flags.methods.end(), method) == flags.methods.end()) continue;
    for (const int bits : flags.bits) names.push_back(method + "-" + std::to_string(bits) + "bit");
  }
  return names;
}

int run(const RunFlags& flags) {
  parse_device(flags.device);  // refused before anything runs
  for (const std::string& method : flags.rotate) {
    if (method != "int2-rot" && method != "kvquant" && method != "kivi" && method != "rtn") {
      throw InputError("--rotate " + method, "", "kvquant, kivi, int2-rot or rtn");
    }
  }
  const DeviceDefaults d = defaults_for(flags.device);
  const auto pick = [](int64_t value, int64_t fallback) { return std::to_string(value > 0 ? value : fallback); };
  const std::filesystem::path out = flags.out;
  std::filesystem::create_directories(out);
  log::LogFile log_file((out / "run.log").string());
  const std::string calib_acts = (out / "calib_acts.h5").string(), heldout_acts = (out / "heldout_acts.h5").string();
  const std::string artifact = (out / "artifact.h5").string();
  std::vector<std::string> model = {"--model", flags.model_dir, "--device", flags.device};
  if (!flags.dtype.empty()) model.insert(model.end(), {"--dtype", flags.dtype});

  std::vector<std::pair<std::string, std::vector<std::string>>> stages;
  for (const std::string& partial : {calib_acts + ".partial", heldout_acts + ".partial"}) {
    std::filesystem::remove(partial);  // this job's own leftovers: captures restart
  }
  std::vector<std::string> capture = {"capture"};
  capture.insert(capture.end(), model.begin(), model.end());
  std::vector<std::string> calib_capture = capture, heldout_capture = capture;
  calib_capture.insert(calib_capture.end(), {"--data", flags.calib, "--samples", pick(flags.samples, d.samples),
                                             "--seq-len", pick(flags.seq_len, d.seq_len), "--out", calib_acts});
  heldout_capture.insert(heldout_capture.end(),
                         {"--data", flags.heldout, "--samples", pick(flags.heldout_samples, d.heldout_samples),
                          "--seq-len", pick(flags.seq_len, d.seq_len), "--seed", "1", "--fields", "q,k_pre,k_post,v",
                          "--out", heldout_acts});
  stages.emplace_back("capture calibration text", calib_capture);
  stages.emplace_back("capture held-out text", heldout_capture);
  std::filesystem::remove(artifact);  // calibrate writes a new artifact
  stages.emplace_back("calibrate", std::vector<std::string>{"calibrate", "--acts", calib_acts, "--out", artifact,
                                                            "--method", joined(flags.methods), "--bits",
                                                            joined_numbers(flags.bits)});
  const std::vector<std::string> to_rotate = rotated_configs(flags);
  if (!flags.no_rotate && !to_rotate.empty()) {
    stages.emplace_back("rotate", std::vector<std::string>{"rotate", "--acts", calib_acts, "--model", flags.model_dir,
                                                           "--artifact", artifact, "--config", joined(to_rotate),
                                                           "--steps", std::to_string(flags.steps), "--device",
                                                           flags.device});
  }
  std::vector<std::string> eval = {"eval"};
  eval.insert(eval.end(), model.begin(), model.end());
  eval.insert(eval.end(), {"--artifact", artifact, "--data", flags.heldout, "--acts", heldout_acts, "--ctx",
                           pick(flags.context, d.context), "--chunk", pick(flags.chunk, d.chunk), "--max-windows",
                           pick(flags.max_windows, d.max_windows), "--batch", std::to_string(d.batch),
                           "--needle-probes",
                           pick(flags.needle_probes, d.needle_probes), "--json", (out / "eval.json").string(),
                           "--report", (out / "report.html").string()});
  if (!flags.needle_contexts.empty()) {
    eval.insert(eval.end(), {"--needle-contexts", joined_numbers(flags.needle_contexts)});
  } else if (flags.device.rfind("cuda", 0) != 0) {
    eval.insert(eval.end(), {"--needle-contexts", "256,512,1024"});  // minutes on a CPU
  }
  if (!flags.needle_template.empty()) eval.insert(eval.end(), {"--needle-template", flags.needle_template});
  if (!flags.tasks.empty()) eval.insert(eval.end(), {"--tasks", flags.tasks});
  if (!flags.gate.empty()) eval.insert(eval.end(), {"--gate", flags.gate});
  stages.emplace_back("evaluate", eval);

  const auto started = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return log::format_duration(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  };
  for (size_t i = 0; i < stages.size(); ++i) {
    log::info("kvforge run: stage ", i + 1, "/", stages.size(), " ", stages[i].first, " (", elapsed(), " so far)");
    const int status = run_stage(stages[i].second);
    if (status == kGateFailedExitCode) {
      log::error("kvforge run: the rollout gate failed; outputs in ", out.string(), " (", elapsed(), ")");
      return status;
    }
    if (status != 0) {
      log::error("kvforge run: stage ", stages[i].first, " failed with status ", status);
      return status;
    }
  }
  log::info("kvforge run: done in ", elapsed(), ": ", artifact, ", ", (out / "report.html").string(), ", ",
            (out / "eval.json").string(), ", ", (out / "run.log").string());
  return 0;
}

}  // namespace

Command add_run_command(CLI::App& app) {
  auto flags = std::make_shared<RunFlags>();
  CLI::App* command = app.add_subcommand(
      "run", "The main job: capture, calibrate (kvquant, kivi, int2-rot, rtn), rotate and evaluate, into one folder");
  command->add_option("-m,--model", flags->model_dir, "Hugging Face model folder")
      ->required()
      ->check(CLI::ExistingDirectory);
  command->add_option("--calib", flags->calib, "Calibration text")->required()->check(CLI::ExistingFile);
  command->add_option("--heldout", flags->heldout, "Held-out text (evaluation)")->required()->check(CLI::ExistingFile);
  command->add_option("-o,--out", flags->out, "Output folder: artifact.h5, report.html, eval.json, run.log, captures")
      ->required();
  command->add_option("--device", flags->device, "cpu, cuda or cuda:N")->capture_default_str();
  command->add_option("--dtype", flags->dtype, "fp32, bf16 or fp16 (default: fp32 on cpu, bf16 on cuda)");
  command->add_option("--method", flags->methods, "Methods to calibrate")->delimiter(',')->capture_default_str();
  command->add_option("--bits", flags->bits, "Bit widths to calibrate")->delimiter(',')->capture_default_str();
  command->add_option("--rotate", flags->rotate, "Methods whose configurations get learned rotations")
      ->delimiter(',')
      ->capture_default_str();
  command->add_flag("--no-rotate", flags->no_rotate, "Skip kvforge rotate");
  command->add_option("--samples", flags->samples, "Calibration windows (default: 8 on cpu, 16 on cuda)")
      ->check(positive_integer());
  command->add_option("--seq-len", flags->seq_len, "Positions per captured window (default: 512 on cpu, 2048 on cuda)")
      ->check(positive_integer());
  command->add_option("--heldout-samples", flags->heldout_samples, "Held-out windows captured for the attention error")
      ->check(positive_integer());
  command->add_option("--steps", flags->steps, "Rotation steps per layer")->capture_default_str();
  command->add_option("--ctx", flags->context, "Evaluation window (default: 512 on cpu, 2048 on cuda)")
      ->check(positive_integer());
  command->add_option("--chunk", flags->chunk, "Perplexity positions per forward pass (default 1: decoding)")
      ->check(positive_integer());
  command->add_option("--max-windows", flags->max_windows, "Perplexity windows (default 8)")
      ->check(positive_integer());
  command->add_option("--needle-probes", flags->needle_probes, "Needle probes per cell (default: 4 on cpu, 10 on cuda)")
      ->check(positive_integer());
  command->add_option("--needle-contexts", flags->needle_contexts, "Needle prompt lengths")->delimiter(',');
  command->add_option("--needle-template", flags->needle_template, "Needle probe template (JSON)");
  command->add_option("--tasks", flags->tasks, "Your probes (JSON lines), see kvforge eval");
  command->add_option("--gate", flags->gate, "Rollout gate, see kvforge eval (exit 3 when it fails)");
  return [flags](const Invocation&) { return run(*flags); };
}

}  // namespace kvforge::cli
