#include "bench/l2_flush.h"

#include <algorithm>

#include "kernels/cuda_runtime_check.h"

namespace kvforge {

L2Flush::L2Flush(int device) {
  int l2 = 0;
  KVFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  l2_bytes_ = l2;
  bytes_ = std::max(kMinBytes, kL2Multiple * l2_bytes_) / 16 * 16;
  reader_.reserve(bytes_);
}

}  // namespace kvforge
