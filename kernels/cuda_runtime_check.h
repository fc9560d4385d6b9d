#pragma once
// CUDA runtime error checks for the kernels' host code (.cu files only):
// KVFORGE_CUDA_CHECK(call) throws std::runtime_error naming the call, the
// file and line and CUDA's error string, built only on failure.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace kvforge::kernels {

[[noreturn]] void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line);

// Devices the runtime sees (0 when there is no driver or no device).
int cuda_device_count();

}  // namespace kvforge::kernels

#define KVFORGE_CUDA_CHECK(call)                                                           \
  do {                                                                                     \
    const cudaError_t kvforge_cuda_status_ = (call);                                       \
    if (kvforge_cuda_status_ != cudaSuccess) {                                             \
      ::kvforge::kernels::throw_cuda_error(kvforge_cuda_status_, #call, __FILE__, __LINE__); \
    }                                                                                      \
  } while (0)
