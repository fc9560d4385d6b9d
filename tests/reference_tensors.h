#pragma once
// Reference tensors written by scripts/make_model_fixtures.py (HF
// transformers) as safetensors, loaded as float32 CPU tensors.
#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <string>

namespace kvforge::testing {

std::map<std::string, at::Tensor> load_reference(const std::filesystem::path& safetensors_file);

// max |actual - expected| / max |expected|
double max_relative_error(const at::Tensor& actual, const at::Tensor& expected);

}  // namespace kvforge::testing
