#pragma once
// decode_merge_kernel<D, kParts, kHeads>: one block of merge_threads() per
// kHeads query heads of a KV head and sequence merges the non-empty split
// states of the decode kernels (SplitWorkspace; FlashInfer's merge_state),
// rotates the output back by the values' rotation and stores it in the io
// type (docs/runtime-layout.md 6.3 steps 4 and 5).
#include <cstdint>

#include "kernels/async_copy.cuh"
#include "kernels/decode_params.h"
#include "kernels/element_access.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/split_states.cuh"
#include "kernels/warp_reductions.cuh"

namespace kvforge::kernels::decode_attention_device {

// The merge's rounds: kParts groups of D threads, each summing every
// kParts-th state of a round of kParts * merge_per_part() states, whose
// rows are all loaded before the block knows their weights (one round trip
// to L2 for the states of a round, instead of one per 8 states of one fma
// chain). Four groups where the states are many (over 8) and the blocks at
// most one per multiprocessor (DecodePlan::wide_merge: batch 1's 64 splits
// and more), else one: a block of 4 D threads and its ~120 registers take a
// whole multiprocessor, which at batch 32 (1024 blocks) ran the merge in 8
// waves; the one-group blocks keep to 64 registers at head_dim 128 (eight
// blocks per multiprocessor: batch 32's in one wave).
inline constexpr int kMergeMaxParts = 4;
template <int kParts>
constexpr int merge_per_part() {
  return kParts == 1 ? 8 : 16;
}
// Query heads per merge block: where the output is rotated and the states
// fit one-group blocks, the four heads of a GQA group (a multiple of 4)
// share one block and each row of their R_v, which is read from L2 once per
// block: with one head a block, batch 8's 256 blocks read 16 MB of
// rotations, and the merge took 13.4 us instead of 5.3 without them (ncu,
// 32K tokens, H200).
inline constexpr int kMergeGroupHeads = 4;
// The value rotation's rows a warp of a one-group, one-head block holds at
// a time (lane l: columns l + 32 j; in 64 registers). The other blocks
// stage R_v in shared memory (merge_stages_rotation).
inline constexpr int kMergeMatrixRows = 4;
template <int D, int kParts, int kHeads = 1>
constexpr int merge_threads() {
  return D * kParts * kHeads;
}
template <int kParts, int kHeads>
constexpr int merge_min_blocks() {
  return kParts > 1 ? 1 : 8 / kHeads;
}
// Whether a block that rotates its output back stages the whole R_v of its
// KV head in shared memory (by cp.async, issued before it waits for the
// split kernels, so the copies overlap their tail) and rotates from there:
// blocks of several thread groups or heads (the wide merge at batch 1, the
// GQA group's four heads from batch 8). Their warps' dot products over rows
// held in registers had loaded the second half of each warp's rows after
// the wait (an L2 round trip on the critical path) and reduced each (row,
// head) by a 5-shuffle warp sum. The one-group, one-head blocks keep those
// register rows: at batch 32 their 1024 blocks would read 64 MB of R_v
// into shared memory and run in waves of three.
template <int kParts, int kHeads>
constexpr bool merge_stages_rotation() {
  return kParts * kHeads > 1;
}
// The staged rotation's dynamic shared memory: R_v (D x D float32, each
// row's 16-byte chunks XOR-swizzled by the row's index mod 8) and the
// column groups' partial dot products (merge_threads() / D groups of
// kHeads x D).
template <int D, int kParts, int kHeads>
constexpr int merge_rotation_shared_bytes() {
  constexpr int kGroups = merge_threads<D, kParts, kHeads>() / D;
  return merge_stages_rotation<kParts, kHeads>()
             ? static_cast<int>(sizeof(float)) * (D * D + kGroups * kHeads * D)
             : 0;
}
// Chunk c (4 floats) of row r of the staged R_v: at chunk c ^ (r mod 8) of
// that row, so that 8 lanes reading chunk c of 8 consecutive rows (one
// 16-byte load's phase) hit 8 different groups of 4 banks.
template <int D>
__device__ inline int staged_rotation_offset(int row, int chunk) {
  return row * D + 4 * (chunk ^ (row & 7));
}

// o = o' R_v^T for the kHeads heads of `merged_rows` from the R_v staged
// in `staged` (merge_rotation_shared_bytes; its copies still in flight),
// into the output from element `output`: the merge block's kThreads
// threads together (see decode_merge_kernel).
template <int D, int kThreads, int kHeads>
__device__ inline void rotate_from_staged(const DecodeParams& p, float* staged, const float (&merged_rows)[kHeads][D],
                                          int64_t output) {
  constexpr int kGroups = kThreads / D, kGroupChunks = D / 4 / kGroups;
  static_assert(kThreads % D == 0 && kGroups > 1 && (D / 4) % kGroups == 0 && kHeads * D <= kThreads,
                "the staged rotation's column groups split the row's chunks evenly");
  float* const partial = staged + D * D;  // [kGroups][kHeads][D]
  copy_async_wait<0>();
  __syncthreads();  // R_v and o' (merged_rows) complete
  const int row = threadIdx.x % D, group = threadIdx.x / D;
  float dot[kHeads];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) dot[h] = 0.0f;
#pragma unroll
  for (int c = group * kGroupChunks; c < (group + 1) * kGroupChunks; ++c) {
    const float4 m = *reinterpret_cast<const float4*>(staged + staged_rotation_offset<D>(row, c));
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      const float4 o = *reinterpret_cast<const float4*>(&merged_rows[h][4 * c]);
      dot[h] = __fmaf_rn(o.w, m.w, __fmaf_rn(o.z, m.z, __fmaf_rn(o.y, m.y, __fmaf_rn(o.x, m.x, dot[h]))));
    }
  }
#pragma unroll
  for (int h = 0; h < kHeads; ++h) partial[(group * kHeads + h) * D + row] = dot[h];
  __syncthreads();
  if (threadIdx.x < kHeads * D) {
    const int h = threadIdx.x / D, r = threadIdx.x % D;
    float sum = partial[h * D + r];
#pragma unroll
    for (int g = 1; g < kGroups; ++g) sum = __fadd_rn(sum, partial[(g * kHeads + h) * D + r]);
    store_io(p.io, p.output, output + h * D + r, sum);
  }
}

// One block of merge_threads<D, kParts, kHeads>() threads per kHeads query
// heads (of one KV head) and sequence entry: the non-empty split states
// merged (M = max m_k, L = sum l_k e^(m_k - M), o' = sum acc_k e^(m_k - M) /
// L; FlashInfer's merge_state, in its own order: each group's fma chain over
// its states, then the groups in order), then o = o' R_v^T. Staged
// (merge_stages_rotation): thread (g, r) of the block's D-thread groups
// sums columns [g D / G, (g + 1) D / G) of row r of the staged R_v with
// each head's o' (4-column chunks in order), and the G partial sums of
// (head, r) are added in group order. Else each row of R_v is one warp's
// dot products with o' (its first kMergeMatrixRows rows loaded before the
// split kernels end). Launched as their dependent, the merge runs its
// preamble (the rows' loads or copies) while they do.
template <int D, int kParts, int kHeads>
__global__ void __launch_bounds__(merge_threads<D, kParts, kHeads>(), merge_min_blocks<kParts, kHeads>())
    decode_merge_kernel(const DecodeParams p, const SplitWorkspace workspace) {
  constexpr int kHeadThreads = merge_threads<D, kParts>(), kHeadWarps = kHeadThreads / kWarpSize;
  constexpr int kThreads = kHeadThreads * kHeads, kWarps = kThreads / kWarpSize;
  constexpr int kPerPart = merge_per_part<kParts>(), kRound = kParts * kPerPart;
  constexpr int kRowsPerWarp = D / kWarps, kRowWords = D / kWarpSize;
  constexpr bool kStaged = merge_stages_rotation<kParts, kHeads>();
  // The register rows (one-group, one-head blocks only): D / 32 warps of
  // 32 rows each, kMergeMatrixRows at a time.
  constexpr int kMatrixRows = kMergeMatrixRows;
  static_assert(kStaged || (D % kWarps == 0 && kRowsPerWarp % kMatrixRows == 0),
                "the rotation's rows split evenly over the warps");
  static_assert(kHeadThreads >= kRound, "a round's weights take one thread each");
  static_assert(kHeads == 1 || kParts == 1, "grouped heads with one thread group each");
  __shared__ float weights[kHeads][kRound];
  __shared__ float parts[kHeads][kParts][D];
  __shared__ float reduce[kHeads][kHeadWarps];
  __shared__ __align__(16) float merged_rows[kHeads][D];
  const int first_head = blockIdx.x * kHeads, entry = blockIdx.y, t = threadIdx.x;
  const int local = t / kHeadThreads, ht = t % kHeadThreads;  // the thread's head in the block, its index there
  const int head = first_head + local;
  const int d = ht % D, part = ht / D, warp = t / kWarpSize, head_warp = ht / kWarpSize, lane = t % kWarpSize;
  const Rotation& rotation = p.value_rotation;
  const bool rotated = rotation.kind == RotationKind::kMatrix;
  const int kv_head = first_head / (p.num_heads / p.key_cache.layout.spec.kv_heads);
  const float* matrix = rotation.matrix + static_cast<int64_t>(kv_head) * D * D;
  // Rows [first_row, first_row + kMatrixRows) of the rotation in the lanes'
  // columns: the split kernels do not write them.
  float matrix_rows[kMatrixRows][kRowWords];
  auto load_matrix_rows = [&](int first_row) {
#pragma unroll
    for (int r = 0; r < kMatrixRows; ++r) {
#pragma unroll
      for (int j = 0; j < kRowWords; ++j) matrix_rows[r][j] = matrix[(first_row + r) * D + lane + kWarpSize * j];
    }
  };
  extern __shared__ __align__(16) uint8_t dynamic_shared[];
  float* const staged = reinterpret_cast<float*>(dynamic_shared);
  if (rotated) {
    if constexpr (kStaged) {
      constexpr int kChunks = D / 4;
      for (int i = t; i < D * kChunks; i += kThreads) {
        const int row = i / kChunks, chunk = i % kChunks;
        copy_async<16>(staged + staged_rotation_offset<D>(row, chunk), matrix + row * D + 4 * chunk);
      }
      copy_async_commit();
    } else {
      load_matrix_rows(warp * kRowsPerWarp);
    }
  }
  wait_for_prerequisite_grid();  // launched as a dependent: the split states are complete from here on
  const int64_t states = workspace.max_splits;
  const int64_t base = (static_cast<int64_t>(entry) * p.num_heads + head) * states;
  float sum = 0.0f, out = 0.0f, max = -INFINITY;
  // Every head of the block has the same states (workspace.max_splits): the
  // rounds and their __syncthreads are the block's.
  for (int64_t round = 0; round < states; round += kRound) {
    // Every state's row of the round is loaded (an empty split's may be
    // anything: its zero weight's select keeps it out).
    float rows[kPerPart];
#pragma unroll
    for (int u = 0; u < kPerPart; ++u) {
      const int64_t k = round + part + kParts * u;
      rows[u] = k < states ? workspace.acc[(base + k) * D + d] : 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    if (ht < kRound && round + ht < states) {
      m = workspace.max_sum[2 * (base + round + ht)];
      l = workspace.max_sum[2 * (base + round + ht) + 1];
    }
    if (round == 0) {
      // The maximum over every state (a round's with the loads above).
      float all = m;
      for (int64_t k = kRound + ht; k < states; k += kHeadThreads) all = fmaxf(all, workspace.max_sum[2 * (base + k)]);
      all = warp_max(all);
      if (lane == 0) reduce[local][head_warp] = all;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < kHeadWarps; ++w) max = fmaxf(max, reduce[local][w]);
    }
    __syncthreads();  // the previous round's weights (and the reduction) are read
    if (ht < kRound) {
      const float weight = m != -INFINITY ? expf(m - max) : 0.0f;
      if (m != -INFINITY) sum = __fmaf_rn(l, weight, sum);
      weights[local][ht] = weight;
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kPerPart; ++u) {
      const float weight = weights[local][part + kParts * u];
      out = weight != 0.0f ? __fmaf_rn(rows[u], weight, out) : out;
    }
  }
  sum = warp_sum(sum);
  parts[local][part][d] = out;
  __syncthreads();  // reduce's maxima are read
  if (lane == 0) reduce[local][head_warp] = sum;
  __syncthreads();
  sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kHeadWarps; ++w) sum += reduce[local][w];
  if (ht < D) {
    float merged = parts[local][0][ht];
#pragma unroll
    for (int q = 1; q < kParts; ++q) merged += parts[local][q][ht];
    merged = __fdiv_rn(merged, sum);
    if (!rotated) {
      store_io(p.io, p.output, (static_cast<int64_t>(entry) * p.num_heads + head) * D + ht, merged);
    } else {
      merged_rows[local][ht] = merged;
    }
  }
  if (!rotated) return;
  if constexpr (kStaged) {
    rotate_from_staged<D, kThreads, kHeads>(p, staged, merged_rows,
                                             (static_cast<int64_t>(entry) * p.num_heads + first_head) * D);
  } else {
    __syncthreads();  // o' in merged_rows: every warp reads all of it
    float merged[kHeads][kRowWords];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
#pragma unroll
      for (int j = 0; j < kRowWords; ++j) merged[h][j] = merged_rows[h][lane + kWarpSize * j];
    }
    const int64_t output = (static_cast<int64_t>(entry) * p.num_heads + first_head) * D;
#pragma unroll 1
    for (int first_row = warp * kRowsPerWarp; first_row < (warp + 1) * kRowsPerWarp; first_row += kMatrixRows) {
      if (first_row != warp * kRowsPerWarp) load_matrix_rows(first_row);
#pragma unroll
      for (int r = 0; r < kMatrixRows; ++r) {
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          float dot = 0.0f;
#pragma unroll
          for (int j = 0; j < kRowWords; ++j) dot = __fmaf_rn(merged[h][j], matrix_rows[r][j], dot);
          dot = warp_sum(dot);
          if (lane == 0) store_io(p.io, p.output, output + h * D + first_row + r, dot);
        }
      }
    }
  }
}

}  // namespace kvforge::kernels::decode_attention_device
