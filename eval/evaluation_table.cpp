#include "eval/evaluation_table.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <stdexcept>

namespace kvforge {
namespace {

std::string fixed(double value, int decimals) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*f", decimals, value);
  return buffer;
}

std::string percent(double share, int decimals) { return fixed(100 * share, decimals) + "%"; }

std::string signed_percent(double share) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%+.2f%%", 100 * share);
  return buffer;
}

bool any_of_configurations(const Evaluation& evaluation, bool (*measured)(const ConfigurationEvaluation&)) {
  return std::any_of(evaluation.configurations.begin(), evaluation.configurations.end(), measured);
}

// Display width of UTF-8 text: one column per code point (continuation
// bytes 10xxxxxx do not start one).
std::size_t display_width(const std::string& text) {
  return static_cast<std::size_t>(
      std::count_if(text.begin(), text.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
}

std::string padded(const std::string& text, std::size_t width, bool right_aligned) {
  const std::string padding(width - std::min(width, display_width(text)), ' ');
  return right_aligned ? padding + text : text + padding;
}

// Aligned columns two spaces apart, a dashed rule under the header; no
// trailing spaces.
std::string aligned_text(const std::vector<ComparisonTable::Column>& columns,
                         const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> widths;
  for (const auto& column : columns) widths.push_back(display_width(column.header));
  for (const auto& row : rows) {
    for (std::size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], display_width(row[i]));
  }
  auto line = [&](auto cell_of) {
    std::string text;
    for (std::size_t i = 0; i < columns.size(); ++i) {
      if (i > 0) text += "  ";
      text += padded(cell_of(i), widths[i], columns[i].numeric);
    }
    text.erase(text.find_last_not_of(' ') + 1);
    return text + "\n";
  };
  std::string text = line([&](std::size_t i) { return columns[i].header; });
  text += line([&](std::size_t i) { return std::string(widths[i], '-'); });
  for (const auto& row : rows) text += line([&](std::size_t i) { return row[i]; });
  return text;
}

// An answer on one terminal line: quoted, control characters escaped, at
// most kMaxAnswerChars code points.
std::string quoted_answer(const std::string& answer) {
  constexpr std::size_t kMaxAnswerChars = 40;
  std::string text;
  std::size_t chars = 0;
  for (std::size_t i = 0; i < answer.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(answer[i]);
    const bool starts_char = (c & 0xC0) != 0x80;
    if (starts_char && chars == kMaxAnswerChars) return "\"" + text + "\"...";
    if (starts_char) ++chars;
    if (c == '\n') {
      text += "\\n";
    } else if (c == '\t') {
      text += "\\t";
    } else if (c == '"' || c == '\\') {
      text += '\\';
      text += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7F) {
      char buffer[8];
      std::snprintf(buffer, sizeof buffer, "\\x%02X", c);
      text += buffer;
    } else {
      text += static_cast<char>(c);
    }
  }
  return "\"" + text + "\"";
}

int match_score(const TaskAnswer& answer) { return (answer.exact ? 1 : 0) + (answer.contains ? 1 : 0); }

}  // namespace

ComparisonTable comparison_table(const Evaluation& evaluation) {
  const bool with_perplexity =
      any_of_configurations(evaluation, [](const ConfigurationEvaluation& c) { return c.perplexity.has_value(); });
  const bool with_needles =
      any_of_configurations(evaluation, [](const ConfigurationEvaluation& c) { return !c.needles.empty(); });
  const bool with_tasks =
      any_of_configurations(evaluation, [](const ConfigurationEvaluation& c) { return !c.tasks.empty(); });
  const bool with_attention =
      any_of_configurations(evaluation, [](const ConfigurationEvaluation& c) { return !c.attention.empty(); });

  ComparisonTable table;
  table.columns = {{"config", false}, {"method", false}, {"bits"}, {"eff.bits"}, {"bytes/token"}};
  if (with_perplexity) {
    for (const char* header : {"ppl", "ppl vs fp16", "KL mean", "KL p99", "KL p99.9", "top-1"}) {
      table.columns.push_back({header});
    }
  }
  if (with_needles) table.columns.push_back({"needle"});
  if (with_tasks) table.columns.push_back({"tasks"});
  if (with_attention) table.columns.push_back({"attn error"});

  const std::optional<CachePerplexity>& reference = evaluation.configurations.empty()
                                                        ? std::optional<CachePerplexity>()
                                                        : evaluation.full_precision().perplexity;
  for (const ConfigurationEvaluation& c : evaluation.configurations) {
    std::vector<std::string> row = {c.name, c.rotated ? c.method + "+rot" : c.method, std::to_string(c.bits),
                                    fixed(c.effective_bits, 3), fixed(c.cache_bytes_per_token, 1)};
    if (with_perplexity) {
      if (c.perplexity) {
        const CachePerplexity& p = *c.perplexity;
        row.push_back(fixed(p.perplexity, 3));
        row.push_back(reference ? signed_percent(p.perplexity / reference->perplexity - 1) : "-");
        row.push_back(fixed(p.kl_mean, 4));
        row.push_back(fixed(p.kl_p99, 4));
        row.push_back(fixed(p.kl_p999, 4));
        row.push_back(percent(p.top1_agreement, 2));
      } else {
        row.insert(row.end(), 6, "-");
      }
    }
    if (with_needles) row.push_back(c.needles.empty() ? "-" : percent(c.needle_accuracy(), 1));
    if (with_tasks) row.push_back(c.tasks.empty() ? "-" : percent(c.task_accuracy(), 1));
    if (with_attention) row.push_back(c.attention.empty() ? "-" : fixed(c.mean_attention_error(), 4));
    table.rows.push_back(std::move(row));
  }
  return table;
}

std::string format_evaluation_table(const Evaluation& evaluation) {
  const ComparisonTable table = comparison_table(evaluation);
  return aligned_text(table.columns, table.rows);
}

std::string FlippedTask::change() const {
  const int before = match_score(full_precision_answer), after = match_score(configuration_answer);
  return after < before ? "lost" : after > before ? "gained" : "changed";
}

std::string match_label(const TaskAnswer& answer) {
  if (answer.exact && answer.contains) return "exact+contains";
  if (answer.exact) return "exact";
  if (answer.contains) return "contains";
  return "miss";
}

std::vector<FlippedTask> flipped_tasks(const Evaluation& evaluation) {
  std::vector<FlippedTask> flips;
  if (evaluation.configurations.empty()) return flips;
  std::map<std::string, const TaskAnswer*> reference;
  for (const TaskAnswer& task : evaluation.full_precision().tasks) reference.emplace(task.id, &task);
  for (std::size_t i = 1; i < evaluation.configurations.size(); ++i) {
    const ConfigurationEvaluation& c = evaluation.configurations[i];
    for (const TaskAnswer& task : c.tasks) {
      const auto found = reference.find(task.id);
      if (found == reference.end()) {
        throw std::invalid_argument("configuration " + c.name + ": task " + task.id +
                                    " has no answer through the 16-bit cache to compare with");
      }
      const TaskAnswer& before = *found->second;
      if (before.exact != task.exact || before.contains != task.contains) {
        flips.push_back({c.name, task.id, before, task});
      }
    }
  }
  return flips;
}

std::string format_flipped_tasks(const Evaluation& evaluation) {
  const bool with_tasks = std::any_of(evaluation.configurations.begin(), evaluation.configurations.end(),
                                      [](const ConfigurationEvaluation& c) { return !c.tasks.empty(); });
  if (!with_tasks) return "";
  const std::vector<FlippedTask> flips = flipped_tasks(evaluation);
  if (flips.empty()) return std::string("No task flipped against ") + kFullPrecisionName + ".\n";
  std::vector<std::vector<std::string>> rows;
  for (const FlippedTask& flip : flips) {
    rows.push_back({flip.configuration, flip.id, flip.change(), match_label(flip.full_precision_answer),
                    quoted_answer(flip.full_precision_answer.answer), match_label(flip.configuration_answer), quoted_answer(flip.configuration_answer.answer)});
  }
  const std::string reference = kFullPrecisionName;
  return "Tasks that flipped against " + reference + " (" + std::to_string(flips.size()) + "):\n" +
         aligned_text({{"config", false},
                       {"task", false},
                       {"change", false},
                       {reference + " match", false},
                       {reference + " answer", false},
                       {"match", false},
                       {"answer", false}},
                      rows);
}

}  // namespace kvforge
