#pragma once
// JSON values and nlohmann parse errors as text for one-line InputErrors.
#include <nlohmann/json.hpp>

#include <string>

namespace kvforge {

// A JSON value as it appears in the file, cut short so a hostile header
// cannot flood an error line.
inline std::string quote_json(const nlohmann::json& value) {
  constexpr std::size_t kMaxChars = 60;
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > kMaxChars) text = text.substr(0, kMaxChars) + "...";
  return text;
}

// nlohmann's message without its "[json.exception.parse_error.101] " tag.
inline std::string parse_error_text(const nlohmann::json::parse_error& error) {
  const std::string text = error.what();
  const auto tag_end = text.find("] ");
  return tag_end == std::string::npos ? text : text.substr(tag_end + 2);
}

}  // namespace kvforge
