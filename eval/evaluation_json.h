#pragma once
// An Evaluation as JSON (`kvforge eval --json`) and back: every field of
// eval/evaluation.h, under a "schema" version, so that a saved evaluation can
// be re-rendered (table, report, gate) without the model.
//
// Layout (schema 2): {"schema": 2, "model", "artifact", "data",
// "command_line", "device", "date", "context", "chunk", "configurations": [
//   {"name", "method", "bits", "rotated", "effective_bits",
//    "cache_bytes_per_token", "seconds",
//    "perplexity": null | {"windows", "tokens_scored", "mean_nll",
//                          "nll_stderr", "perplexity", "kl_mean", "kl_p99",
//                          "kl_p999", "top1_agreement"},
//    "attention": [{"layer", "key_kl", "key_output", "value_output"}],
//    "needles": [{"context", "depth", "probes", "correct"}],
//    "needle_probes": [{"context", "depth", "probe", "expected", "answer",
//                       "correct", "margin"}],
//    "tasks": [{"id", "answer", "exact", "contains"}],
//    "needle_accuracy", "task_accuracy", "mean_attention_error"}]}
// The last three are derived (written for readers such as jq, ignored when
// read back). Non-finite numbers are written as the strings "NaN",
// "Infinity" and "-Infinity" (JSON has no such numbers). Schema 1 is
// schema 2 without "needle_probes" (read back with no needle answers).
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "eval/evaluation.h"

namespace kvforge {

inline constexpr int kEvaluationJsonSchema = 2;

nlohmann::json evaluation_to_json(const Evaluation& evaluation);

// Every field is required (perplexity may be null); `source` names the
// input in errors. Throws InputError (formats/input_error.h) naming the
// field's path, e.g. "eval.json: configurations[1].perplexity.kl_p99: a
// number, missing"; configurations[0] must be kFullPrecisionName.
Evaluation evaluation_from_json(const nlohmann::json& json, const std::string& source);

// Reads and parses a file written from evaluation_to_json.
Evaluation read_evaluation_json(const std::filesystem::path& path);

}  // namespace kvforge
