// Pre-tokenizers: Sequence, Split, ByteLevel, Metaspace, Digits.
#include "model/tokenizer_components.h"
#include "model/tokenizer_pattern.h"
#include "model/tokenizer_unicode.h"

namespace kvforge::tokenizer_detail {
namespace {

// The GPT-2 pre-tokenization regex of ByteLevel(use_regex=true).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Replaces every piece by the non-empty pieces that `split` makes of it; a
// sub-piece keeps `at_origin` when it starts where its parent started.
template <typename SplitFn>
void split_pieces(std::vector<Piece>& pieces, SplitFn split) {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (Piece& piece : pieces) {
    for (const Range& range : split(piece.text)) {
      if (range.end <= range.begin) continue;
      out.push_back(Piece{piece.text.substr(range.begin, range.end - range.begin), piece.at_origin && range.begin == 0});
    }
  }
  pieces = std::move(out);
}

std::string replace_char(const std::string& text, char from, const std::string& to) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == from) {
      out += to;
    } else {
      out += c;
    }
  }
  return out;
}

SplitBehavior parse_behavior(const Field& field) {
  const std::string name = field.as_string();
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  field.fail("one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
}

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (const auto& step : steps_) step->pre_tokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(Pattern pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](const std::string& text) {
      std::vector<Region> regions = pattern_.find_matches(text);
      if (invert_) invert_regions(regions);
      return split_regions(regions, behavior_);
    });
  }

 private:
  Pattern pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

// Optionally prefixes a space, optionally splits with the GPT-2 regex, then
// maps every byte to its byte-level character.
class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex), pattern_(Pattern::regex(kGpt2Pattern)) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    if (add_prefix_space_) {
      for (Piece& piece : pieces) {
        if (piece.text.empty() || piece.text.front() != ' ') piece.text.insert(0, 1, ' ');
      }
    }
    if (use_regex_) {
      split_pieces(pieces, [&](const std::string& text) {
        return split_regions(pattern_.find_matches(text), SplitBehavior::kIsolated);
      });
    }
    for (Piece& piece : pieces) piece.text = bytes_to_byte_level(piece.text);
  }

 private:
  bool add_prefix_space_;
  bool use_regex_;
  Pattern pattern_;
};

enum class PrependScheme { kFirst, kAlways, kNever };

// Spaces become the replacement character (U+2581 normally), which is
// prepended per the scheme; with `split`, each replacement starts a piece.
class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(char32_t replacement, PrependScheme scheme, bool split)
      : scheme_(scheme), split_(split), split_pattern_(Pattern::characters([replacement](char32_t c) {
          return c == replacement;
        })) {
    append_utf8(replacement_, replacement);
  }
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (Piece& piece : pieces) {
      piece.text = replace_char(piece.text, ' ', replacement_);
      const bool starts_with_replacement = piece.text.compare(0, replacement_.size(), replacement_) == 0;
      const bool prepend = !starts_with_replacement && (scheme_ == PrependScheme::kAlways ||
                                                        (scheme_ == PrependScheme::kFirst && piece.at_origin));
      if (prepend) piece.text.insert(0, replacement_);
    }
    if (split_) {
      split_pieces(pieces, [&](const std::string& text) {
        return split_regions(split_pattern_.find_matches(text), SplitBehavior::kMergedWithNext);
      });
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
  Pattern split_pattern_;
};

// Numeric characters (Rust's char::is_numeric: categories Nd, Nl, No) alone
// or in runs. A one-character regex yields one match per character, like
// HF's per-character predicate.
class DigitsPreTokenizer final : public PreTokenizer {
 public:
  explicit DigitsPreTokenizer(bool individual_digits)
      : behavior_(individual_digits ? SplitBehavior::kIsolated : SplitBehavior::kContiguous),
        pattern_(Pattern::regex(R"(\p{N})")) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](const std::string& text) {
      return split_regions(pattern_.find_matches(text), behavior_);
    });
  }

 private:
  SplitBehavior behavior_;
  Pattern pattern_;
};

PrependScheme parse_prepend_scheme(const Field& field) {
  if (auto scheme = field.find("prepend_scheme")) {
    const std::string name = scheme->as_string();
    if (name == "first") return PrependScheme::kFirst;
    if (name == "always") return PrependScheme::kAlways;
    if (name == "never") return PrependScheme::kNever;
    scheme->fail("one of first, always, never");
  }
  // Files written before prepend_scheme existed carry add_prefix_space.
  return field.bool_or("add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
}

}  // namespace

std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const Field& field) {
  const std::string type = component_type(field, {"Split", "ByteLevel", "Metaspace", "Digits", "Sequence"});
  if (type == "Sequence") {
    const Field list = field.at("pretokenizers");
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (size_t i = 0; i < list.size(); ++i) steps.push_back(parse_pre_tokenizer(list.at(i)));
    return std::make_unique<SequencePreTokenizer>(std::move(steps));
  }
  if (type == "Split") {
    return std::make_unique<SplitPreTokenizer>(parse_pattern(field.at("pattern")), parse_behavior(field.at("behavior")),
                                               field.bool_or("invert", false));
  }
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPreTokenizer>(field.bool_or("add_prefix_space", true),
                                                   field.bool_or("use_regex", true));
  }
  if (type == "Metaspace") {
    return std::make_unique<MetaspacePreTokenizer>(parse_char(field.at("replacement")), parse_prepend_scheme(field),
                                                   field.bool_or("split", true));
  }
  return std::make_unique<DigitsPreTokenizer>(field.bool_or("individual_digits", false));
}

bool metaspace_prepends(const Field& field) { return parse_prepend_scheme(field) != PrependScheme::kNever; }

}  // namespace kvforge::tokenizer_detail
