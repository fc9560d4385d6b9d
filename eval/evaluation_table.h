#pragma once
// The comparison of an Evaluation's configurations as a table (one row per
// configuration, columns only for what was measured), as terminal text, and
// the user's tasks whose score flipped against the 16-bit cache. The HTML
// report shows the same cells.
#include <string>
#include <vector>

#include "eval/evaluation.h"

namespace kvforge {

// Cells as text, "-" where a configuration lacks a measured column's value.
// Columns: config, method, bits, eff.bits, bytes/token; with perplexity: ppl,
// ppl vs fp16 (relative change, %), KL mean, KL p99, KL p99.9, top-1; with
// needles: needle; with tasks: tasks; with attention errors: attn error
// (mean over layers of key- plus value-induced output error).
struct ComparisonTable {
  struct Column {
    std::string header;
    bool numeric = true;  // right-aligned
  };
  std::vector<Column> columns;
  std::vector<std::vector<std::string>> rows;  // one per configuration, in order
};

ComparisonTable comparison_table(const Evaluation& evaluation);

// The table as aligned plain text, one line per row plus a header and a
// rule, each line ending in '\n'.
std::string format_evaluation_table(const Evaluation& evaluation);

// A task whose exact or contains match through a configuration differs from
// the 16-bit cache's on the same input.
struct FlippedTask {
  std::string configuration;
  std::string id;
  TaskAnswer full_precision_answer;  // through the 16-bit cache
  TaskAnswer configuration_answer;   // through the configuration
  // "lost" (fewer matches than fp16), "gained" (more) or "changed".
  std::string change() const;
};

// Every flip, configuration by configuration in the evaluation's order, then
// in the tasks file's order. Tasks are paired with fp16's by id; a task id
// fp16 did not answer throws std::invalid_argument.
std::vector<FlippedTask> flipped_tasks(const Evaluation& evaluation);

// The flips as aligned text under a heading line; a line saying none
// flipped when none did; "" when no tasks were evaluated.
std::string format_flipped_tasks(const Evaluation& evaluation);

// How a task answer matched: "exact+contains", "exact", "contains" or "miss".
std::string match_label(const TaskAnswer& answer);

}  // namespace kvforge
