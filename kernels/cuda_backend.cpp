#include "kernels/cuda_backend.h"

#include <cstring>
#include <iterator>

#include "kernels/append_launch.h"
#include "kernels/cuda_runtime_check.h"
#include "kernels/decode_attention_launch.h"

namespace kvforge::kernels {
namespace {

// Makes `device` current until the end of the scope, then the caller's
// device again: torch reads the current device for "cuda" without an index,
// so a backend on cuda:1 must not leave it there.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    KVFORGE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      KVFORGE_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);  // best effort: a destructor does not throw
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// The non-throwing paths (release, the destructor): the device made current
// when possible, the caller's restored, and the runtime's last error cleared,
// so that a later cudaGetLastError() after a launch reports only that launch.
template <class Body>
void quietly_on(int device, Body&& body) noexcept {
  int previous = 0;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device &&
                        cudaSetDevice(device) == cudaSuccess;
  body();
  if (switched) cudaSetDevice(previous);
  cudaGetLastError();
}

}  // namespace

CudaBackend::CudaBackend(int device) : device_(device) {
  const DeviceScope scope(device_);
  KVFORGE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

CudaBackend::DeviceMemory::~DeviceMemory() {
  if (data != nullptr) cudaFree(data);  // no throwing from a destructor
}

CudaBackend::~CudaBackend() {
  if (stream_ == nullptr) return;
  quietly_on(device_, [this] {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  });
}

void* CudaBackend::allocate(int64_t bytes) {
  if (bytes <= 0) return nullptr;
  const DeviceScope scope(device_);
  void* memory = nullptr;
  KVFORGE_CUDA_CHECK(cudaMalloc(&memory, static_cast<size_t>(bytes)));
  // Ordered before every later copy and kernel on the stream.
  const cudaError_t zeroed = cudaMemsetAsync(memory, 0, static_cast<size_t>(bytes), stream_);
  if (zeroed != cudaSuccess) {
    cudaFree(memory);
    KVFORGE_CUDA_CHECK(zeroed);
  }
  return memory;
}

void CudaBackend::release(void* memory) noexcept {
  if (memory == nullptr) return;
  quietly_on(device_, [&] {
    cudaStreamSynchronize(stream_);  // a kernel still running on the stream may use the memory
    cudaFree(memory);
  });
}

void CudaBackend::copy_in(void* backend_memory, const void* host, int64_t bytes) {
  if (bytes <= 0) return;
  const DeviceScope scope(device_);
  KVFORGE_CUDA_CHECK(
      cudaMemcpyAsync(backend_memory, host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_));
  KVFORGE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::enqueue_copy_in(void* backend_memory, const void* host, int64_t bytes) {
  if (bytes <= 0) return;
  const DeviceScope scope(device_);
  if (bytes > PinnedStagingRing::kBytes) {  // a large prefill's rows: the driver stages them
    KVFORGE_CUDA_CHECK(
        cudaMemcpyAsync(backend_memory, host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_));
    return;
  }
  uint8_t* const staged = staging_.reserve(bytes);
  std::memcpy(staged, host, static_cast<size_t>(bytes));
  KVFORGE_CUDA_CHECK(
      cudaMemcpyAsync(backend_memory, staged, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_));
  staging_.queued(stream_);
}

// ------------------------------------------------------------ pinned staging

CudaBackend::PinnedStagingRing::~PinnedStagingRing() {
  for (const InFlight& f : in_flight_) cudaEventDestroy(f.copied);
  for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
  if (memory_ != nullptr) cudaFreeHost(memory_);
}

uint8_t* CudaBackend::PinnedStagingRing::reserve(int64_t bytes) {
  if (memory_ == nullptr) {
    void* memory = nullptr;
    KVFORGE_CUDA_CHECK(cudaHostAlloc(&memory, static_cast<size_t>(kBytes), cudaHostAllocPortable));
    memory_ = static_cast<uint8_t*>(memory);
  }
  // Copies that have finished give their regions back (oldest first), so
  // that the scan below stays short.
  while (!in_flight_.empty()) {
    const cudaError_t state = cudaEventQuery(in_flight_.front().copied);
    if (state == cudaErrorNotReady) break;
    KVFORGE_CUDA_CHECK(state);
    spare_events_.push_back(in_flight_.front().copied);
    in_flight_.pop_front();
  }
  const int64_t size = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (head_ + size > kBytes) head_ = 0;  // the ring's tail end stays unused this round
  const int64_t begin = head_, end = head_ + size;
  // The newest in-flight copy that read any of [begin, end): once its event
  // has passed, so have all older ones (one stream, in order).
  auto newest = in_flight_.end();
  for (auto f = in_flight_.begin(); f != in_flight_.end(); ++f) {
    if (f->begin < end && begin < f->end) newest = f;
  }
  if (newest != in_flight_.end()) {
    KVFORGE_CUDA_CHECK(cudaEventSynchronize(newest->copied));
    const auto past = std::next(newest);
    for (auto f = in_flight_.begin(); f != past; ++f) spare_events_.push_back(f->copied);
    in_flight_.erase(in_flight_.begin(), past);
  }
  head_ = end;
  last_begin_ = begin;
  last_end_ = end;
  return memory_ + begin;
}

void CudaBackend::PinnedStagingRing::queued(cudaStream_t stream) {
  cudaEvent_t event = nullptr;
  if (spare_events_.empty()) {
    KVFORGE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  } else {
    event = spare_events_.back();
    spare_events_.pop_back();
  }
  const cudaError_t recorded = cudaEventRecord(event, stream);
  if (recorded != cudaSuccess) {
    spare_events_.push_back(event);
    KVFORGE_CUDA_CHECK(recorded);
  }
  in_flight_.push_back({last_begin_, last_end_, event});
}

void CudaBackend::copy_out(void* host, const void* backend_memory, int64_t bytes) {
  if (bytes <= 0) return;
  const DeviceScope scope(device_);
  KVFORGE_CUDA_CHECK(
      cudaMemcpyAsync(host, backend_memory, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, stream_));
  KVFORGE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::append(const AppendParams& params) {
  const DeviceScope scope(device_);
  launch_append(params, stream_);
}

DecodePlanner& CudaBackend::planner() {
  if (!planner_) planner_.emplace();
  return *planner_;
}

DecodeParams CudaBackend::with_workspace(const DecodeParams& params, const DecodePlan& plan) {
  if (params.workspace != nullptr) return params;
  // Without a workspace the launch would allocate and free one on every call.
  const int64_t bytes = DecodePlanner::workspace_bytes(params, plan);
  if (bytes > workspace_.bytes) {
    KVFORGE_CUDA_CHECK(cudaStreamSynchronize(stream_));  // an earlier decode may still use the old one
    KVFORGE_CUDA_CHECK(cudaFree(workspace_.data));
    workspace_.data = nullptr;
    workspace_.bytes = 0;
    KVFORGE_CUDA_CHECK(cudaMalloc(&workspace_.data, static_cast<size_t>(bytes)));
    workspace_.bytes = bytes;
  }
  DecodeParams with = params;
  with.workspace = workspace_.data;
  with.workspace_bytes = workspace_.bytes;
  return with;
}

void CudaBackend::decode_attention(const DecodeParams& params) {
  const DeviceScope scope(device_);
  if (params.workspace != nullptr || params.batch.count <= 0) {
    planner().launch(params, stream_);
  } else {
    // Planned once for the workspace and the launch.
    const DecodePlan plan = planner().plan(params);
    planner().launch(with_workspace(params, plan), plan, stream_);
  }
  KVFORGE_CUDA_CHECK(cudaGetLastError());
}

bool CudaBackend::decode_step(const AppendParams& step_append, const DecodeParams& decode) {
  const DeviceScope scope(device_);
  bool fused = false;
  if (decode.batch.count <= 0) {
    fused = planner().launch_step(step_append, decode, stream_);
  } else {
    const DecodePlan plan = planner().plan(decode);
    fused = planner().launch_step(step_append, with_workspace(decode, plan), plan, stream_);
  }
  KVFORGE_CUDA_CHECK(cudaGetLastError());
  if (fused) ++fused_steps_;
  return fused;
}

void CudaBackend::synchronize() {
  const DeviceScope scope(device_);
  KVFORGE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

}  // namespace kvforge::kernels
