#pragma once
// The query rotation's launches (kernels/rotate_queries_kernel.cuh, in
// kernels/rotate_queries.cu): every query of the batch rotated by the keys'
// matrix into `rotated` ([count][num_heads][D] float32, the decode's
// workspace) before the kernels that read it, which launch as its
// programmatic dependents (DecodePlan::rotate_queries_first).
#include <cuda_runtime.h>

#include "kernels/decode_params.h"
#include "kernels/step_append.h"

namespace kvforge::kernels {

void launch_rotate_queries(const DecodeParams& params, float* rotated, cudaStream_t stream);

// The same with the decoding step's append `step` (one new token per entry,
// StepAppendHost::kRotateQueries: matrix rotations, a sliding window in
// both kinds) rotated and stored beside it.
void launch_rotate_queries_step(const DecodeParams& params, float* rotated, const StepAppendArgs& step,
                                cudaStream_t stream);

// Blocks of that step variant (its instance for the decode's head_dim, bits
// and element) one multiprocessor holds at once: DecodePlan's
// rotation_step_in_one_wave (0, where none fits: no step joins it).
int rotate_queries_step_blocks_per_multiprocessor(const DecodeParams& params);

}  // namespace kvforge::kernels
