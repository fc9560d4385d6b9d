#include "kernels/cuda_backend.h"

#include "kernels/append_launch.h"
#include "kernels/cuda_runtime_check.h"
#include "kernels/decode_attention_launch.h"

namespace kvforge::kernels {

CudaBackend::CudaBackend(int device) : device_(device) {
  KVFORGE_CUDA_CHECK(cudaSetDevice(device_));
  KVFORGE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

CudaBackend::DeviceMemory::~DeviceMemory() {
  if (data != nullptr) cudaFree(data);  // no throwing from a destructor
}

CudaBackend::~CudaBackend() {
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);  // no throwing from a destructor: errors surface at the next call
    cudaStreamDestroy(stream_);
  }
}

void* CudaBackend::allocate(int64_t bytes) {
  if (bytes <= 0) return nullptr;
  KVFORGE_CUDA_CHECK(cudaSetDevice(device_));
  void* memory = nullptr;
  KVFORGE_CUDA_CHECK(cudaMalloc(&memory, static_cast<size_t>(bytes)));
  // Ordered before every later copy and kernel on the stream.
  KVFORGE_CUDA_CHECK(cudaMemsetAsync(memory, 0, static_cast<size_t>(bytes), stream_));
  return memory;
}

void CudaBackend::release(void* memory) {
  if (memory == nullptr) return;
  // A kernel still running on the stream may use the memory.
  KVFORGE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  KVFORGE_CUDA_CHECK(cudaFree(memory));
}

void CudaBackend::copy_in(void* backend_memory, const void* host, int64_t bytes) {
  if (bytes <= 0) return;
  KVFORGE_CUDA_CHECK(
      cudaMemcpyAsync(backend_memory, host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_));
  KVFORGE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::enqueue_copy_in(void* backend_memory, const void* host, int64_t bytes) {
  if (bytes <= 0) return;
  KVFORGE_CUDA_CHECK(
      cudaMemcpyAsync(backend_memory, host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_));
}

void CudaBackend::copy_out(void* host, const void* backend_memory, int64_t bytes) {
  if (bytes <= 0) return;
  KVFORGE_CUDA_CHECK(
      cudaMemcpyAsync(host, backend_memory, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, stream_));
  KVFORGE_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::append(const AppendParams& params) {
  KVFORGE_CUDA_CHECK(cudaSetDevice(device_));
  launch_append(params, stream_);
}

void CudaBackend::decode_attention(const DecodeParams& params) {
  KVFORGE_CUDA_CHECK(cudaSetDevice(device_));
  if (params.workspace != nullptr || params.batch.count <= 0) {
    launch_decode_attention(params, stream_);
  } else {
    // Else the launch would allocate and free its workspace on every call.
    const int64_t bytes = decode_workspace_bytes(params);
    if (bytes > workspace_.bytes) {
      KVFORGE_CUDA_CHECK(cudaStreamSynchronize(stream_));  // an earlier decode may still use the old one
      KVFORGE_CUDA_CHECK(cudaFree(workspace_.data));
      workspace_.data = nullptr;
      workspace_.bytes = 0;
      KVFORGE_CUDA_CHECK(cudaMalloc(&workspace_.data, static_cast<size_t>(bytes)));
      workspace_.bytes = bytes;
    }
    DecodeParams with_workspace = params;
    with_workspace.workspace = workspace_.data;
    with_workspace.workspace_bytes = workspace_.bytes;
    launch_decode_attention(with_workspace, stream_);
  }
  KVFORGE_CUDA_CHECK(cudaGetLastError());
}

void CudaBackend::synchronize() { KVFORGE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

}  // namespace kvforge::kernels
