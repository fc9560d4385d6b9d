#pragma once
// Where a quantized token's codes, group parameters and outlier entries lie
// for the tensor-core decode kernels (docs/runtime-layout.md sections 3 and
// 4): per-token pair indices, per-channel token groups' parameter streams,
// single codes, and the walks over a token's outlier rows that correct
// scores and value sums.
#include <cstdint>

#include "kernels/decode_block_state.cuh"
#include "kernels/decode_params.h"
#include "kernels/element_access.cuh"
#include "kernels/page_reading.cuh"
#include "kernels/warp_channel_sums.cuh"
#include "kernels/warp_reductions.cuh"

namespace kvforge::kernels::decode_attention_device {

// Where the codes and the per-token parameters of token slot s lie.
struct SlotAddress {
  const uint8_t* page = nullptr;
  int64_t in_page = 0;
};

// The pair index (in the page's parameter section) of group `group` of head
// `head` of a per-token grouping (runtime_layout.h's token_pair_offset with
// the pairs per head given, so that no 64-bit division runs per token).
__device__ inline int32_t token_pair_index(const TensorLayoutSpec& spec, int head, int32_t in_page, int group,
                                           int pairs_per_head) {
  if (spec.grouping == ScaleGrouping::kPerTokenAllHeads) return in_page;
  return (head * spec.page_size + in_page) * pairs_per_head + group;
}

// Channel parameters of key channel d of head `head` for token slot s:
// per_channel_tokens from the group's striped pairs (stream position sigma =
// first + d, first = the head's channel 0 of the group, split once into
// page-table entry and offset), per_channel_offline from the artifact's
// (offset, scale) (uniform levels -1 + 2k / top).
struct ChannelStream {
  int64_t first_entry = 0;  // page-table entry of channel 0
  int32_t first_offset = 0;  // its pair within that page
  int32_t per_page = 0;
};

__device__ inline ChannelStream channel_stream(const TensorPageLayout& l, int64_t s, int head) {
  if (l.spec.grouping != ScaleGrouping::kPerChannelTokens) return {};
  const int64_t sigma = channel_pair_stream_index(l, s / l.spec.group, static_cast<int64_t>(head) * l.spec.head_dim);
  const int64_t per_page = pairs_per_page(l);
  return {sigma / per_page, static_cast<int32_t>(sigma % per_page), static_cast<int32_t>(per_page)};
}

__device__ inline Affine channel_affine(const PagedTensor& cache, const Dequantization& dq, const int32_t* page_row,
                                        const ChannelStream& stream, int head, int d, int top) {
  const TensorPageLayout& l = cache.layout;
  const int D = l.spec.head_dim;
  if (l.spec.grouping == ScaleGrouping::kPerChannelOffline) {
    const float offset = dq.channel_offset[head * D + d], scale = dq.channel_scale[head * D + d];
    return {__fsub_rn(offset, scale), __fdiv_rn(__fmul_rn(2.0f, scale), static_cast<float>(top))};
  }
  const int32_t position = stream.first_offset + d;
  const int64_t page = page_row[stream.first_entry + position / stream.per_page];
  const uint8_t* params = cache.pages + page * l.page_bytes + l.params_offset;
  return affine_of_pair(l, dq, params + (position % stream.per_page) * l.pair_bytes, top);
}

// The code of channel d of a token's row (head `head`).
template <int kBits>
__device__ inline int code_at(const TensorPageLayout& l, SlotAddress at, int head, int d) {
  const uint8_t* row = at.page + code_row_offset(l, head, at.in_page);
  const uint32_t word = load_u32(row + (d * kBits / 32) * 4);
  return static_cast<int>((word >> ((d * kBits) % 32)) & ((1u << kBits) - 1));
}

// One token's CSR row of outliers walked an entry of head `head` at a time
// (a span per head, or the all-heads span narrowed to the head: its
// indices ascend, so the head's entries end at the first of a later head).
// Empty until opened.
struct OutlierRowWalk {
  OutlierPages pages;  // by shifts, not a 64-bit division per entry
  uint32_t entry = 0, end = 0;

  __device__ OutlierRowWalk(const PagedTensor& cache, int32_t slot) : pages(cache, slot) {}
  __device__ void open(const PagedTensor& cache, SlotAddress at, int head) {
    const TensorPageLayout& l = cache.layout;
    const int64_t span = l.outlier_spans == 1 ? 0 : head;
    const uint8_t* pointer = at.page + row_pointer_offset(l, at.in_page * l.outlier_spans + span);
    entry = load_u32(pointer);
    end = load_u32(pointer + kRowPointerBytes);
  }
  // The next entry of head `head`: its channel d and value x; false once
  // the head's entries are done.
  __device__ bool next(const PagedTensor& cache, int head, int& d, float& x) {
    const TensorPageLayout& l = cache.layout;
    while (entry < end) {
      const uint32_t e = entry++;
      const uint8_t* page = pages.page(cache, e);
      const uint32_t in_page = pages.slot_in_page(e);
      uint32_t index = load_index(page + outlier_index_offset(l, in_page), l.outlier_index_bytes);
      if (l.outlier_spans == 1) {  // all heads: index = head * D + d, in 32 bits
        const auto dim = static_cast<uint32_t>(l.spec.head_dim);
        const uint32_t entry_head = index / dim;
        if (entry_head < static_cast<uint32_t>(head)) continue;
        if (entry_head > static_cast<uint32_t>(head)) {
          entry = end;
          return false;
        }
        index %= dim;
      }
      d = static_cast<int>(index);
      x = load_element(l.spec.element, page + outlier_value_offset(l, in_page));
      return true;
    }
    return false;
  }
};

// Calls f(d, value) for every outlier entry of head `head` in token slot s's row.
template <class F>
__device__ inline void for_each_outlier(const PagedTensor& cache, int32_t slot, SlotAddress at, int head, F&& f) {
  OutlierRowWalk walk(cache, slot);
  walk.open(cache, at, head);
  int d = 0;
  float x = 0.0f;
  while (walk.next(cache, head, d, x)) f(d, x);
}

// A warp's value outlier corrections of one step or tile (lanes below
// `tokens` hold a token each; at(lane) its slot address, delta(lane, d, x)
// its x - x^ at channel d, weight(lane, h) its weight for head h) added to
// rows[h][d] for h < group: one entry a lane a round, the lanes on one
// channel summed into one (add_at_channels), no atomics.
template <class At, class Delta, class Weight, class Rows>
__device__ inline void add_value_outliers(const PagedTensor& cache, int32_t slot, int head, int tokens, int group,
                                          At&& at, Delta&& delta, Weight&& weight, Rows& rows) {
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  OutlierRowWalk walk(cache, slot);
  if (lane < tokens) walk.open(cache, at(lane), head);
  for (;;) {
    int d = 0;
    float x = 0.0f;
    const bool has = walk.next(cache, head, d, x);
    const unsigned active = __ballot_sync(0xffffffffu, has);
    if (active == 0u) break;
    __syncwarp();  // the previous round's stores
    if (has) {
      const float change = delta(lane, d, x);
      float add[kMaxTensorCoreGroup];
#pragma unroll
      for (int h = 0; h < kMaxTensorCoreGroup; ++h) add[h] = h < group ? __fmul_rn(weight(lane, h), change) : 0.0f;
      add_at_channels(active, d, add, group, rows);
    }
  }
}

// Keys whose (a, b) are per channel: every token's codes share them.
__device__ inline bool per_channel_groups(const TensorLayoutSpec& spec) {
  return spec.grouping == ScaleGrouping::kPerChannelTokens || spec.grouping == ScaleGrouping::kPerChannelOffline;
}

}  // namespace kvforge::kernels::decode_attention_device
