// The user's --tasks (eval/task_probe.h): the JSONL format and its one-line
// errors, answer matching, prompt truncation, the flip listing, and passkey
// tasks on pyllama-16m answered through the 16-bit cache (most pass) and a
// zeroed cache (none do).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "eval/task_probe.h"
#include "formats/input_error.h"
#include "model/tokenizer.h"
#include "model/transformer.h"
#include "tests/test_paths.h"
#include "tests/zeroed_cache_policy.h"

namespace kvforge {
namespace {

constexpr int32_t kBos = 0, kEos = 1;  // pyllama-16m's <|bos|>, <|eos|>

// ----------------------------------------------------------------- parsing

TEST(UserTasks, ParsesLinesIdsAndBlankLines) {
  const std::string text =
      R"({"id": "a", "context": "ctx", "question": "q?", "answer": "x"})"
      "\n\n"
      R"({"id": 7, "context": "", "question": "q2", "answer": " y "})"
      "\r\n"
      R"({"context": "c3", "question": "q3", "answer": "z"})"
      "\n   \n";
  const auto tasks = parse_user_tasks(text, "t.jsonl");
  ASSERT_EQ(tasks.size(), 3u);
  EXPECT_EQ(tasks[0].id, "a");
  EXPECT_EQ(tasks[0].line, 1);
  EXPECT_EQ(tasks[0].context, "ctx");
  EXPECT_EQ(tasks[0].question, "q?");
  EXPECT_EQ(tasks[1].id, "7");
  EXPECT_EQ(tasks[1].line, 3);
  EXPECT_EQ(tasks[1].answer, " y ");
  EXPECT_EQ(tasks[2].id, "4");  // no id: the line number
  EXPECT_EQ(tasks[2].line, 4);
}

TEST(UserTasks, ErrorsAreOneLineNamingFileLineAndField) {
  const std::string good = R"({"id": "a", "context": "c", "question": "q", "answer": "x"})";
  struct Case {
    std::string text, expected;
  };
  const std::vector<Case> cases = {
      {"", "t.jsonl: at least one task"},
      {good + "\n{\"id\": \"b\", ", "t.jsonl: line 2: not JSON"},
      {"[1, 2]", "t.jsonl: line 1: a JSON object, got [1,2]"},
      {R"({"context": "c", "question": "q"})", "t.jsonl: line 1: answer: a string (the field is missing)"},
      {R"({"context": 3, "question": "q", "answer": "x"})", "t.jsonl: line 1: context: a string, got 3"},
      {R"({"context": "c", "question": "", "answer": "x"})", "t.jsonl: line 1: question: a non-empty question"},
      {R"({"context": "c", "question": "q", "answer": "  "})", "t.jsonl: line 1: answer: a non-blank answer"},
      {R"({"context": "c", "question": "q", "answer": "two\nlines"})", "t.jsonl: line 1: answer: a single line"},
      {R"({"id": 1.5, "context": "c", "question": "q", "answer": "x"})",
       "t.jsonl: line 1: id: a string or an integer, got 1.5"},
      {R"({"context": "c", "question": "q", "answer": "x", "expected": "y"})",
       "t.jsonl: line 1: expected: an unknown field"},
      {good + "\n\n" + good, "t.jsonl: line 3: id: a unique id, \"a\" is used before"},
  };
  for (const Case& c : cases) {
    try {
      parse_user_tasks(c.text, "t.jsonl");
      ADD_FAILURE() << "accepted: " << c.text;
    } catch (const InputError& error) {
      const std::string message = error.what();
      EXPECT_EQ(message.rfind(c.expected, 0), 0u) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  }
  EXPECT_THROW(load_user_tasks("/nonexistent/tasks.jsonl"), InputError);
}

TEST(UserTasks, AnswersMatchExactlyOrByContainment) {
  TaskAnswer a = match_task_answer("1", " Paris", "Paris ");
  EXPECT_TRUE(a.exact);
  EXPECT_TRUE(a.contains);
  EXPECT_EQ(a.id, "1");
  EXPECT_EQ(a.answer, " Paris");
  a = match_task_answer("2", "Paris, France", "Paris");
  EXPECT_FALSE(a.exact);
  EXPECT_TRUE(a.contains);
  a = match_task_answer("3", "Pari", "Paris");
  EXPECT_FALSE(a.exact);
  EXPECT_FALSE(a.contains);
  a = match_task_answer("4", "paris", "Paris");  // case matters
  EXPECT_FALSE(a.exact);
  EXPECT_FALSE(a.contains);
}

TEST(UserTasks, FlipsListTasksLostAndGainedAgainstFullPrecision) {
  const auto answer = [](std::string id, bool contains) {
    TaskAnswer a;
    a.id = std::move(id);
    a.contains = contains;
    a.exact = contains;
    return a;
  };
  const std::vector<TaskAnswer> fp16 = {answer("a", true), answer("b", false), answer("c", true), answer("d", false),
                                        answer("e", true)};
  // The configuration's answers in another order: paired by id.
  const std::vector<TaskAnswer> config = {answer("e", false), answer("d", false), answer("c", true),
                                          answer("b", true), answer("a", false)};
  const TaskFlips flips = task_flips(fp16, config);
  EXPECT_EQ(flips.lost, (std::vector<std::string>{"a", "e"}));
  EXPECT_EQ(flips.gained, (std::vector<std::string>{"b"}));
  EXPECT_FALSE(flips.empty());
  EXPECT_TRUE(task_flips(fp16, fp16).empty());
  EXPECT_THROW(task_flips(fp16, {answer("a", true)}), std::invalid_argument);
  std::vector<TaskAnswer> renamed = config;
  renamed[0].id = "x";
  EXPECT_THROW(task_flips(fp16, renamed), std::invalid_argument);
}

// ------------------------------------------------------------ with a model

class TasksOnPyLlama : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_file(testing::pyllama_dir() / "tokenizer.json"));
    model_ = std::make_unique<Transformer>(
        Transformer::load(testing::pyllama_dir(), {c10::Device(c10::kCPU), c10::kFloat}));
    heldout_ = std::make_unique<std::string>(testing::read_file(testing::shared_dir() / "data" / "heldout.txt"));
  }
  static void TearDownTestSuite() {
    tokenizer_.reset();
    model_.reset();
    heldout_.reset();
  }
  // Whole lines of heldout.txt from about `offset`, about `chars` long.
  static std::string lines_at(size_t offset, size_t chars) {
    const size_t begin = heldout_->find('\n', offset) + 1;
    const size_t end = heldout_->find('\n', begin + chars) + 1;
    return heldout_->substr(begin, end - begin);
  }
  // The passkey pattern of pyllama-16m's training as user tasks: a value
  // stated in the middle of held-out code, asked for at the end.
  static std::string passkey_tasks_jsonl(int count) {
    const std::vector<std::string> names = {"Birch", "Cedar", "Maple", "Willow", "Aspen", "Rowan"};
    const std::string alphabet = "abcdefghijklmnopqrstuvwxyz0123456789";
    std::string jsonl;
    for (int i = 0; i < count; ++i) {
      std::string value;
      for (int j = 0; j < 5 + i % 4; ++j) value += alphabet[static_cast<size_t>((i * 7 + j * 13 + j * j) % 36)];
      const std::string name = names[static_cast<size_t>(i) % names.size()];
      nlohmann::json task = {
          {"id", "passkey-" + std::to_string(i)},
          {"context", lines_at(50000 + 9000 * static_cast<size_t>(i), 500) + "PASSKEY_" + name + " = \"" + value +
                          "\"\n" + lines_at(53000 + 9000 * static_cast<size_t>(i), 500)},
          {"question", "\nassert PASSKEY_" + name + " == \""},
          {"answer", value + "\""}};
      jsonl += task.dump() + "\n";
    }
    return jsonl;
  }
  static std::unique_ptr<Tokenizer> tokenizer_;
  static std::unique_ptr<Transformer> model_;
  static std::unique_ptr<std::string> heldout_;
};
std::unique_ptr<Tokenizer> TasksOnPyLlama::tokenizer_;
std::unique_ptr<Transformer> TasksOnPyLlama::model_;
std::unique_ptr<std::string> TasksOnPyLlama::heldout_;

TEST_F(TasksOnPyLlama, LongContextsAreCutFromTheLeft) {
  UserTask task;
  task.id = "long";
  task.context = lines_at(10000, 2000);
  task.question = "\nassert x == \"";
  task.answer = "abc\"";
  TaskScoringOptions options;
  options.bos = kBos;
  const int64_t budget = task_decode_budget(*tokenizer_, task, options);
  EXPECT_EQ(budget, 16);  // 4 answer tokens + 8 < the minimum 16
  const auto context = tokenizer_->encode(task.context);
  const auto question = tokenizer_->encode(task.question);
  ASSERT_GT(context.size(), 200u);
  int64_t cut = -1;
  const auto prompt = task_prompt(*tokenizer_, task, options, 128, &cut);
  ASSERT_EQ(static_cast<int64_t>(prompt.size()), 128 - budget);
  EXPECT_EQ(prompt.front(), kBos);
  EXPECT_EQ(cut, static_cast<int64_t>(context.size() + question.size()) + 1 + budget - 128);
  // The context's last tokens, then the whole question.
  EXPECT_TRUE(std::equal(context.end() - (prompt.size() - 1 - question.size()), context.end(), prompt.begin() + 1));
  EXPECT_TRUE(std::equal(question.begin(), question.end(), prompt.end() - static_cast<int64_t>(question.size())));
  // Room enough: nothing cut.
  EXPECT_EQ(task_prompt(*tokenizer_, task, options, 4096, &cut).size(), 1 + context.size() + question.size());
  EXPECT_EQ(cut, 0);
  // Not even the question fits.
  EXPECT_THROW(task_prompt(*tokenizer_, task, options, 16, &cut), std::invalid_argument);
}

// Floor 9 of 12: the README reports 0.99 passkey retrieval with the
// full-precision cache; were the true rate as low as 0.95, 12 independent
// tasks would give 8 or fewer right with probability ~2e-3 (binomial).
TEST_F(TasksOnPyLlama, FullPrecisionAnswersPasskeyTasksAndAZeroedCacheDoesNot) {
  const auto tasks = parse_user_tasks(passkey_tasks_jsonl(12), "passkeys.jsonl");
  TaskScoringOptions options;
  options.chunk = 96;
  options.bos = kBos;
  options.eos = kEos;
  const auto fp16 = answer_user_tasks(*model_, *tokenizer_, tasks, cache_policy_maker(*model_, nullptr), options);
  ASSERT_EQ(fp16.size(), tasks.size());
  int exact = 0, contains = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    EXPECT_EQ(fp16[i].id, tasks[i].id);
    EXPECT_EQ(fp16[i].answer.find('\n'), std::string::npos);  // decoding stopped at the line's end
    exact += fp16[i].exact ? 1 : 0;
    contains += fp16[i].contains ? 1 : 0;
    std::printf("%s: expected %s, answered %s\n", tasks[i].id.c_str(), tasks[i].answer.c_str(),
                fp16[i].answer.c_str());
  }
  std::printf("fp16 cache: %d/12 exact, %d/12 contains\n", exact, contains);
  EXPECT_GE(contains, 9);
  EXPECT_GE(exact, 9);

  const CachePolicyMaker zeroed = [](int64_t, int64_t) { return std::make_unique<testing::ZeroedCachePolicy>(); };
  const auto broken = answer_user_tasks(*model_, *tokenizer_, tasks, zeroed, options);
  for (const TaskAnswer& answer : broken) EXPECT_FALSE(answer.contains) << answer.id << ": " << answer.answer;
  // Every task fp16 passed is listed as lost, none as gained.
  const TaskFlips flips = task_flips(fp16, broken);
  EXPECT_EQ(static_cast<int>(flips.lost.size()), contains);
  EXPECT_TRUE(flips.gained.empty());
}

}  // namespace
}  // namespace kvforge
