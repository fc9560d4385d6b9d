#pragma once
// Needle-in-a-haystack probes for `kvforge eval`: a fact (the needle) is
// placed at a depth of a stretch of held-out text (the haystack), a
// question at the end asks for it, and greedy decoding through a KV cache
// must reproduce the answer token for token.
//
// The probe format is a template (`--needle-template FILE.json`):
//   {
//     "needle":        "\nPASSKEY_{name} = \"{value}\"\n",
//     "question":      "\nassert PASSKEY_{name} == \"",
//     "answer_suffix": "\"",
//     "value_alphabet": "abcdefghijklmnopqrstuvwxyz0123456789",
//     "value_length":  [5, 8],
//     "names":         ["Birch", "Cedar", ...]
//   }
// {name} and {value} are replaced everywhere in needle and question (other
// braces stay as they are); the needle must hold {value}, the question must
// not, and the question ends where the answer starts. The answer is the
// value followed by answer_suffix (taken literally, may be empty). value_length is [min, max] or one number;
// the alphabet is printable ASCII, one symbol per byte. The default
// (default_needle_template(), shipped as eval/templates/passkey.json) is
// pyllama-16m's passkey protocol (its README).
//
// A probe of context C and depth d (BOS on):
//   [BOS] haystack[0, p) needle haystack[p, H) question     (C tokens)
// with H = C - 1 - |needle| - |question| haystack tokens cut from the token
// stream of the held-out text at a seeded random offset, p = round(d * H).
// Needle, question and answer are tokenized on their own and spliced in as
// token ids, so the insertion never merges tokens across its borders.
// Probe k of context C draws its name, value and haystack offset from a
// generator seeded by (seed, C, k) alone: every depth of that context sees
// the same haystack and fact (only the position moves), and every cache
// configuration sees identical probes.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "eval/cached_greedy_decoding.h"
#include "eval/evaluation.h"
#include "model/tokenizer.h"
#include "model/transformer.h"

namespace kvforge {

struct NeedleTemplate {
  std::string needle;    // holds {value}, may hold {name}
  std::string question;  // may hold {name}; ends where the answer starts
  std::string answer_suffix;
  std::string value_alphabet;
  int64_t value_min_length = 1;
  int64_t value_max_length = 1;
  std::vector<std::string> names;  // not empty when {name} is used

  bool operator==(const NeedleTemplate&) const = default;
};

// pyllama-16m's passkey protocol.
NeedleTemplate default_needle_template();
// InputError(file, field, expected) for malformed JSON, a missing or
// mistyped field, an unknown field, or a template that cannot work.
NeedleTemplate parse_needle_template(const std::string& json_text, const std::string& file_for_errors);
NeedleTemplate load_needle_template(const std::filesystem::path& file);

// The cells to probe; cells are visited in (context, depth) order, both
// ascending.
struct NeedleGrid {
  std::vector<int64_t> contexts;  // prompt tokens per probe (BOS and question included)
  std::vector<double> depths;     // each in [0, 1]
  int64_t probes_per_cell = 20;
  uint64_t seed = 0;
};

// {0, 0.1, 0.25, 0.5, 0.75, 0.9, 1}.
std::vector<double> default_needle_depths();
// {256, 512, 1024, 2048}, clipped as clip_needle_contexts does.
std::vector<int64_t> default_needle_contexts(int64_t max_positions, int64_t answer_budget);
// Every context above max_positions - answer_budget (the prompt plus the
// decoded answer must fit the model's positions) becomes that limit;
// sorted, duplicates dropped. std::invalid_argument when the limit is < 1.
std::vector<int64_t> clip_needle_contexts(std::vector<int64_t> contexts, int64_t max_positions,
                                          int64_t answer_budget);
// An upper bound of the answer's tokens under a byte-level or byte-fallback
// tokenizer (one token per byte at worst), plus 2 tokens of slack.
int64_t needle_answer_budget(const NeedleTemplate& needle_template);

struct NeedleProbe {
  int64_t context = 0;
  double depth = 0;
  std::string name, value;
  std::vector<int32_t> prompt;  // exactly `context` tokens, ends with the question
  std::vector<int32_t> answer;  // tokens of value + answer_suffix
  int64_t needle_position = 0;  // index in prompt of the needle's first token
  int64_t needle_tokens = 0;
  int64_t haystack_offset = 0;  // stream index of the haystack's first token
};

// Probes in (context, depth, probe) order, probes_per_cell per cell.
// `stream` is the tokenized held-out text. std::invalid_argument (one line,
// naming the context) when a context cannot hold BOS, needle and question,
// or the stream is shorter than a haystack, or the grid is empty or has a
// depth outside [0, 1].
std::vector<NeedleProbe> build_needle_probes(const Tokenizer& tokenizer, std::span<const int32_t> stream,
                                             const NeedleTemplate& needle_template, const NeedleGrid& grid,
                                             std::optional<int32_t> bos);

struct NeedleScoringOptions {
  int64_t chunk = 512;  // prefill tokens per forward pass (eval's chunk flag)
  int64_t batch = 8;    // probes of one context decoded together
};

struct NeedleOutcome {
  std::vector<int32_t> decoded;  // greedy tokens, cut at the first one that misses the answer
  bool correct = false;          // decoded == answer
  // The smallest decision margin over the decoded steps (GreedyDecoding's
  // margins): how far the outcome is from flipping. A correct answer with
  // margin m survives any perturbation of the logits by less than m / 2; a
  // miss has its smallest margin at or before the step it missed.
  double margin = 0;
};

// Greedy decoding through a cache from `make_cache` for each probe: the
// prompt prefilled in chunks, then up to |answer| tokens, stopping at the
// first token that differs from the answer's (the teacher-forced rule of
// the pyllama README: correct iff every answer token is the argmax).
// Probes of one context are decoded in batches of options.batch.
std::vector<NeedleOutcome> answer_needle_probes(const Transformer& model, const std::vector<NeedleProbe>& probes,
                                                const CachePolicyMaker& make_cache,
                                                const NeedleScoringOptions& options);

// Outcomes counted per (context, depth) cell, in the probes' order.
std::vector<NeedleCell> needle_cells(const std::vector<NeedleProbe>& probes,
                                     const std::vector<NeedleOutcome>& outcomes);

// Each probe's outcome as ConfigurationEvaluation::needle_answers: probe
// index within its cell, expected and decoded text (`tokenizer` decodes),
// correctness and margin. std::invalid_argument when the counts differ.
std::vector<NeedleAnswer> needle_answers(const Tokenizer& tokenizer, const std::vector<NeedleProbe>& probes,
                                         const std::vector<NeedleOutcome>& outcomes);

// answer_needle_probes then needle_cells: ConfigurationEvaluation::needles.
std::vector<NeedleCell> score_needle_probes(const Transformer& model, const std::vector<NeedleProbe>& probes,
                                            const CachePolicyMaker& make_cache,
                                            const NeedleScoringOptions& options);

}  // namespace kvforge
