// The terminal table and the flipped-tasks listing, checked as exact text
// on a hand-made Evaluation whose cells are worked out by hand below.
#include <gtest/gtest.h>

#include <stdexcept>

#include "eval/evaluation_table.h"

namespace kvforge {
namespace {

CachePerplexity perplexity_of(double perplexity, double kl_mean, double kl_p99, double kl_p999, double top1) {
  return {8, 4088, 0, 0, perplexity, kl_mean, kl_p99, kl_p999, top1};
}

ConfigurationEvaluation configuration(std::string name, std::string method, int bits, double effective_bits,
                                      double bytes_per_token) {
  ConfigurationEvaluation c;
  c.name = std::move(name);
  c.method = std::move(method);
  c.bits = bits;
  c.effective_bits = effective_bits;
  c.cache_bytes_per_token = bytes_per_token;
  return c;
}

// fp16: perplexity 20, needles 8/8, tasks 2/2, attention error 0.
// kivi-2bit: perplexity 20.6 (+3.00%), needles 3/4 + 2/4 = 62.5%, tasks
//   1/2 (task a lost), attention error 0.1 + 0.05 = 0.15.
// kvquant-2bit (rotated): only tasks measured, task b lost its exact match.
Evaluation hand_made() {
  Evaluation e;
  ConfigurationEvaluation fp16 = configuration(kFullPrecisionName, "fp16", 16, 16, 5120);
  fp16.perplexity = perplexity_of(20, 0, 0, 0, 1);
  fp16.needles = {{256, 0, 4, 4}, {256, 1, 4, 4}};
  fp16.tasks = {{"a", "Paris", true, true}, {"b", "42", true, true}};
  fp16.attention = {{0, 0, 0, 0}};

  ConfigurationEvaluation kivi = configuration("kivi-2bit", "kivi", 2, 2.625, 840);
  kivi.perplexity = perplexity_of(20.6, 0.05, 0.5, 1.25, 0.9125);
  kivi.needles = {{256, 0, 4, 3}, {256, 1, 4, 2}};
  kivi.tasks = {{"a", "Lyon", false, false}, {"b", "42", true, true}};
  kivi.attention = {{0, 0.02, 0.1, 0.05}};

  ConfigurationEvaluation kvquant = configuration("kvquant-2bit", "kvquant", 2, 2.3, 736);
  kvquant.rotated = true;
  kvquant.tasks = {{"a", "Paris", true, true}, {"b", "the answer is 42\n", false, true}};

  e.configurations = {fp16, kivi, kvquant};
  return e;
}

TEST(EvaluationTable, ExactTextWithEveryColumn) {
  EXPECT_EQ(format_evaluation_table(hand_made()),
            "config        method       bits  eff.bits  bytes/token     ppl  ppl vs fp16  KL mean  KL p99  KL p99.9  "
            "  top-1  needle   tasks  attn error\n"
            "------------  -----------  ----  --------  -----------  ------  -----------  -------  ------  --------  "
            "-------  ------  ------  ----------\n"
            "fp16          fp16           16    16.000       5120.0  20.000       +0.00%   0.0000  0.0000    0.0000  "
            "100.00%  100.0%  100.0%      0.0000\n"
            "kivi-2bit     kivi            2     2.625        840.0  20.600       +3.00%   0.0500  0.5000    1.2500  "
            " 91.25%   62.5%   50.0%      0.1500\n"
            "kvquant-2bit  kvquant+rot     2     2.300        736.0       -            -        -       -         -  "
            "      -       -  100.0%           -\n");
}

TEST(EvaluationTable, ColumnsOnlyForWhatWasMeasured) {
  Evaluation e = hand_made();
  for (ConfigurationEvaluation& c : e.configurations) {
    c.perplexity.reset();
    c.attention.clear();
    c.tasks.clear();
  }
  EXPECT_EQ(format_evaluation_table(e),
            "config        method       bits  eff.bits  bytes/token  needle\n"
            "------------  -----------  ----  --------  -----------  ------\n"
            "fp16          fp16           16    16.000       5120.0  100.0%\n"
            "kivi-2bit     kivi            2     2.625        840.0   62.5%\n"
            "kvquant-2bit  kvquant+rot     2     2.300        736.0       -\n");
  const ComparisonTable table = comparison_table(e);
  ASSERT_EQ(table.columns.size(), 6u);
  EXPECT_FALSE(table.columns[0].numeric);
  EXPECT_TRUE(table.columns[5].numeric);
}

TEST(EvaluationTable, FlippedTasksListedWithBothAnswers) {
  const std::vector<FlippedTask> flips = flipped_tasks(hand_made());
  ASSERT_EQ(flips.size(), 2u);
  EXPECT_EQ(flips[0].configuration, "kivi-2bit");
  EXPECT_EQ(flips[0].id, "a");
  EXPECT_EQ(flips[0].change(), "lost");
  EXPECT_EQ(flips[1].configuration, "kvquant-2bit");
  EXPECT_EQ(flips[1].configuration_answer.answer, "the answer is 42\n");
  EXPECT_EQ(format_flipped_tasks(hand_made()),
            "Tasks that flipped against fp16 (2):\n"
            "config        task  change  fp16 match      fp16 answer  match     answer\n"
            "------------  ----  ------  --------------  -----------  --------  --------------------\n"
            "kivi-2bit     a     lost    exact+contains  \"Paris\"      miss      \"Lyon\"\n"
            "kvquant-2bit  b     lost    exact+contains  \"42\"         contains  \"the answer is 42\\n\"\n");
}

TEST(EvaluationTable, GainedAndChangedFlipsAndLongAnswersCut) {
  Evaluation e = hand_made();
  e.configurations[0].tasks[1] = {"b", "no idea", false, false};
  e.configurations[1].tasks[1] = {"b", std::string(45, 'x'), false, true};   // gained contains
  e.configurations[2].tasks[0] = {"a", "Paris", true, false};                // exact only, fp16 had both
  e.configurations[2].tasks[1] = {"b", "no idea", false, false};             // same as fp16: no flip
  const std::vector<FlippedTask> flips = flipped_tasks(e);
  ASSERT_EQ(flips.size(), 3u);
  EXPECT_EQ(flips[1].change(), "gained");
  EXPECT_EQ(flips[2].change(), "lost");
  FlippedTask swapped{"x", "t", {"t", "a", true, false}, {"t", "a", false, true}};
  EXPECT_EQ(swapped.change(), "changed");
  const std::string text = format_flipped_tasks(e);
  EXPECT_NE(text.find("\"" + std::string(40, 'x') + "\"..."), std::string::npos) << text;
  EXPECT_EQ(text.find(std::string(41, 'x')), std::string::npos) << text;
}

TEST(EvaluationTable, FlippedTasksWhenNoneOrNoTasks) {
  Evaluation e = hand_made();
  e.configurations[1].tasks = e.configurations[0].tasks;
  e.configurations[2].tasks = e.configurations[0].tasks;
  EXPECT_EQ(format_flipped_tasks(e), "No task flipped against fp16.\n");
  for (ConfigurationEvaluation& c : e.configurations) c.tasks.clear();
  EXPECT_EQ(format_flipped_tasks(e), "");
}

TEST(EvaluationTable, ATaskFp16DidNotAnswerIsAnError) {
  Evaluation e = hand_made();
  e.configurations[1].tasks.push_back({"c", "?", false, false});
  try {
    flipped_tasks(e);
    FAIL() << "an unpaired task was accepted";
  } catch (const std::invalid_argument& error) {
    EXPECT_STREQ(error.what(), "configuration kivi-2bit: task c has no answer through the 16-bit cache to compare with");
  }
}

TEST(EvaluationTable, ControlCharactersInAnswersAreEscaped) {
  Evaluation e = hand_made();
  e.configurations[1].tasks[0].answer = "tab\there \"q\" back\\slash \x1b[31m";
  const std::string text = format_flipped_tasks(e);
  EXPECT_NE(text.find("\"tab\\there \\\"q\\\" back\\\\slash \\x1B[31m\""), std::string::npos) << text;
  EXPECT_EQ(text.find('\x1b'), std::string::npos);
}

}  // namespace
}  // namespace kvforge
