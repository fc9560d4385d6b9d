#include "calib/fingerprint_rope.h"

#include <nlohmann/json.hpp>

#include "formats/input_error.h"

namespace kvforge {
namespace {

constexpr const char* kField = "/model@rope";

double number(const nlohmann::json& json, const char* key, const std::string& file) {
  const auto it = json.find(key);
  if (it == json.end() || !it->is_number()) {
    throw InputError(file, kField, std::string("expected a number \"") + key + "\" in " + json.dump());
  }
  return it->get<double>();
}

}  // namespace

RopeConfig parse_rope_json(const std::string& json_text, const std::string& file_for_errors) {
  const nlohmann::json json = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object()) throw InputError(file_for_errors, kField, "expected a JSON object, got " + json_text);
  const auto type = json.find("type");
  if (type == json.end() || !type->is_string()) {
    throw InputError(file_for_errors, kField, "expected a string \"type\" in " + json_text);
  }
  RopeConfig rope;
  const std::string name = type->get<std::string>();
  if (name == "default") {
    rope.type = RopeType::kDefault;
  } else if (name == "linear") {
    rope.type = RopeType::kLinear;
  } else if (name == "llama3") {
    rope.type = RopeType::kLlama3;
  } else {
    throw InputError(file_for_errors, kField, "expected type default, linear or llama3, got \"" + name + "\"");
  }
  rope.theta = number(json, "theta", file_for_errors);
  if (rope.type != RopeType::kDefault) rope.factor = number(json, "factor", file_for_errors);
  if (rope.type == RopeType::kLlama3) {
    rope.low_freq_factor = number(json, "low_freq_factor", file_for_errors);
    rope.high_freq_factor = number(json, "high_freq_factor", file_for_errors);
    rope.original_max_position_embeddings =
        static_cast<int64_t>(number(json, "original_max_position_embeddings", file_for_errors));
  }
  return rope;
}

}  // namespace kvforge
