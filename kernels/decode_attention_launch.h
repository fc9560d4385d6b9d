#pragma once
#include <cuda_runtime.h>

#include "kernels/decode_params.h"

namespace kvforge::kernels {

void launch_decode_attention(const DecodeParams& params, cudaStream_t stream);

}  // namespace kvforge::kernels
