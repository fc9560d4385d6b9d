#include "model/tokenizer_bpe.h"

#include <cstdio>
#include <limits>
#include <mutex>
#include <queue>

#include "formats/input_error.h"
#include "model/tokenizer_unicode.h"

namespace kvforge::tokenizer_detail {
namespace {

constexpr int64_t kMaxId = std::numeric_limits<int32_t>::max();

// One symbol of a word being merged: a doubly linked list over a vector, as
// in HF's Word. len == 0 marks a symbol merged into its left neighbour.
struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  uint32_t len;
};

// A candidate merge of the pair starting at symbol `pos`.
struct Candidate {
  int32_t rank;
  int32_t pos;
  int32_t new_id;
};

// priority_queue puts the "largest" on top; the lowest rank wins, ties go to
// the leftmost position.
struct CandidateOrder {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  }
};

std::pair<std::string, std::string> merge_pair(const Field& merge) {
  if (merge.json().is_string()) {
    const std::string text = merge.as_string();
    const size_t space = text.find(' ');
    if (space == std::string::npos) merge.fail("a merge \"left right\" with one space");
    return {text.substr(0, space), text.substr(space + 1)};
  }
  if (merge.json().is_array()) {
    if (merge.size() != 2) merge.fail("a merge [\"left\", \"right\"] of two strings");
    return {merge.at(size_t{0}).as_string(), merge.at(size_t{1}).as_string()};
  }
  merge.fail("a merge, either \"left right\" or [\"left\", \"right\"]");
}

}  // namespace

BpeModel::BpeModel(const Field& model) : file_(model.file()) {
  model.require_object();
  if (auto dropout = model.find("dropout")) {
    if (dropout->as_number() != 0.0) dropout->fail("null or 0 (BPE dropout is random and not supported)");
  }
  unk_token_ = model.optional_string("unk_token");
  continuing_subword_prefix_ = model.string_or("continuing_subword_prefix", "");
  end_of_word_suffix_ = model.string_or("end_of_word_suffix", "");
  fuse_unk_ = model.bool_or("fuse_unk", false);
  byte_fallback_ = model.bool_or("byte_fallback", false);
  ignore_merges_ = model.bool_or("ignore_merges", false);
  read_vocab(model.at("vocab"));
  read_merges(model.at("merges"));
  if (unk_token_) {
    if (auto id = token_to_id(*unk_token_)) unk_id_ = *id;
  }
  for (int byte = 0; byte < 256; ++byte) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", byte);
    byte_ids_[byte] = token_to_id(name).value_or(-1);
  }
}

void BpeModel::read_vocab(const Field& vocab) {
  vocab.require_object();
  vocab_.reserve(vocab.json().size());
  for (const auto& [token, value] : vocab.json().items()) {
    const Field entry(value, vocab.path() + "[" + describe_json(token) + "]", vocab.file());
    const auto id = static_cast<int32_t>(entry.as_int(0, kMaxId));
    vocab_[token] = id;
    vocab_r_[id] = token;
    max_id_ = std::max<int64_t>(max_id_, id);
  }
}

void BpeModel::read_merges(const Field& merges) {
  const size_t count = merges.size();
  merges_.reserve(count);
  const size_t prefix_length = continuing_subword_prefix_.size();
  for (size_t rank = 0; rank < count; ++rank) {
    const Field merge = merges.at(rank);
    const auto [left, right] = merge_pair(merge);
    const auto left_id = token_to_id(left);
    const auto right_id = token_to_id(right);
    if (!left_id || !right_id) {
      merge.fail("tokens of model.vocab (\"" + one_line(left_id ? right : left) + "\" is not in the vocab)");
    }
    // The right part loses its continuing-subword prefix when merged.
    const std::string merged =
        left + (prefix_length > 0 && right.compare(0, prefix_length, continuing_subword_prefix_) == 0
                    ? right.substr(prefix_length)
                    : right);
    const auto merged_id = token_to_id(merged);
    if (!merged_id) merge.fail("a merge whose result \"" + one_line(merged) + "\" is in model.vocab");
    // A repeated merge takes the later rank, as HF's HashMap collect does.
    merges_[pair_key(*left_id, *right_id)] = MergeTarget{static_cast<int32_t>(rank), *merged_id};
  }
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  auto it = vocab_r_.find(id);
  return it == vocab_r_.end() ? nullptr : &it->second;
}

int32_t BpeModel::unk_id() const {
  if (!unk_id_) throw InputError(file_, "model.unk_token", "a token of model.vocab; got \"" + one_line(*unk_token_) + "\"");
  return *unk_id_;
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto id = token_to_id(word)) {
      out.push_back(*id);
      return;
    }
  }
  {
    std::shared_lock lock(cache_mutex_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids = merge_word(word);
  out.insert(out.end(), ids.begin(), ids.end());
  if (word.size() > kMaxCachedWordBytes) return;
  std::unique_lock lock(cache_mutex_);
  if (cache_.size() < kCacheCapacity) cache_.emplace(std::string(word), std::move(ids));
}

std::vector<int32_t> BpeModel::merge_word(std::string_view word) const {
  // Initial symbols: one per character (HF's BPE::merge_word), with byte
  // fallback or (possibly fused) unk for characters outside the vocab.
  std::vector<int32_t> ids;
  int32_t pending_unk = -1;  // an unk id not yet emitted (it may be fused)
  const bool affixes = !continuing_subword_prefix_.empty() || !end_of_word_suffix_.empty();
  std::string affixed;
  size_t pos = 0;
  while (pos < word.size()) {
    const size_t begin = pos;
    pos = std::min(word.size(), pos + utf8_sequence_length(static_cast<unsigned char>(word[pos])));
    std::string_view symbol = word.substr(begin, pos - begin);
    if (affixes) {
      affixed.assign(begin > 0 ? continuing_subword_prefix_ : std::string());
      affixed.append(symbol);
      if (pos == word.size()) affixed.append(end_of_word_suffix_);
      symbol = affixed;
    }
    if (auto id = token_to_id(symbol)) {
      if (pending_unk >= 0) {
        ids.push_back(pending_unk);
        pending_unk = -1;
      }
      ids.push_back(*id);
      continue;
    }
    if (byte_fallback_) {
      bool all_bytes_known = true;
      for (char c : symbol) all_bytes_known = all_bytes_known && byte_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all_bytes_known) {
        // As in HF, a pending unk is not flushed here.
        for (char c : symbol) ids.push_back(byte_ids_[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    if (unk_token_) {
      if (pending_unk >= 0 && !fuse_unk_) ids.push_back(pending_unk);
      if (pending_unk < 0 || !fuse_unk_) pending_unk = unk_id();
    }
  }
  if (pending_unk >= 0) ids.push_back(pending_unk);
  apply_merges(ids);
  return ids;
}

void BpeModel::apply_merges(std::vector<int32_t>& ids) const {
  if (ids.size() < 2 || merges_.empty()) return;
  const auto count = static_cast<int32_t>(ids.size());
  std::vector<Symbol> symbols(ids.size());
  for (int32_t i = 0; i < count; ++i) symbols[i] = Symbol{ids[i], i - 1, i + 1 < count ? i + 1 : -1, 1};

  auto find_merge = [&](int32_t left, int32_t right) -> const MergeTarget* {
    auto it = merges_.find(pair_key(left, right));
    return it == merges_.end() ? nullptr : &it->second;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, CandidateOrder> queue;
  for (int32_t i = 0; i + 1 < count; ++i) {
    if (const MergeTarget* m = find_merge(symbols[i].id, symbols[i + 1].id)) queue.push({m->rank, i, m->new_id});
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& current = symbols[top.pos];
    if (current.len == 0 || current.next == -1) continue;
    const int32_t next_pos = current.next;
    const Symbol right = symbols[next_pos];
    // Skip entries made stale by earlier merges.
    const MergeTarget* still = find_merge(current.id, right.id);
    if (still == nullptr || still->new_id != top.new_id) continue;

    current.id = top.new_id;
    current.len += right.len;
    current.next = right.next;
    symbols[next_pos].len = 0;
    if (right.next >= 0) symbols[right.next].prev = top.pos;

    if (current.prev >= 0) {
      if (const MergeTarget* m = find_merge(symbols[current.prev].id, current.id)) {
        queue.push({m->rank, current.prev, m->new_id});
      }
    }
    if (current.next >= 0) {
      if (const MergeTarget* m = find_merge(current.id, symbols[current.next].id)) {
        queue.push({m->rank, top.pos, m->new_id});
      }
    }
  }
  ids.clear();
  for (const Symbol& s : symbols) {
    if (s.len != 0) ids.push_back(s.id);
  }
}

}  // namespace kvforge::tokenizer_detail
