#pragma once
// Wall seconds of `work` on a device: synchronized before and after, so
// queued CUDA kernels are counted where they run, not where they start.
#include <c10/core/Device.h>
#include <c10/cuda/CUDAFunctions.h>

#include <chrono>
#include <functional>

namespace kvforge {

inline double seconds_of(const c10::Device& device, const std::function<void()>& work) {
  if (device.is_cuda()) c10::cuda::device_synchronize();
  const auto start = std::chrono::steady_clock::now();
  work();
  if (device.is_cuda()) c10::cuda::device_synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace kvforge
