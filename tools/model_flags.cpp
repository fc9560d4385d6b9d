#include "tools/model_flags.h"

namespace kvforge::cli {

void ModelFlags::add_to(CLI::App& command) {
  command.add_option("-m,--model", model_dir, "Hugging Face model folder (config.json, safetensors, tokenizer.json)")
      ->required()
      ->check(CLI::ExistingDirectory);
  command.add_option("--device", device, "cpu, cuda or cuda:N")->capture_default_str();
  command.add_option("--dtype", dtype, "fp32, bf16 or fp16 (default: fp32 on cpu, bf16 on cuda)");
  command.add_option("--attention", attention,
                     "eager (transformers' eager attention, op for op) or sdpa (fused kernels); "
                     "auto: eager on cpu, sdpa on cuda")
      ->capture_default_str();
}

ComputeTarget ModelFlags::target() const {
  ComputeTarget target;
  target.device = parse_device(device);
  target.dtype = dtype.empty() ? (target.device.is_cuda() ? c10::kBFloat16 : c10::kFloat) : parse_dtype(dtype);
  target.attention = parse_attention(attention, target.device);
  return target;
}

}  // namespace kvforge::cli
