#pragma once
// `kvforge eval`'s measurements of every configuration, in one call: the
// 16-bit cache first, then each artifact configuration, each measured on the
// same windows, probes and tasks (eval/evaluation.h holds the result).
//   - perplexity, KL and top-1 against the 16-bit cache (cache_perplexity.h);
//   - needle probes built once from the held-out text (needle_probe.h);
//   - the user's tasks (task_probe.h);
//   - per-layer post-W_O attention error on held-out captures
//     (attention_error.h);
//   - effective bits and cache bytes per token (configuration_cost.h).
// Each part runs only when the plan asks for it.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <vector>

#include "eval/cache_perplexity.h"
#include "eval/evaluation.h"
#include "eval/needle_probe.h"
#include "eval/task_probe.h"
#include "formats/activation_store.h"
#include "formats/quantizer_config.h"
#include "model/tokenizer.h"
#include "model/transformer.h"
#include "rotation/model_rotation.h"

namespace kvforge {

struct NeedlePlan {
  NeedleTemplate probe_template;
  NeedleGrid grid;
  NeedleScoringOptions scoring;
  std::optional<int32_t> bos;  // prepended to every probe (whether or not perplexity is measured)
};

struct AttentionErrorPlan {
  const ActivationStoreReader* store = nullptr;  // held-out captures of the same model
  std::filesystem::path model_dir;               // its o_proj weights
  AttentionTermOptions options;
};

struct EvaluationPlan {
  std::optional<CachePerplexityOptions> perplexity;
  std::optional<NeedlePlan> needles;
  std::vector<UserTask> tasks;  // none: no task answers
  TaskScoringOptions task_options;
  std::optional<AttentionErrorPlan> attention;
  int64_t bits_context = 2048;  // the context effective bits and bytes per token are counted at
  // Needles and tasks through the runtime kernels instead of the simulated
  // cache (perplexity: CachePerplexityOptions::cache).
  QuantizedCacheKind cache = QuantizedCacheKind::kSimulated;
};

// configurations: the artifact's, in the order to report (each must fit the
// model: std::invalid_argument otherwise). The result's configurations[0] is
// the 16-bit cache; the provenance fields (model, artifact, data, command
// line, device, date) are left for the caller.
Evaluation evaluate_cache_configurations(const Transformer& model, const Tokenizer& tokenizer,
                                         std::span<const int32_t> stream,
                                         std::span<const QuantizerConfig* const> configurations,
                                         const EvaluationPlan& plan);

}  // namespace kvforge
