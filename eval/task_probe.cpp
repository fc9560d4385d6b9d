#include "eval/task_probe.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "formats/input_error.h"
#include "formats/json_error_text.h"
#include "log/log.h"
#include "log/progress.h"

namespace kvforge {
namespace {

std::string trimmed(const std::string& text) {
  constexpr const char* kBlank = " \t\r\n";
  const size_t begin = text.find_first_not_of(kBlank);
  if (begin == std::string::npos) return {};
  const size_t end = text.find_last_not_of(kBlank);
  return text.substr(begin, end - begin + 1);
}

std::string line_field(int64_t line, const std::string& field) {
  return "line " + std::to_string(line) + (field.empty() ? "" : ": " + field);
}

std::string task_string(const nlohmann::json& object, const std::string& key, const std::string& file, int64_t line) {
  const auto it = object.find(key);
  if (it == object.end()) throw InputError(file, line_field(line, key), "a string (the field is missing)");
  if (!it->is_string()) throw InputError(file, line_field(line, key), "a string, got " + quote_json(*it));
  return it->get<std::string>();
}

UserTask parse_task_line(const std::string& text, const std::string& file, int64_t line) {
  nlohmann::json object;
  try {
    object = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& error) {
    throw InputError(file, line_field(line, ""), "not JSON: " + parse_error_text(error));
  }
  if (!object.is_object()) throw InputError(file, line_field(line, ""), "a JSON object, got " + quote_json(object));
  for (const auto& [key, value] : object.items()) {
    if (key != "id" && key != "context" && key != "question" && key != "answer") {
      throw InputError(file, line_field(line, key), "an unknown field (expected id, context, question, answer)");
    }
  }
  UserTask task;
  task.line = line;
  if (const auto id = object.find("id"); id != object.end()) {
    if (id->is_string()) {
      task.id = id->get<std::string>();
    } else if (id->is_number_integer()) {
      task.id = std::to_string(id->get<int64_t>());
    } else {
      throw InputError(file, line_field(line, "id"), "a string or an integer, got " + quote_json(*id));
    }
    if (task.id.empty()) throw InputError(file, line_field(line, "id"), "a non-empty id");
  } else {
    task.id = std::to_string(line);
  }
  task.context = task_string(object, "context", file, line);
  task.question = task_string(object, "question", file, line);
  task.answer = task_string(object, "answer", file, line);
  if (task.question.empty()) throw InputError(file, line_field(line, "question"), "a non-empty question");
  if (trimmed(task.answer).empty()) throw InputError(file, line_field(line, "answer"), "a non-blank answer");
  if (trimmed(task.answer).find('\n') != std::string::npos) {
    throw InputError(file, line_field(line, "answer"), "a single line (decoding stops at a newline)");
  }
  return task;
}

bool holds_newline(const Tokenizer& tokenizer, int32_t token) {
  const int32_t one[1] = {token};
  return tokenizer.decode(one).find('\n') != std::string::npos;
}

}  // namespace

std::vector<UserTask> parse_user_tasks(const std::string& jsonl_text, const std::string& file) {
  std::vector<UserTask> tasks;
  std::set<std::string> ids;
  std::istringstream lines(jsonl_text);
  std::string text;
  for (int64_t line = 1; std::getline(lines, text); ++line) {
    if (trimmed(text).empty()) continue;
    UserTask task = parse_task_line(text, file, line);
    if (!ids.insert(task.id).second) {
      throw InputError(file, line_field(line, "id"), "a unique id, \"" + task.id + "\" is used before");
    }
    tasks.push_back(std::move(task));
  }
  if (tasks.empty()) throw InputError(file, "", "at least one task (one JSON object per line)");
  return tasks;
}

std::vector<UserTask> load_user_tasks(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw InputError(file.string(), "", "cannot open the tasks file");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_user_tasks(text.str(), file.string());
}

int64_t task_decode_budget(const Tokenizer& tokenizer, const UserTask& task, const TaskScoringOptions& options) {
  const auto answer_tokens = static_cast<int64_t>(tokenizer.encode(task.answer).size());
  return std::max(answer_tokens + options.answer_margin, options.min_new_tokens);
}

std::vector<int32_t> task_prompt(const Tokenizer& tokenizer, const UserTask& task, const TaskScoringOptions& options,
                                 int64_t max_positions, int64_t* cut_tokens) {
  const std::vector<int32_t> context = tokenizer.encode(task.context);
  const std::vector<int32_t> question = tokenizer.encode(task.question);
  const int64_t budget = task_decode_budget(tokenizer, task, options);
  const int64_t fixed = (options.bos ? 1 : 0) + static_cast<int64_t>(question.size()) + budget;
  const auto context_tokens = static_cast<int64_t>(context.size());
  int64_t cut = 0;
  if (max_positions > 0) {
    if (fixed > max_positions) {
      throw std::invalid_argument("task " + task.id + ": BOS, the question and " + std::to_string(budget) +
                                  " answer tokens need " + std::to_string(fixed) + " positions, the model has " +
                                  std::to_string(max_positions));
    }
    cut = std::max<int64_t>(0, fixed + context_tokens - max_positions);
  }
  if (cut_tokens) *cut_tokens = cut;
  std::vector<int32_t> prompt;
  prompt.reserve(static_cast<size_t>(fixed + context_tokens - cut));
  if (options.bos) prompt.push_back(*options.bos);
  prompt.insert(prompt.end(), context.begin() + cut, context.end());
  prompt.insert(prompt.end(), question.begin(), question.end());
  return prompt;
}

TaskAnswer match_task_answer(const std::string& id, const std::string& answer, const std::string& expected) {
  const std::string want = trimmed(expected);
  TaskAnswer result;
  result.id = id;
  result.answer = answer;
  result.exact = trimmed(answer) == want;
  result.contains = answer.find(want) != std::string::npos;
  return result;
}

std::vector<TaskAnswer> answer_user_tasks(const Transformer& model, const Tokenizer& tokenizer,
                                          const std::vector<UserTask>& tasks, const CachePolicyMaker& make_cache,
                                          const TaskScoringOptions& options) {
  const int64_t max_positions =
      options.max_positions > 0 ? options.max_positions : model.config().max_position_embeddings;
  std::vector<TaskAnswer> answers;
  answers.reserve(tasks.size());
  log::ProgressMeter progress("tasks", static_cast<int64_t>(tasks.size()));
  int64_t matched = 0;
  for (const UserTask& task : tasks) {
    int64_t cut = 0;
    const std::vector<int32_t> prompt = task_prompt(tokenizer, task, options, max_positions, &cut);
    if (cut > 0) {
      log::info("task ", task.id, " (line ", task.line, "): context cut by ", cut,
                " tokens from the left to fit the model's ", max_positions, " positions");
    }
    const int64_t budget = task_decode_budget(tokenizer, task, options);
    const auto cache = make_cache(1, static_cast<int64_t>(prompt.size()) + budget);
    const auto decoded = greedy_decode_through_cache(
        model, {prompt}, *cache, {.chunk = options.chunk, .max_new_tokens = budget},
        [&](size_t, std::span<const int32_t> chosen) {
          const int32_t token = chosen.back();
          return (options.eos && token == *options.eos) || holds_newline(tokenizer, token);
        });
    std::vector<int32_t> tokens = decoded.front().tokens;
    if (!tokens.empty() && options.eos && tokens.back() == *options.eos) tokens.pop_back();
    std::string text = tokenizer.decode(tokens, /*skip_special_tokens=*/true);
    if (const size_t newline = text.find('\n'); newline != std::string::npos) text.resize(newline);
    answers.push_back(match_task_answer(task.id, text, task.answer));
    matched += answers.back().contains ? 1 : 0;
    progress.advance(1, static_cast<int64_t>(prompt.size()),
                     log::concat("contains ", matched, "/", static_cast<int64_t>(answers.size())));
  }
  progress.finish(log::concat("contains ", matched, "/", static_cast<int64_t>(answers.size())));
  return answers;
}

TaskFlips task_flips(const std::vector<TaskAnswer>& full_precision, const std::vector<TaskAnswer>& configuration) {
  std::map<std::string, bool> passed;
  for (const TaskAnswer& answer : configuration) passed[answer.id] = answer.contains;
  if (passed.size() != full_precision.size() || configuration.size() != full_precision.size()) {
    throw std::invalid_argument("task flips: " + std::to_string(configuration.size()) + " answers against " +
                                std::to_string(full_precision.size()) + " of the 16-bit cache");
  }
  TaskFlips flips;
  for (const TaskAnswer& baseline : full_precision) {
    const auto it = passed.find(baseline.id);
    if (it == passed.end()) {
      throw std::invalid_argument("task flips: task " + baseline.id + " has no answer under the configuration");
    }
    if (baseline.contains && !it->second) flips.lost.push_back(baseline.id);
    if (!baseline.contains && it->second) flips.gained.push_back(baseline.id);
  }
  return flips;
}

}  // namespace kvforge
