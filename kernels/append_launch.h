#pragma once
// The CUDA append kernel's launcher (kernels/append_kernel.cu): checks the
// params (std::invalid_argument naming the field) and launches, for keys and
// then values, one block per sequence of the batch on `stream`.
#include <cuda_runtime.h>

#include "kernels/decode_params.h"

namespace kvforge::kernels {

void launch_append(const AppendParams& params, cudaStream_t stream);

}  // namespace kvforge::kernels
