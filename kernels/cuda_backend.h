#pragma once
// The CUDA kernel backend of QuantizedKVCache: device memory (zeroed on
// allocation), copies on the backend's stream, and the two kernels:
// append (kernels/append_kernel.cu) and decode_attention
// (kernels/decode_attention.cu), whose split workspace the backend keeps
// between calls (grown when a call needs more). Host code in C++20 (a .cpp: QuantizedKVCache
// is C++20, the CUDA sources C++17). Device memory is not host-addressable:
// QuantizedKVCache copies what it inspects out through copy_out.
#include <cuda_runtime.h>

#include <deque>
#include <optional>
#include <vector>

#include "kernels/decode_attention_launch.h"
#include "kernels/quantized_kv_cache.h"

namespace kvforge::kernels {

// Every call makes the backend's device current for its duration and gives
// the caller's current device back (a host program such as torch keeps its
// own); a failed CUDA call throws std::runtime_error naming the call and
// CUDA's one-line error string, except in release and the destructor, which
// never throw (they run while exceptions unwind and at interpreter exit).
class CudaBackend final : public KernelBackend {
 public:
  // Uses `device` and a stream of its own.
  explicit CudaBackend(int device = 0);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  void* allocate(int64_t bytes) override;
  // Waits for the stream, frees; CUDA errors are ignored (a failed kernel's
  // sticky error was reported by the call that met it).
  void release(void* memory) noexcept override;
  // Both copies return when the bytes have arrived (the host side may be a
  // temporary).
  void copy_in(void* backend_memory, const void* host, int64_t bytes) override;
  void copy_out(void* host, const void* backend_memory, int64_t bytes) override;
  // No wait: the bytes are copied into pinned staging memory the queued copy
  // reads (from pageable memory the driver may wait for the stream instead),
  // so the caller may change them as soon as the call returns. Copies larger
  // than the staging ring go directly, and may wait.
  void enqueue_copy_in(void* backend_memory, const void* host, int64_t bytes) override;
  bool host_addressable() const override { return false; }
  // Launch on the stream; the params' pointers are device pointers. A
  // decode without params.workspace gets the backend's.
  void append(const AppendParams& params) override;
  void decode_attention(const DecodeParams& params) override;
  // The append inside the decode's launch where DecodePlanner::launch_step
  // can (step_append_host), else the two launches.
  bool decode_step(const AppendParams& step_append, const DecodeParams& decode) override;
  void synchronize() override;  // the backend's stream

  // Decoding steps whose append ran inside the decode's launch, so far.
  int64_t fused_steps() const { return fused_steps_; }

  cudaStream_t stream() const { return stream_; }

 private:
  // The decode plans' device facts, asked once (made on the first decode,
  // with the backend's device current).
  DecodePlanner& planner();
  // `params` with the backend's workspace, grown to what `plan` needs
  // (params' own workspace kept where it has one).
  DecodeParams with_workspace(const DecodeParams& params, const DecodePlan& plan);
  std::optional<DecodePlanner> planner_;
  int64_t fused_steps_ = 0;
  // Device memory freed on destruction (after the stream has finished).
  struct DeviceMemory {
    DeviceMemory() = default;
    DeviceMemory(const DeviceMemory&) = delete;
    DeviceMemory& operator=(const DeviceMemory&) = delete;
    ~DeviceMemory();
    void* data = nullptr;
    int64_t bytes = 0;
  };

  // Pinned host memory in a ring: each queued copy takes the next region
  // and an event recorded after it; a region is reused once the events of
  // the copies that read it have passed.
  class PinnedStagingRing {
   public:
    static constexpr int64_t kBytes = int64_t{1} << 20;
    static constexpr int64_t kAlignment = 256;
    PinnedStagingRing() = default;
    PinnedStagingRing(const PinnedStagingRing&) = delete;
    PinnedStagingRing& operator=(const PinnedStagingRing&) = delete;
    ~PinnedStagingRing();  // after the stream has finished (the backend's destructor)
    // A region of `bytes` (at most kBytes) whose earlier copies have finished.
    uint8_t* reserve(int64_t bytes);
    // The copy reading the region reserve() returned last is queued on `stream`.
    void queued(cudaStream_t stream);

   private:
    struct InFlight {
      int64_t begin = 0, end = 0;
      cudaEvent_t copied = nullptr;
    };
    uint8_t* memory_ = nullptr;
    int64_t head_ = 0, last_begin_ = 0, last_end_ = 0;
    std::deque<InFlight> in_flight_;  // oldest first
    std::vector<cudaEvent_t> spare_events_;
  };

  int device_;
  cudaStream_t stream_ = nullptr;
  DeviceMemory workspace_;  // decode_attention's split states
  PinnedStagingRing staging_;
};

}  // namespace kvforge::kernels
