#pragma once
// A cold L2 cache before each timed repeat. A server's decode of one layer
// follows the other layers' weights and caches through L2, so it finds none
// of its own bytes there; a benchmark that repeats one call back to back
// would find all of them whenever they fit (a 32K-token 2-bit cache at
// batch 1 is 19 MB, the H200's L2 60 MB, its bf16 cache 67 MB), flattering
// the smaller cache against the larger one. L2Flush reads a buffer several
// times the L2's size: clean lines, so that the timed work after it writes
// back nothing of the flush's.
#include <cuda_runtime.h>

#include <cstdint>

#include "bench/launch_floor.h"

namespace kvforge {

class L2Flush {
 public:
  // A buffer of kL2Multiple times the device's L2 size (at least kMinBytes).
  explicit L2Flush(int device);

  // Queues a kernel on `stream` that reads the whole buffer (ReadFloor's).
  void run(cudaStream_t stream) const { reader_.run(bytes_, stream); }

  int64_t bytes() const { return bytes_; }
  int64_t l2_bytes() const { return l2_bytes_; }

  static constexpr int64_t kL2Multiple = 4;
  static constexpr int64_t kMinBytes = int64_t{64} << 20;

 private:
  int64_t l2_bytes_ = 0, bytes_ = 0;
  ReadFloor reader_;
};

}  // namespace kvforge
