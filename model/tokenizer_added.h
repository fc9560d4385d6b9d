#pragma once
// Added tokens (tokenizer.json "added_tokens"): they are cut out of the text
// before pre-tokenization, as HF's AddedVocabulary does: tokens with
// normalized=false are matched in the raw text, those with normalized=true
// in each normalized piece; among overlapping candidates the leftmost, then
// longest wins. single_word, lstrip and rstrip are honoured.
#include <bitset>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvforge::tokenizer_detail {

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

// A part of the text: either plain text or one added token.
struct Segment {
  std::string_view text;  // the matched span for a token (lstrip/rstrip included)
  std::optional<int32_t> id;
};

// Finds added tokens in text: a trie over their (possibly normalized)
// contents, searched leftmost-longest.
class AddedTokenMatcher {
 public:
  AddedTokenMatcher();
  // `pattern` is what to look for; `token` indexes the caller's token list.
  void add(std::string_view pattern, size_t token);
  bool empty() const { return patterns_ == 0; }

  struct Match {
    size_t begin;
    size_t end;
    size_t token;
  };
  // The leftmost match starting at or after `from`, the longest among those.
  std::optional<Match> find(std::string_view text, size_t from) const;

 private:
  struct Node {
    std::unordered_map<unsigned char, int32_t> children;
    int64_t token = -1;
  };
  std::vector<Node> nodes_;
  std::bitset<256> first_bytes_;
  size_t patterns_ = 0;
};

// Splits `text` around the matches of `matcher` (HF's
// AddedVocabulary::find_matches): empty text segments are omitted.
std::vector<Segment> split_added_tokens(std::string_view text, const AddedTokenMatcher& matcher,
                                        const std::vector<AddedToken>& tokens);

}  // namespace kvforge::tokenizer_detail
