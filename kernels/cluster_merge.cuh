#pragma once
// The split states of one (KV head, sequence) merged inside the
// thread-block cluster of its int8 blocks (DecodePlan::cluster_merge): the
// decode's splits of a (KV head, sequence) are the consecutive blocks
// 0..S-1 along x, launched as one cluster of S <= kMaxClusterBlocks
// blocks, so that each block keeps its split state in its own shared
// memory and the cluster merges them there (distributed shared memory)
// instead of writing them to the workspace for decode_merge_kernel: no
// second kernel, no states through L2. Only for states the int8 kernel
// writes alone (no exact ranges' blocks) and outputs not rotated back.
//
// The arithmetic is the merge kernel's in log2 units (the int8 kernel's
// states are): M = max m_k, L = sum l_k 2^(m_k - M), o = sum acc_k
// 2^(m_k - M) / L, a block's warps joined first as write_block_state joins
// them; each block of the cluster writes an S-th of the group's outputs.
#include <cooperative_groups.h>

#include "kernels/decode_block_state.cuh"
#include "kernels/decode_params.h"
#include "kernels/element_access.cuh"
#include "kernels/split_states.cuh"
#include "kernels/warp_reductions.cuh"

namespace kvforge::kernels::decode_attention_device {

inline constexpr int kMaxClusterBlocks = 8;  // the portable cluster size

// What a block shows its cluster (max and sum per head; its value sums are
// `merged`, below) and its own scratch: over the block's query rows once
// the walk is done with them (int8 kernel: Shared::query).
template <int kWarps>
struct ClusterMergeShared {
  float max[kMaxTensorCoreGroup], sum[kMaxTensorCoreGroup];    // log2 units; an empty split's max -inf
  float rescale[kMaxTensorCoreGroup][kWarps];                   // the block's warps' weights
  float weight[kMaxClusterBlocks][kMaxTensorCoreGroup];         // the cluster's blocks' weights
  float total[kMaxTensorCoreGroup];                             // L of each head
};

// The block's part of the cluster merge, every thread of every block of the
// cluster calling it (it synchronizes the cluster twice). `has_tokens`: the
// block walked tokens, so that its warps' states (state_max, state_sum,
// out: write_block_state's shapes, after a __syncthreads) are joined into
// `merged` [head][D] (which may be out's first warp's rows: each element is
// read and written by one thread); an empty split shows a max of -inf and
// neither reads out nor writes merged. Every block's `merged` and `shared`
// lie at the same shared-memory offsets (the same kernel). The output rows
// of the group's `group` heads start at row `first_row` of `output` (`io`
// elements). Not inlined, and given scalars: the decode kernels' walks run
// at their register limit, and this tail's code inlined beside the walk
// cost the int8 kernel a spill in its step loop.
template <int D, int kWarps>
__device__ __noinline__ void merge_in_cluster(ElementType io, void* output, int64_t first_row, int group,
                                              bool has_tokens, ClusterMergeShared<kWarps>* shared_state,
                                              const float (*state_max)[kMaxTensorCoreGroup],
                                              const float (*state_sum)[kMaxTensorCoreGroup],
                                              const float (*out)[kMaxTensorCoreGroup][D], float (*merged)[D]) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  ClusterMergeShared<kWarps>& shared = *shared_state;
  const int t = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  if (!has_tokens) {
    if (t < group) shared.max[t] = -INFINITY, shared.sum[t] = 0.0f;
  } else {
    if (t < group) {
      float sum;
      shared.max[t] = join_warp_states<kWarps>(state_max, state_sum, t, sum, shared.rescale[t]);
      shared.sum[t] = sum;
    }
    __syncthreads();
    for (int i = t; i < group * D; i += threads) {
      const int h = i / D, d = i % D;
      float value = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = shared.rescale[h][w];
        value = weight != 0.0f ? __fmaf_rn(out[w][h][d], weight, value) : value;
      }
      merged[h][d] = value;
    }
  }
  cluster.sync();  // every block's state written and visible to the cluster
  const int blocks = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  if (t < group) {
    float m[kMaxClusterBlocks], l[kMaxClusterBlocks];
#pragma unroll
    for (int q = 0; q < kMaxClusterBlocks; ++q) {
      if (q < blocks) {
        const ClusterMergeShared<kWarps>* other = cluster.map_shared_rank(&shared, q);
        m[q] = other->max[t], l[q] = other->sum[t];
      }
    }
    float all = -INFINITY;
#pragma unroll
    for (int q = 0; q < kMaxClusterBlocks; ++q) all = q < blocks ? fmaxf(all, m[q]) : all;
    float total = 0.0f;
#pragma unroll
    for (int q = 0; q < kMaxClusterBlocks; ++q) {
      const float weight = q < blocks && m[q] != -INFINITY ? exp2f(m[q] - all) : 0.0f;
      if (weight != 0.0f) total = __fmaf_rn(l[q], weight, total);
      shared.weight[q][t] = weight;
    }
    shared.total[t] = total;
  }
  __syncthreads();
  // This block's S-th of the group's outputs (rows h, channels d, as the
  // output is laid out), in the splits' order.
  const int elements = group * D, share = (elements + blocks - 1) / blocks;
  const int end = (rank + 1) * share < elements ? (rank + 1) * share : elements;
  for (int i = rank * share + t; i < end; i += threads) {
    const int h = i / D, d = i % D;
    // Every block's element loaded at once (an empty split's not at all).
    float x[kMaxClusterBlocks];
#pragma unroll
    for (int q = 0; q < kMaxClusterBlocks; ++q) {
      x[q] = q < blocks && shared.weight[q][h] != 0.0f ? *cluster.map_shared_rank(&merged[h][d], q) : 0.0f;
    }
    float value = 0.0f;
#pragma unroll
    for (int q = 0; q < kMaxClusterBlocks; ++q) {
      const float weight = shared.weight[q][h];
      value = weight != 0.0f ? __fmaf_rn(x[q], weight, value) : value;
    }
    store_io(io, output, (first_row + h) * D + d, __fdiv_rn(value, shared.total[h]));
  }
  cluster.sync();  // no block leaves while the others read its shared memory
}

}  // namespace kvforge::kernels::decode_attention_device
