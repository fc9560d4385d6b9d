#pragma once
// Lanes of a warp adding per-head amounts into shared rows, each lane at a
// channel of its own choosing (value outliers' corrections, one round of
// the lanes' entries at a time). The lanes of a round that hold one channel
// (all of them where a step's tokens share their outlier channels, as
// persistent outlier channels and repeated tokens do) sum their amounts
// into the lowest of them by a tree over their ranks (log2 of their count
// shuffles a head), which alone writes: a plain read-modify-write per
// channel. Shared float atomics would be compare-and-swap loops on sm_90,
// and 32 lanes on one address retry for each other. A round where every
// channel has one lane (the common case) takes no shuffle.
#include <cstdint>

namespace kvforge::kernels::decode_attention_device {

// Called by exactly the lanes of `active` (converged), each adding add[h]
// to rows[h][d] for h < group (rows: [head][channel] floats in shared
// memory); `add` is used up. The caller orders one round's writes before
// the next round's reads (__syncwarp between rounds).
template <int kHeads, class Rows>
__device__ __forceinline__ void add_at_channels(unsigned active, int d, float (&add)[kHeads], int group, Rows& rows) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const unsigned same = __match_any_sync(active, d);
  const int count = __popc(same), rank = __popc(same & ((1u << lane) - 1u));
  const int most = static_cast<int>(__reduce_max_sync(active, static_cast<unsigned>(count)));
  for (int stride = 1; stride < most; stride *= 2) {
    // Rank r takes rank r + stride's sum where r is a multiple of 2 stride:
    // the stride-th lane of its channel above its own, found by clearing
    // the lowest bits (stride - 1 of them, none in the common collision of
    // two lanes: a modulo by 2 stride and __fns there cost ~5% of the
    // lookup kernel's time at batch 8 and 32).
    const bool takes = (rank & (2 * stride - 1)) == 0 && rank + stride < count;
    int from = lane;
    if (takes) {
      uint32_t above = same & ~((2u << lane) - 1u);
      for (int k = 1; k < stride; ++k) above &= above - 1u;
      from = __ffs(above) - 1;
    }
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (h >= group) break;
      const float other = __shfl_sync(active, add[h], from);
      if (takes) add[h] = __fadd_rn(add[h], other);
    }
  }
  if (rank == 0) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (h >= group) break;
      float& at = rows[h][d];
      at = __fadd_rn(at, add[h]);
    }
  }
}

}  // namespace kvforge::kernels::decode_attention_device
