#pragma once
// A table of names for an enum's values: one place that says how each value
// is spelled, read by the code that prints a value and the code that parses
// one (the artifact's attributes, the command line's flags).
#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvforge {

template <typename Enum, size_t N>
using NameTable = std::array<std::pair<Enum, std::string_view>, N>;

// The value's name, "?" for a value the table lacks.
template <typename Enum, size_t N>
std::string_view name_in(const NameTable<Enum, N>& table, Enum value) {
  for (const auto& [e, name] : table) {
    if (e == value) return name;
  }
  return "?";
}

template <typename Enum, size_t N>
std::optional<Enum> parse_in(const NameTable<Enum, N>& table, std::string_view text) {
  for (const auto& [e, name] : table) {
    if (name == text) return e;
  }
  return std::nullopt;
}

template <typename Enum, size_t N>
std::vector<std::string> names_in(const NameTable<Enum, N>& table) {
  std::vector<std::string> names;
  for (const auto& entry : table) names.emplace_back(entry.second);
  return names;
}

}  // namespace kvforge
