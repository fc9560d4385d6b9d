#pragma once
// The user's own probes (`kvforge eval --tasks FILE.jsonl`), answered by
// greedy decoding through each cache on identical inputs, and the A/B
// listing of the tasks whose outcome flipped against the 16-bit cache.
//
// FILE.jsonl: one JSON object per line (UTF-8; blank lines are skipped but
// counted in line numbers):
//   {"id": "capital-fr", "context": "France's capital is Paris. ...",
//    "question": "\nQ: What is France's capital?\nA:", "answer": " Paris"}
// "id" is optional (a string or an integer; default: the line number) and
// unique; "context" and "question" are strings, "question" non-empty;
// "answer" is a non-empty single-line string (decoding stops at a newline).
// Other fields are refused (a typo would otherwise pass unnoticed).
//
// Prompt: [BOS] + tokens(context) + tokens(question), each tokenized on its
// own. When prompt and decoding do not fit the model's positions, the
// context is cut from the left (logged). Decoding: greedy through the cache
// (prefill in chunks), for max(tokens(answer) + answer_margin,
// min_new_tokens) tokens, stopping at EOS or at a token whose text holds a
// newline; the answer is the decoded text up to the first newline.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "eval/cached_greedy_decoding.h"
#include "eval/evaluation.h"
#include "model/tokenizer.h"
#include "model/transformer.h"

namespace kvforge {

struct UserTask {
  std::string id;
  std::string context, question, answer;
  int64_t line = 0;  // 1-based line in the file
};

// InputError("FILE", "line N: field", expected) for bad JSON, a missing,
// mistyped or unknown field, an empty question or answer, a multi-line
// answer, a duplicate id, or a file without tasks.
std::vector<UserTask> parse_user_tasks(const std::string& jsonl_text, const std::string& file_for_errors);
std::vector<UserTask> load_user_tasks(const std::filesystem::path& file);

struct TaskScoringOptions {
  int64_t chunk = 512;          // prefill tokens per forward pass (eval's chunk flag)
  int64_t answer_margin = 8;    // decoded tokens beyond the expected answer's
  int64_t min_new_tokens = 16;  // decode at least this many
  std::optional<int32_t> bos;   // prepended when set
  std::optional<int32_t> eos;   // decoding stops at it
  int64_t max_positions = 0;    // 0: the model's max_position_embeddings
};

// Tokens decoded for a task: max(|answer tokens| + margin, min_new_tokens).
int64_t task_decode_budget(const Tokenizer& tokenizer, const UserTask& task, const TaskScoringOptions& options);

// The prompt's tokens, the context cut from the left to leave room for the
// decode budget; `cut_tokens` says how many context tokens were dropped.
// std::invalid_argument when BOS, question and budget alone do not fit.
std::vector<int32_t> task_prompt(const Tokenizer& tokenizer, const UserTask& task, const TaskScoringOptions& options,
                                 int64_t max_positions, int64_t* cut_tokens = nullptr);

// exact: trimmed answer == trimmed expected; contains: the answer holds the
// trimmed expected (trimming: spaces, tabs, CR, LF at both ends).
TaskAnswer match_task_answer(const std::string& id, const std::string& answer, const std::string& expected);

// The tasks in the file's order, each through a fresh cache of one row.
std::vector<TaskAnswer> answer_user_tasks(const Transformer& model, const Tokenizer& tokenizer,
                                          const std::vector<UserTask>& tasks, const CachePolicyMaker& make_cache,
                                          const TaskScoringOptions& options);

// Tasks whose contains-match (the task accuracy's measure) differs between
// the 16-bit cache and a configuration, in the baseline's order.
struct TaskFlips {
  std::vector<std::string> lost;    // passed under fp16, fail under the configuration
  std::vector<std::string> gained;  // failed under fp16, pass under the configuration
  bool empty() const { return lost.empty() && gained.empty(); }
};
// Paired by id; std::invalid_argument when the two lists do not hold the
// same ids.
TaskFlips task_flips(const std::vector<TaskAnswer>& full_precision, const std::vector<TaskAnswer>& configuration);

}  // namespace kvforge
