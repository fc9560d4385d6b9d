#pragma once
// The CUDA append kernel's launcher (kernels/append_kernel.cu): checks the
// params (std::invalid_argument naming the field) and launches keys and
// values on `stream`: a warp per token, KV head and kind where the layout
// allows it, else one block per sequence of the batch and kind.
#include <cuda_runtime.h>

#include "kernels/decode_params.h"

namespace kvforge::kernels {

void launch_append(const AppendParams& params, cudaStream_t stream);

// Whether launch_append takes the call with the token-parallel kernel
// (kernels/append_token_kernel.cuh: AppendParams::kernel kAuto, the rows
// known, both kinds per-token groups of whole lanes' channels without
// outliers, no rotation or a matrix one, head_dim 64, 128 or 256, equal
// bits); otherwise one block per sequence and kind.
bool takes_token_parallel(const AppendParams& params);

}  // namespace kvforge::kernels
