#include "eval/rollout_gate.h"

#include <array>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <optional>
#include <utility>

#include "formats/input_error.h"

namespace kvforge {
namespace {

constexpr const char* kGateFlag = "--gate";

constexpr std::array<std::pair<const char*, GateMetric>, 9> kMetrics = {{
    {"needle", GateMetric::kNeedle},
    {"ppl", GateMetric::kPerplexity},
    {"kl", GateMetric::kKlMean},
    {"kl_p99", GateMetric::kKlP99},
    {"kl_p999", GateMetric::kKlP999},
    {"top1", GateMetric::kTop1},
    {"tasks", GateMetric::kTasks},
    {"attention_error", GateMetric::kAttentionError},
    {"bits", GateMetric::kBits},
}};

// Longer symbols first, so that ">=" is not read as ">" followed by "=".
constexpr std::array<std::pair<const char*, GateComparison>, 4> kComparisons = {{
    {">=", GateComparison::kGreaterEqual},
    {"<=", GateComparison::kLessEqual},
    {">", GateComparison::kGreater},
    {"<", GateComparison::kLess},
}};

std::string metric_list() {
  std::string text;
  for (const auto& [name, metric] : kMetrics) text += (text.empty() ? "" : ", ") + std::string(name);
  return text;
}

std::string_view trimmed(std::string_view text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(" \t") - first + 1);
}

std::optional<double> finite_number(std::string_view text) {
  double value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc() || stop != end || !std::isfinite(value)) return std::nullopt;
  return value;
}

// Numbers in messages: short, but exact enough to tell 0.98 from 0.979.
std::string shown(double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.6g", value);
  return buffer;
}

GateClause parse_clause(std::string_view raw) {
  const std::string_view clause = trimmed(raw);
  const std::string field = "clause '" + std::string(clause) + "'";
  if (clause.empty()) {
    throw InputError(kGateFlag, "", "clauses METRIC OP VALUE separated by commas, such as ppl<=1.03*fp16, got an empty clause");
  }
  const auto name_end = clause.find_first_of("<>= \t");
  const std::string_view name = clause.substr(0, name_end);
  GateClause result;
  bool known = false;
  for (const auto& [metric_name, metric] : kMetrics) {
    if (name == metric_name) {
      result.metric = metric;
      known = true;
    }
  }
  if (!known) throw InputError(kGateFlag, field, "a metric (" + metric_list() + ") first, got '" + std::string(name) + "'");

  const std::string_view after_name = trimmed(clause.substr(name.size()));
  bool compared = false;
  std::string_view right;
  for (const auto& [symbol, comparison] : kComparisons) {
    const std::string_view symbol_text = symbol;
    if (after_name.substr(0, symbol_text.size()) == symbol_text) {
      result.comparison = comparison;
      right = trimmed(after_name.substr(symbol_text.size()));
      compared = true;
      break;
    }
  }
  if (!compared || right.substr(0, 1) == "=") {
    throw InputError(kGateFlag, field,
                     "an operator (>=, <=, >, <) after '" + std::string(name) + "', got '" + std::string(after_name) + "'");
  }

  const std::string symbol = gate_comparison_symbol(result.comparison);
  const std::string expected_right = "a number or <factor>*" + std::string(kFullPrecisionName) + " after '" + symbol +
                                     "', got '" + std::string(right) + "'";
  const auto star = right.find('*');
  std::string right_text;
  if (star == std::string_view::npos) {
    const auto number = finite_number(right);
    if (!number) throw InputError(kGateFlag, field, expected_right);
    result.number = *number;
    right_text = std::string(right);
  } else {
    const auto factor = finite_number(trimmed(right.substr(0, star)));
    if (!factor || trimmed(right.substr(star + 1)) != kFullPrecisionName) throw InputError(kGateFlag, field, expected_right);
    result.number = *factor;
    result.relative_to_fp16 = true;
    right_text = std::string(trimmed(right.substr(0, star))) + "*" + kFullPrecisionName;
  }
  result.text = std::string(name) + symbol + right_text;
  return result;
}

// Why a configuration has no value of `metric`.
std::string missing_measurement(GateMetric metric) {
  switch (metric) {
    case GateMetric::kNeedle:
      return "no needle probes were run";
    case GateMetric::kTasks:
      return "no tasks were evaluated (--tasks)";
    case GateMetric::kAttentionError:
      return "no attention errors were measured (they need held-out captures)";
    case GateMetric::kBits:
      return "effective bits are always measured";
    default:
      return "no perplexity was measured";
  }
}

std::optional<double> metric_value(const ConfigurationEvaluation& c, GateMetric metric) {
  switch (metric) {
    case GateMetric::kNeedle:
      return c.needles.empty() ? std::nullopt : std::optional<double>(c.needle_accuracy());
    case GateMetric::kTasks:
      return c.tasks.empty() ? std::nullopt : std::optional<double>(c.task_accuracy());
    case GateMetric::kAttentionError:
      return c.attention.empty() ? std::nullopt : std::optional<double>(c.mean_attention_error());
    case GateMetric::kBits:
      return c.effective_bits;
    default:
      break;
  }
  if (!c.perplexity) return std::nullopt;
  switch (metric) {
    case GateMetric::kPerplexity:
      return c.perplexity->perplexity;
    case GateMetric::kKlMean:
      return c.perplexity->kl_mean;
    case GateMetric::kKlP99:
      return c.perplexity->kl_p99;
    case GateMetric::kKlP999:
      return c.perplexity->kl_p999;
    default:
      return c.perplexity->top1_agreement;
  }
}

double measured(const ConfigurationEvaluation& c, const GateClause& clause) {
  const auto value = metric_value(c, clause.metric);
  if (!value) {
    throw InputError(kGateFlag, "clause '" + clause.text + "'",
                     "metric " + gate_metric_name(clause.metric) + " was not measured for configuration " + c.name +
                         " (" + missing_measurement(clause.metric) + ")");
  }
  return *value;
}

bool holds(double value, GateComparison comparison, double threshold) {
  switch (comparison) {
    case GateComparison::kGreaterEqual:
      return value >= threshold;
    case GateComparison::kLessEqual:
      return value <= threshold;
    case GateComparison::kGreater:
      return value > threshold;
    default:
      return value < threshold;
  }
}

const ConfigurationEvaluation& configuration_named(const Evaluation& evaluation, const std::string& name) {
  std::string names;
  for (const ConfigurationEvaluation& c : evaluation.configurations) {
    if (c.name == name) return c;
    names += (names.empty() ? "" : ", ") + c.name;
  }
  throw InputError(kGateFlag, "configuration", "one of the evaluated configurations (" + names + "), got '" + name + "'");
}

}  // namespace

std::string gate_metric_name(GateMetric metric) {
  for (const auto& [name, value] : kMetrics) {
    if (value == metric) return name;
  }
  return "?";
}

std::string gate_comparison_symbol(GateComparison comparison) {
  for (const auto& [symbol, value] : kComparisons) {
    if (value == comparison) return symbol;
  }
  return "?";
}

RolloutGate parse_rollout_gate(std::string_view spec) {
  if (trimmed(spec).empty()) {
    throw InputError(kGateFlag, "", "at least one clause such as needle>=0.98*fp16, got an empty gate");
  }
  RolloutGate gate;
  std::size_t start = 0;
  while (true) {
    const auto comma = spec.find(',', start);
    gate.clauses.push_back(parse_clause(spec.substr(start, comma == std::string_view::npos ? comma : comma - start)));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return gate;
}

std::string GateFailure::line() const {
  return configuration + ": " + gate_metric_name(clause.metric) + " = " + shown(value) + " fails " + clause.text +
         " (threshold " + shown(threshold) + (clause.relative_to_fp16 ? " = " : ", ") + derivation + ")";
}

GateResult evaluate_rollout_gate(const RolloutGate& gate, const Evaluation& evaluation,
                                 const std::vector<std::string>& configurations) {
  GateResult result;
  if (configurations.empty()) {
    for (const ConfigurationEvaluation& c : evaluation.configurations) {
      if (c.name != kFullPrecisionName) result.configurations.push_back(c.name);
    }
  } else {
    result.configurations = configurations;
  }
  const ConfigurationEvaluation& reference = configuration_named(evaluation, kFullPrecisionName);
  for (const std::string& name : result.configurations) {
    const ConfigurationEvaluation& c = configuration_named(evaluation, name);
    for (const GateClause& clause : gate.clauses) {
      const double value = measured(c, clause);
      double threshold = clause.number;
      std::string derivation = "absolute";
      if (clause.relative_to_fp16) {
        const double reference_value = measured(reference, clause);
        threshold = clause.number * reference_value;
        derivation = shown(clause.number) + " x " + kFullPrecisionName + "'s " + gate_metric_name(clause.metric) + " " +
                     shown(reference_value);
      }
      if (!holds(value, clause.comparison, threshold)) {
        result.failures.push_back({c.name, clause, value, threshold, std::move(derivation)});
      }
    }
  }
  return result;
}

}  // namespace kvforge
