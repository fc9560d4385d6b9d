#pragma once
// Programmatic dependent launch (sm_90; the device side no-ops where it is
// absent): a kernel launched with programmatic stream serialization may
// start once every block of the kernel before it has called
// allow_dependent_launch (or exited), and wait_for_prerequisite_grid waits
// until that kernel has completed and its writes are visible.
// decode_attention uses it so that the exact ranges' blocks run beside the
// int8 kernel's (or fill its last wave) and the merge launches while they
// run (kernels/decode_attention.cu, launch_for_bits); the decode benchmark
// times its floor (bench/launch_floor.h).
#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda_runtime_check.h"

namespace kvforge::kernels {

__device__ inline void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ inline void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Launches `kernel` on `stream`; `dependent`: with programmatic stream
// serialization, so that its blocks may start while the kernel before it
// still runs: the kernel must wait for that one
// (wait_for_prerequisite_grid) before it reads what it wrote, or, if it
// reads nothing of it, before it completes.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, int threads, int shared_bytes, cudaStream_t stream,
                   bool dependent, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(shared_bytes);
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = dependent ? 1 : 0;
  KVFORGE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace kvforge::kernels
