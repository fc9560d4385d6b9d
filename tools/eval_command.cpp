// kvforge eval: the 16-bit cache and an artifact's configurations side by
// side on held-out text (perplexity, KL, top-1, needles, tasks, attention
// error, bits), printed as a table, written as JSON and an HTML report, and
// checked against a rollout gate (exit status 3 when it fails).
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>

#include "eval/evaluation_json.h"
#include "eval/evaluation_report.h"
#include "eval/evaluation_run.h"
#include "eval/evaluation_table.h"
#include "eval/rollout_gate.h"
#include "formats/artifact.h"
#include "formats/atomic_text_file.h"
#include "formats/input_error.h"
#include "formats/model_fingerprint.h"
#include "formats/safetensors.h"
#include "formats/utc_timestamp.h"
#include "log/log.h"
#include "tools/commands.h"
#include "tools/flag_checks.h"
#include "tools/model_flags.h"
#include "tools/text_input.h"

namespace kvforge::cli {
namespace {

struct EvalFlags {
  ModelFlags model;
  std::string artifact;
  std::string data;
  std::vector<std::string> configs;
  int64_t context = 1024;
  int64_t chunk = 1;
  int64_t prefill_chunk = 512;
  int64_t batch = 1;
  int64_t max_windows = 8;
  bool no_perplexity = false;
  bool no_bos = false;
  // Needles.
  bool no_needles = false;
  std::string needle_template;
  std::vector<int64_t> needle_contexts;
  std::vector<double> needle_depths;
  int64_t needle_probes = 10;
  int64_t needle_batch = 8;
  uint64_t seed = 0;
  // Tasks, attention error.
  std::string tasks;
  std::string acts;
  int64_t acts_samples = 0;
  // Outputs.
  std::string json;
  std::string report;
  std::string gate;
  std::vector<std::string> gate_configs;
  bool through_kernels = false;
};

// The artifact's configurations named by --configs (all by default), in
// that order. InputError naming the artifact and the unknown name.
std::vector<const QuantizerConfig*> select_configurations(const Artifact& artifact, const EvalFlags& flags) {
  std::vector<const QuantizerConfig*> selected;
  if (flags.configs.empty()) {
    for (const QuantizerConfig& config : artifact.configs) selected.push_back(&config);
    return selected;
  }
  for (const std::string& name : flags.configs) {
    const QuantizerConfig* found = nullptr;
    std::string names;
    for (const QuantizerConfig& config : artifact.configs) {
      if (config.name == name) found = &config;
      names += (names.empty() ? "" : ", ") + config.name;
    }
    if (found == nullptr) throw InputError(flags.artifact, "/configs/" + name, "a configuration named one of: " + names);
    selected.push_back(found);
  }
  return selected;
}

EvaluationPlan plan_of(const EvalFlags& flags, const ModelConfig& config, const ActivationStoreReader* acts) {
  EvaluationPlan plan;
  const std::optional<int32_t> bos = bos_token(config, flags.no_bos);
  if (!flags.no_perplexity) {
    CachePerplexityOptions perplexity;
    perplexity.windows.context = flags.context;
    perplexity.windows.bos = bos;
    perplexity.windows.batch = flags.batch;
    if (flags.max_windows > 0) perplexity.windows.max_windows = flags.max_windows;
    perplexity.chunk = flags.chunk;
    if (flags.through_kernels) perplexity.cache = QuantizedCacheKind::kKernels;
    plan.perplexity = perplexity;
  }
  if (!flags.no_needles) {
    NeedlePlan needles;
    needles.probe_template =
        flags.needle_template.empty() ? default_needle_template() : load_needle_template(flags.needle_template);
    const int64_t budget = needle_answer_budget(needles.probe_template);
    needles.grid.contexts = flags.needle_contexts.empty()
                                ? default_needle_contexts(config.max_position_embeddings, budget)
                                : clip_needle_contexts(flags.needle_contexts, config.max_position_embeddings, budget);
    needles.grid.depths = flags.needle_depths.empty() ? default_needle_depths() : flags.needle_depths;
    needles.grid.probes_per_cell = flags.needle_probes;
    needles.grid.seed = flags.seed;
    needles.scoring.chunk = flags.prefill_chunk;
    needles.scoring.batch = flags.needle_batch;
    needles.bos = bos;
    plan.needles = needles;
  }
  if (!flags.tasks.empty()) {
    plan.tasks = load_user_tasks(flags.tasks);
    plan.task_options.chunk = flags.prefill_chunk;
    plan.task_options.bos = bos;
    if (config.eos_token_id) plan.task_options.eos = static_cast<int32_t>(*config.eos_token_id);
  }
  if (acts != nullptr) {
    AttentionErrorPlan attention;
    attention.store = acts;
    attention.model_dir = flags.model.model_dir;
    attention.options.max_samples = flags.acts_samples;
    attention.options.device = flags.model.target().device;
    plan.attention = attention;
  }
  plan.bits_context = flags.context;
  if (flags.through_kernels) plan.cache = QuantizedCacheKind::kKernels;
  return plan;
}

// A gate clause on a metric the flags leave unmeasured is refused before
// any model time is spent (the gate would refuse it after the run).
void check_gate_is_measured(const RolloutGate& gate, const EvalFlags& flags) {
  for (const GateClause& clause : gate.clauses) {
    std::string missing;
    switch (clause.metric) {
      case GateMetric::kNeedle:
        if (flags.no_needles) missing = "needle probes (drop --no-needles)";
        break;
      case GateMetric::kPerplexity:
      case GateMetric::kKlMean:
      case GateMetric::kKlP99:
      case GateMetric::kKlP999:
      case GateMetric::kTop1:
        if (flags.no_perplexity) missing = "perplexity (drop --no-perplexity)";
        break;
      case GateMetric::kTasks:
        if (flags.tasks.empty()) missing = "--tasks FILE.jsonl";
        break;
      case GateMetric::kAttentionError:
        if (flags.acts.empty()) missing = "--acts STORE (held-out captures)";
        break;
      case GateMetric::kBits:
        break;
    }
    if (!missing.empty()) {
      throw InputError("--gate", "clause '" + clause.text + "'",
                       "a metric this run measures: " + gate_metric_name(clause.metric) + " needs " + missing);
    }
  }
}

int run(const EvalFlags& flags, const Invocation& invocation) {
  // Refusals first: a bad gate or output path costs no model time.
  const std::optional<RolloutGate> gate =
      flags.gate.empty() ? std::nullopt : std::optional<RolloutGate>(parse_rollout_gate(flags.gate));
  if (gate) check_gate_is_measured(*gate, flags);
  const ComputeTarget target = flags.model.target();
  const std::filesystem::path model_dir = flags.model.model_dir;
  const ModelConfig config = load_model_config(model_dir);
  const Tokenizer tokenizer = load_tokenizer(model_dir);

  Artifact artifact;
  if (!flags.artifact.empty()) {
    artifact = read_artifact(flags.artifact);
    check_artifact_matches(artifact, fingerprint_model(config, Checkpoint(model_dir), tokenizer.sha256()),
                           flags.artifact);
  } else if (!flags.configs.empty()) {
    throw InputError("--configs", "", "an --artifact to take the configurations from");
  }
  const std::vector<const QuantizerConfig*> configurations = select_configurations(artifact, flags);
  std::unique_ptr<ActivationStoreReader> acts;
  if (!flags.acts.empty()) {
    acts = std::make_unique<ActivationStoreReader>(flags.acts);
    if (!artifact.configs.empty()) check_artifact_matches(artifact, acts->layout().model, flags.acts);
  }
  const EvaluationPlan plan = plan_of(flags, config, acts.get());

  const std::string text = read_text_file(flags.data);
  const std::vector<int32_t> tokens = tokenizer.encode(text);
  log::info("tokenized ", flags.data, ": ", tokens.size(), " tokens");
  log::info("loading ", model_dir.string(), " on ", target.device.str(), " as ", dtype_label(target.dtype));
  const Transformer model = Transformer::load(model_dir, target);

  Evaluation evaluation = evaluate_cache_configurations(model, tokenizer, tokens, configurations, plan);
  evaluation.model = model_dir.string();
  evaluation.artifact = flags.artifact;
  evaluation.data = flags.data;
  evaluation.command_line = invocation.command_line;
  evaluation.device = target.device.str() + " " + dtype_label(target.dtype);
  evaluation.date = current_utc_timestamp();

  std::cout << format_evaluation_table(evaluation);
  const std::string flips = format_flipped_tasks(evaluation);
  if (!flips.empty()) std::cout << "\n" << flips;
  std::cout.flush();
  if (!flags.json.empty()) {
    const std::string json = evaluation_to_json(evaluation).dump(1) + "\n";
    if (flags.json == "-") {
      std::cout << json;
    } else {
      write_text_file_atomically(flags.json, json, "the evaluation's JSON");
      log::info("wrote ", flags.json);
    }
  }
  if (!flags.report.empty()) {
    write_evaluation_report(evaluation, flags.report);
    log::info("wrote ", flags.report);
  }
  if (gate) {
    // Without an artifact the 16-bit cache is what there is to check.
    std::vector<std::string> checked = flags.gate_configs;
    if (checked.empty() && evaluation.configurations.size() == 1) checked.push_back(kFullPrecisionName);
    const GateResult result = evaluate_rollout_gate(*gate, evaluation, checked);
    for (const GateFailure& failure : result.failures) log::error("gate: ", failure.line());
    if (!result.passed()) {
      log::error("gate failed: ", result.failures.size(), " threshold(s) not met (", flags.gate, ")");
      return kGateFailedExitCode;
    }
    log::info("gate passed: ", flags.gate);
  }
  return 0;
}

}  // namespace

Command add_eval_command(CLI::App& app) {
  auto flags = std::make_shared<EvalFlags>();
  CLI::App* command = app.add_subcommand(
      "eval", "Compare the 16-bit cache with an artifact's configurations: perplexity, KL, needles, tasks, gate");
  flags->model.add_to(*command);
  command->add_option("-a,--artifact", flags->artifact, "Artifact (HDF5) whose configurations to evaluate")
      ->check(CLI::ExistingFile);
  command->add_option("-f,--data", flags->data, "Held-out text: perplexity windows and needle haystacks")
      ->required()
      ->check(CLI::ExistingFile);
  command->add_option("--configs", flags->configs, "Configurations to evaluate, in this order (default: all)")
      ->delimiter(',');
  command->add_option("-c,--ctx", flags->context, "Perplexity window in positions, BOS included")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 24));
  command->add_option("--chunk", flags->chunk,
                      "Perplexity: positions fed per forward pass (1: every token a decoding step, the runtime's "
                      "windows exactly; larger is faster and quantizes a superset)")
      ->capture_default_str()
      ->check(positive_integer());
  command->add_option("--prefill-chunk", flags->prefill_chunk,
                      "Needle and task prompts: positions per prefill pass before decoding the answer")
      ->capture_default_str()
      ->check(positive_integer());
  command->add_option("-b,--batch", flags->batch, "Perplexity windows per forward pass")
      ->capture_default_str()
      ->check(positive_integer());
  command->add_option("--max-windows", flags->max_windows, "Perplexity windows evaluated (0: every window)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  command->add_flag("--no-perplexity", flags->no_perplexity, "Skip perplexity, KL and top-1");
  command->add_flag("--no-bos", flags->no_bos, "Do not prepend the model's BOS token");
  command->add_flag("--no-needles", flags->no_needles, "Skip the needle-in-a-haystack probes");
  command->add_option("--needle-template", flags->needle_template,
                      "Needle probe template (JSON, see eval/templates/passkey.json; default: that passkey probe)")
      ->check(CLI::ExistingFile);
  command->add_option("--needle-contexts", flags->needle_contexts,
                      "Prompt lengths of the needle probes (default 256,512,1024,2048 up to the model's maximum)")
      ->delimiter(',')
      ->check(positive_integer());
  command->add_option("--needle-depths", flags->needle_depths, "Needle depths in [0, 1] (default 0,0.1,0.25,0.5,0.75,0.9,1)")
      ->delimiter(',')
      ->check(CLI::Range(0.0, 1.0));
  command->add_option("--needle-probes", flags->needle_probes, "Probes per context and depth")
      ->capture_default_str()
      ->check(positive_integer());
  command->add_option("--needle-batch", flags->needle_batch, "Needle probes decoded together")
      ->capture_default_str()
      ->check(positive_integer());
  command->add_option("--seed", flags->seed, "Seed of the needle probes")->capture_default_str();
  command->add_option("--tasks", flags->tasks, "Your probes: JSON lines {\"id\", \"context\", \"question\", \"answer\"}")
      ->check(CLI::ExistingFile);
  command->add_option("--acts", flags->acts, "Held-out activation store (capture) for the per-layer post-W_O error")
      ->check(CLI::ExistingFile);
  command->add_option("--acts-samples", flags->acts_samples, "Windows of --acts used (0: all)")
      ->check(CLI::NonNegativeNumber);
  command->add_option("--json", flags->json, "Write the evaluation as JSON to this file (- for stdout)");
  command->add_option("--report", flags->report, "Write a self-contained HTML report to this file");
  command->add_option("--gate", flags->gate,
                      "Rollout thresholds, e.g. 'needle>=0.98*fp16,ppl<=1.03*fp16,kl_p99<=0.5' (exit 3 on failure)");
  command->add_flag("--through-kernels", flags->through_kernels,
                    "Run the quantized caches through the runtime kernels (CUDA on a GPU, their CPU reference "
                    "otherwise) instead of the simulated quantizer; every token is a decoding step");
  command->add_option("--gate-configs", flags->gate_configs,
                      "Configurations the gate checks (default: every evaluated one but fp16; fp16 may be named)")
      ->delimiter(',');
  return [flags](const Invocation& invocation) { return run(*flags, invocation); };
}

}  // namespace kvforge::cli
