#pragma once
// Patterns and split behaviors of HF tokenizers' NormalizedString::split:
// regexes (written for Oniguruma in tokenizer.json, run here with PCRE2),
// literal strings and per-character predicates, and the five
// SplitDelimiterBehavior rules that turn matches into pieces.
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvforge::tokenizer_detail {

// [begin, end) byte range of a string.
struct Range {
  size_t begin = 0;
  size_t end = 0;
};

// One region of a string and whether the pattern matched it. find_matches
// returns regions that tile the whole string, in order.
struct Region {
  Range range;
  bool is_match = false;
};

// Rewrites an Oniguruma (Ruby syntax) pattern into PCRE2 syntax with the same
// meaning under PCRE2_UTF|PCRE2_UCP: \s, \S (Unicode White_Space, which
// includes U+0085), \w, \W (letters, marks, numbers, connector punctuation),
// \h, \H (hex digits in Oniguruma) and \uHHHH. Throws std::invalid_argument
// for constructs PCRE2 cannot express (nested classes, class intersection).
std::string oniguruma_to_pcre2(std::string_view pattern);

// A compiled regex (PCRE2, UTF + UCP, JIT when available). Immutable and
// safe to share between threads.
class Regex {
 public:
  // Throws std::invalid_argument with the compiler's message on a bad pattern.
  explicit Regex(std::string_view oniguruma_pattern);
  // Non-overlapping matches, left to right. `text` must be valid UTF-8. After
  // an empty match the search resumes one character later.
  std::vector<Range> find_all(std::string_view text) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
};

// What a Split pre-tokenizer or a Replace normalizer/decoder looks for.
class Pattern {
 public:
  static Pattern literal(std::string text);
  static Pattern regex(std::string_view oniguruma_pattern);
  // Each character for which `predicate` holds is one match.
  static Pattern characters(std::function<bool(char32_t)> predicate);

  // Regions tiling `text` (valid UTF-8); a single non-match region for "".
  std::vector<Region> find_matches(std::string_view text) const;
  // `text` with every match replaced by `content`.
  std::string replace_all(std::string_view text, std::string_view content) const;

 private:
  enum class Kind { kLiteral, kRegex, kCharacters };
  Kind kind_ = Kind::kLiteral;
  std::string literal_;
  std::shared_ptr<const Regex> regex_;
  std::function<bool(char32_t)> predicate_;
};

// SplitDelimiterBehavior.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Flips is_match on every region (Split's `invert`).
void invert_regions(std::vector<Region>& regions);
// The ranges of the pieces that `behavior` makes of `regions`; empty pieces
// are dropped (as PreTokenizedString::split drops them).
std::vector<Range> split_regions(const std::vector<Region>& regions, SplitBehavior behavior);

}  // namespace kvforge::tokenizer_detail
