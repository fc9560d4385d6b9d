#pragma once
// Moves recorded activations off the GPU without stalling it: each tensor is
// copied into pinned host memory on a side CUDA stream that waits only for
// the work that produced it, so the copies overlap the rest of the forward
// pass. On the CPU staging is a plain copy.
#include <ATen/core/Tensor.h>

#include <deque>
#include <functional>
#include <memory>

namespace kvforge {

class HostStager {
 public:
  explicit HostStager(c10::Device device);
  ~HostStager();
  HostStager(const HostStager&) = delete;
  HostStager& operator=(const HostStager&) = delete;

  // Starts copying `values` to the host; `consume` runs with the host copy
  // (same dtype and shape, contiguous) during the next drain().
  void stage(const at::Tensor& values, std::function<void(const at::Tensor& host)> consume);
  // Waits for every staged copy, in order, and runs its consumer.
  void drain();
  // Runs the consumers of the copies that have already finished, in order,
  // without waiting: keeps host memory to what is still in flight.
  void drain_ready();
  size_t pending() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvforge
