#include "model/tokenizer_json.h"

#include <cstdio>

#include "formats/input_error.h"
#include "model/tokenizer_unicode.h"

namespace kvforge::tokenizer_detail {
namespace {

const char* type_name(const nlohmann::json& value) {
  switch (value.type()) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::boolean: return "a boolean";
    case nlohmann::json::value_t::string: return "a string";
    case nlohmann::json::value_t::array: return "an array";
    case nlohmann::json::value_t::object: return "an object";
    case nlohmann::json::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

std::string child_path(const std::string& parent, std::string_view key) {
  return parent.empty() ? std::string(key) : parent + "." + std::string(key);
}

}  // namespace

std::string one_line(std::string_view text, size_t limit) {
  std::string out;
  size_t pos = 0;
  while (pos < text.size()) {
    if (out.size() >= limit) return out + "...";
    const auto c = static_cast<unsigned char>(text[pos]);
    const size_t length = c < 0x80 ? 1 : utf8_valid_length_at(text, pos);
    if (c < 0x20 || c == 0x7F || length == 0) {
      // Control characters and bytes of ill-formed UTF-8 are shown escaped.
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", c);
      out += buf;
      ++pos;
    } else {
      out.append(text.substr(pos, length));
      pos += length;
    }
  }
  return out;
}

std::string describe_json(const nlohmann::json& value) {
  // The replace handler keeps dump() from throwing on invalid UTF-8 (which
  // the parser rejects anyway). Long arrays and objects are cut short.
  return one_line(value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

Field::Field(const nlohmann::json& value, std::string path, const std::string& file)
    : value_(&value), path_(std::move(path)), file_(&file) {}

void Field::fail(std::string_view expected) const {
  throw InputError(*file_, path_, std::string(expected) + "; got " + describe_json(*value_));
}

void Field::fail_plain(std::string_view message) const {
  throw InputError(*file_, path_, std::string(message));
}

void Field::require_object() const {
  if (!value_->is_object()) fail("an object");
}

Field Field::at(std::string_view key) const {
  require_object();
  auto it = value_->find(key);
  const std::string path = child_path(path_, key);
  if (it == value_->end()) throw InputError(*file_, path, "required field is missing");
  if (it->is_null()) throw InputError(*file_, path, "required field is null");
  return Field(*it, path, *file_);
}

std::optional<Field> Field::find(std::string_view key) const {
  require_object();
  auto it = value_->find(key);
  if (it == value_->end() || it->is_null()) return std::nullopt;
  return Field(*it, child_path(path_, key), *file_);
}

size_t Field::size() const {
  if (!value_->is_array()) fail("an array");
  return value_->size();
}

Field Field::at(size_t index) const {
  if (index >= size()) fail_plain("index " + std::to_string(index) + " out of range");
  return Field((*value_)[index], path_ + "[" + std::to_string(index) + "]", *file_);
}

std::string Field::as_string() const {
  if (!value_->is_string()) fail(std::string("a string, not ") + type_name(*value_));
  return value_->get<std::string>();
}

bool Field::as_bool() const {
  if (!value_->is_boolean()) fail(std::string("a boolean, not ") + type_name(*value_));
  return value_->get<bool>();
}

int64_t Field::as_int(int64_t min, int64_t max) const {
  const std::string range = "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]";
  if (value_->is_number_unsigned()) {
    const uint64_t v = value_->get<uint64_t>();
    if (v > static_cast<uint64_t>(max) || static_cast<int64_t>(v) < min) fail(range);
    return static_cast<int64_t>(v);
  }
  if (value_->is_number_integer()) {
    const int64_t v = value_->get<int64_t>();
    if (v < min || v > max) fail(range);
    return v;
  }
  fail(range);
}

double Field::as_number() const {
  if (!value_->is_number()) fail(std::string("a number, not ") + type_name(*value_));
  return value_->get<double>();
}

std::string Field::string_or(std::string_view key, std::string_view fallback) const {
  auto member = find(key);
  return member ? member->as_string() : std::string(fallback);
}

bool Field::bool_or(std::string_view key, bool fallback) const {
  auto member = find(key);
  return member ? member->as_bool() : fallback;
}

std::optional<std::string> Field::optional_string(std::string_view key) const {
  auto member = find(key);
  if (!member) return std::nullopt;
  return member->as_string();
}

}  // namespace kvforge::tokenizer_detail
