// kvforge capture: record queries, keys, values and their Fisher sensitivity
// over calibration text into an activation store (or merge stores).
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "capture/capture.h"
#include "capture/capture_memory.h"
#include "capture/device_memory.h"
#include "formats/input_error.h"
#include "formats/model_fingerprint.h"
#include "formats/sha256.h"
#include "kvforge/version.h"
#include "log/log.h"
#include "tools/commands.h"
#include "tools/flag_checks.h"
#include "tools/model_flags.h"
#include "tools/text_input.h"

namespace kvforge::cli {
namespace {

struct CaptureFlags {
  ModelFlags model;
  std::string data;
  std::string out;
  std::vector<std::string> merge;
  int64_t samples = 16;
  int64_t seq_len = 2048;
  uint64_t seed = 0;
  std::vector<std::string> fields;
  int compression = 1;
  int64_t loss_chunk = 1024;
  bool resume = false;
  bool no_bos = false;
  bool allow_long_context = false;
  bool skip_memory_check = false;
  std::string command_line;
};

std::vector<ActivationField> parse_fields(const std::vector<std::string>& names) {
  if (names.empty()) return all_activation_fields();
  std::vector<ActivationField> fields;
  for (const auto& name : names) {
    const auto field = parse_activation_field(name);
    if (!field) throw InputError("--fields " + name, "", "expected q, k_pre, k_post, v, fisher_k or fisher_v");
    fields.push_back(*field);
  }
  return fields;
}

// Test hook for crash recovery: KVFORGE_ABORT_AFTER_SAMPLES=n ends the
// process abruptly (no cleanup, as a kill would) after n committed samples.
std::optional<int64_t> abort_after_samples() {
  const char* value = std::getenv("KVFORGE_ABORT_AFTER_SAMPLES");
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::stoll(value);
}

int run_merge(const CaptureFlags& flags) {
  std::vector<std::filesystem::path> inputs(flags.merge.begin(), flags.merge.end());
  merge_activation_stores(inputs, flags.out);
  log::info("merged ", inputs.size(), " stores into ", flags.out);
  return 0;
}

bool records_fisher(const std::vector<ActivationField>& fields) {
  return std::any_of(fields.begin(), fields.end(), [](ActivationField f) {
    return f == ActivationField::kFisherKeys || f == ActivationField::kFisherValues;
  });
}

// Windows longer than the model was trained for give activations unlike any
// it produces in use, and are the usual typo (100000 for 1000).
void check_context_length(const CaptureFlags& flags, const ModelConfig& config) {
  const int64_t max_positions = config.max_position_embeddings;
  if (max_positions <= 0 || flags.seq_len <= max_positions) return;
  const std::string what = "the model's max_position_embeddings (" + std::to_string(max_positions) + ", " +
                           (std::filesystem::path(flags.model.model_dir) / "config.json").string() + ")";
  if (!flags.allow_long_context) {
    throw InputError("--seq-len " + std::to_string(flags.seq_len), "",
                     "expected at most " + what + "; --allow-long-context captures past it");
  }
  log::warn("--seq-len ", flags.seq_len, " exceeds ", what, ": capturing past it (--allow-long-context)");
}

// Refuses before anything is allocated when the capture cannot fit.
void check_memory(const CaptureFlags& flags, const ModelConfig& config, const ComputeTarget& target,
                  const std::vector<ActivationField>& fields) {
  const CaptureMemoryEstimate estimate =
      estimate_capture_memory(config, {.seq_len = flags.seq_len,
                                       .dtype = target.dtype,
                                       .attention = target.attention,
                                       .fisher = records_fisher(fields),
                                       .loss_chunk_tokens = flags.loss_chunk,
                                       .staging_in_same_memory = !target.device.is_cuda()});
  const std::optional<int64_t> available = available_device_memory(target.device);
  log::info("memory estimate on ", target.device.str(), ": ", format_bytes(estimate.peak()), " peak (weights ",
            format_bytes(estimate.weights), ", forward ", format_bytes(estimate.forward), ", loss ",
            format_bytes(estimate.loss_head), ", layer backward ", format_bytes(estimate.layer_backward), "); ",
            available ? format_bytes(*available) : std::string("unknown"), " available");
  if (!available || estimate.peak() <= *available) return;
  const std::string need = "a capture of " + std::to_string(flags.seq_len) + " positions needs about " +
                           format_bytes(estimate.peak()) + " on " + target.device.str() + ", " +
                           format_bytes(*available) + " available";
  if (!flags.skip_memory_check) {
    throw InputError("--seq-len " + std::to_string(flags.seq_len), "",
                     "expected a window that fits: " + need + "; --skip-memory-check tries anyway");
  }
  log::warn(need, ": trying anyway (--skip-memory-check)");
}

int run(const CaptureFlags& flags) {
  if (!flags.merge.empty()) return run_merge(flags);
  if (flags.model.model_dir.empty() || flags.data.empty()) {
    throw InputError("capture", "", "expected --model and --data (or --merge A.h5 B.h5 ...)");
  }
  const ComputeTarget target = flags.model.target();
  const std::filesystem::path model_dir = flags.model.model_dir;
  const ModelConfig config = load_model_config(model_dir);
  const std::vector<ActivationField> fields = parse_fields(flags.fields);
  check_context_length(flags, config);
  check_memory(flags, config, target, fields);
  const Tokenizer tokenizer = load_tokenizer(model_dir);
  const std::string text = read_text_file(flags.data);
  const std::vector<int32_t> tokens = tokenizer.encode(text);
  log::info("tokenized ", flags.data, ": ", tokens.size(), " tokens");

  ActivationStoreLayout layout;
  {
    const Checkpoint checkpoint(model_dir);
    layout.model = fingerprint_model(config, checkpoint, tokenizer.sha256());
  }
  CaptureSettings settings;
  settings.bos = bos_token(config, flags.no_bos);
  // Before the store is created: a refusal leaves no OUT.partial behind.
  const int64_t window_text_tokens = flags.seq_len - (settings.bos ? 1 : 0);
  if (static_cast<int64_t>(tokens.size()) < window_text_tokens) {
    throw InputError(flags.data, "", "expected at least one window of " + std::to_string(window_text_tokens) +
                                         " text tokens (--seq-len " + std::to_string(flags.seq_len) + "), got " +
                                         std::to_string(tokens.size()));
  }
  settings.samples = flags.samples;
  settings.seq_len = flags.seq_len;
  settings.seed = flags.seed;
  settings.recorder.fields = fields;
  settings.recorder.loss_chunk_tokens = flags.loss_chunk;
  auto& provenance = layout.provenance;
  provenance.data_file = std::filesystem::path(flags.data).filename().string();
  provenance.data_sha256 = sha256_hex(text);
  provenance.data_tokens = static_cast<int64_t>(tokens.size());
  provenance.samples = flags.samples;
  provenance.seq_len = flags.seq_len;
  provenance.seed = flags.seed;
  provenance.bos = settings.bos.has_value();
  provenance.compute_dtype = dtype_label(target.dtype);
  provenance.device = target.device.str();
  provenance.tool_version = kVersion;
  provenance.command_line = flags.command_line;
  layout.fields = settings.recorder.fields;
  layout.compression_level = flags.compression;

  // Written under a temporary name, renamed only when complete.
  const std::filesystem::path out = flags.out;
  const std::filesystem::path partial = out.string() + ".partial";
  if (std::filesystem::exists(partial) && !flags.resume) {
    throw InputError(partial.string(), "", "an interrupted capture exists: pass --resume to continue it, or delete it");
  }
  ActivationStoreWriter writer = flags.resume && std::filesystem::exists(partial)
                                     ? ActivationStoreWriter::resume(partial, layout)
                                     : ActivationStoreWriter::create(partial, layout);
  log::info("loading ", model_dir.string(), " on ", target.device.str(), " as ", dtype_label(target.dtype));
  const Transformer model = Transformer::load(model_dir, target);
  const auto abort_after = abort_after_samples();
  int64_t committed_this_run = 0;
  run_capture(model, tokens, settings, writer, [&](int64_t) {
    if (abort_after && ++committed_this_run >= *abort_after) std::_Exit(137);
  });
  writer.close();
  std::filesystem::rename(partial, out);
  log::info("wrote ", out.string(), ": ", flags.samples, " samples x ", flags.seq_len, " tokens");
  return 0;
}

}  // namespace

Command add_capture_command(CLI::App& app) {
  auto flags = std::make_shared<CaptureFlags>();
  CLI::App* command = app.add_subcommand(
      "capture", "Record queries, keys, values and Fisher sensitivity over calibration text into an HDF5 store");
  CLI::Option* model =
      command->add_option("-m,--model", flags->model.model_dir, "Hugging Face model folder")->check(CLI::ExistingDirectory);
  command->add_option("--device", flags->model.device, "cpu, cuda or cuda:N")->capture_default_str();
  command->add_option("--dtype", flags->model.dtype, "fp32, bf16 or fp16 (default: fp32 on cpu, bf16 on cuda)");
  command->add_option("--attention", flags->model.attention, "auto, eager or sdpa")->capture_default_str();
  CLI::Option* data = command->add_option("-f,--data", flags->data, "Calibration text file")->check(CLI::ExistingFile);
  command->add_option("-o,--out", flags->out, "Activation store to write (HDF5)")->required();
  command->add_option("--merge", flags->merge, "Merge these stores of the same model into --out instead")
      ->expected(2, -1)
      ->check(CLI::ExistingFile)
      ->excludes(model)
      ->excludes(data);
  command->add_option("-n,--samples", flags->samples, "Windows to record")->capture_default_str()->check(positive_integer());
  command->add_option("-l,--seq-len", flags->seq_len, "Positions per window, BOS included")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 24));
  command->add_option("--seed", flags->seed, "Seed of the window sampler")->capture_default_str();
  command->add_option("--fields", flags->fields, "Fields to record (default all): q k_pre k_post v fisher_k fisher_v")
      ->delimiter(',');
  command->add_option("--compression", flags->compression, "Deflate level 0-9 (0: none)")
      ->capture_default_str()
      ->check(CLI::Range(0, 9));
  command->add_option("--loss-chunk", flags->loss_chunk, "Positions whose logits are held at once in the Fisher pass")
      ->capture_default_str()
      ->check(positive_integer());
  command->add_flag("--resume", flags->resume, "Continue an interrupted capture (OUT.partial)");
  command->add_flag("--no-bos", flags->no_bos, "Do not start windows with the model's BOS token");
  command->add_flag("--allow-long-context", flags->allow_long_context,
                    "Allow --seq-len past the model's max_position_embeddings (warns)");
  command->add_flag("--skip-memory-check", flags->skip_memory_check,
                    "Run even when the memory estimate exceeds what the device has free (warns)");
  return [flags](const Invocation& invocation) {
    flags->command_line = invocation.command_line;
    return run(*flags);
  };
}

}  // namespace kvforge::cli
