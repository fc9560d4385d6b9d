// Normalizers, and the JSON helpers shared by all components.
#include <stdexcept>

#include "model/tokenizer_components.h"
#include "model/tokenizer_pattern.h"
#include "model/tokenizer_unicode.h"

namespace kvforge::tokenizer_detail {
namespace {

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  std::string normalize(std::string text) const override {
    for (const auto& step : steps_) {
      if (text.empty()) break;
      text = step->normalize(std::move(text));
    }
    return text;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string normalize(std::string text) const override { return text.empty() ? text : prefix_ + text; }

 private:
  std::string prefix_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(Pattern pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::string normalize(std::string text) const override { return pattern_.replace_all(text, content_); }

 private:
  Pattern pattern_;
  std::string content_;
};

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm form) : form_(form) {}
  std::string normalize(std::string text) const override { return unicode_normalize(text, form_); }

 private:
  NormalForm form_;
};

class LowercaseNormalizer final : public Normalizer {
 public:
  std::string normalize(std::string text) const override { return unicode_lowercase(text); }
};

// Strips Unicode whitespace (Rust's char::is_whitespace) from either end.
class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  std::string normalize(std::string text) const override {
    size_t begin = 0;
    size_t end = text.size();
    if (left_) {
      size_t pos = 0;
      while (pos < end) {
        const size_t at = pos;
        if (!is_whitespace(next_code_point(text, pos))) {
          begin = at;
          break;
        }
        begin = pos;
      }
    }
    if (right_) {
      while (end > begin) {
        size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
        size_t pos = start;
        if (!is_whitespace(next_code_point(text, pos))) break;
        end = start;
      }
    }
    return text.substr(begin, end - begin);
  }

 private:
  bool left_;
  bool right_;
};

}  // namespace

std::string component_type(const Field& field, const std::vector<std::string>& supported) {
  field.require_object();
  const Field type = field.at("type");
  const std::string name = type.as_string();
  for (const std::string& candidate : supported) {
    if (candidate == name) return name;
  }
  type.fail("one of " + join_names(supported));
}

Pattern parse_pattern(const Field& field) {
  field.require_object();
  if (auto text = field.find("String")) return Pattern::literal(text->as_string());
  if (auto regex = field.find("Regex")) {
    const std::string source = regex->as_string();
    try {
      return Pattern::regex(source);
    } catch (const std::invalid_argument& error) {
      regex->fail_plain(std::string("a supported regex (") + error.what() + ")");
    }
  }
  field.fail("an object {\"String\": ...} or {\"Regex\": ...}");
}

char32_t parse_char(const Field& field) {
  const std::string text = field.as_string();
  size_t pos = 0;
  const char32_t cp = text.empty() ? 0 : next_code_point(text, pos);
  if (text.empty() || pos != text.size()) field.fail("a single character");
  return cp;
}

std::unique_ptr<Normalizer> parse_normalizer(const Field& field) {
  const std::string type = component_type(
      field, {"Sequence", "Prepend", "Replace", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip"});
  if (type == "Sequence") {
    const Field list = field.at("normalizers");
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (size_t i = 0; i < list.size(); ++i) steps.push_back(parse_normalizer(list.at(i)));
    return std::make_unique<SequenceNormalizer>(std::move(steps));
  }
  const bool needs_tables = type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD" || type == "Lowercase";
  if (needs_tables && !have_unicode_tables()) {
    field.at("type").fail("a normalizer other than NFC, NFD, NFKC, NFKD, Lowercase: this kvforge was built without "
                          "ICU (install libicu-dev and rebuild)");
  }
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(field.at("prepend").as_string());
  if (type == "Replace") {
    return std::make_unique<ReplaceNormalizer>(parse_pattern(field.at("pattern")), field.at("content").as_string());
  }
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfc);
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfd);
  if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfkc);
  if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(NormalForm::kNfkd);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  return std::make_unique<StripNormalizer>(field.bool_or("strip_left", true), field.bool_or("strip_right", true));
}

}  // namespace kvforge::tokenizer_detail
