#include "kernels/cuda_runtime_check.h"

#include "kernels/decode_params.h"  // the parameter structs compile as CUDA

namespace kvforge::kernels {

void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                           cudaGetErrorString(error));
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return count;
}

}  // namespace kvforge::kernels
