#include "eval/needle_probe.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "formats/input_error.h"
#include "formats/json_error_text.h"
#include "log/log.h"
#include "log/progress.h"

namespace kvforge {
namespace {

constexpr const char* kNamePlaceholder = "{name}";
constexpr const char* kValuePlaceholder = "{value}";
// Longer values stop being a passkey and start being a document.
constexpr int64_t kMaxValueLength = 256;

bool holds(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

std::string fill(const std::string& text, const std::string& name, const std::string& value) {
  return replace_all(replace_all(text, kNamePlaceholder, name), kValuePlaceholder, value);
}

// The template's own rules, shared by the parser and the built-in default.
void check_template(const NeedleTemplate& t, const std::string& file) {
  if (!holds(t.needle, kValuePlaceholder)) {
    throw InputError(file, "needle", "a text holding {value} (the fact to retrieve)");
  }
  if (holds(t.question, kValuePlaceholder)) {
    throw InputError(file, "question", "a text without {value} (it would give the answer away)");
  }
  if (t.question.empty()) throw InputError(file, "question", "a non-empty text");
  if (t.value_alphabet.empty()) throw InputError(file, "value_alphabet", "at least one symbol");
  for (const char c : t.value_alphabet) {
    if (c < 0x21 || c > 0x7e) {
      throw InputError(file, "value_alphabet", "printable ASCII symbols without spaces, one per byte");
    }
  }
  if (t.value_min_length < 1 || t.value_min_length > t.value_max_length || t.value_max_length > kMaxValueLength) {
    throw InputError(file, "value_length",
                     "[min, max] with 1 <= min <= max <= " + std::to_string(kMaxValueLength) + ", got [" +
                         std::to_string(t.value_min_length) + ", " + std::to_string(t.value_max_length) + "]");
  }
  const bool uses_name = holds(t.needle, kNamePlaceholder) || holds(t.question, kNamePlaceholder);
  if (uses_name && t.names.empty()) {
    throw InputError(file, "names", "a non-empty list (the needle or question uses {name})");
  }
  for (size_t i = 0; i < t.names.size(); ++i) {
    if (t.names[i].empty()) throw InputError(file, "names[" + std::to_string(i) + "]", "a non-empty name");
  }
}

std::string string_field(const nlohmann::json& object, const std::string& key, const std::string& file) {
  const auto it = object.find(key);
  if (it == object.end()) throw InputError(file, key, "a string (the field is missing)");
  if (!it->is_string()) throw InputError(file, key, "a string, got " + quote_json(*it));
  return it->get<std::string>();
}

int64_t length_bound(const nlohmann::json& value, const std::string& field, const std::string& file) {
  if (!value.is_number_integer()) throw InputError(file, field, "an integer, got " + quote_json(value));
  return value.get<int64_t>();
}

// SplitMix64 (Steele, Lea, Flood 2014): a fixed, portable sequence for a
// seed, unlike std:: distributions, whose output the standard leaves to the
// library.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) without modulo bias (rejection below 2^64 mod n).
  uint64_t below(uint64_t n) {
    const uint64_t threshold = (0 - n) % n;
    for (;;) {
      const uint64_t r = next();
      if (r >= threshold) return r % n;
    }
  }

 private:
  uint64_t state_;
};

uint64_t probe_seed(uint64_t seed, int64_t context, int64_t probe) {
  SplitMix64 mix(seed);
  SplitMix64 by_context(mix.next() ^ static_cast<uint64_t>(context));
  SplitMix64 by_probe(by_context.next() ^ static_cast<uint64_t>(probe));
  return by_probe.next();
}

std::vector<double> checked_depths(std::vector<double> depths) {
  if (depths.empty()) throw std::invalid_argument("needle depths: none given");
  for (const double d : depths) {
    if (!(d >= 0 && d <= 1)) {
      throw std::invalid_argument("needle depth " + std::to_string(d) + ": expected a fraction in [0, 1]");
    }
  }
  std::sort(depths.begin(), depths.end());
  depths.erase(std::unique(depths.begin(), depths.end()), depths.end());
  return depths;
}

std::vector<int64_t> checked_contexts(std::vector<int64_t> contexts) {
  if (contexts.empty()) throw std::invalid_argument("needle contexts: none given");
  std::sort(contexts.begin(), contexts.end());
  contexts.erase(std::unique(contexts.begin(), contexts.end()), contexts.end());
  return contexts;
}

// What one probe index of one context draws: the same for every depth.
struct DrawnFact {
  std::string name, value;
  std::vector<int32_t> needle, question, answer;
  int64_t haystack_offset = 0;
};

// Name and value, then the tokens of needle, question and answer; the
// haystack offset is drawn by the caller, which knows the haystack length.
DrawnFact draw_fact(const Tokenizer& tokenizer, const NeedleTemplate& t, SplitMix64& random) {
  DrawnFact fact;
  if (!t.names.empty()) fact.name = t.names[random.below(t.names.size())];
  const auto span = static_cast<uint64_t>(t.value_max_length - t.value_min_length + 1);
  const int64_t length = t.value_min_length + static_cast<int64_t>(random.below(span));
  for (int64_t i = 0; i < length; ++i) fact.value += t.value_alphabet[random.below(t.value_alphabet.size())];
  fact.needle = tokenizer.encode(fill(t.needle, fact.name, fact.value));
  fact.question = tokenizer.encode(fill(t.question, fact.name, fact.value));
  fact.answer = tokenizer.encode(fact.value + t.answer_suffix);
  return fact;
}

}  // namespace

NeedleTemplate default_needle_template() {
  NeedleTemplate t;
  t.needle = "\nPASSKEY_{name} = \"{value}\"\n";
  t.question = "\nassert PASSKEY_{name} == \"";
  t.answer_suffix = "\"";
  t.value_alphabet = "abcdefghijklmnopqrstuvwxyz0123456789";
  t.value_min_length = 5;
  t.value_max_length = 8;
  t.names = {"Birch",   "Cedar",    "Maple",   "Willow",  "Aspen",  "Alder",    "Hazel",    "Rowan",
             "Spruce",  "Larch",    "Juniper", "Cypress", "Poplar", "Linden",   "Elm",      "Oak",
             "Pine",    "Ash",      "Yew",     "Holly",   "Laurel", "Magnolia", "Sequoia",  "Redwood",
             "Hemlock", "Sycamore", "Chestnut", "Walnut", "Hickory", "Acacia",  "Banyan",   "Baobab"};
  return t;
}

NeedleTemplate parse_needle_template(const std::string& json_text, const std::string& file) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::parse_error& error) {
    throw InputError(file, "", "not JSON: " + parse_error_text(error));
  }
  if (!root.is_object()) throw InputError(file, "", "a JSON object, got " + quote_json(root));
  static const std::set<std::string> known{"needle",         "question",     "answer_suffix",
                                           "value_alphabet", "value_length", "names"};
  for (const auto& [key, value] : root.items()) {
    if (!known.count(key)) {
      throw InputError(file, key,
                       "an unknown field (expected needle, question, answer_suffix, value_alphabet, value_length, "
                       "names)");
    }
  }
  NeedleTemplate t;
  t.needle = string_field(root, "needle", file);
  t.question = string_field(root, "question", file);
  t.answer_suffix = root.contains("answer_suffix") ? string_field(root, "answer_suffix", file) : "";
  t.value_alphabet = string_field(root, "value_alphabet", file);

  const auto length = root.find("value_length");
  if (length == root.end()) throw InputError(file, "value_length", "[min, max] or a number (the field is missing)");
  if (length->is_array()) {
    if (length->size() != 2) throw InputError(file, "value_length", "[min, max], got " + quote_json(*length));
    t.value_min_length = length_bound((*length)[0], "value_length[0]", file);
    t.value_max_length = length_bound((*length)[1], "value_length[1]", file);
  } else {
    t.value_min_length = t.value_max_length = length_bound(*length, "value_length", file);
  }

  if (const auto names = root.find("names"); names != root.end()) {
    if (!names->is_array()) throw InputError(file, "names", "a list of strings, got " + quote_json(*names));
    for (size_t i = 0; i < names->size(); ++i) {
      const auto& name = (*names)[i];
      if (!name.is_string()) {
        throw InputError(file, "names[" + std::to_string(i) + "]", "a string, got " + quote_json(name));
      }
      t.names.push_back(name.get<std::string>());
    }
  }
  check_template(t, file);
  return t;
}

NeedleTemplate load_needle_template(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw InputError(file.string(), "", "cannot open the needle template");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_needle_template(text.str(), file.string());
}

std::vector<double> default_needle_depths() { return {0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0}; }

std::vector<int64_t> default_needle_contexts(int64_t max_positions, int64_t answer_budget) {
  return clip_needle_contexts({256, 512, 1024, 2048}, max_positions, answer_budget);
}

std::vector<int64_t> clip_needle_contexts(std::vector<int64_t> contexts, int64_t max_positions,
                                          int64_t answer_budget) {
  const int64_t limit = max_positions - answer_budget;
  if (limit < 1) {
    throw std::invalid_argument("needle contexts: the model's " + std::to_string(max_positions) +
                                " positions leave no room for a prompt and " + std::to_string(answer_budget) +
                                " answer tokens");
  }
  for (int64_t& context : contexts) context = std::min(context, limit);
  std::sort(contexts.begin(), contexts.end());
  contexts.erase(std::unique(contexts.begin(), contexts.end()), contexts.end());
  return contexts;
}

int64_t needle_answer_budget(const NeedleTemplate& t) {
  return t.value_max_length + static_cast<int64_t>(t.answer_suffix.size()) + 2;
}

std::vector<NeedleProbe> build_needle_probes(const Tokenizer& tokenizer, std::span<const int32_t> stream,
                                             const NeedleTemplate& needle_template, const NeedleGrid& grid,
                                             std::optional<int32_t> bos) {
  check_template(needle_template, "needle template");
  const std::vector<int64_t> contexts = checked_contexts(grid.contexts);
  const std::vector<double> depths = checked_depths(grid.depths);
  if (grid.probes_per_cell < 1) {
    throw std::invalid_argument("needle probes per cell: " + std::to_string(grid.probes_per_cell) +
                                ", expected >= 1");
  }
  const int64_t bos_tokens = bos ? 1 : 0;
  const auto stream_tokens = static_cast<int64_t>(stream.size());
  std::vector<NeedleProbe> probes;
  probes.reserve(contexts.size() * depths.size() * static_cast<size_t>(grid.probes_per_cell));
  for (const int64_t context : contexts) {
    std::vector<DrawnFact> facts;
    for (int64_t k = 0; k < grid.probes_per_cell; ++k) {
      SplitMix64 random(probe_seed(grid.seed, context, k));
      DrawnFact fact = draw_fact(tokenizer, needle_template, random);
      const int64_t haystack = context - bos_tokens - static_cast<int64_t>(fact.needle.size() + fact.question.size());
      if (haystack < 0) {
        throw std::invalid_argument("needle context " + std::to_string(context) + ": BOS, needle and question take " +
                                    std::to_string(context - haystack) + " tokens, more than the context");
      }
      if (stream_tokens < haystack) {
        throw std::invalid_argument("needle context " + std::to_string(context) + ": the text has " +
                                    std::to_string(stream_tokens) + " tokens, fewer than the " +
                                    std::to_string(haystack) + " of a haystack");
      }
      fact.haystack_offset = static_cast<int64_t>(random.below(static_cast<uint64_t>(stream_tokens - haystack + 1)));
      facts.push_back(std::move(fact));
    }
    for (const double depth : depths) {
      for (const DrawnFact& fact : facts) {
        const int64_t haystack =
            context - bos_tokens - static_cast<int64_t>(fact.needle.size() + fact.question.size());
        const int64_t split = std::llround(depth * static_cast<double>(haystack));
        const auto hay = stream.subspan(static_cast<size_t>(fact.haystack_offset), static_cast<size_t>(haystack));
        NeedleProbe probe;
        probe.context = context;
        probe.depth = depth;
        probe.name = fact.name;
        probe.value = fact.value;
        probe.answer = fact.answer;
        probe.haystack_offset = fact.haystack_offset;
        probe.needle_position = bos_tokens + split;
        probe.needle_tokens = static_cast<int64_t>(fact.needle.size());
        probe.prompt.reserve(static_cast<size_t>(context));
        if (bos) probe.prompt.push_back(*bos);
        probe.prompt.insert(probe.prompt.end(), hay.begin(), hay.begin() + split);
        probe.prompt.insert(probe.prompt.end(), fact.needle.begin(), fact.needle.end());
        probe.prompt.insert(probe.prompt.end(), hay.begin() + split, hay.end());
        probe.prompt.insert(probe.prompt.end(), fact.question.begin(), fact.question.end());
        probes.push_back(std::move(probe));
      }
    }
  }
  return probes;
}

std::vector<NeedleOutcome> answer_needle_probes(const Transformer& model, const std::vector<NeedleProbe>& probes,
                                                const CachePolicyMaker& make_cache,
                                                const NeedleScoringOptions& options) {
  if (options.batch < 1) {
    throw std::invalid_argument("needle batch " + std::to_string(options.batch) + ", expected >= 1");
  }
  std::vector<NeedleOutcome> outcomes(probes.size());
  log::ProgressMeter progress("needles", static_cast<int64_t>(probes.size()));
  // A cache is reused while batches keep its shape (one allocation per
  // context, not per batch).
  std::unique_ptr<KVCachePolicy> cache;
  int64_t cache_batch = 0, cache_capacity = 0;
  int64_t correct = 0;
  for (size_t first = 0; first < probes.size();) {
    size_t end = first;
    while (end < probes.size() && end - first < static_cast<size_t>(options.batch) &&
           probes[end].context == probes[first].context) {
      ++end;
    }
    std::vector<std::vector<int32_t>> prompts;
    int64_t longest_answer = 0;
    for (size_t i = first; i < end; ++i) {
      prompts.push_back(probes[i].prompt);
      longest_answer = std::max(longest_answer, static_cast<int64_t>(probes[i].answer.size()));
    }
    const auto rows = static_cast<int64_t>(end - first);
    // Capacity for the longest answer of any context: the next batches of
    // this context reuse the cache.
    const int64_t capacity = probes[first].context + longest_answer;
    if (!cache || cache_batch != rows || cache_capacity < capacity) {
      cache = make_cache(rows, capacity);
      cache_batch = rows;
      cache_capacity = capacity;
    }
    const auto decoded = greedy_decode_through_cache(
        model, prompts, *cache, {.chunk = options.chunk, .max_new_tokens = longest_answer},
        [&](size_t row, std::span<const int32_t> chosen) {
          const std::vector<int32_t>& answer = probes[first + row].answer;
          const size_t n = chosen.size();
          return n >= answer.size() || chosen[n - 1] != answer[n - 1];
        });
    for (size_t row = 0; row < decoded.size(); ++row) {
      NeedleOutcome& outcome = outcomes[first + row];
      outcome.decoded = decoded[row].tokens;
      outcome.margin = *std::min_element(decoded[row].margins.begin(), decoded[row].margins.end());
      outcome.correct = outcome.decoded == probes[first + row].answer;
      correct += outcome.correct ? 1 : 0;
    }
    progress.advance(rows, rows * probes[first].context,
                     log::concat("correct ", correct, "/", static_cast<int64_t>(end)));
    first = end;
  }
  progress.finish(log::concat("correct ", correct, "/", static_cast<int64_t>(probes.size())));
  return outcomes;
}

std::vector<NeedleCell> needle_cells(const std::vector<NeedleProbe>& probes,
                                     const std::vector<NeedleOutcome>& outcomes) {
  if (probes.size() != outcomes.size()) {
    throw std::invalid_argument("needle cells: " + std::to_string(outcomes.size()) + " outcomes for " +
                                std::to_string(probes.size()) + " probes");
  }
  std::vector<NeedleCell> cells;
  for (size_t i = 0; i < probes.size(); ++i) {
    if (cells.empty() || cells.back().context != probes[i].context || cells.back().depth != probes[i].depth) {
      cells.push_back({.context = probes[i].context, .depth = probes[i].depth});
    }
    ++cells.back().probes;
    cells.back().correct += outcomes[i].correct ? 1 : 0;
  }
  return cells;
}

std::vector<NeedleAnswer> needle_answers(const Tokenizer& tokenizer, const std::vector<NeedleProbe>& probes,
                                         const std::vector<NeedleOutcome>& outcomes) {
  if (probes.size() != outcomes.size()) {
    throw std::invalid_argument("needle answers: " + std::to_string(outcomes.size()) + " outcomes for " +
                                std::to_string(probes.size()) + " probes");
  }
  std::vector<NeedleAnswer> answers;
  answers.reserve(probes.size());
  int64_t in_cell = 0;
  for (size_t i = 0; i < probes.size(); ++i) {
    const bool same_cell = i > 0 && probes[i].context == probes[i - 1].context && probes[i].depth == probes[i - 1].depth;
    in_cell = same_cell ? in_cell + 1 : 0;
    answers.push_back({.context = probes[i].context,
                       .depth = probes[i].depth,
                       .probe = in_cell,
                       .expected = tokenizer.decode(probes[i].answer, /*skip_special_tokens=*/false),
                       .answer = tokenizer.decode(outcomes[i].decoded, /*skip_special_tokens=*/false),
                       .correct = outcomes[i].correct,
                       .margin = outcomes[i].margin});
  }
  return answers;
}

std::vector<NeedleCell> score_needle_probes(const Transformer& model, const std::vector<NeedleProbe>& probes,
                                            const CachePolicyMaker& make_cache,
                                            const NeedleScoringOptions& options) {
  return needle_cells(probes, answer_needle_probes(model, probes, make_cache, options));
}

}  // namespace kvforge
