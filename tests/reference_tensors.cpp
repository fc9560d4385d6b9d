#include "tests/reference_tensors.h"

#include <ATen/ATen.h>

#include "formats/safetensors.h"

namespace kvforge::testing {

std::map<std::string, at::Tensor> load_reference(const std::filesystem::path& safetensors_file) {
  const SafetensorsFile file(safetensors_file);
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [name, view] : file.tensors()) {
    const auto dtype = view.dtype == DType::kF32 ? at::kFloat : view.dtype == DType::kF16 ? at::kHalf : at::kBFloat16;
    tensors[name] = at::from_blob(const_cast<std::byte*>(view.bytes.data()), view.shape,
                                  at::TensorOptions().dtype(dtype))
                        .to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  }
  return tensors;
}

double max_relative_error(const at::Tensor& actual, const at::Tensor& expected) {
  const at::Tensor a = actual.to(at::kCPU, at::kDouble);
  const at::Tensor e = expected.to(at::kCPU, at::kDouble);
  return (a - e).abs().max().item<double>() / e.abs().max().item<double>();
}

}  // namespace kvforge::testing
