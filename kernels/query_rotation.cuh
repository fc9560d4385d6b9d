#pragma once
// The queries rotated by the keys' rotation (docs/runtime-layout.md 6.3
// step 1, float32) inside a decode kernel's block: one element, or a GQA
// group's rows with the matrix read once for four heads.
#include <cstdint>

#include "kernels/decode_params.h"

namespace kvforge::kernels::decode_attention_device {

// Element j of query q (D floats) rotated by the keys' rotation of KV head
// `kv_head` (docs/runtime-layout.md 6.3 step 1, float32): a matrix as fmas
// over i ascending, pair angles with the float64 tables rounded to float32.
template <int D>
__device__ inline float rotated_query_element(const Rotation& rotation, const float* q, int kv_head, int j) {
  if (rotation.kind == RotationKind::kMatrix) {
    const float* matrix = rotation.matrix + static_cast<int64_t>(kv_head) * D * D;
    float out = 0.0f;
    // The fmas stay one chain in k order (6.3's arithmetic); unrolled, the
    // matrix loads of 16 steps are in flight at once instead of one load
    // per fma of the chain (every block rotates its group's queries, also
    // the exact ranges' short ones).
#pragma unroll 16
    for (int k = 0; k < D; ++k) out = __fmaf_rn(q[k], matrix[k * D + j], out);
    return out;
  }
  if (rotation.kind == RotationKind::kPairAngles) {
    constexpr int kHalf = D / 2;
    const int pair = j % kHalf;
    const float c = static_cast<float>(rotation.pair_cos[kv_head * kHalf + pair]);
    const float s = static_cast<float>(rotation.pair_sin[kv_head * kHalf + pair]);
    const float a = q[pair], b = q[pair + kHalf];
    return j < kHalf ? __fmaf_rn(a, c, -__fmul_rn(b, s)) : __fmaf_rn(a, s, __fmul_rn(b, c));
  }
  return q[j];
}

// The GQA group's queries rotated by the keys' rotation of `kv_head`:
// query[h * D + j] = rotated_query_element of raw[h * D ...] for h < group
// (raw: rows of D floats in shared memory, 16-byte aligned; read up to the
// next multiple of 4 rows), 0 for group <= h < heads (an mma's padding).
// The block's threads together; the caller synchronizes. A matrix column
// is read once for four heads, whose sums (each rotated_query_element's one
// fma chain in k order) run side by side: each block rotates its group's
// queries, also the exact ranges' blocks of 64 tokens, where one chain per
// element was half of their time. kRowsInFlight rows' loads are issued
// together: each batch is a round trip to L2, the rotation's latency
// (D / kRowsInFlight of them), and costs kRowsInFlight registers, which a
// kernel with registers to spare before its main loop gives (the int8
// kernel: 64, 2 round trips at head_dim 128).
template <int D, int kRowsInFlight = 16>
__device__ inline void rotate_group_queries(const Rotation& rotation, int kv_head, int group, int heads,
                                            const float* raw, float* query) {
  for (int i = group * D + static_cast<int>(threadIdx.x); i < heads * D; i += blockDim.x) query[i] = 0.0f;
  if (rotation.kind != RotationKind::kMatrix) {
    for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
      query[i] = rotated_query_element<D>(rotation, raw + (i / D) * D, kv_head, i % D);
    }
    return;
  }
  constexpr int kHeads = 4;  // per thread
  static_assert(D % kRowsInFlight == 0 && kRowsInFlight % 4 == 0, "whole batches of rows");
  const float* matrix = rotation.matrix + static_cast<int64_t>(kv_head) * D * D;
  const int units = (group + kHeads - 1) / kHeads * D;
  for (int unit = threadIdx.x; unit < units; unit += blockDim.x) {
    const int j = unit % D, first_head = unit / D * kHeads;
    const float* rows = raw + first_head * D;
    float sum[kHeads] = {0.0f, 0.0f, 0.0f, 0.0f};
    // kRowsInFlight rows' loads before their fmas: a row's fmas wait on its
    // loads and the next rows' loads issue after those fmas, so each batch
    // is a round trip to L2 (8 rows a batch had made 16 per block, the
    // preamble's longest chain where the keys are rotated).
#pragma unroll 1
    for (int k0 = 0; k0 < D; k0 += kRowsInFlight) {
      float r[kRowsInFlight];
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) r[i] = matrix[(k0 + i) * D + j];
#pragma unroll
      for (int i = 0; i < kRowsInFlight; i += 4) {
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          const float4 x = *reinterpret_cast<const float4*>(rows + h * D + k0 + i);
          sum[h] = __fmaf_rn(x.w, r[i + 3], __fmaf_rn(x.z, r[i + 2], __fmaf_rn(x.y, r[i + 1], __fmaf_rn(x.x, r[i], sum[h]))));
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (first_head + h < group) query[(first_head + h) * D + j] = sum[h];
    }
  }
}

}  // namespace kvforge::kernels::decode_attention_device
