#include "model/tokenizer_pattern.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <stdexcept>

#include "model/tokenizer_unicode.h"

namespace kvforge::tokenizer_detail {
namespace {

// Oniguruma's Unicode \w, as a PCRE2 class body.
constexpr std::string_view kWordClassBody = "\\p{L}\\p{M}\\p{N}\\p{Pc}";
constexpr std::string_view kHexClassBody = "0-9a-fA-F";

bool is_hex(char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; }

// Copies a `{...}` argument (of \p, \x, \k ...) starting at `pos`, if any.
void copy_braced(std::string_view pattern, size_t& pos, std::string& out) {
  if (pos >= pattern.size() || pattern[pos] != '{') return;
  const size_t close = pattern.find('}', pos);
  const size_t end = close == std::string_view::npos ? pattern.size() : close + 1;
  out.append(pattern.substr(pos, end - pos));
  pos = end;
}

// Translates the escape at pattern[pos] == '\\'; advances `pos` past it.
void translate_escape(std::string_view pattern, size_t& pos, bool in_class, std::string& out) {
  if (pos + 1 >= pattern.size()) {
    out += '\\';
    ++pos;
    return;
  }
  const char c = pattern[pos + 1];
  pos += 2;
  switch (c) {
    case 's': out += "\\p{White_Space}"; return;
    case 'S': out += "\\P{White_Space}"; return;
    case 'w':
      out += in_class ? std::string(kWordClassBody) : "[" + std::string(kWordClassBody) + "]";
      return;
    case 'W':
      // Inside a class a negated union cannot be written in PCRE2; PCRE2's \W
      // differs only on marks and connector punctuation.
      out += in_class ? std::string("\\W") : "[^" + std::string(kWordClassBody) + "]";
      return;
    case 'h':
      out += in_class ? std::string(kHexClassBody) : "[" + std::string(kHexClassBody) + "]";
      return;
    case 'H':
      if (in_class) throw std::invalid_argument("\\H inside a character class is not supported");
      out += "[^" + std::string(kHexClassBody) + "]";
      return;
    case 'u':
      if (pos + 4 <= pattern.size() && is_hex(pattern[pos]) && is_hex(pattern[pos + 1]) && is_hex(pattern[pos + 2]) &&
          is_hex(pattern[pos + 3])) {
        out += "\\x{" + std::string(pattern.substr(pos, 4)) + "}";
        pos += 4;
        return;
      }
      throw std::invalid_argument("\\u must be followed by 4 hex digits");
    case 'p':
    case 'P':
    case 'x':
      out += '\\';
      out += c;
      copy_braced(pattern, pos, out);
      return;
    default:
      out += '\\';
      out += c;
      // Keep a multi-byte escaped character whole.
      while (pos < pattern.size() && (static_cast<unsigned char>(pattern[pos]) & 0xC0) == 0x80) out += pattern[pos++];
      return;
  }
}

struct CodeDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};

std::string pcre2_message(int error_code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(error_code, buffer, sizeof buffer);
  return reinterpret_cast<const char*>(buffer);
}

size_t next_char_end(std::string_view text, size_t pos) {
  return std::min(text.size(), pos + utf8_sequence_length(static_cast<unsigned char>(text[pos])));
}

// Regions from non-overlapping match ranges (NormalizedString's Pattern impl
// for regexes and strings).
std::vector<Region> regions_from_matches(std::string_view text, const std::vector<Range>& matches) {
  if (text.empty()) return {Region{{0, 0}, false}};
  std::vector<Region> regions;
  size_t previous = 0;
  for (const Range& m : matches) {
    if (previous != m.begin) regions.push_back({{previous, m.begin}, false});
    regions.push_back({m, true});
    previous = m.end;
  }
  if (previous != text.size()) regions.push_back({{previous, text.size()}, false});
  return regions;
}

std::vector<Range> find_literal(std::string_view text, std::string_view needle) {
  std::vector<Range> matches;
  if (needle.empty()) return matches;
  for (size_t pos = text.find(needle); pos != std::string_view::npos; pos = text.find(needle, pos + needle.size())) {
    matches.push_back({pos, pos + needle.size()});
  }
  return matches;
}

// Each character satisfying the predicate is its own match (the Pattern impl
// for Fn(char) -> bool).
std::vector<Region> find_characters(std::string_view text, const std::function<bool(char32_t)>& predicate) {
  if (text.empty()) return {Region{{0, 0}, false}};
  std::vector<Region> regions;
  size_t last = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t begin = pos;
    const char32_t cp = next_code_point(text, pos);
    if (predicate(cp)) {
      if (last < begin) regions.push_back({{last, begin}, false});
      regions.push_back({{begin, pos}, true});
      last = pos;
    }
  }
  if (last < text.size()) regions.push_back({{last, text.size()}, false});
  return regions;
}

}  // namespace

std::string oniguruma_to_pcre2(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 32);
  bool in_class = false;
  size_t pos = 0;
  while (pos < pattern.size()) {
    const char c = pattern[pos];
    if (c == '\\') {
      translate_escape(pattern, pos, in_class, out);
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      ++pos;
      // A leading '^' and a ']' right after the opening are literal parts.
      if (pos < pattern.size() && pattern[pos] == '^') out += pattern[pos++];
      if (pos < pattern.size() && pattern[pos] == ']') out += pattern[pos++];
      continue;
    }
    if (in_class) {
      if (c == ']') {
        in_class = false;
      } else if (c == '[') {
        if (pattern.substr(pos, 2) != "[:") throw std::invalid_argument("nested character classes are not supported");
        const size_t close = pattern.find(":]", pos + 2);
        if (close == std::string_view::npos) throw std::invalid_argument("unterminated POSIX class");
        out.append(pattern.substr(pos, close + 2 - pos));
        pos = close + 2;
        continue;
      } else if (c == '&' && pattern.substr(pos, 2) == "&&") {
        throw std::invalid_argument("character class intersection (&&) is not supported");
      }
    }
    out += c;
    ++pos;
  }
  return out;
}

struct Regex::Code {
  std::unique_ptr<pcre2_code, CodeDeleter> code;
};

Regex::Regex(std::string_view oniguruma_pattern) {
  const std::string translated = oniguruma_to_pcre2(oniguruma_pattern);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    throw std::invalid_argument("regex does not compile: " + pcre2_message(error_code) + " at offset " +
                                std::to_string(error_offset) + " of the PCRE2 translation");
  }
  // JIT is an optimization only: without it pcre2_match interprets.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  auto holder = std::make_shared<Code>();
  holder->code.reset(code);
  code_ = std::move(holder);
}

std::vector<Range> Regex::find_all(std::string_view text) const {
  std::vector<Range> matches;
  pcre2_code* code = code_->code.get();
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(pcre2_match_data_create_from_pattern(code, nullptr));
  if (!data) throw std::bad_alloc();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    int rc = pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, data.get(), nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // The interpreter keeps its backtracking frames on the heap.
      rc = pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, data.get(), nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw std::runtime_error("regex match failed: " + pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const size_t begin = ovector[0];
    const size_t end = std::max<size_t>(ovector[0], ovector[1]);
    matches.push_back({begin, end});
    if (end > begin) {
      start = end;
    } else {
      if (end >= text.size()) break;
      start = next_char_end(text, end);
    }
  }
  return matches;
}

Pattern Pattern::literal(std::string text) {
  Pattern p;
  p.kind_ = Kind::kLiteral;
  p.literal_ = std::move(text);
  return p;
}

Pattern Pattern::regex(std::string_view oniguruma_pattern) {
  Pattern p;
  p.kind_ = Kind::kRegex;
  p.regex_ = std::make_shared<const Regex>(oniguruma_pattern);
  return p;
}

Pattern Pattern::characters(std::function<bool(char32_t)> predicate) {
  Pattern p;
  p.kind_ = Kind::kCharacters;
  p.predicate_ = std::move(predicate);
  return p;
}

std::vector<Region> Pattern::find_matches(std::string_view text) const {
  switch (kind_) {
    case Kind::kLiteral: return regions_from_matches(text, find_literal(text, literal_));
    case Kind::kRegex: return regions_from_matches(text, regex_->find_all(text));
    case Kind::kCharacters: return find_characters(text, predicate_);
  }
  return {};
}

std::string Pattern::replace_all(std::string_view text, std::string_view content) const {
  std::string out;
  out.reserve(text.size());
  for (const Region& region : find_matches(text)) {
    if (region.is_match) {
      out.append(content);
    } else {
      out.append(text.substr(region.range.begin, region.range.end - region.range.begin));
    }
  }
  return out;
}

void invert_regions(std::vector<Region>& regions) {
  for (Region& region : regions) region.is_match = !region.is_match;
}

std::vector<Range> split_regions(const std::vector<Region>& regions, SplitBehavior behavior) {
  // (range, removed) pairs, built exactly as NormalizedString::split does.
  std::vector<Range> kept;
  std::vector<std::pair<Range, bool>> pieces;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Region& r : regions) pieces.push_back({r.range, false});
      break;
    case SplitBehavior::kRemoved:
      for (const Region& r : regions) pieces.push_back({r.range, r.is_match});
      break;
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Region& r : regions) {
        if (r.is_match == previous_match && !pieces.empty()) {
          pieces.back().first.end = r.range.end;
        } else {
          pieces.push_back({r.range, false});
        }
        previous_match = r.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Region& r : regions) {
        if (r.is_match && !previous_match && !pieces.empty()) {
          pieces.back().first.end = r.range.end;
        } else {
          pieces.push_back({r.range, false});
        }
        previous_match = r.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      // Walks backwards: a match joins the piece that follows it.
      bool previous_match = false;
      for (auto it = regions.rbegin(); it != regions.rend(); ++it) {
        if (it->is_match && !previous_match && !pieces.empty()) {
          pieces.back().first.begin = it->range.begin;
        } else {
          pieces.push_back({it->range, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    }
  }
  for (const auto& [range, removed] : pieces) {
    if (!removed && range.end > range.begin) kept.push_back(range);
  }
  return kept;
}

}  // namespace kvforge::tokenizer_detail
