#pragma once
// Where and in which precision the model runs: `--device cpu|cuda[:N]` and
// `--dtype fp32|bf16|fp16`, checked against what this machine has.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace kvforge {

struct ComputeTarget {
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType dtype = c10::kFloat;
};

// Throws std::invalid_argument with one line saying what was expected, e.g.
// "--device cuda: no CUDA device is available on this machine".
c10::Device parse_device(const std::string& text);
c10::ScalarType parse_dtype(const std::string& text);
std::string dtype_label(c10::ScalarType dtype);  // "fp32", "bf16", "fp16"
bool cuda_available();

}  // namespace kvforge
