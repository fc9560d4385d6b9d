#pragma once
// The rollout gate (`kvforge eval --gate SPEC`): thresholds on an
// Evaluation's metrics that every checked configuration must meet, either
// absolute (`kl_p99<=0.5`) or relative to the 16-bit cache's value of the
// same metric (`needle>=0.98*fp16`).
//
// SPEC: clauses separated by commas; a clause is METRIC OP RHS, spaces
// allowed between the parts, with
//   METRIC  needle (accuracy over the grid, 0..1), ppl, kl (mean, nats),
//           kl_p99, kl_p999, top1 (agreement with fp16, 0..1), tasks
//           (contains accuracy, 0..1), attention_error (mean over layers of
//           key- plus value-induced output error), bits (effective bits)
//   OP      >=  <=  >  <
//   RHS     a number, or <factor>*fp16
#include <string>
#include <string_view>
#include <vector>

#include "eval/evaluation.h"

namespace kvforge {

// `kvforge eval` exits with this status when a gate's threshold fails.
inline constexpr int kGateFailedExitCode = 3;

enum class GateMetric { kNeedle, kPerplexity, kKlMean, kKlP99, kKlP999, kTop1, kTasks, kAttentionError, kBits };
enum class GateComparison { kGreaterEqual, kLessEqual, kGreater, kLess };

struct GateClause {
  std::string text;  // as written, spaces removed, e.g. "needle>=0.98*fp16"
  GateMetric metric = GateMetric::kNeedle;
  GateComparison comparison = GateComparison::kGreaterEqual;
  double number = 0;              // the absolute threshold, or the factor
  bool relative_to_fp16 = false;  // threshold = number * fp16's value
};

struct RolloutGate {
  std::vector<GateClause> clauses;
};

// Throws InputError("--gate", "clause '...'", what was expected) on the
// first clause that does not parse; an empty SPEC is an error too.
RolloutGate parse_rollout_gate(std::string_view spec);

// The metric's name as the gate spells it ("kl_p99"), and its symbol.
std::string gate_metric_name(GateMetric metric);
std::string gate_comparison_symbol(GateComparison comparison);

struct GateFailure {
  std::string configuration;
  GateClause clause;
  double value = 0;      // the configuration's value of the metric
  double threshold = 0;  // what it was compared with
  std::string derivation;  // "absolute" or "0.98 x fp16's 1"
  // One line: "kivi-2bit: needle = 0.8125, fails needle>=0.98*fp16
  // (threshold 0.98 = 0.98 x fp16's 1)".
  std::string line() const;
};

struct GateResult {
  std::vector<std::string> configurations;  // the ones checked, in order
  std::vector<GateFailure> failures;        // by configuration, then clause
  bool passed() const { return failures.empty(); }
};

// Checks every clause against each of `configurations` (names; empty: every
// configuration but fp16; fp16 may be named). A NaN value fails every
// comparison. Throws InputError("--gate", ...) naming the metric when a
// clause's metric was not measured for a checked configuration (or, for a
// relative clause, for fp16), and naming the configuration when one is
// unknown.
GateResult evaluate_rollout_gate(const RolloutGate& gate, const Evaluation& evaluation,
                                 const std::vector<std::string>& configurations = {});

}  // namespace kvforge
