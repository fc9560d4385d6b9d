// The rollout gate: parsing (every metric and operator, spaces, relative and
// absolute thresholds, one-line errors for what does not parse), thresholds
// derived from fp16, a zeroed cache failing every clause by name, fp16's own
// metrics passing, and unmeasured metrics refused rather than passed.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "eval/rollout_gate.h"
#include "formats/input_error.h"
#include "tests/sample_evaluation.h"

namespace kvforge {
namespace {

std::string parse_error(const std::string& spec) {
  try {
    parse_rollout_gate(spec);
  } catch (const InputError& error) {
    return error.what();
  }
  return "";
}

std::vector<std::string> lines(const GateResult& result) {
  std::vector<std::string> text;
  for (const GateFailure& failure : result.failures) text.push_back(failure.line());
  return text;
}

// What a cache of zeros gives on pyllama-16m's 32000-token vocabulary:
// attention over zero keys is uniform and reads zero values, so the next
// token is predicted from the residual stream alone: perplexity in the
// thousands, no needle or task found, top-1 agreement near chance.
ConfigurationEvaluation zeroed_cache() {
  ConfigurationEvaluation c;
  c.name = "zeroed";
  c.method = "rtn";
  c.bits = 2;
  c.effective_bits = 2.5;
  c.cache_bytes_per_token = 800;
  c.perplexity = CachePerplexity{8, 4088, std::log(4100.0), 0.05, 4100, 6.2, 11.8, 14.9, 0.021};
  const ConfigurationEvaluation fp16 = testing::sample_evaluation().configurations[0];
  for (NeedleCell cell : fp16.needles) {
    cell.correct = 0;
    c.needles.push_back(cell);
  }
  for (TaskAnswer task : fp16.tasks) {
    task.answer = "";
    task.exact = task.contains = false;
    c.tasks.push_back(task);
  }
  for (int64_t layer = 0; layer < 5; ++layer) c.attention.push_back({layer, 2.1, 1.0, 1.0});
  return c;
}

TEST(RolloutGate, ParsesEveryMetricOperatorAndBothKindsOfThreshold) {
  const RolloutGate gate = parse_rollout_gate(
      "needle>=0.98*fp16,ppl<=1.03*fp16,kl<0.1,kl_p99<=0.5,kl_p999<2,top1>0.9,tasks>=1*fp16,attention_error<=0.25,"
      "bits<2.75");
  ASSERT_EQ(gate.clauses.size(), 9u);
  const GateMetric metrics[] = {GateMetric::kNeedle, GateMetric::kPerplexity, GateMetric::kKlMean,
                                GateMetric::kKlP99,  GateMetric::kKlP999,     GateMetric::kTop1,
                                GateMetric::kTasks,  GateMetric::kAttentionError, GateMetric::kBits};
  const GateComparison comparisons[] = {GateComparison::kGreaterEqual, GateComparison::kLessEqual,
                                        GateComparison::kLess,         GateComparison::kLessEqual,
                                        GateComparison::kLess,         GateComparison::kGreater,
                                        GateComparison::kGreaterEqual, GateComparison::kLessEqual,
                                        GateComparison::kLess};
  const double numbers[] = {0.98, 1.03, 0.1, 0.5, 2, 0.9, 1, 0.25, 2.75};
  const bool relative[] = {true, true, false, false, false, false, true, false, false};
  for (std::size_t i = 0; i < 9; ++i) {
    SCOPED_TRACE(gate.clauses[i].text);
    EXPECT_EQ(gate.clauses[i].metric, metrics[i]);
    EXPECT_EQ(gate.clauses[i].comparison, comparisons[i]);
    EXPECT_EQ(gate.clauses[i].number, numbers[i]);
    EXPECT_EQ(gate.clauses[i].relative_to_fp16, relative[i]);
  }
  EXPECT_EQ(gate.clauses[0].text, "needle>=0.98*fp16");
  EXPECT_EQ(gate_metric_name(GateMetric::kAttentionError), "attention_error");
}

TEST(RolloutGate, SpacesBetweenThePartsAreAllowed) {
  const RolloutGate gate = parse_rollout_gate(" needle >= 0.98 * fp16 , kl_p99<= 5e-1 ");
  ASSERT_EQ(gate.clauses.size(), 2u);
  EXPECT_EQ(gate.clauses[0].text, "needle>=0.98*fp16");
  EXPECT_TRUE(gate.clauses[0].relative_to_fp16);
  EXPECT_EQ(gate.clauses[1].text, "kl_p99<=5e-1");
  EXPECT_EQ(gate.clauses[1].number, 0.5);
}

TEST(RolloutGate, WhatDoesNotParseIsOneLineNamingTheClause) {
  const std::pair<const char*, const char*> cases[] = {
      {"", "--gate: at least one clause such as needle>=0.98*fp16, got an empty gate"},
      {"needle>=0.9,,ppl<=2",
       "--gate: clauses METRIC OP VALUE separated by commas, such as ppl<=1.03*fp16, got an empty clause"},
      {"recall>=0.9",
       "--gate: clause 'recall>=0.9': a metric (needle, ppl, kl, kl_p99, kl_p999, top1, tasks, attention_error, bits) "
       "first, got 'recall'"},
      {"needle", "--gate: clause 'needle': an operator (>=, <=, >, <) after 'needle', got ''"},
      {"needle=>0.9", "--gate: clause 'needle=>0.9': an operator (>=, <=, >, <) after 'needle', got '=>0.9'"},
      {"needle==0.9", "--gate: clause 'needle==0.9': an operator (>=, <=, >, <) after 'needle', got '==0.9'"},
      {"needle>==0.9", "--gate: clause 'needle>==0.9': an operator (>=, <=, >, <) after 'needle', got '>==0.9'"},
      {"ppl<=", "--gate: clause 'ppl<=': a number or <factor>*fp16 after '<=', got ''"},
      {"ppl<=high", "--gate: clause 'ppl<=high': a number or <factor>*fp16 after '<=', got 'high'"},
      {"ppl<=1.03*fp32", "--gate: clause 'ppl<=1.03*fp32': a number or <factor>*fp16 after '<=', got '1.03*fp32'"},
      {"ppl<=fp16*1.03", "--gate: clause 'ppl<=fp16*1.03': a number or <factor>*fp16 after '<=', got 'fp16*1.03'"},
      {"ppl<=*fp16", "--gate: clause 'ppl<=*fp16': a number or <factor>*fp16 after '<=', got '*fp16'"},
      {"ppl<=1.03fp16", "--gate: clause 'ppl<=1.03fp16': a number or <factor>*fp16 after '<=', got '1.03fp16'"},
      {"kl<nan", "--gate: clause 'kl<nan': a number or <factor>*fp16 after '<', got 'nan'"},
      {"kl<inf", "--gate: clause 'kl<inf': a number or <factor>*fp16 after '<', got 'inf'"},
  };
  for (const auto& [spec, expected] : cases) {
    EXPECT_EQ(parse_error(spec), expected) << "spec: " << spec;
  }
}

TEST(RolloutGate, RelativeThresholdsAreTheFactorTimesFp16sValue) {
  Evaluation e = testing::sample_evaluation();  // fp16 perplexity 20.5; kvquant-2bit 21.02
  // 1.03 x 20.5 = 21.115 >= 21.02: passes; an absolute 21 does not.
  const GateResult relative = evaluate_rollout_gate(parse_rollout_gate("ppl<=1.03*fp16"), e, {"kvquant-2bit"});
  EXPECT_TRUE(relative.passed()) << ::testing::PrintToString(lines(relative));
  const GateResult absolute = evaluate_rollout_gate(parse_rollout_gate("ppl<=21"), e, {"kvquant-2bit"});
  ASSERT_EQ(absolute.failures.size(), 1u);
  EXPECT_EQ(absolute.failures[0].line(), "kvquant-2bit: ppl = 21.02 fails ppl<=21 (threshold 21, absolute)");
  // 1.02 x 20.5 = 20.91 < 21.02.
  const GateResult tighter = evaluate_rollout_gate(parse_rollout_gate("ppl<=1.02*fp16"), e, {"kvquant-2bit"});
  ASSERT_EQ(tighter.failures.size(), 1u);
  EXPECT_DOUBLE_EQ(tighter.failures[0].threshold, 1.02 * 20.5);
  EXPECT_EQ(tighter.failures[0].line(),
            "kvquant-2bit: ppl = 21.02 fails ppl<=1.02*fp16 (threshold 20.91 = 1.02 x fp16's ppl 20.5)");
}

TEST(RolloutGate, ChecksEveryConfigurationButFp16ByDefault) {
  const Evaluation e = testing::sample_evaluation();
  const GateResult result = evaluate_rollout_gate(parse_rollout_gate("needle>=0.98*fp16,ppl<=1.03*fp16"), e);
  EXPECT_EQ(result.configurations, (std::vector<std::string>{"kvquant-2bit", "kivi-2bit", "rtn-2bit"}));
  // kvquant: needle 59/60 = 0.983 >= 0.98, ppl 21.02 <= 21.115: passes.
  // kivi: needle 42/60 = 0.7, ppl 21.9: both fail. rtn: needle 19/60, ppl 27.4.
  EXPECT_EQ(lines(result),
            (std::vector<std::string>{
                "kivi-2bit: needle = 0.7 fails needle>=0.98*fp16 (threshold 0.98 = 0.98 x fp16's needle 1)",
                "kivi-2bit: ppl = 21.9 fails ppl<=1.03*fp16 (threshold 21.115 = 1.03 x fp16's ppl 20.5)",
                "rtn-2bit: needle = 0.316667 fails needle>=0.98*fp16 (threshold 0.98 = 0.98 x fp16's needle 1)",
                "rtn-2bit: ppl = 27.4 fails ppl<=1.03*fp16 (threshold 21.115 = 1.03 x fp16's ppl 20.5)"}));
}

TEST(RolloutGate, AZeroedCacheFailsEveryClauseByName) {
  Evaluation e = testing::sample_evaluation();
  e.configurations.push_back(zeroed_cache());
  const RolloutGate gate = parse_rollout_gate(
      "needle>=0.98*fp16,ppl<=1.03*fp16,kl_p99<=0.5,top1>=0.9,kl<=0.1,kl_p999<=2,tasks>=1*fp16,attention_error<=0.2");
  const GateResult result = evaluate_rollout_gate(gate, e, {"zeroed"});
  EXPECT_FALSE(result.passed());
  EXPECT_EQ(lines(result),
            (std::vector<std::string>{
                "zeroed: needle = 0 fails needle>=0.98*fp16 (threshold 0.98 = 0.98 x fp16's needle 1)",
                "zeroed: ppl = 4100 fails ppl<=1.03*fp16 (threshold 21.115 = 1.03 x fp16's ppl 20.5)",
                "zeroed: kl_p99 = 11.8 fails kl_p99<=0.5 (threshold 0.5, absolute)",
                "zeroed: top1 = 0.021 fails top1>=0.9 (threshold 0.9, absolute)",
                "zeroed: kl = 6.2 fails kl<=0.1 (threshold 0.1, absolute)",
                "zeroed: kl_p999 = 14.9 fails kl_p999<=2 (threshold 2, absolute)",
                // fp16 answers 2 of its 3 tasks: 1 x 2/3.
                "zeroed: tasks = 0 fails tasks>=1*fp16 (threshold 0.666667 = 1 x fp16's tasks 0.666667)",
                "zeroed: attention_error = 2 fails attention_error<=0.2 (threshold 0.2, absolute)"}));
  EXPECT_EQ(kGateFailedExitCode, 3);
}

TEST(RolloutGate, Fp16AndAConfigurationWithFp16sMetricsPass) {
  Evaluation e = testing::sample_evaluation();
  ConfigurationEvaluation copy = e.configurations[0];
  copy.name = "lossless";
  copy.method = "kvquant";
  e.configurations.push_back(copy);
  const RolloutGate gate =
      parse_rollout_gate("needle>=0.98*fp16,ppl<=1.03*fp16,kl_p99<=0.5,top1>=0.9,tasks>=1*fp16,kl<=1*fp16");
  const GateResult result = evaluate_rollout_gate(gate, e, {kFullPrecisionName, "lossless"});
  EXPECT_TRUE(result.passed()) << ::testing::PrintToString(lines(result));
  EXPECT_EQ(result.configurations.size(), 2u);
}

TEST(RolloutGate, StrictAndInclusiveComparisonsAtTheThreshold) {
  const Evaluation e = testing::sample_evaluation();  // kvquant-2bit top1 0.931
  EXPECT_TRUE(evaluate_rollout_gate(parse_rollout_gate("top1>=0.931"), e, {"kvquant-2bit"}).passed());
  EXPECT_FALSE(evaluate_rollout_gate(parse_rollout_gate("top1>0.931"), e, {"kvquant-2bit"}).passed());
  EXPECT_TRUE(evaluate_rollout_gate(parse_rollout_gate("top1<=0.931"), e, {"kvquant-2bit"}).passed());
  EXPECT_FALSE(evaluate_rollout_gate(parse_rollout_gate("top1<0.931"), e, {"kvquant-2bit"}).passed());
  EXPECT_TRUE(evaluate_rollout_gate(parse_rollout_gate("bits<2.5"), e, {"kvquant-2bit"}).passed());
}

TEST(RolloutGate, ANaNValueFailsWhicheverWayTheClausePoints) {
  Evaluation e = testing::sample_evaluation();
  e.configurations[1].perplexity->perplexity = std::numeric_limits<double>::quiet_NaN();
  const GateResult result = evaluate_rollout_gate(parse_rollout_gate("ppl<=1e9,ppl>=0"), e, {"kvquant-2bit"});
  EXPECT_EQ(lines(result), (std::vector<std::string>{"kvquant-2bit: ppl = nan fails ppl<=1e9 (threshold 1e+09, absolute)",
                                                     "kvquant-2bit: ppl = nan fails ppl>=0 (threshold 0, absolute)"}));
}

std::string evaluation_error(const std::string& spec, const Evaluation& e, const std::vector<std::string>& names = {}) {
  try {
    evaluate_rollout_gate(parse_rollout_gate(spec), e, names);
  } catch (const InputError& error) {
    return error.what();
  }
  return "";
}

TEST(RolloutGate, AMetricThatWasNotMeasuredIsAnErrorNotAPass) {
  Evaluation e = testing::sample_evaluation();
  for (ConfigurationEvaluation& c : e.configurations) c.tasks.clear();
  EXPECT_EQ(evaluation_error("needle>=0.9,tasks>=0.9", e),
            "--gate: clause 'tasks>=0.9': metric tasks was not measured for configuration kvquant-2bit (no tasks were "
            "evaluated (--tasks))");
  // Measured for the configuration but not for fp16, which a relative clause needs.
  Evaluation no_reference = testing::sample_evaluation();
  no_reference.configurations[0].perplexity.reset();
  EXPECT_EQ(evaluation_error("top1>=0.99*fp16", no_reference),
            "--gate: clause 'top1>=0.99*fp16': metric top1 was not measured for configuration fp16 (no perplexity was "
            "measured)");
  EXPECT_EQ(evaluation_error("top1>=0.9", no_reference), "");
  Evaluation no_attention = testing::sample_evaluation();
  no_attention.configurations[2].attention.clear();
  EXPECT_EQ(evaluation_error("attention_error<=1", no_attention),
            "--gate: clause 'attention_error<=1': metric attention_error was not measured for configuration kivi-2bit "
            "(no attention errors were measured (they need held-out captures))");
  Evaluation no_needles = testing::sample_evaluation();
  no_needles.configurations[3].needles.clear();
  EXPECT_EQ(evaluation_error("needle>=0", no_needles),
            "--gate: clause 'needle>=0': metric needle was not measured for configuration rtn-2bit (no needle probes "
            "were run)");
}

TEST(RolloutGate, AnUnknownConfigurationIsNamed) {
  EXPECT_EQ(evaluation_error("ppl<=30", testing::sample_evaluation(), {"kivi-4bit"}),
            "--gate: configuration: one of the evaluated configurations (fp16, kvquant-2bit, kivi-2bit, rtn-2bit), got "
            "'kivi-4bit'");
}

}  // namespace
}  // namespace kvforge
