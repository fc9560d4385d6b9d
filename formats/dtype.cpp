#include "formats/dtype.h"

namespace kvforge {

std::optional<DType> parse_safetensors_dtype(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  return std::nullopt;
}

}  // namespace kvforge
