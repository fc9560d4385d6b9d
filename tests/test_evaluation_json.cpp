// Evaluation <-> JSON: every field survives the round trip (non-finite
// numbers included), every missing or mistyped field is a one-line error
// naming its path, and the schema version is checked.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <limits>

#include "eval/evaluation_json.h"
#include "formats/input_error.h"
#include "tests/sample_evaluation.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

using nlohmann::json;

// Bitwise equality, so that NaN == NaN and -0 != 0 would be told apart.
bool same_number(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

#define EXPECT_SAME_NUMBER(a, b) EXPECT_TRUE(same_number((a), (b))) << #a << " = " << (a) << ", " << #b << " = " << (b)

void expect_same(const Evaluation& a, const Evaluation& b) {
  EXPECT_EQ(a.model, b.model);
  EXPECT_EQ(a.artifact, b.artifact);
  EXPECT_EQ(a.data, b.data);
  EXPECT_EQ(a.command_line, b.command_line);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(a.date, b.date);
  EXPECT_EQ(a.context, b.context);
  EXPECT_EQ(a.chunk, b.chunk);
  ASSERT_EQ(a.configurations.size(), b.configurations.size());
  for (std::size_t i = 0; i < a.configurations.size(); ++i) {
    SCOPED_TRACE("configuration " + std::to_string(i));
    const ConfigurationEvaluation &x = a.configurations[i], &y = b.configurations[i];
    EXPECT_EQ(x.name, y.name);
    EXPECT_EQ(x.method, y.method);
    EXPECT_EQ(x.bits, y.bits);
    EXPECT_EQ(x.rotated, y.rotated);
    EXPECT_SAME_NUMBER(x.effective_bits, y.effective_bits);
    EXPECT_SAME_NUMBER(x.cache_bytes_per_token, y.cache_bytes_per_token);
    EXPECT_SAME_NUMBER(x.seconds, y.seconds);
    ASSERT_EQ(x.perplexity.has_value(), y.perplexity.has_value());
    if (x.perplexity) {
      const CachePerplexity &p = *x.perplexity, &q = *y.perplexity;
      EXPECT_EQ(p.windows, q.windows);
      EXPECT_EQ(p.tokens_scored, q.tokens_scored);
      EXPECT_SAME_NUMBER(p.mean_nll, q.mean_nll);
      EXPECT_SAME_NUMBER(p.nll_stderr, q.nll_stderr);
      EXPECT_SAME_NUMBER(p.perplexity, q.perplexity);
      EXPECT_SAME_NUMBER(p.kl_mean, q.kl_mean);
      EXPECT_SAME_NUMBER(p.kl_p99, q.kl_p99);
      EXPECT_SAME_NUMBER(p.kl_p999, q.kl_p999);
      EXPECT_SAME_NUMBER(p.top1_agreement, q.top1_agreement);
    }
    ASSERT_EQ(x.attention.size(), y.attention.size());
    for (std::size_t l = 0; l < x.attention.size(); ++l) {
      EXPECT_EQ(x.attention[l].layer, y.attention[l].layer);
      EXPECT_SAME_NUMBER(x.attention[l].key_kl, y.attention[l].key_kl);
      EXPECT_SAME_NUMBER(x.attention[l].key_output, y.attention[l].key_output);
      EXPECT_SAME_NUMBER(x.attention[l].value_output, y.attention[l].value_output);
    }
    ASSERT_EQ(x.needles.size(), y.needles.size());
    for (std::size_t n = 0; n < x.needles.size(); ++n) {
      EXPECT_EQ(x.needles[n].context, y.needles[n].context);
      EXPECT_SAME_NUMBER(x.needles[n].depth, y.needles[n].depth);
      EXPECT_EQ(x.needles[n].probes, y.needles[n].probes);
      EXPECT_EQ(x.needles[n].correct, y.needles[n].correct);
    }
    ASSERT_EQ(x.needle_answers.size(), y.needle_answers.size());
    for (std::size_t n = 0; n < x.needle_answers.size(); ++n) {
      const NeedleAnswer &p = x.needle_answers[n], &q = y.needle_answers[n];
      EXPECT_EQ(p.context, q.context);
      EXPECT_SAME_NUMBER(p.depth, q.depth);
      EXPECT_EQ(p.probe, q.probe);
      EXPECT_EQ(p.expected, q.expected);
      EXPECT_EQ(p.answer, q.answer);
      EXPECT_EQ(p.correct, q.correct);
      EXPECT_SAME_NUMBER(p.margin, q.margin);
    }
    ASSERT_EQ(x.tasks.size(), y.tasks.size());
    for (std::size_t t = 0; t < x.tasks.size(); ++t) {
      EXPECT_EQ(x.tasks[t].id, y.tasks[t].id);
      EXPECT_EQ(x.tasks[t].answer, y.tasks[t].answer);
      EXPECT_EQ(x.tasks[t].exact, y.tasks[t].exact);
      EXPECT_EQ(x.tasks[t].contains, y.tasks[t].contains);
    }
  }
}

// The sample with values that JSON cannot hold as numbers, digits a short
// decimal would round, and text that needs escaping.
Evaluation awkward_sample() {
  Evaluation e = testing::sample_evaluation();
  e.configurations[1].perplexity->kl_p999 = std::numeric_limits<double>::infinity();
  e.configurations[2].perplexity->perplexity = std::numeric_limits<double>::quiet_NaN();
  e.configurations[2].seconds = -std::numeric_limits<double>::infinity();
  e.configurations[3].effective_bits = 2.0 / 3.0 + 1e-17 * 3;
  e.configurations[3].perplexity.reset();
  e.configurations[3].tasks[0].answer = "line one\nline \"two\"\t\xC3\xA9\x01";
  e.configurations[2].needle_answers[1].margin = 1.0 / 3.0 * 1e-7;
  e.command_line = "kvforge eval --gate 'needle>=0.98*fp16'";
  return e;
}

Evaluation round_tripped(const Evaluation& e) {
  return evaluation_from_json(json::parse(evaluation_to_json(e).dump()), "round-trip.json");
}

// Every object field's path and pointer, e.g. "configurations[1].perplexity.kl_p99".
void field_paths(const json& value, const std::string& path, const json::json_pointer& pointer,
                 std::vector<std::pair<std::string, json::json_pointer>>& out) {
  if (value.is_object()) {
    for (const auto& [key, child] : value.items()) {
      const std::string child_path = path.empty() ? key : path + "." + key;
      out.emplace_back(child_path, pointer / key);
      field_paths(child, child_path, pointer / key, out);
    }
  } else if (value.is_array()) {
    for (std::size_t i = 0; i < value.size(); ++i) {
      field_paths(value[i], path + "[" + std::to_string(i) + "]", pointer / i, out);
    }
  }
}

std::string error_of(const json& document) {
  try {
    evaluation_from_json(document, "eval.json");
  } catch (const InputError& error) {
    return error.what();
  }
  return "";
}

TEST(EvaluationJson, RoundTripKeepsEveryFieldBitForBit) {
  const Evaluation original = awkward_sample();
  expect_same(original, round_tripped(original));
}

TEST(EvaluationJson, WritingWhatWasReadGivesTheSameDocument) {
  const json first = evaluation_to_json(awkward_sample());
  EXPECT_EQ(evaluation_to_json(round_tripped(awkward_sample())), first);
}

TEST(EvaluationJson, HasTheSchemaVersionAndTheDerivedSummaries) {
  const Evaluation e = testing::sample_evaluation();
  const json j = evaluation_to_json(e);
  EXPECT_EQ(j.at("schema"), kEvaluationJsonSchema);
  EXPECT_EQ(j.at("configurations").size(), 4u);
  const json& kivi = j.at("configurations")[2];
  EXPECT_EQ(kivi.at("name"), "kivi-2bit");
  // kivi's grid: 4-c correct per cell minus one at depth 0.5: (4+3+2)*5 - 3 of 60 probes.
  EXPECT_DOUBLE_EQ(kivi.at("needle_accuracy").get<double>(), 42.0 / 60.0);
  EXPECT_DOUBLE_EQ(kivi.at("task_accuracy").get<double>(), 1.0 / 3.0);
  EXPECT_TRUE(j.at("configurations")[0].at("perplexity").is_object());
}

TEST(EvaluationJson, NonFiniteNumbersAreNamedStrings) {
  const json j = evaluation_to_json(awkward_sample());
  EXPECT_EQ(j.at("configurations")[1].at("perplexity").at("kl_p999"), "Infinity");
  EXPECT_EQ(j.at("configurations")[2].at("perplexity").at("perplexity"), "NaN");
  EXPECT_EQ(j.at("configurations")[2].at("seconds"), "-Infinity");
  EXPECT_TRUE(j.at("configurations")[3].at("perplexity").is_null());
}

TEST(EvaluationJson, EveryMissingFieldIsOneLineNamingIt) {
  const json complete = evaluation_to_json(testing::sample_evaluation());
  std::vector<std::pair<std::string, json::json_pointer>> paths;
  field_paths(complete, "", json::json_pointer(), paths);
  int checked = 0;
  for (const auto& [path, pointer] : paths) {
    const std::string key = pointer.back();
    if (key == "needle_accuracy" || key == "task_accuracy" || key == "mean_attention_error") {
      json document = complete;
      document[pointer.parent_pointer()].erase(key);
      EXPECT_EQ(error_of(document), "") << "derived " << path << " is not required";
      continue;
    }
    json document = complete;
    document[pointer.parent_pointer()].erase(key);
    const std::string error = error_of(document);
    EXPECT_EQ(error, "eval.json: " + path + ": a required field, missing");
    ++checked;
  }
  // 10 top-level fields + per configuration 12 fields, 9 in perplexity,
  // 4 per attention layer (5), 4 per needle cell (15), 7 per needle
  // answer (2), 4 per task (3).
  EXPECT_EQ(checked, 10 + 4 * (12 + 9 + 5 * 4 + 15 * 4 + 2 * 7 + 3 * 4));
}

TEST(EvaluationJson, MistypedFieldsNameTheFieldAndWhatWasExpected) {
  const json complete = evaluation_to_json(testing::sample_evaluation());
  json bits = complete;
  bits["configurations"][2]["bits"] = "two";
  EXPECT_EQ(error_of(bits), "eval.json: configurations[2].bits: an integer, got \"two\"");
  json kl = complete;
  kl["configurations"][1]["perplexity"]["kl_p99"] = true;
  EXPECT_EQ(error_of(kl), "eval.json: configurations[1].perplexity.kl_p99: a number (or \"NaN\", \"Infinity\", "
                          "\"-Infinity\"), got true");
  json needles = complete;
  needles["configurations"][0]["needles"] = json::object();
  EXPECT_EQ(error_of(needles), "eval.json: configurations[0].needles: an array, got {}");
  json correct = complete;
  correct["configurations"][3]["needles"][4]["correct"] = 5;
  EXPECT_EQ(error_of(correct), "eval.json: configurations[3].needles[4].correct: at most probes (4), got 5");
  json negative = complete;
  negative["context"] = -1;
  EXPECT_EQ(error_of(negative), "eval.json: context: a count >= 0, got -1");
  json rotated = complete;
  rotated["configurations"][1]["rotated"] = 1;
  EXPECT_EQ(error_of(rotated), "eval.json: configurations[1].rotated: true or false, got 1");
  EXPECT_EQ(error_of(json::array()), "eval.json: an object, got []");
}

TEST(EvaluationJson, ChecksTheSchemaAndThatFp16ComesFirst) {
  json complete = evaluation_to_json(testing::sample_evaluation());
  json future = complete;
  future["schema"] = 3;
  EXPECT_EQ(error_of(future), "eval.json: schema: 1 to 2 (this kvforge's evaluation formats), got 3");
  // Schema 1 (before per-probe needle answers) still reads, without them.
  json first = complete;
  first["schema"] = 1;
  for (json& c : first["configurations"]) c.erase("needle_probes");
  const Evaluation old = evaluation_from_json(first, "eval.json");
  EXPECT_TRUE(old.configurations[1].needle_answers.empty());
  EXPECT_EQ(old.configurations[1].needles.size(), 15u);
  json swapped = complete;
  std::swap(swapped["configurations"][0], swapped["configurations"][1]);
  EXPECT_EQ(error_of(swapped),
            "eval.json: configurations[0].name: \"fp16\" (the 16-bit cache comes first), got \"kvquant-2bit\"");
  json none = complete;
  none["configurations"] = json::array();
  EXPECT_EQ(error_of(none), "eval.json: configurations: at least the 16-bit configuration \"fp16\", got none");
}

TEST(EvaluationJson, ReadsAFileAndNamesItWhenItIsNotJson) {
  const auto dir = testing::scratch_dir("evaluation-json");
  const Evaluation original = awkward_sample();
  testing::write_file(dir / "eval.json", evaluation_to_json(original).dump(1));
  expect_same(original, read_evaluation_json(dir / "eval.json"));

  testing::write_file(dir / "broken.json", "{\"schema\": 1,");
  try {
    read_evaluation_json(dir / "broken.json");
    FAIL() << "a truncated file was accepted";
  } catch (const InputError& error) {
    const std::string text = error.what();
    EXPECT_EQ(text.rfind((dir / "broken.json").string() + ": valid JSON: ", 0), 0u) << text;
    EXPECT_EQ(text.find('\n'), std::string::npos) << text;
  }
  EXPECT_THROW(read_evaluation_json(dir / "absent.json"), InputError);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvforge
