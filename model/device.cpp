#include "model/device.h"

#include <ATen/Context.h>

#include <stdexcept>

namespace kvforge {

bool cuda_available() { return at::globalContext().hasCUDA(); }

c10::Device parse_device(const std::string& text) {
  if (text == "cpu") return c10::Device(c10::kCPU);
  if (text == "cuda" || text.rfind("cuda:", 0) == 0) {
    if (!cuda_available()) {
      throw std::invalid_argument("--device " + text +
                                  ": no CUDA device is available on this machine (use --device cpu)");
    }
    int index = 0;
    if (text.size() > 5) {
      try {
        std::size_t used = 0;
        index = std::stoi(text.substr(5), &used);
        if (used != text.size() - 5 || index < 0) throw std::invalid_argument("");
      } catch (const std::exception&) {
        throw std::invalid_argument("--device " + text + ": expected cuda:N with N a device index");
      }
      const auto count = static_cast<int>(at::detail::getCUDAHooks().deviceCount());
      if (index >= count) {
        throw std::invalid_argument("--device " + text + ": only " + std::to_string(count) +
                                    " CUDA device(s) present");
      }
    }
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  throw std::invalid_argument("--device " + text + ": expected cpu, cuda or cuda:N");
}

c10::ScalarType parse_dtype(const std::string& text) {
  if (text == "fp32" || text == "float32") return c10::kFloat;
  if (text == "bf16" || text == "bfloat16") return c10::kBFloat16;
  if (text == "fp16" || text == "float16") return c10::kHalf;
  throw std::invalid_argument("--dtype " + text + ": expected fp32, bf16 or fp16");
}

std::string dtype_label(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat: return "fp32";
    case c10::kBFloat16: return "bf16";
    case c10::kHalf: return "fp16";
    default: return c10::toString(dtype);
  }
}

AttentionBackend parse_attention(const std::string& text, c10::Device device) {
  if (text == "eager") return AttentionBackend::kEager;
  if (text == "sdpa") return AttentionBackend::kFused;
  if (text == "auto") return device.is_cuda() ? AttentionBackend::kFused : AttentionBackend::kEager;
  throw std::invalid_argument("--attention " + text + ": expected auto, eager or sdpa");
}

std::string attention_label(AttentionBackend backend) {
  return backend == AttentionBackend::kEager ? "eager" : "sdpa";
}

}  // namespace kvforge
