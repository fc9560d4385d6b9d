#include "bench/launch_floor.h"

#include "kernels/cuda_runtime_check.h"
#include "kernels/programmatic_launch.cuh"

namespace kvforge {
namespace {

__global__ void empty_kernel() {}

// Lets its dependent launch, as the decode's split kernels do.
__global__ void empty_primary_kernel() { kernels::allow_dependent_launch(); }

__global__ void empty_dependent_kernel() { kernels::wait_for_prerequisite_grid(); }

}  // namespace

void launch_empty_kernel(cudaStream_t stream) {
  empty_kernel<<<1, 32, 0, stream>>>();
  KVFORGE_CUDA_CHECK(cudaGetLastError());
}

void launch_empty_dependent_pair(cudaStream_t stream) {
  kernels::launch_kernel(empty_primary_kernel, dim3(1), 32, 0, stream, false);
  kernels::launch_kernel(empty_dependent_kernel, dim3(1), 32, 0, stream, true);
}

}  // namespace kvforge
