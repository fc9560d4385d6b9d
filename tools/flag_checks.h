#pragma once
// Validators for flag values whose CLI11 messages would not say plainly what
// was expected (CLI::PositiveNumber prints the range 0 to DBL_MAX in full).
#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace kvforge::cli {

// An integer >= 1; the error reads "--flag: expected a positive integer, got "x"".
inline CLI::Validator positive_integer() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const std::string error = "expected a positive integer, got \"" + text + "\"";
        size_t used = 0;
        int64_t value = 0;
        try {
          value = std::stoll(text, &used);
        } catch (const std::exception&) {
          return error;
        }
        return used == text.size() && value >= 1 ? std::string() : error;
      },
      "POSITIVE");
}

}  // namespace kvforge::cli
