#include "bench/busy_wait.h"

#include "kernels/cuda_runtime_check.h"

namespace kvforge {
namespace {

__device__ inline uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void busy_wait_kernel(int64_t nanoseconds) {
  const uint64_t end = global_timer_ns() + static_cast<uint64_t>(nanoseconds);
  while (global_timer_ns() < end) {
  }
}

}  // namespace

void busy_wait_on(cudaStream_t stream, int64_t nanoseconds) {
  busy_wait_kernel<<<1, 1, 0, stream>>>(nanoseconds);
  KVFORGE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvforge
