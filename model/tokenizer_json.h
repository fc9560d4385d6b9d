#pragma once
// Typed, path-aware access to a parsed tokenizer.json. Every accessor either
// returns a value of the requested type or throws kvforge::InputError naming
// the file, the JSON path of the offending field (e.g.
// `pre_tokenizer.pretokenizers[1].type`) and what was expected, so that a bad
// file is reported in one line and never crashes the reader.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace kvforge::tokenizer_detail {

class Field {
 public:
  // `file` must outlive the Field and every Field derived from it.
  Field(const nlohmann::json& value, std::string path, const std::string& file);

  const nlohmann::json& json() const { return *value_; }
  const std::string& path() const { return path_; }
  const std::string& file() const { return *file_; }
  bool is_null() const { return value_->is_null(); }

  // Object members. at() requires the member to be present and non-null;
  // find() returns nullopt when it is absent or null.
  Field at(std::string_view key) const;
  std::optional<Field> find(std::string_view key) const;
  // Array elements; size() requires an array.
  size_t size() const;
  Field at(size_t index) const;

  std::string as_string() const;
  bool as_bool() const;
  int64_t as_int(int64_t min, int64_t max) const;
  double as_number() const;
  void require_object() const;

  // Optional members with a default used when absent or null.
  std::string string_or(std::string_view key, std::string_view fallback) const;
  bool bool_or(std::string_view key, bool fallback) const;
  std::optional<std::string> optional_string(std::string_view key) const;

  // Throws InputError(file, path, expected + "; got <this value>").
  [[noreturn]] void fail(std::string_view expected) const;
  // Same, without the "; got ..." suffix.
  [[noreturn]] void fail_plain(std::string_view message) const;

 private:
  const nlohmann::json* value_;
  std::string path_;
  const std::string* file_;
};

// A short one-line rendering of a JSON value for error messages.
std::string describe_json(const nlohmann::json& value);
// `text` cut to `limit` bytes with control characters escaped, so that an
// error message stays on one line.
std::string one_line(std::string_view text, size_t limit = 80);

}  // namespace kvforge::tokenizer_detail
