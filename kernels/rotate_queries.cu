// The query rotation's launches (kernels/rotate_queries_launch.h): a block
// per (KV head, sequence), and with a step's append a second one per pair
// for its value rows; the step variant instantiated per head_dim, bits and
// cache element (store_token_part's).
#include "kernels/rotate_queries_launch.h"

#include "kernels/programmatic_launch.cuh"
#include "kernels/rotate_queries_kernel.cuh"

namespace kvforge::kernels {
namespace {

namespace device = decode_attention_device;

template <typename Kernel, typename Step>
void launch_rotation(Kernel kernel, const DecodeParams& p, int threads, unsigned kinds, float* rotated,
                     const Step& step, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.key_cache.layout.spec.kv_heads), static_cast<unsigned>(p.batch.count), kinds);
  prefer_max_shared_carveout(kernel);
  launch_kernel(kernel, grid, threads, 0, stream, false, p, rotated, step);
}

// The step variant's instance for the decode's head_dim, bits and element
// (one signature for all: the template arguments are the kernel's own).
using StepRotationKernel = decltype(&device::rotate_group_queries_kernel<64, true, 2, ElementType::kFloat16>);

template <int D, int kBits>
StepRotationKernel step_kernel_for_bits(ElementType element) {
  using E = ElementType;
  switch (element) {
    case E::kFloat16:
      return device::rotate_group_queries_kernel<D, true, kBits, E::kFloat16>;
    case E::kBFloat16:
      return device::rotate_group_queries_kernel<D, true, kBits, E::kBFloat16>;
    case E::kFloat32:
      break;
  }
  return device::rotate_group_queries_kernel<D, true, kBits, E::kFloat32>;
}

template <int D>
StepRotationKernel step_kernel_for_head_dim(const TensorLayoutSpec& spec) {
  return spec.bits == 2 ? step_kernel_for_bits<D, 2>(spec.element) : step_kernel_for_bits<D, 4>(spec.element);
}

StepRotationKernel step_rotation_kernel(const TensorLayoutSpec& spec) {
  return spec.head_dim == 64 ? step_kernel_for_head_dim<64>(spec) : step_kernel_for_head_dim<128>(spec);
}

int rotation_threads(const TensorLayoutSpec& spec) { return device::kRotationSlices * static_cast<int>(spec.head_dim); }

}  // namespace

void launch_rotate_queries(const DecodeParams& p, float* rotated, cudaStream_t stream) {
  const int threads = rotation_threads(p.key_cache.layout.spec);
  if (p.key_cache.layout.spec.head_dim == 64) {
    launch_rotation(device::rotate_group_queries_kernel<64>, p, threads, 1, rotated, NoStepAppend{}, stream);
  } else {
    launch_rotation(device::rotate_group_queries_kernel<128>, p, threads, 1, rotated, NoStepAppend{}, stream);
  }
}

void launch_rotate_queries_step(const DecodeParams& p, float* rotated, const StepAppendArgs& step,
                                cudaStream_t stream) {
  const TensorLayoutSpec& keys = p.key_cache.layout.spec;
  launch_rotation(step_rotation_kernel(keys), p, rotation_threads(keys), 2, rotated, step, stream);
}

int rotate_queries_step_blocks_per_multiprocessor(const DecodeParams& p) {
  const TensorLayoutSpec& keys = p.key_cache.layout.spec;
  const StepRotationKernel kernel = step_rotation_kernel(keys);
  prefer_max_shared_carveout(kernel);  // as its launches ask
  int blocks = 0;
  KVFORGE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, rotation_threads(keys), 0));
  return blocks;
}

}  // namespace kvforge::kernels
