#pragma once
// The emptiest launches, for the decode benchmark to time under its own
// timer (median_us): what any decode call on the device pays before it
// reads a byte. One empty kernel, and the decode's two-kernel shape: an
// empty kernel and an empty programmatic dependent that waits for it
// (griddepcontrol.wait), as the merge waits for the split kernels.
#include <cuda_runtime.h>

namespace kvforge {

// Queues one empty kernel (one block of one warp) on `stream`.
void launch_empty_kernel(cudaStream_t stream);

// Queues an empty kernel and, with programmatic stream serialization, an
// empty kernel that waits for it, on `stream`.
void launch_empty_dependent_pair(cudaStream_t stream);

}  // namespace kvforge
