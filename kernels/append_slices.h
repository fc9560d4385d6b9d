#pragma once
// How the per-sequence append kernel (kernels/append_kernel.cuh) splits one
// sequence's tensor over thread blocks: a block per slice of a token's
// kv_heads * head_dim channels, each slice a whole number of the tensor's
// groups. Host and device code (the launch's grid, a block's channels).
#include <cstdint>

#include "kernels/decode_params.h"
#include "kernels/runtime_layout.h"

namespace kvforge::kernels {

// The per-sequence append kernel's threads a block (append_kernel.cuh).
inline constexpr int32_t kAppendBlockThreads = 256;

// The channels one block takes:
// - per_channel_tokens without outliers: kAppendBlockThreads (a group's
//   completion is per channel; one block per sequence completed 1024
//   channels four a thread on one multiprocessor at batch 1);
// - per_token groups of whole warps' widths without outliers, where they
//   outnumber the block's warps: a group per warp (quantize_groups_by_warp
//   walks a warp's groups one after another, and at batch 1 that chain is
//   the decoding step's append: KIVI's values, 32 groups of 32 channels at
//   1024, were four groups a warp);
// - else the whole token: a token's outlier entries are numbered across all
//   its channels, and the other groupings' groups span the token.
KVFORGE_HOST_DEVICE inline int32_t slice_channels(const TensorPageLayout& l, const Quantization& q) {
  const int32_t width = l.spec.kv_heads * l.spec.head_dim;
  if (q.outliers != OutlierSelection::kNone || l.outlier_spans > 0) return width;
  if (l.spec.grouping == ScaleGrouping::kPerChannelTokens) return kAppendBlockThreads;
  constexpr int32_t warps = kAppendBlockThreads / 32;
  if (l.spec.grouping == ScaleGrouping::kPerToken && l.spec.group > 0 && l.spec.group % 32 == 0 &&
      width / l.spec.group > warps) {
    return warps * l.spec.group;
  }
  return width;
}

// The blocks one sequence's tensor takes: its slices, the last one
// possibly narrower.
KVFORGE_HOST_DEVICE inline int32_t channel_slices(const TensorPageLayout& l, const Quantization& q) {
  const int32_t width = l.spec.kv_heads * l.spec.head_dim, per_slice = slice_channels(l, q);
  return (width + per_slice - 1) / per_slice;
}

}  // namespace kvforge::kernels
