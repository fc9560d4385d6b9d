#include "bench/launch_floor.h"

#include <algorithm>

#include "kernels/cuda_runtime_check.h"
#include "kernels/decode_params.h"
#include "kernels/programmatic_launch.cuh"

namespace kvforge {
namespace {

__global__ void empty_kernel() {}

// Lets its dependent launch, as the decode's split kernels do.
__global__ void empty_primary_kernel() { kernels::allow_dependent_launch(); }

__global__ void empty_dependent_kernel() { kernels::wait_for_prerequisite_grid(); }

// The same pair with the decode kernels' parameter block (DecodeParams by
// value): what the launches' larger parameters cost, if anything.
__global__ void empty_primary_params_kernel(const kernels::DecodeParams) { kernels::allow_dependent_launch(); }
__global__ void empty_dependent_params_kernel(const kernels::DecodeParams) { kernels::wait_for_prerequisite_grid(); }

// Every thread reads its share of `count` 16-byte words, the loads of four
// words in flight at a time; the XOR of what it read is stored only if it
// equals a value zeroed memory cannot give, so that nothing is written and
// the loads stay.
__global__ void read_floor_kernel(const uint4* words, int64_t count, uint32_t* sink) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t x = 0;
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < count; i += 4 * stride) {
    const uint4 a = __ldcg(words + i), b = __ldcg(words + i + stride);
    const uint4 c = __ldcg(words + i + 2 * stride), d = __ldcg(words + i + 3 * stride);
    x ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < count; i += stride) {
    const uint4 a = __ldcg(words + i);
    x ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (x == 0x9e3779b9u) *sink = x;
}

}  // namespace

void launch_empty_kernel(cudaStream_t stream) {
  empty_kernel<<<1, 32, 0, stream>>>();
  KVFORGE_CUDA_CHECK(cudaGetLastError());
}

ReadFloor::~ReadFloor() { cudaFree(buffer_); }

void ReadFloor::reserve(int64_t bytes) {
  bytes = (bytes + 15) / 16 * 16;
  if (bytes <= capacity_) return;
  KVFORGE_CUDA_CHECK(cudaDeviceSynchronize());
  KVFORGE_CUDA_CHECK(cudaFree(buffer_));
  buffer_ = nullptr;
  capacity_ = 0;
  KVFORGE_CUDA_CHECK(cudaMalloc(&buffer_, static_cast<size_t>(bytes) + 16));
  KVFORGE_CUDA_CHECK(cudaMemset(buffer_, 0, static_cast<size_t>(bytes) + 16));
  capacity_ = bytes;
}

void ReadFloor::run(int64_t bytes, cudaStream_t stream) const {
  const int64_t words = std::min((bytes + 15) / 16, capacity_ / 16);
  int device = 0, multiprocessors = 0;
  KVFORGE_CUDA_CHECK(cudaGetDevice(&device));
  KVFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  // Four blocks of 256 threads a multiprocessor: 32 warps, each with four
  // 16-byte loads in flight, keep the device's memory system full.
  const auto* words_at = static_cast<const uint4*>(buffer_);
  auto* sink = reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(buffer_) + capacity_);
  read_floor_kernel<<<4 * multiprocessors, 256, 0, stream>>>(words_at, words, sink);
  KVFORGE_CUDA_CHECK(cudaGetLastError());
}

void launch_empty_dependent_pair(cudaStream_t stream) {
  kernels::launch_kernel(empty_primary_kernel, dim3(1), 32, 0, stream, false);
  kernels::launch_kernel(empty_dependent_kernel, dim3(1), 32, 0, stream, true);
}

void launch_empty_dependent_pair_with_decode_params(cudaStream_t stream) {
  const kernels::DecodeParams params;
  kernels::launch_kernel(empty_primary_params_kernel, dim3(1), 32, 0, stream, false, params);
  kernels::launch_kernel(empty_dependent_params_kernel, dim3(1), 32, 0, stream, true, params);
}

}  // namespace kvforge
