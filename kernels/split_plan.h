#pragma once
// How many context splits the tensor-core decode kernels cut the longest
// sequence into, and how wide the merge's blocks are (plan_decode_attention):
// host arithmetic, tested on the CPU (tests/test_split_plan.cpp).
//
// A block's time is modeled as its tokens plus a fixed cost (its queries
// and key operands, its state written for the merge: kSplitOverheadTokens
// tokens' worth), and the blocks run in waves of the device's resident
// blocks. At batch 32 on 8 KV heads (256 blocks per split) and 528 resident
// blocks, two splits fill one wave where one would leave half the device
// idle; at batch 8 (64 per split), 2048 blocks of 256 tokens cost more than
// 512 of 1024 (measured on the H200: 171 against 146 us at 32K).
#include <algorithm>
#include <cstdint>

namespace kvforge::kernels {

inline constexpr int64_t kSplitOverheadTokens = 512;

// Waves times a block's modeled time, for `splits` splits of `longest`
// tokens with `per_split` blocks each and `resident` blocks per wave.
inline double split_time(int64_t longest, int64_t per_split, int64_t resident, int64_t splits) {
  const int64_t waves = (per_split * splits + resident - 1) / resident;
  const int64_t tokens = (longest + splits - 1) / splits;
  return static_cast<double>(waves) * static_cast<double>(tokens + kSplitOverheadTokens);
}

// The number of splits in [1, max_splits] of least split_time; ties go to
// fewer splits (fewer states to merge).
inline int64_t splits_for_whole_waves(int64_t longest, int64_t per_split, int64_t resident, int64_t max_splits) {
  int64_t best = 1;
  double best_time = split_time(longest, per_split, resident, 1);
  for (int64_t splits = 2; splits <= max_splits; ++splits) {
    const double time = split_time(longest, per_split, resident, splits);
    if (time < best_time) best = splits, best_time = time;
  }
  return best;
}

// Whether the merge's blocks take four groups of threads
// (DecodePlan::wide_merge): more `states` per query head than a one-group
// block loads in a round (`round_states`), and its `blocks` (query heads
// times sequences) at most one per multiprocessor, since a four-group block
// takes a whole one (at batch 32, 1024 of them had run in 8 waves).
inline bool wide_merge(int64_t states, int64_t blocks, int64_t multiprocessors, int64_t round_states) {
  return states > round_states && blocks <= multiprocessors;
}

// Query heads per merge block (DecodePlan::merge_heads): `group_heads`
// (kMergeGroupHeads, 4) heads of one KV head share a one-group block where
// the output is rotated back (R_v of the KV head read from L2 once for
// them, not once per head) and `group` (query heads per KV head) is a
// multiple of them; else one.
inline int32_t merge_heads(bool rotated_output, bool wide, int64_t group, int32_t group_heads) {
  return rotated_output && !wide && group % group_heads == 0 ? group_heads : 1;
}

// Whether the int8 kernel's `splits` blocks of a (KV head, sequence) may
// merge their states in a thread-block cluster (DecodePlan::cluster_merge,
// kernels/cluster_merge.cuh) instead of the merge kernel: the int8 kernel
// writes every state (no `exact_splits` blocks of the exact ranges), no
// matrix rotation (`rotated`: the merge kernel rotates the output back; the
// queries' rotation kernel would precede a clustered launch), and the
// splits fit a portable cluster (`max_cluster`, 8).
inline bool cluster_merge_applies(bool int8, int64_t exact_splits, bool rotated, int64_t splits, int64_t max_cluster) {
  return int8 && exact_splits == 0 && !rotated && splits >= 1 && splits <= max_cluster;
}

// Whether clustering a launch of `blocks` adds no wave: the device holds as
// many of them at once in clusters (`resident_in_clusters`: resident
// clusters times their blocks; a cluster's blocks share one GPC) as one by
// one (`resident`).
inline bool clusters_add_no_wave(int64_t blocks, int64_t resident, int64_t resident_in_clusters) {
  return resident_in_clusters >= std::min(blocks, resident);
}

}  // namespace kvforge::kernels
