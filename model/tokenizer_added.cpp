#include "model/tokenizer_added.h"

#include "model/tokenizer_pattern.h"
#include "model/tokenizer_unicode.h"

namespace kvforge::tokenizer_detail {
namespace {

// Whether the single character `character` is a word character of the Rust
// regex crate's \w, which HF's single_word check uses: Alphabetic, marks,
// decimal digits, connector punctuation, Join_Control.
bool is_word_character(std::string_view character) {
  // Compiled once; immutable and thread-safe afterwards.
  static const Regex kWordCharacter(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])");
  return !kWordCharacter.find_all(character).empty();
}

bool ends_with_word(std::string_view text) {
  if (text.empty()) return false;
  size_t start = text.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  return is_word_character(text.substr(start));
}

bool starts_with_word(std::string_view text) {
  if (text.empty()) return false;
  return is_word_character(text.substr(0, utf8_sequence_length(static_cast<unsigned char>(text[0]))));
}

// Start of the trailing whitespace run of text[0, end).
size_t trailing_space_start(std::string_view text, size_t end) {
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    size_t pos = start;
    if (!is_whitespace(next_code_point(text, pos))) break;
    end = start;
  }
  return end;
}

// End of the whitespace run starting at `begin`.
size_t leading_space_end(std::string_view text, size_t begin) {
  size_t pos = begin;
  while (pos < text.size()) {
    size_t next = pos;
    if (!is_whitespace(next_code_point(text, next))) break;
    pos = next;
  }
  return pos;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher() : nodes_(1) {}

void AddedTokenMatcher::add(std::string_view pattern, size_t token) {
  if (pattern.empty()) return;  // HF ignores empty added tokens
  int32_t node = 0;
  for (char c : pattern) {
    const auto byte = static_cast<unsigned char>(c);
    auto it = nodes_[node].children.find(byte);
    if (it == nodes_[node].children.end()) {
      nodes_.emplace_back();
      const auto child = static_cast<int32_t>(nodes_.size() - 1);
      nodes_[node].children.emplace(byte, child);
      node = child;
    } else {
      node = it->second;
    }
  }
  // A repeated content keeps the first token registered.
  if (nodes_[node].token < 0) {
    nodes_[node].token = static_cast<int64_t>(token);
    ++patterns_;
  }
  first_bytes_.set(static_cast<unsigned char>(pattern.front()));
}

std::optional<AddedTokenMatcher::Match> AddedTokenMatcher::find(std::string_view text, size_t from) const {
  if (patterns_ == 0) return std::nullopt;
  for (size_t begin = from; begin < text.size(); ++begin) {
    if (!first_bytes_.test(static_cast<unsigned char>(text[begin]))) continue;
    std::optional<Match> best;
    int32_t node = 0;
    for (size_t pos = begin; pos < text.size(); ++pos) {
      const auto& children = nodes_[node].children;
      auto it = children.find(static_cast<unsigned char>(text[pos]));
      if (it == children.end()) break;
      node = it->second;
      if (nodes_[node].token >= 0) best = Match{begin, pos + 1, static_cast<size_t>(nodes_[node].token)};
    }
    if (best) return best;
  }
  return std::nullopt;
}

std::vector<Segment> split_added_tokens(std::string_view text, const AddedTokenMatcher& matcher,
                                        const std::vector<AddedToken>& tokens) {
  std::vector<Segment> segments;
  size_t start_offset = 0;  // end of the last emitted token
  size_t search_from = 0;   // where the matcher resumes (end of its last match)
  while (auto match = matcher.find(text, search_from)) {
    search_from = match->end;
    const AddedToken& token = tokens[match->token];
    size_t begin = match->begin;
    size_t end = match->end;
    if (token.single_word) {
      const bool space_before = begin == 0 || !ends_with_word(text.substr(0, begin));
      const bool space_after = end == text.size() || !starts_with_word(text.substr(end));
      if (!space_before || !space_after) continue;
    }
    if (token.lstrip) begin = std::max(trailing_space_start(text, begin), start_offset);
    if (token.rstrip) end = leading_space_end(text, end);
    if (begin > start_offset) segments.push_back({text.substr(start_offset, begin - start_offset), std::nullopt});
    segments.push_back({text.substr(begin, end - begin), token.id});
    start_offset = end;
  }
  if (start_offset < text.size()) segments.push_back({text.substr(start_offset), std::nullopt});
  return segments;
}

}  // namespace kvforge::tokenizer_detail
