#pragma once
// A decoding step's append carried by the decode's own launch
// (DecodePlanner::launch_step, kernels/decode_attention_launch.h): what the
// kernel that appends each batch entry's one new token (the int8 decode
// kernel, or the query rotation's: step_append_host) needs beyond its
// DecodeParams. The pools, slots, lengths and rotations are the decode's
// (its lengths count the new token: entry i's goes to position lengths[i] -
// 1); the rest is the step's AppendParams'.
// A plain struct of pointers and values (host and device), as the params.
#include <cstdint>
#include <type_traits>

#include "kernels/decode_params.h"
#include "kernels/warp_run.h"

namespace kvforge::kernels {

struct StepAppendArgs {
  const void* keys = nullptr;  // [count][kv_heads][D] of `input`: entry i's new token is row i
  const void* values = nullptr;
  ElementType input = ElementType::kFloat32;
  Quantization key_quantization, value_quantization;
  // The page table, written: entry i's new page (new_page_plus_one[i] - 1,
  // as InlineBatchArrays') at new_page_index(spec, lengths[i] - 1). In the
  // int8 kernel by the appending warp of every KV head (the same id), which
  // then reads it back from the table after its own write and fence: no
  // block depends on another's write (a change that let one KV head write
  // it would have the others read a stale entry). In the query rotation's
  // kernel by the keys' block of KV head 0 alone: no kernel of the call
  // reads that entry (the token is in the window), the blocks that store
  // take the id from here (step_token_place).
  int32_t* page_table = nullptr;
  int32_t new_page_plus_one[kInlineBatchEntries] = {};  // all 0 where the pages were uploaded
};

// A kernel's step-append parameter: StepAppendArgs where it appends the
// step's tokens (its kStepAppend instantiation), else nothing.
struct NoStepAppend {};
template <bool kStepAppend>
using StepAppendParam = std::conditional_t<kStepAppend, StepAppendArgs, NoStepAppend>;

// Where entry `entry`'s new token goes: slot `slot`, position length - 1
// (length: the decode's, counting it), its page (page_row: the slot's
// page-table row as the launch finds it, without the page the step opens),
// and that page's table index where the step opens one (the inline
// arrays'). Host and device: the kernels' placement, tested on the host.
struct StepTokenPlace {
  int32_t slot = 0;
  int64_t token = 0;
  int32_t page_id = 0;          // 0 within the sink
  int32_t new_page_index = -1;  // -1: the step opens no page (or it was uploaded)
  int32_t new_page = 0;
};

KVFORGE_HOST_DEVICE inline StepTokenPlace step_token_place(const TensorLayoutSpec& spec, const StepAppendArgs& step,
                                                           int32_t entry, int32_t slot, int64_t length,
                                                           const int32_t* page_row) {
  StepTokenPlace place;
  place.slot = slot;
  place.token = length - 1;
  const int32_t opened = entry < kInlineBatchEntries ? step.new_page_plus_one[entry] - 1 : -1;
  if (opened >= 0) {
    place.new_page_index = new_page_index(spec, length - 1);
    place.new_page = opened;
  }
  if (place.token >= spec.sink_tokens) {
    const auto index = static_cast<int32_t>((place.token - spec.sink_tokens) / spec.page_size);
    place.page_id = index == place.new_page_index ? place.new_page : page_row[index];
  }
  return place;
}

// The warps of an int8 decode block (kernels/decode_int8_kernel.cuh) that
// store a step's token, where the block's tokens [first, last) end at it
// (last == length, the entry's length counting it): the keys by the warp
// whose run holds it (last_run_warp: it stores them before it reads the
// token), the values by another warp (its neighbour, keys ^ 1), first
// thing, ahead of the block's __syncthreads that precedes every read of the
// token: the two chains of float64 work run side by side instead of one
// after the other on one warp. Both -1 where the block does not end at the
// token. `warps` even.
struct StepAppendWarps {
  int keys = -1;
  int values = -1;
};

KVFORGE_HOST_DEVICE inline StepAppendWarps step_append_warps(int64_t first, int64_t last, int64_t length,
                                                             int warps, int step_tokens) {
  StepAppendWarps w;
  if (first < last && last == length) {
    w.keys = last_run_warp(first, last, warps, step_tokens);
    w.values = w.keys ^ 1;
  }
  return w;
}

// The step append of `append` (one new token per entry of the decode that
// follows it, in the same order): its rows, input type, quantizers, page
// table and inline new pages (its rotations are the decode's:
// step_append_host).
inline StepAppendArgs step_append_args(const AppendParams& append) {
  StepAppendArgs s;
  s.keys = append.keys;
  s.values = append.values;
  s.input = append.input;
  s.key_quantization = append.key_quantization;
  s.value_quantization = append.value_quantization;
  s.page_table = append.page_table;
  for (int32_t i = 0; i < append.inline_arrays.count && i < kInlineBatchEntries; ++i) {
    s.new_page_plus_one[i] = append.inline_arrays.new_page_plus_one[i];
  }
  return s;
}

}  // namespace kvforge::kernels
