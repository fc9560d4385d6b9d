#pragma once
// What `kvforge eval` measures, as plain values (no torch): one
// ConfigurationEvaluation per cache configuration (the 16-bit cache first,
// then the artifact's configurations in the order asked), each measured on
// the same tokens, windows and probes. The JSON writer, the terminal table,
// the HTML report and the gate all read these types and nothing else.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvforge {

// The name the 16-bit cache has everywhere (tables, JSON, the gate's
// `fp16` reference).
inline constexpr const char* kFullPrecisionName = "fp16";

// Perplexity through the cache with decode-time semantics (chunked prefill),
// and the next-token distributions against the 16-bit cache's on the same
// positions (llama.cpp's perplexity --kl-divergence).
struct CachePerplexity {
  int64_t windows = 0;
  int64_t tokens_scored = 0;
  double mean_nll = 0;
  double nll_stderr = 0;
  double perplexity = 0;
  // KL(P_fp16 || P_config) over the scored positions, in nats; 0 for fp16.
  double kl_mean = 0, kl_p99 = 0, kl_p999 = 0;
  double top1_agreement = 1;  // share of positions whose argmax equals fp16's
};

// Post-W_O attention-output error of one layer on held-out captures,
// averaged over KV heads: the key-induced term (KL and relative output
// error with exact values) and the value-induced term (relative output error
// with exact keys), rotation/model_rotation.h's measure_attention_terms.
struct LayerAttentionError {
  int64_t layer = 0;
  double key_kl = 0;
  double key_output = 0;
  double value_output = 0;
};

// One cell of the needle grid: probes of one context length with the
// needle at one depth (0 = start of the haystack, 1 = just before the
// question).
struct NeedleCell {
  int64_t context = 0;
  double depth = 0;
  int64_t probes = 0;
  int64_t correct = 0;
  double accuracy() const { return probes > 0 ? static_cast<double>(correct) / static_cast<double>(probes) : 0; }
};

// One needle probe answered through one cache. A probe is named by
// (context, depth, probe): `probe` is its index within the cell, the k-th
// fact drawn for that context (needle_probe.h: the same fact at every depth),
// so two evaluations with the same grid and seed name the same prompts.
struct NeedleAnswer {
  int64_t context = 0;
  double depth = 0;
  int64_t probe = 0;
  std::string expected;  // the answer's text (value and suffix)
  std::string answer;    // the greedy decoding's text, cut at its first wrong token
  bool correct = false;
  // The smallest decision margin over the decoded steps: the chosen token's
  // logit minus the runner-up's, in logits (NeedleOutcome::margin). Tells a
  // flip at a near-tie (margin ~1e-6, arithmetic) from a real disagreement.
  double margin = 0;
};

// One of the user's tasks (--tasks FILE.jsonl) answered through a cache.
struct TaskAnswer {
  std::string id;      // the line's "id", or its 1-based line number
  std::string answer;  // greedy decoding, decoded text
  bool exact = false;     // answer (trimmed) == expected (trimmed)
  bool contains = false;  // answer contains expected
};

struct ConfigurationEvaluation {
  std::string name;          // kFullPrecisionName or the artifact configuration's name
  std::string method;        // "fp16", "kvquant", "kivi", "int2-rot", "rtn"
  int bits = 16;
  bool rotated = false;
  double effective_bits = 16;     // per cached element at the evaluated context (calib/effective_bits.h)
  double cache_bytes_per_token = 0;  // all layers, keys and values
  std::optional<CachePerplexity> perplexity;
  std::vector<LayerAttentionError> attention;  // empty when no held-out captures were given
  std::vector<NeedleCell> needles;             // the same grid for every configuration
  std::vector<NeedleAnswer> needle_answers;    // every probe of the grid, in the cells' order
  std::vector<TaskAnswer> tasks;               // in the tasks file's order
  double seconds = 0;

  double needle_accuracy() const;  // over every probe of the grid (0 when none)
  double task_accuracy() const;    // share of contains matches (0 when none)
  double mean_attention_error() const;  // mean over layers of key_output + value_output
};

struct Evaluation {
  std::string model;     // the model directory
  std::string artifact;  // the artifact path ("" when only fp16 was evaluated)
  std::string data;      // the held-out text
  std::string command_line;
  std::string device;
  std::string date;      // UTC "YYYY-MM-DDTHH:MM:SSZ" when it ran (formats/utc_timestamp.h)
  int64_t context = 0;   // perplexity window
  int64_t chunk = 0;     // prefill chunk
  std::vector<ConfigurationEvaluation> configurations;  // configurations[0] is fp16

  const ConfigurationEvaluation& full_precision() const { return configurations.front(); }
};

}  // namespace kvforge
