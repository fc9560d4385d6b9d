#pragma once
// The keys' matrix rotation of every query of the batch, once per decode
// call (DecodePlan::rotate_queries_first), and, in its step variant, the
// decoding step's new tokens rotated and stored beside it (int2-rot's
// StepAppendHost::kRotateQueries, step_append.cuh).
//
// One block per (KV head, sequence) rotates the group's queries into
// `rotated` (SplitWorkspace::queries). The tensor-core kernels' blocks
// had each rotated their group's queries, 64 KB of the matrix from L2 and
// 64 K fmas per block of 4 heads at head_dim 128: at 32K tokens and batch 8
// some 500 blocks, 11% of the int8 kernel's instructions
// (bench/results/ncu-decode-int2rot-rotated-h200-2026-12-02.txt). The
// matrix's rows are cut into kRotationSlices slices, thread (slice, j)
// loading its slice of column j at once (one round trip to memory; a
// thread per column, 32 rows in flight, made four and ran 7 us a block) and
// summing it for each head in one fma chain in row order; the slices'
// sums are added in slice order. The kernel behind it may launch at once
// and waits for it before it reads the queries (load_group_queries).
//
// The step variant (kStepAppend) has a second block per (KV head,
// sequence), z = 1: z = 0 also stores the entry's new key row (its
// threads' matrix registers are the keys' rotation's), z = 1 loads the
// values' matrix and stores the value row. Every kernel that reads the
// token starts after this one has completed (the rotation's dependent
// waits for it before it lets its own dependents launch).
#include <cstdint>

#include "kernels/decode_block_state.cuh"
#include "kernels/decode_params.h"
#include "kernels/element_access.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/query_rotation.cuh"
#include "kernels/split_states.cuh"
#include "kernels/step_append.cuh"

namespace kvforge::kernels::decode_attention_device {

inline constexpr int kRotationSlices = 4;

// kBits and kElement: the step's cache (kStepAppend only).
template <int D, bool kStepAppend = false, int kBits = 2, ElementType kElement = ElementType::kFloat32>
__global__ void __launch_bounds__(kRotationSlices * D)
    rotate_group_queries_kernel(const DecodeParams p, float* rotated,
                                const __grid_constant__ StepAppendParam<kStepAppend> step) {
  allow_dependent_launch();
  constexpr int kRows = D / kRotationSlices;
  const int kv_head = blockIdx.x, entry = blockIdx.y;
  const int j = threadIdx.x % D, slice = threadIdx.x / D;
  if constexpr (kStepAppend) {
    if (blockIdx.z == 1) {  // the value row alone
      auto& step_row = step_append_device::rotated_step_shared<D>();
      step_append_device::place_rotated_step_token(p, step, entry, step_row);
      const bool matrix = p.value_rotation.kind == RotationKind::kMatrix;
      float r[kRows];
      if (matrix) {
        const float* column = p.value_rotation.matrix + static_cast<int64_t>(kv_head) * D * D + slice * kRows * D + j;
#pragma unroll
        for (int i = 0; i < kRows; ++i) r[i] = column[i * D];
      }
      step_append_device::load_rotated_step_row<D, kElement>(p, step, entry, kv_head, 1, step_row);
      __syncthreads();
      if (matrix) step_append_device::rotate_step_row<D, kRotationSlices>(r, step_row);
      step_append_device::store_rotated_step_row<D, kBits, kElement>(p, step, kv_head, 1, matrix, step_row);
      return;
    }
  }
  __shared__ __align__(16) float raw[kMaxTensorCoreGroup][D];
  __shared__ float partial[kRotationSlices][kMaxTensorCoreGroup][D];
  const int group = p.num_heads / p.key_cache.layout.spec.kv_heads;
  const int64_t first = static_cast<int64_t>(entry) * p.num_heads + kv_head * group;
  const float* column = p.key_rotation.matrix + static_cast<int64_t>(kv_head) * D * D + slice * kRows * D + j;
  float r[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) r[i] = column[i * D];
  if constexpr (kStepAppend) {
    auto& step_row = step_append_device::rotated_step_shared<D>();
    step_append_device::place_rotated_step_token(p, step, entry, step_row);
    step_append_device::load_rotated_step_row<D, kElement>(p, step, entry, kv_head, 0, step_row);
  }
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) raw[i / D][i % D] = load_io(p.io, p.queries, first * D + i);
  __syncthreads();
  for (int h = 0; h < group; ++h) {
    const float* x = &raw[h][slice * kRows];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; i += 4) {
      const float4 q = *reinterpret_cast<const float4*>(x + i);
      sum = __fmaf_rn(q.w, r[i + 3], __fmaf_rn(q.z, r[i + 2], __fmaf_rn(q.y, r[i + 1], __fmaf_rn(q.x, r[i], sum))));
    }
    partial[slice][h][j] = sum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    const int h = i / D, d = i % D;
    float sum = partial[0][h][d];
#pragma unroll
    for (int s = 1; s < kRotationSlices; ++s) sum = __fadd_rn(sum, partial[s][h][d]);
    rotated[first * D + i] = sum;
  }
  if constexpr (kStepAppend) {  // the key row, from the same registers (the plan rotates the keys by a matrix)
    auto& step_row = step_append_device::rotated_step_shared<D>();
    step_append_device::rotate_step_row<D, kRotationSlices>(r, step_row);
    step_append_device::store_rotated_step_row<D, kBits, kElement>(p, step, kv_head, 0, true, step_row);
  }
}

}  // namespace kvforge::kernels::decode_attention_device
