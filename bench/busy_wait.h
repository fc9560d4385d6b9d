#pragma once
// A kernel that keeps a stream busy for a while: queued ahead of work the
// host enqueues, it lets the benchmark time that work's device side back to
// back, without the host's enqueue gaps in it.
#include <cuda_runtime.h>

#include <cstdint>

namespace kvforge {

// Queues one single-thread kernel on `stream` that spins for `nanoseconds`
// of the device's global timer.
void busy_wait_on(cudaStream_t stream, int64_t nanoseconds);

}  // namespace kvforge
