#pragma once
// Programmatic dependent launch (sm_90; the device side no-ops where it is
// absent): a kernel launched with programmatic stream serialization may
// start once every block of the kernel before it has called
// allow_dependent_launch (or exited), and wait_for_prerequisite_grid waits
// until that kernel has completed and its writes are visible.
// decode_attention uses it so that the exact ranges' blocks run beside the
// int8 kernel's (or fill its last wave) and the merge launches while they
// run (kernels/decode_attention.cu, launch_for_bits); the decode benchmark
// times its floor (bench/launch_floor.h). The same launches may group
// their blocks in thread-block clusters (sm_90), whose blocks read each
// other's shared memory: the int8 kernel's splits merge their states that
// way (kernels/cluster_merge.cuh).
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

// The launch attribute of clusters of `blocks` consecutive blocks along x.
inline cudaLaunchAttribute cluster_attribute(int blocks) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = static_cast<unsigned>(blocks);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  return attribute;
}

// Launches `kernel` on `stream`; `dependent`: with programmatic stream
// serialization, so that its blocks may start while the kernel before it
// still runs: the kernel must wait for that one
// (wait_for_prerequisite_grid) before it reads what it wrote, or, if it
// reads nothing of it, before it completes. `cluster_blocks` > 0: in
// thread-block clusters of that many consecutive blocks along x (a divisor
// of grid.x, at most 8), co-scheduled so that they share shared memory.
template <typename... Params, typename... Args>
void launch_kernel_in_clusters(void (*kernel)(Params...), dim3 grid, int cluster_blocks, int threads, int shared_bytes,
                               cudaStream_t stream, bool dependent, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(shared_bytes);
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  unsigned count = 0;
  if (dependent) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cluster_blocks > 0) attributes[count++] = cluster_attribute(cluster_blocks);
  config.attrs = attributes;
  config.numAttrs = count;
  KVFORGE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, int threads, int shared_bytes, cudaStream_t stream,
                   bool dependent, Args&&... args) {
  launch_kernel_in_clusters(kernel, grid, 0, threads, shared_bytes, stream, dependent, std::forward<Args>(args)...);
}

// Clusters of `cluster_blocks` blocks of `kernel` (threads and dynamic
// shared memory as its launch's) that the device holds at once; 0 where the
// runtime cannot say (no clusters of that size for the kernel), so that a
// caller launches without them.
template <typename... Params>
int resident_clusters(void (*kernel)(Params...), int cluster_blocks, int threads, int shared_bytes) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(cluster_blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(shared_bytes);
  cudaLaunchAttribute attribute = cluster_attribute(cluster_blocks);
  config.attrs = &attribute;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());  // the refusal is the answer, not the next call's error
    return 0;
  }
  return clusters;
}

// Kernels whose blocks share multiprocessors with the int8 kernel's (the
// exact blocks beside them at batch 1, the query rotation before them) ask
// for the largest shared-memory carveout: a multiprocessor configures its
// L1/shared split for the first kernel it runs, and a small kernel's own
// choice (12 KB a block) leaves no room for the int8 blocks' 55 KB until
// it drains (int2-rot at 128K batch 1: 47 -> 55 us with the exact kernel,
// which asked for less than the general kernel's 36 KB).
template <typename Kernel>
void prefer_max_shared_carveout(Kernel kernel) {
  KVFORGE_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
}

}  // namespace kvforge::kernels
