#pragma once
// The BPE model of tokenizer.json ("model": {"type": "BPE", ...}): vocab,
// ranked merges (both the "a b" and the ["a", "b"] forms), byte_fallback,
// unk_token with fuse_unk, ignore_merges, continuing_subword_prefix and
// end_of_word_suffix. tokenize() equals HF tokenizers' BPE::tokenize for one
// pre-token; results are cached per word.
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/tokenizer_json.h"

namespace kvforge::tokenizer_detail {

// Hash and equality that let unordered_map<std::string, ...> be searched
// with a string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
struct StringEqual {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return a == b; }
};
template <typename T>
using StringMap = std::unordered_map<std::string, T, StringHash, StringEqual>;

class BpeModel {
 public:
  // Reads the "model" object; throws InputError for a bad or unsupported one
  // (non-zero dropout, merges naming unknown tokens, ...).
  explicit BpeModel(const Field& model);
  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  // Appends the ids of one pre-token (a "word") to `out`.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;  // nullptr when unknown
  int64_t max_id() const { return max_id_; }          // -1 for an empty vocab

 private:
  struct MergeTarget {
    int32_t rank;
    int32_t new_id;
  };

  void read_vocab(const Field& vocab);
  void read_merges(const Field& merges);
  std::vector<int32_t> merge_word(std::string_view word) const;
  void apply_merges(std::vector<int32_t>& ids) const;
  int32_t unk_id() const;

  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

  std::string file_;  // for errors raised while encoding
  StringMap<int32_t> vocab_;
  std::unordered_map<int32_t, std::string> vocab_r_;
  std::unordered_map<uint64_t, MergeTarget> merges_;
  int64_t max_id_ = -1;
  std::optional<std::string> unk_token_;
  std::optional<int32_t> unk_id_;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_ids_{};  // <0xNN> ids, -1 when absent

  // Word -> ids. Bounded; once full, new words are no longer remembered.
  // Long words (a whole line without pre-tokenizer) are rarely repeated.
  static constexpr size_t kCacheCapacity = 1 << 16;
  static constexpr size_t kMaxCachedWordBytes = 256;
  mutable std::shared_mutex cache_mutex_;
  mutable StringMap<std::vector<int32_t>> cache_;
};

}  // namespace kvforge::tokenizer_detail
