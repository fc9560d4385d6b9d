#pragma once
// The split states of one (KV head, sequence) merged by the last of its
// int8 blocks to finish (DecodePlan::last_split_merge): each block writes
// its state to the workspace as for decode_merge_kernel, then takes a
// ticket from the pair's counter (an atomic increment that wraps to zero
// at the last ticket, so the counter is zero again for the next launch);
// the block that draws the last ticket merges every state of the pair and
// writes the group's outputs. No second kernel: the merges of pairs that
// finish early run beside the others' walks, and only the last pair's is
// on the call's tail. Only for states the int8 kernel writes alone (no
// exact ranges' blocks) and outputs not rotated back.
//
// Ordering: the block's threads store their parts of the state, a block
// barrier, then one thread's release-acquire increment at device scope
// publishes them (cumulatively) with the ticket; the last block's acquire
// of that counter, then a block barrier, orders its loads of the other
// blocks' states after their stores (the loads bypass L1 all the same).
//
// The arithmetic is the merge kernel's (natural units, as write_block_state
// stores them): M = max m_k, L = sum l_k e^(m_k - M), o = sum_k acc_k
// e^(m_k - M) / L, the states in split order, an empty split (m = -inf)
// skipped.
#include "kernels/decode_attention_kernel.cuh"
#include "kernels/decode_tensor_core_kernel.cuh"
#include "kernels/split_plan.h"

namespace kvforge::kernels::decode_attention_device {

// The last block's scratch (int8 kernel: over its query rows, free once
// the walk is done with them).
struct LastSplitShared {
  float weight[kLastSplitMergeMaxStates][kMaxTensorCoreGroup];  // e^(m_k - M) per state and head; 0: skipped
  float total[kMaxTensorCoreGroup];                          // L of each head
  unsigned last;                                             // this block drew the last ticket
};

// Increments *counter at device scope with release and acquire semantics,
// wrapping to 0 after `last`; returns the value before.
__device__ inline unsigned take_ticket(unsigned* counter, unsigned last) {
  unsigned before;
  asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;\n" : "=r"(before) : "l"(counter), "r"(last) : "memory");
  return before;
}

// The block's ticket and, if it is the last of the pair's `states`, the
// merge: every thread of the block calls it after the block's state is
// stored (write_block_state or write_empty_state). The group's `group`
// heads' states start at state row `state_base` (as their output rows do);
// `io` elements of output. Not inlined, and given scalars: the int8
// kernel's walk runs at its register limit (as merge_in_cluster).
template <int D>
__device__ __noinline__ void merge_if_last_split(const float* max_sum, const float* acc, int states,
                                                 unsigned* ticket, ElementType io, void* output, int64_t state_base,
                                                 int group, LastSplitShared* shared_state) {
  LastSplitShared& shared = *shared_state;
  const int t = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  __syncthreads();  // every thread's part of the state is stored
  if (t == 0) {
    const unsigned before = take_ticket(ticket, static_cast<unsigned>(states - 1));
    // A counter that was not zero when the launch began (a workspace not
    // cleared: DecodeParams::workspace) would merge too early or never.
    if (before >= static_cast<unsigned>(states)) __trap();
    shared.last = before == static_cast<unsigned>(states - 1) ? 1u : 0u;
  }
  __syncthreads();
  if (shared.last == 0) return;
  if (t < group) {
    const float* row = max_sum + 2 * (state_base + t) * states;
    float m[kLastSplitMergeMaxStates], l[kLastSplitMergeMaxStates];
#pragma unroll
    for (int k = 0; k < kLastSplitMergeMaxStates; ++k) {
      m[k] = k < states ? __ldcg(row + 2 * k) : -INFINITY;
      l[k] = k < states ? __ldcg(row + 2 * k + 1) : 0.0f;
    }
    float all = -INFINITY;
#pragma unroll
    for (int k = 0; k < kLastSplitMergeMaxStates; ++k) all = fmaxf(all, m[k]);
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < kLastSplitMergeMaxStates; ++k) {
      const float weight = m[k] != -INFINITY ? expf(m[k] - all) : 0.0f;
      if (weight != 0.0f) total = __fmaf_rn(l[k], weight, total);
      shared.weight[k][t] = weight;
    }
    shared.total[t] = total;
  }
  __syncthreads();
  // Four consecutive channels of one head a thread (16-byte loads of each
  // state's row; D is a multiple of 4), every state's loaded at once.
  const int quads = group * D / 4;
  for (int i = t; i < quads; i += threads) {
    const int h = 4 * i / D, d = 4 * i % D;
    const float* rows = acc + (state_base + h) * states * D + d;
    float4 x[kLastSplitMergeMaxStates];
#pragma unroll
    for (int k = 0; k < kLastSplitMergeMaxStates; ++k) {
      x[k] = k < states && shared.weight[k][h] != 0.0f ? __ldcg(reinterpret_cast<const float4*>(rows + k * D))
                                                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float4 value = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int k = 0; k < kLastSplitMergeMaxStates; ++k) {
      const float weight = k < states ? shared.weight[k][h] : 0.0f;
      if (weight != 0.0f) {
        value.x = __fmaf_rn(x[k].x, weight, value.x);
        value.y = __fmaf_rn(x[k].y, weight, value.y);
        value.z = __fmaf_rn(x[k].z, weight, value.z);
        value.w = __fmaf_rn(x[k].w, weight, value.w);
      }
    }
    const float total = shared.total[h];
    const int64_t out = (state_base + h) * D + d;
    store_io(io, output, out, __fdiv_rn(value.x, total));
    store_io(io, output, out + 1, __fdiv_rn(value.y, total));
    store_io(io, output, out + 2, __fdiv_rn(value.z, total));
    store_io(io, output, out + 3, __fdiv_rn(value.w, total));
  }
}

}  // namespace kvforge::kernels::decode_attention_device
