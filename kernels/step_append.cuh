#pragma once
// Device code of a decoding step's append inside the decode's kernels
// (StepAppendArgs, kernels/step_append.h): the warp that reads an
// entry's new token quantizes and stores that token of its KV head, keys
// and values, before it reads anything of it. A separate
// append launch costs a decoding step about an empty kernel's time (~2.7 us
// on the H200 under the benchmark's timer), more than a tenth of the decode
// at batch 1 (bench/README.md): inside the decode's launch the append is a
// warp's few hundred cycles.
//
// The layouts served are the token-parallel append's: each token is
// quantized on its own, so the code is append_token_kernel.cuh's (the same
// float64 operations in the same order as the CPU reference, written with
// explicit intrinsics and fmas: this file is compiled with FMA
// contraction, as the decode) and stores the same bytes as the append
// kernel. Without a rotation, sink or window (rtn's) the int8 kernel's warp
// whose run ends at the new token appends it (append_step_token). (The exact
// kernel's block that reads a window's new token appending it, a matrix
// rotation included, was measured slower than two launches and removed:
// bench/README.md, the thirty-third session.)
#include <cstdint>

#include "kernels/append_token_kernel.cuh"
#include "kernels/step_append.h"

namespace kvforge::kernels::step_append_device {

// Where a step token goes (append_token_kernel.cuh's target), and the page
// the step opens for it.
struct StepToken {
  append_device::TokenTarget target;
  int32_t new_page_index = -1;  // the table index of a page the step opens; -1: none
  int32_t new_page = 0;
};

// Entry `entry`'s new token (step_token_place).
__device__ inline StepToken step_token(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                       int32_t slot, int64_t length, const int32_t* page_row) {
  const StepTokenPlace place = step_token_place(p.key_cache.layout.spec, step, entry, slot, length, page_row);
  StepToken t;
  t.target.slot = place.slot;
  t.target.token = place.token;
  t.target.page_id = place.page_id;
  t.target.to_ring = false;  // no window: rtn's layouts (step_append_host)
  t.new_page_index = place.new_page_index;
  t.new_page = place.new_page;
  return t;
}

// A page the step opens, written into the page table by one lane (every KV
// head's warp writes the same id, and reads it back after its own
// write: no other block's write to wait for).
__device__ inline void write_step_page(const DecodeParams& p, const StepAppendArgs& step, const StepToken& token) {
  if (token.new_page_index >= 0) {
    step.page_table[static_cast<int64_t>(token.target.slot) * p.batch.page_table_stride + token.new_page_index] =
        token.new_page;
  }
}

template <int kE, int kBits, ElementType kElement>
__device__ inline void append_step_token_as(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                            int32_t kv_head, const StepToken& token) {
  // No rotation here (step_append_host).
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
  if (threadIdx.x % 32 == 0) write_step_page(p, step, token);
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
