#pragma once
// The CUDA decode_attention kernel's launcher (kernels/decode_attention.cu):
// one query per sequence over its paged, quantized KV cache, as
// docs/runtime-layout.md section 6.3 states and decode_attention_reference
// computes; every pointer of params is device memory.
#include <cuda_runtime.h>

#include "kernels/decode_params.h"

namespace kvforge::kernels {

void launch_decode_attention(const DecodeParams& params, cudaStream_t stream);

}  // namespace kvforge::kernels
