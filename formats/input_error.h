#pragma once
// The one error type for bad input: it names the file, the field and what
// was expected, so the CLI can print it as a single line and exit non-zero.
#include <stdexcept>
#include <string>

namespace kvforge {

class InputError : public std::runtime_error {
 public:
  // e.g. InputError("model/config.json", "num_key_value_heads",
  //                 "a divisor of num_attention_heads (32), got 5")
  InputError(std::string file, std::string field, std::string expected)
      : std::runtime_error(file + ": " + (field.empty() ? std::string() : field + ": ") + expected),
        file_(std::move(file)),
        field_(std::move(field)) {}

  const std::string& file() const { return file_; }
  const std::string& field() const { return field_; }

 private:
  std::string file_;
  std::string field_;
};

}  // namespace kvforge
