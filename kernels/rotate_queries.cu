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

template <int D, int kBits>
void launch_step_for_bits(const DecodeParams& p, float* rotated, const StepAppendArgs& step, cudaStream_t stream) {
  constexpr int kThreads = device::kRotationSlices * D;
  using E = ElementType;
  switch (p.key_cache.layout.spec.element) {
    case E::kFloat16:
      launch_rotation(device::rotate_group_queries_kernel<D, true, kBits, E::kFloat16>, p, kThreads, 2, rotated, step,
                      stream);
      return;
    case E::kBFloat16:
      launch_rotation(device::rotate_group_queries_kernel<D, true, kBits, E::kBFloat16>, p, kThreads, 2, rotated, step,
                      stream);
      return;
    case E::kFloat32:
      launch_rotation(device::rotate_group_queries_kernel<D, true, kBits, E::kFloat32>, p, kThreads, 2, rotated, step,
                      stream);
      return;
  }
}

template <int D>
void launch_step_for_head_dim(const DecodeParams& p, float* rotated, const StepAppendArgs& step, cudaStream_t stream) {
  if (p.key_cache.layout.spec.bits == 2) {
    launch_step_for_bits<D, 2>(p, rotated, step, stream);
  } else {
    launch_step_for_bits<D, 4>(p, rotated, step, stream);
  }
}

}  // namespace

void launch_rotate_queries(const DecodeParams& p, float* rotated, cudaStream_t stream) {
  if (p.key_cache.layout.spec.head_dim == 64) {
    launch_rotation(device::rotate_group_queries_kernel<64>, p, device::kRotationSlices * 64, 1, rotated,
                    NoStepAppend{}, stream);
  } else {
    launch_rotation(device::rotate_group_queries_kernel<128>, p, device::kRotationSlices * 128, 1, rotated,
                    NoStepAppend{}, stream);
  }
}

void launch_rotate_queries_step(const DecodeParams& p, float* rotated, const StepAppendArgs& step,
                                cudaStream_t stream) {
  if (p.key_cache.layout.spec.head_dim == 64) {
    launch_step_for_head_dim<64>(p, rotated, step, stream);
  } else {
    launch_step_for_head_dim<128>(p, rotated, step, stream);
  }
}

}  // namespace kvforge::kernels
