#include "bench/l2_flush.h"

#include <algorithm>

#include "kernels/cuda_runtime_check.h"

namespace kvforge {
namespace {

// Reads `words` 16-byte words with every thread of the grid; the XOR of
// what a thread read is stored only if it equals a value the buffer's
// contents cannot produce by chance in practice, so that the loads are
// not optimized away and nothing is written.
__global__ void read_all_kernel(const uint4* words, int64_t count, uint32_t* sink) {
  uint32_t x = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 w = __ldcg(words + i);
    x ^= w.x ^ w.y ^ w.z ^ w.w;
  }
  if (x == 0x9e3779b9u) *sink = x;
}

}  // namespace

L2Flush::L2Flush(int device) {
  int l2 = 0;
  KVFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  l2_bytes_ = l2;
  bytes_ = std::max(kMinBytes, kL2Multiple * l2_bytes_) / 16 * 16;
  KVFORGE_CUDA_CHECK(cudaMalloc(&buffer_, static_cast<size_t>(bytes_) + 16));
  KVFORGE_CUDA_CHECK(cudaMemset(buffer_, 0, static_cast<size_t>(bytes_) + 16));
}

L2Flush::~L2Flush() { cudaFree(buffer_); }

void L2Flush::run(cudaStream_t stream) const {
  int device = 0, multiprocessors = 0;
  KVFORGE_CUDA_CHECK(cudaGetDevice(&device));
  KVFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  const auto* words = static_cast<const uint4*>(buffer_);
  auto* sink = reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(buffer_) + bytes_);
  read_all_kernel<<<4 * multiprocessors, 512, 0, stream>>>(words, bytes_ / 16, sink);
  KVFORGE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvforge
