#pragma once
// What every split decode kernel's block does around its walk (the bf16,
// int8, lookup and exact kernels): the GQA group's queries loaded and
// rotated, the tokens the block takes, and its warps' online-softmax
// states joined into the one split state decode_merge_kernel (or the
// cluster merge) reads.
#include <cmath>
#include <cstdint>

#include "kernels/decode_params.h"
#include "kernels/element_access.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/query_rotation.cuh"
#include "kernels/split_states.cuh"

namespace kvforge::kernels::decode_attention_device {

inline constexpr int kMaxTensorCoreGroup = 8;  // query heads per KV head: the mma's N

// The GQA group's queries (state_base + h, h < group) into `raw`, rotated by
// the keys' rotation into `query` (float32, 6.3 step 1; heads past the group
// are the mma's padding: zero), and `out_count` floats of `out` zeroed; the
// block's threads together, synchronized on return. kRowsInFlight:
// rotate_group_queries's. With `rotated` (SplitWorkspace::queries) the
// queries are rotate_group_queries_kernel's (rotate_queries_kernel.cuh):
// the kernel, launched as its programmatic dependent, waits for it here,
// and lets its own dependent launch only then (that one reads them too,
// and what that kernel's step append stored, without waiting: its
// prerequisite is this kernel). kRowLoads: the raw queries by load_rows
// (one round trip), and where the keys have no rotation straight into
// `query` (`raw` untouched); else one element a thread and iteration (the
// lookup and bf16 kernels: at their register cap, ptxas spilled in their
// main loops with the row loads in the prologue).
// `before_sync()`: run by every thread after its loads and before the first
// barrier (a decoding step's append stores its token there, its own loads
// issued before this call: their round trips overlap the queries').
struct NothingBeforeSync {
  __device__ void operator()() const {}
};
template <int D, int kRowsInFlight = 16, bool kRowLoads = false, typename BeforeSync = NothingBeforeSync>
__device__ inline void load_group_queries(const DecodeParams& p, const float* rotated, int64_t state_base, int group,
                                          int kv_head, float (&query)[kMaxTensorCoreGroup][D],
                                          float (&raw)[kMaxTensorCoreGroup][D], float* out, int out_count,
                                          BeforeSync before_sync = {}) {
  for (int i = threadIdx.x; i < out_count; i += blockDim.x) out[i] = 0;
  if (rotated != nullptr) {
    wait_for_prerequisite_grid();
    allow_dependent_launch();
    load_rows<D>(ElementType::kFloat32, rotated, state_base, group, kMaxTensorCoreGroup, &query[0][0]);
    before_sync();
    __syncthreads();
    return;
  }
  if constexpr (kRowLoads) {
    // Keys without a rotation: the raw queries are the queries.
    const bool rotate = p.key_rotation.kind != RotationKind::kNone;
    load_rows<D>(p.io, p.queries, state_base, group, kMaxTensorCoreGroup, rotate ? &raw[0][0] : &query[0][0]);
    before_sync();
    __syncthreads();
    if (!rotate) return;
  } else {
    for (int i = threadIdx.x; i < kMaxTensorCoreGroup * D; i += blockDim.x) {
      const int h = i / D, d = i % D;
      raw[h][d] = h < group ? load_io(p.io, p.queries, (state_base + h) * D + d) : 0.0f;
    }
    before_sync();
    __syncthreads();
  }
  rotate_group_queries<D, kRowsInFlight>(p.key_rotation, kv_head, group, kMaxTensorCoreGroup, &raw[0][0],
                                         &query[0][0]);
  __syncthreads();
}

// Head h's state over a block's kWarps warps' (max and sum in log2 units;
// a warp without tokens, m_w = -inf, weighs 0): its max m, returned, its
// sum and each warp's weight 2^(m_w - m) into rescale[w].
template <int kWarps>
__device__ inline float join_warp_states(const float (*state_max)[kMaxTensorCoreGroup],
                                         const float (*state_sum)[kMaxTensorCoreGroup], int h, float& sum,
                                         float* rescale) {
  float m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, state_max[w][h]);
  sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const float weight = state_max[w][h] == -INFINITY ? 0.0f : exp2f(state_max[w][h] - m);
    if (weight != 0.0f) sum = __fmaf_rn(state_sum[w][h], weight, sum);
    rescale[w] = weight;
  }
  return m;
}

// The block's split state from its kWarps warps' (max and sum in log2
// units, turned back into natural units for the merge kernel; each warp's
// output rows): the block's threads together, after a __syncthreads. A
// head's warp weights 2^(m_w - m) are computed once, by one thread per
// head, not once per channel; a warp without tokens (m_w = -inf) weighs 0
// and its rows are skipped.
template <int D, int kWarps>
__device__ inline void write_block_state(const SplitWorkspace& workspace, int64_t state_base, int split, int group,
                                         const float (&state_max)[kWarps][kMaxTensorCoreGroup],
                                         const float (&state_sum)[kWarps][kMaxTensorCoreGroup],
                                         const float (&out)[kWarps][kMaxTensorCoreGroup][D]) {
  __shared__ float rescale[kMaxTensorCoreGroup][kWarps];
  if (static_cast<int>(threadIdx.x) < group) {
    const int h = threadIdx.x;
    float sum;
    const float m = join_warp_states<kWarps>(state_max, state_sum, h, sum, rescale[h]);
    const int64_t index = (state_base + h) * workspace.max_splits + split;
    workspace.max_sum[2 * index] = m == -INFINITY ? -INFINITY : m * 0.6931471805599453f;  // log2 units to natural
    workspace.max_sum[2 * index + 1] = sum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    const int h = i / D, d = i % D;
    float value = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = rescale[h][w];
      value = weight != 0.0f ? __fmaf_rn(out[w][h][d], weight, value) : value;
    }
    workspace.acc[((state_base + h) * workspace.max_splits + split) * D + d] = value;
  }
}

struct TensorCoreSplits {
  int64_t tokens_per_split = 0;  // a multiple of kTensorCoreWarps * kTileRows
  // The int8 kernel's splits of a (KV head, sequence) are one thread-block
  // cluster that merges their states and writes the output
  // (DecodePlan::cluster_merge, kernels/cluster_merge.cuh).
  bool cluster_merge = false;
};

// The quantized tokens [first, last) of a tensor-core block (context split
// `split` of KV head `kv_head` of batch entry `entry`), its GQA group size,
// and the index of its first query head's state (entry * H + kv_head * group).
struct BlockTokens {
  int64_t first = 0, last = 0, state_base = 0;
  int group = 0;
};

__device__ inline BlockTokens block_tokens(const DecodeParams& p, const TensorCoreSplits& splits, int split, int kv_head,
                                           int entry) {
  BlockTokens b;
  b.group = p.num_heads / p.key_cache.layout.spec.kv_heads;
  int64_t range_begin, range_end;
  tensor_core_range(p, entry_length(p, entry), range_begin, range_end);
  b.first = range_begin + static_cast<int64_t>(split) * splits.tokens_per_split;
  b.last = b.first + splits.tokens_per_split < range_end ? b.first + splits.tokens_per_split : range_end;
  b.state_base = static_cast<int64_t>(entry) * p.num_heads + static_cast<int64_t>(kv_head) * b.group;
  return b;
}

// An empty split's states (one per query head of the group): a max of -inf,
// which the merge skips.
__device__ inline void write_empty_state(const SplitWorkspace& workspace, const BlockTokens& block, int split) {
  if (threadIdx.x < block.group) {
    workspace.max_sum[2 * ((block.state_base + threadIdx.x) * workspace.max_splits + split)] = -INFINITY;
  }
}

}  // namespace kvforge::kernels::decode_attention_device
