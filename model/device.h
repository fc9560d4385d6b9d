#pragma once
// Where and in which precision the model runs: `--device cpu|cuda[:N]` and
// `--dtype fp32|bf16|fp16`, checked against what this machine has.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace kvforge {

// How attention is computed. kEager repeats transformers' eager attention
// operation for operation (matmul, scale, mask, float32 softmax, matmul), so
// low-precision results round as HF's do; kFused calls
// scaled_dot_product_attention (flash / memory-efficient kernels), which
// long sequences need.
enum class AttentionBackend { kEager, kFused };

struct ComputeTarget {
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType dtype = c10::kFloat;
  AttentionBackend attention = AttentionBackend::kEager;
};

// Throws std::invalid_argument with one line saying what was expected, e.g.
// "--device cuda: no CUDA device is available on this machine".
c10::Device parse_device(const std::string& text);
c10::ScalarType parse_dtype(const std::string& text);
std::string dtype_label(c10::ScalarType dtype);  // "fp32", "bf16", "fp16"
// "eager" or "sdpa"; "auto" picks eager on CPU and sdpa on CUDA.
AttentionBackend parse_attention(const std::string& text, c10::Device device);
std::string attention_label(AttentionBackend backend);
bool cuda_available();

}  // namespace kvforge
