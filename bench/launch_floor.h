#pragma once
// The floors a decode call stands on, for the decode benchmark to time under
// its own timer (median_us): the emptiest launches (what any decode call
// pays before it reads a byte: one empty kernel, and the decode's two-kernel
// shape, an empty kernel and an empty programmatic dependent that waits for
// it (griddepcontrol.wait), as the merge waits for the split kernels), and
// one launch that only reads a call's bytes (ReadFloor).
#include <cuda_runtime.h>

#include <cstdint>

namespace kvforge {

// Queues one empty kernel (one block of one warp) on `stream`.
void launch_empty_kernel(cudaStream_t stream);

// Queues an empty kernel and, with programmatic stream serialization, an
// empty kernel that waits for it, on `stream`.
void launch_empty_dependent_pair(cudaStream_t stream);

// The same pair, each kernel taking a DecodeParams by value (1,104 bytes
// since the inline decode arrays, 712 before): the parameter block's share
// of a decode call's launches.
void launch_empty_dependent_pair_with_decode_params(cudaStream_t stream);

// The least time one launch on this device takes to read a decode call's
// bytes, launch included (the decode benchmark's read_floor_us): one
// kernel over every multiprocessor reading `bytes` of a buffer in 16-byte
// loads through L2, as the decode's cp.async.cg copies do.
class ReadFloor {
 public:
  ReadFloor() = default;
  ~ReadFloor();
  ReadFloor(const ReadFloor&) = delete;
  ReadFloor& operator=(const ReadFloor&) = delete;

  // Grows the buffer to `bytes` (synchronous: call it outside the timing).
  void reserve(int64_t bytes);
  // Queues the read of the first `bytes` (rounded up to 16; at most the
  // reserved bytes) on `stream`.
  void run(int64_t bytes, cudaStream_t stream) const;

 private:
  int64_t capacity_ = 0;
  void* buffer_ = nullptr;  // capacity_ bytes, zeroed, then one word the kernel may write
};

}  // namespace kvforge
