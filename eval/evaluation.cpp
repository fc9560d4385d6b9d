#include "eval/evaluation.h"

namespace kvforge {

double ConfigurationEvaluation::needle_accuracy() const {
  int64_t probes = 0, correct = 0;
  for (const NeedleCell& cell : needles) {
    probes += cell.probes;
    correct += cell.correct;
  }
  return probes > 0 ? static_cast<double>(correct) / static_cast<double>(probes) : 0;
}

double ConfigurationEvaluation::task_accuracy() const {
  if (tasks.empty()) return 0;
  int64_t matched = 0;
  for (const TaskAnswer& task : tasks) matched += task.contains ? 1 : 0;
  return static_cast<double>(matched) / static_cast<double>(tasks.size());
}

double ConfigurationEvaluation::mean_attention_error() const {
  if (attention.empty()) return 0;
  double sum = 0;
  for (const LayerAttentionError& layer : attention) sum += layer.key_output + layer.value_output;
  return sum / static_cast<double>(attention.size());
}

}  // namespace kvforge
