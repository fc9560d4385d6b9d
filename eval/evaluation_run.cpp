#include "eval/evaluation_run.h"

#include <chrono>

#include "eval/attention_error.h"
#include "eval/cached_greedy_decoding.h"
#include "eval/configuration_cost.h"
#include "log/log.h"

namespace kvforge {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string name_of(const QuantizerConfig* config) { return config ? config->name : kFullPrecisionName; }

}  // namespace

Evaluation evaluate_cache_configurations(const Transformer& model, const Tokenizer& tokenizer,
                                         std::span<const int32_t> stream,
                                         std::span<const QuantizerConfig* const> configurations,
                                         const EvaluationPlan& plan) {
  // nullptr first: the 16-bit cache.
  std::vector<const QuantizerConfig*> all{nullptr};
  all.insert(all.end(), configurations.begin(), configurations.end());
  Evaluation evaluation;
  for (const QuantizerConfig* config : all) {
    evaluation.configurations.push_back(describe_configuration(config, model.config(), plan.bits_context));
  }
  if (plan.perplexity) {
    evaluation.context = plan.perplexity->windows.context;
    evaluation.chunk = plan.perplexity->chunk;
    log::info("perplexity, KL and top-1 of ", all.size(), " caches (context ", evaluation.context, ", chunk ",
              evaluation.chunk, ")");
    const CachePerplexityResult result = evaluate_cache_perplexity(model, stream, configurations, *plan.perplexity);
    for (size_t i = 0; i < all.size(); ++i) {
      evaluation.configurations[i].perplexity = result.perplexity.at(i);
      evaluation.configurations[i].seconds += result.seconds.at(i);
    }
  }
  if (plan.needles) {
    const std::vector<NeedleProbe> probes =
        build_needle_probes(tokenizer, stream, plan.needles->probe_template, plan.needles->grid, plan.needles->bos);
    log::info("needle probes: ", probes.size(), " (", plan.needles->grid.contexts.size(), " contexts x ",
              plan.needles->grid.depths.size(), " depths x ", plan.needles->grid.probes_per_cell, ") per cache");
    for (size_t i = 0; i < all.size(); ++i) {
      const auto start = Clock::now();
      const std::vector<NeedleOutcome> outcomes =
          answer_needle_probes(model, probes, cache_policy_maker(model, all[i], plan.cache), plan.needles->scoring);
      evaluation.configurations[i].needles = needle_cells(probes, outcomes);
      evaluation.configurations[i].needle_answers = needle_answers(tokenizer, probes, outcomes);
      evaluation.configurations[i].seconds += seconds_since(start);
      log::info("needles through ", name_of(all[i]), ": accuracy ", evaluation.configurations[i].needle_accuracy(),
                " (", seconds_since(start), " s)");
    }
  }
  if (!plan.tasks.empty()) {
    for (size_t i = 0; i < all.size(); ++i) {
      const auto start = Clock::now();
      evaluation.configurations[i].tasks =
          answer_user_tasks(model, tokenizer, plan.tasks, cache_policy_maker(model, all[i], plan.cache), plan.task_options);
      evaluation.configurations[i].seconds += seconds_since(start);
      log::info("tasks through ", name_of(all[i]), ": ", evaluation.configurations[i].task_accuracy() * 100,
                "% contain the answer");
    }
  }
  if (plan.attention) {
    for (size_t i = 0; i < all.size(); ++i) {
      if (all[i] == nullptr) continue;  // the 16-bit cache has no quantization error
      const auto start = Clock::now();
      evaluation.configurations[i].attention =
          measure_attention_error(*plan.attention->store, plan.attention->model_dir, all[i], plan.attention->options);
      evaluation.configurations[i].seconds += seconds_since(start);
    }
  }
  return evaluation;
}

}  // namespace kvforge
