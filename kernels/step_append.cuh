#pragma once
// Device code of a decoding step's append inside the int8 decode kernel
// (StepAppendArgs, kernels/step_append.h): the warp whose run of the
// context ends at an entry's new token quantizes and stores that token of
// its KV head, keys and values, before it reads anything of it. A separate
// append launch costs a decoding step about an empty kernel's time (~2.7 us
// on the H200 under the benchmark's timer), more than a tenth of the decode
// at batch 1 (bench/README.md): inside the decode's launch the append is a
// warp's few hundred cycles.
//
// The layouts served are the token-parallel append's without a rotation,
// sink or window (rtn's): each token is quantized on its own, so the warp
// runs append_token_kernel.cuh's per-warp functions (the same float64
// operations in the same order as the CPU reference, written with explicit
// intrinsics: this file is compiled with FMA contraction, as the decode)
// and stores the same bytes as the append kernel.
#include <cstdint>

#include "kernels/append_token_kernel.cuh"
#include "kernels/step_append.h"

namespace kvforge::kernels::step_append_device {

// Where a warp's step token goes, and the page the step opens for it.
struct StepToken {
  append_device::TokenTarget target;
  int32_t new_page_index = -1;  // the table index of a page the step opens; -1: none
  int32_t new_page = 0;
};

// Entry `entry`'s new token, at position length - 1 of slot `slot`
// (page_row: the slot's page-table row).
__device__ inline StepToken step_token(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                       int32_t slot, int64_t length, const int32_t* page_row) {
  const TensorLayoutSpec& spec = p.key_cache.layout.spec;
  StepToken t;
  t.target.slot = slot;
  t.target.token = length - 1;
  t.target.to_ring = false;  // no window: rtn's layouts (step_append_fuses)
  const int32_t opened = entry < kInlineBatchEntries ? step.new_page_plus_one[entry] - 1 : -1;
  const int32_t new_index = new_page_index(spec, length - 1);
  if (opened >= 0) {
    t.new_page_index = new_index;
    t.new_page = opened;
  }
  if (t.target.token >= spec.sink_tokens) {
    const auto index = static_cast<int32_t>((t.target.token - spec.sink_tokens) / spec.page_size);
    t.target.page_id = index == t.new_page_index ? t.new_page : page_row[index];
  }
  return t;
}

template <int kE, int kBits, ElementType kElement>
__device__ inline void append_step_token_as(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                            int32_t kv_head, const StepToken& token) {
  const append_device::TokenTensorArgs keys{p.key_cache, step.key_quantization, Rotation{}, step.keys};
  const append_device::TokenTensorArgs values{p.value_cache, step.value_quantization, Rotation{}, step.values};
  // Both kinds' loads first: their round trips overlap.
  double key_part[kE], value_part[kE];
  append_device::load_token_part<kE, kElement>(keys, step.input, entry, kv_head, key_part);
  append_device::load_token_part<kE, kElement>(values, step.input, entry, kv_head, value_part);
  append_device::store_token_part<kE, kBits, kElement>(keys, token.target, kv_head, key_part);
  append_device::store_token_part<kE, kBits, kElement>(values, token.target, kv_head, value_part);
}

// The whole warp: entry `entry`'s new token of KV head `kv_head`, keys and
// values, stored, and a page the step opens written into the page table.
// On return the warp's later reads (the page table's and its copies into
// shared memory) see the stored bytes.
template <int D, int kBits>
__device__ inline void append_step_token(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                         int32_t kv_head, const StepToken& token) {
  constexpr int kE = D / 32;
  // Every KV head's warp writes the same id: each then reads it back from
  // the table in its walk, after its own write (no other block's write to
  // wait for, and no second page id through the walk's registers).
  if (token.new_page_index >= 0 && threadIdx.x % 32 == 0) {
    step.page_table[static_cast<int64_t>(token.target.slot) * p.batch.page_table_stride + token.new_page_index] =
        token.new_page;
  }
  switch (p.key_cache.layout.spec.element) {
    case ElementType::kFloat16:
      append_step_token_as<kE, kBits, ElementType::kFloat16>(p, step, entry, kv_head, token);
      break;
    case ElementType::kBFloat16:
      append_step_token_as<kE, kBits, ElementType::kBFloat16>(p, step, entry, kv_head, token);
      break;
    case ElementType::kFloat32:
      append_step_token_as<kE, kBits, ElementType::kFloat32>(p, step, entry, kv_head, token);
      break;
  }
  // The lanes' stores at device scope before any lane's copy reads them
  // (the code rows' copies go through L2).
  __threadfence();
  __syncwarp();
}

}  // namespace kvforge::kernels::step_append_device
