#pragma once
// A CUDA graph captured from the work a callable enqueues on a stream, and
// replayed: how a server runs a decoding step (DecodePlanner::launch) without
// paying every launch's host time again. The capture freezes what the
// launches were given: kernel parameters (device pointers, the batch count,
// the plan's splits, worked out from batch.max_length, so plan for the
// longest context the graph will serve, or with 0 for the page table's
// capacity) are those of the capture; a replay
// reads the device memory they point at as it is then (queries, lengths,
// slots, page tables, pages), so a server updates those in place between
// replays. Captured in relaxed mode: the launches set kernel attributes,
// which are not stream work. Host code of kvforge_kernels_cuda.
#include <cuda_runtime.h>

#include <memory>
#include <utility>

namespace kvforge::kernels {

class CapturedGraph {
 public:
  // Runs enqueue(stream) under capture (stream: not the legacy default
  // stream) and instantiates what it enqueued; if enqueue throws, the
  // capture is ended and its graph released before the exception goes on.
  template <class Enqueue>
  static CapturedGraph capture(cudaStream_t stream, Enqueue&& enqueue) {
    begin_capture(stream);
    try {
      std::forward<Enqueue>(enqueue)(stream);
    } catch (...) {
      abandon_capture(stream);
      throw;
    }
    return CapturedGraph(end_capture(stream));
  }

  // Enqueues one replay on `stream`.
  void launch(cudaStream_t stream) const;

 private:
  struct ExecDeleter {
    void operator()(CUgraphExec_st* exec) const;
  };
  using Exec = std::unique_ptr<CUgraphExec_st, ExecDeleter>;
  explicit CapturedGraph(Exec exec) : exec_(std::move(exec)) {}
  static void begin_capture(cudaStream_t stream);
  static void abandon_capture(cudaStream_t stream);
  static Exec end_capture(cudaStream_t stream);

  Exec exec_;
};

}  // namespace kvforge::kernels
