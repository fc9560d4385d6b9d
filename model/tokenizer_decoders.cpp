// Decoders and post-processors.
#include <limits>
#include <optional>

#include "model/tokenizer_components.h"
#include "model/tokenizer_pattern.h"
#include "model/tokenizer_unicode.h"

namespace kvforge::tokenizer_detail {
namespace {

std::optional<unsigned> hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return std::nullopt;
}

// The byte of a "<0xNN>" token, parsed as Rust's u8::from_str_radix(NN, 16)
// does (which also takes "+N").
std::optional<unsigned char> byte_token_value(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token.back() != '>') return std::nullopt;
  const auto high = hex_value(token[3]);
  const auto low = hex_value(token[4]);
  if (high && low) return static_cast<unsigned char>(*high * 16 + *low);
  if (token[3] == '+' && low) return static_cast<unsigned char>(*low);
  return std::nullopt;
}

std::vector<char32_t> code_points(const std::string& text) {
  std::vector<char32_t> out;
  size_t pos = 0;
  while (pos < text.size()) out.push_back(next_code_point(text, pos));
  return out;
}

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& step : steps_) step->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

// Maps byte-level characters back to bytes over all tokens at once (a token
// with a character outside the table contributes its own UTF-8 bytes), then
// decodes the bytes lossily.
class ByteLevelDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    std::string token_bytes;
    for (const std::string& token : tokens) {
      token_bytes.clear();
      bool mapped = true;
      size_t pos = 0;
      while (pos < token.size() && mapped) {
        const auto byte = unicode_to_byte(next_code_point(token, pos));
        if (byte) {
          token_bytes += static_cast<char>(*byte);
        } else {
          mapped = false;
        }
      }
      bytes += mapped ? token_bytes : token;
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

// The replacement character becomes a space, except in the first token when
// a prefix was prepended, where it is dropped.
class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(char32_t replacement, bool drop_in_first) : replacement_(replacement), drop_in_first_(drop_in_first) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      for (char32_t cp : code_points(tokens[i])) {
        if (cp != replacement_) {
          append_utf8(out, cp);
        } else if (i != 0 || !drop_in_first_) {
          out += ' ';
        }
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  char32_t replacement_;
  bool drop_in_first_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(Pattern pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) token = pattern_.replace_all(token, content_);
  }

 private:
  Pattern pattern_;
  std::string content_;
};

// Runs of <0xNN> tokens become the UTF-8 text they spell, or one U+FFFD per
// byte when that is not valid UTF-8.
class ByteFallbackDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (!first_invalid_utf8(pending)) {
        out.push_back(pending);
      } else {
        for (size_t i = 0; i < pending.size(); ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      pending.clear();
    };
    for (std::string& token : tokens) {
      if (auto byte = byte_token_value(token)) {
        pending += static_cast<char>(*byte);
      } else {
        flush();
        out.push_back(std::move(token));
      }
    }
    flush();
    tokens = std::move(out);
  }
};

class FuseDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string joined;
    for (const std::string& token : tokens) joined += token;
    tokens.assign(1, std::move(joined));
  }
};

// Removes up to `start` leading and `stop` trailing `content` characters
// from every token.
class StripDecoder final : public Decoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop) : content_(content), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) {
      const std::vector<char32_t> chars = code_points(token);
      size_t begin = 0;
      while (begin < start_ && begin < chars.size() && chars[begin] == content_) ++begin;
      size_t end = chars.size();
      while (chars.size() - end < stop_ && end > 0 && chars[end - 1] == content_) --end;
      // HF panics when the two cuts cross; an empty token is the sane answer.
      std::string out;
      for (size_t i = begin; i < end; ++i) append_utf8(out, chars[i]);
      token = std::move(out);
    }
  }

 private:
  char32_t content_;
  size_t start_;
  size_t stop_;
};

class SequenceProcessor final : public PostProcessor {
 public:
  explicit SequenceProcessor(std::vector<std::unique_ptr<PostProcessor>> steps) : steps_(std::move(steps)) {}
  void process(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    for (const auto& step : steps_) step->process(ids, add_special_tokens);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

// ByteLevel as a post-processor only trims offsets: ids are unchanged.
class IdentityProcessor final : public PostProcessor {
 public:
  void process(std::vector<int32_t>&, bool) const override {}
};

// TemplateProcessing's "single" template: special tokens around sequence $A.
class TemplateProcessor final : public PostProcessor {
 public:
  // Each element: the ids of a special token, or nullopt for the sequence.
  explicit TemplateProcessor(std::vector<std::optional<std::vector<int32_t>>> pieces) : pieces_(std::move(pieces)) {}
  void process(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    if (!add_special_tokens) return;
    std::vector<int32_t> out;
    for (const auto& piece : pieces_) {
      if (piece) {
        out.insert(out.end(), piece->begin(), piece->end());
      } else {
        out.insert(out.end(), ids.begin(), ids.end());
      }
    }
    ids = std::move(out);
  }

 private:
  std::vector<std::optional<std::vector<int32_t>>> pieces_;
};

std::vector<int32_t> special_token_ids(const Field& special_tokens, const Field& id_field) {
  const std::string name = id_field.as_string();
  auto entry = special_tokens.find(name);
  if (!entry) id_field.fail("a key of " + special_tokens.path());
  const Field ids = entry->at("ids");
  std::vector<int32_t> out;
  for (size_t i = 0; i < ids.size(); ++i) {
    out.push_back(static_cast<int32_t>(ids.at(i).as_int(0, std::numeric_limits<int32_t>::max())));
  }
  return out;
}

std::unique_ptr<PostProcessor> parse_template(const Field& field) {
  const Field single = field.at("single");
  const Field special_tokens = field.at("special_tokens");
  special_tokens.require_object();
  std::vector<std::optional<std::vector<int32_t>>> pieces;
  for (size_t i = 0; i < single.size(); ++i) {
    const Field piece = single.at(i);
    piece.require_object();
    if (auto special = piece.find("SpecialToken")) {
      pieces.emplace_back(special_token_ids(special_tokens, special->at("id")));
    } else if (auto sequence = piece.find("Sequence")) {
      const Field id = sequence->at("id");
      if (id.as_string() != "A") id.fail("\"A\" (the single template can only hold sequence A)");
      pieces.emplace_back(std::nullopt);
    } else {
      piece.fail("an object {\"SpecialToken\": ...} or {\"Sequence\": ...}");
    }
  }
  return std::make_unique<TemplateProcessor>(std::move(pieces));
}

}  // namespace

std::unique_ptr<Decoder> parse_decoder(const Field& field) {
  const std::string type =
      component_type(field, {"ByteLevel", "Metaspace", "Sequence", "Replace", "ByteFallback", "Fuse", "Strip"});
  if (type == "Sequence") {
    const Field list = field.at("decoders");
    std::vector<std::unique_ptr<Decoder>> steps;
    for (size_t i = 0; i < list.size(); ++i) steps.push_back(parse_decoder(list.at(i)));
    return std::make_unique<SequenceDecoder>(std::move(steps));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") {
    return std::make_unique<MetaspaceDecoder>(parse_char(field.at("replacement")), metaspace_prepends(field));
  }
  if (type == "Replace") {
    return std::make_unique<ReplaceDecoder>(parse_pattern(field.at("pattern")), field.at("content").as_string());
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  constexpr int64_t kMaxCut = std::numeric_limits<int32_t>::max();
  return std::make_unique<StripDecoder>(parse_char(field.at("content")),
                                        static_cast<size_t>(field.at("start").as_int(0, kMaxCut)),
                                        static_cast<size_t>(field.at("stop").as_int(0, kMaxCut)));
}

std::unique_ptr<PostProcessor> parse_post_processor(const Field& field) {
  const std::string type = component_type(field, {"TemplateProcessing", "ByteLevel", "Sequence"});
  if (type == "Sequence") {
    const Field list = field.at("processors");
    std::vector<std::unique_ptr<PostProcessor>> steps;
    for (size_t i = 0; i < list.size(); ++i) steps.push_back(parse_post_processor(list.at(i)));
    return std::make_unique<SequenceProcessor>(std::move(steps));
  }
  if (type == "ByteLevel") return std::make_unique<IdentityProcessor>();
  return parse_template(field);
}

}  // namespace kvforge::tokenizer_detail
