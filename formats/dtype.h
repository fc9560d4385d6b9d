#pragma once
// Element types of checkpoint tensors.
#include <cstddef>
#include <optional>
#include <string_view>

namespace kvforge {

enum class DType { kF32, kF16, kBF16 };

constexpr std::size_t element_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }
constexpr std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
  }
  return "?";
}
// Parses safetensors' spelling ("F32", "F16", "BF16"); nullopt for anything else.
std::optional<DType> parse_safetensors_dtype(std::string_view name);

}  // namespace kvforge
