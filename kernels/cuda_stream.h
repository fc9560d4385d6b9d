#pragma once
// A CUDA stream owned for its lifetime (non-blocking: it does not wait for
// the legacy default stream), for host code that needs a stream of its own,
// such as a graph capture (CUDA does not capture the legacy default stream:
// kernels::CapturedGraph). Destroyed with the object; work queued on it is
// not waited for.
#include <cuda_runtime.h>

#include <memory>

#include "kernels/cuda_runtime_check.h"

namespace kvforge::kernels {

class CudaStream {
 public:
  CudaStream() {
    cudaStream_t stream = nullptr;
    KVFORGE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    stream_.reset(stream);
  }
  cudaStream_t get() const { return stream_.get(); }

 private:
  struct Destroy {
    void operator()(CUstream_st* stream) const { cudaStreamDestroy(stream); }
  };
  std::unique_ptr<CUstream_st, Destroy> stream_;
};

}  // namespace kvforge::kernels
