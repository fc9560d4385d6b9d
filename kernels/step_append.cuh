#pragma once
// Device code of a decoding step's append inside the decode's kernels
// (StepAppendArgs, kernels/step_append.h): the warp or block that reads an
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
// kernel. Without a sink or window (rtn's) the int8 kernel's warp whose run
// ends at the new token appends it (append_step_token); with a window the
// token is read back from its ring row only, by the one block of the exact
// ranges whose chunk ends at it, which appends it first, its whole block
// staging a matrix rotation (append_step_token_block).
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

// Entry `entry`'s new token (step_token_place); target.to_ring for the keys
// (a single token of a call always lands in a ring there is: the values'
// may differ, step_value_target).
__device__ inline StepToken step_token(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                       int32_t slot, int64_t length, const int32_t* page_row) {
  const StepTokenPlace place = step_token_place(p.key_cache.layout.spec, step, entry, slot, length, page_row);
  StepToken t;
  t.target.slot = place.slot;
  t.target.token = place.token;
  t.target.page_id = place.page_id;
  t.target.to_ring = p.key_cache.layout.ring_capacity > 0;
  t.new_page_index = place.new_page_index;
  t.new_page = place.new_page;
  return t;
}

// The values' target: the keys' with the values' ring.
__device__ inline append_device::TokenTarget step_value_target(const DecodeParams& p, const StepToken& token) {
  append_device::TokenTarget target = token.target;
  target.to_ring = p.value_cache.layout.ring_capacity > 0;
  return target;
}

// A page the step opens, written into the page table by one lane (every KV
// head's block or warp writes the same id, and reads it back after its own
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
  // No rotation here (step_append_host): the step's are kNone.
  const append_device::TokenTensorArgs keys{p.key_cache, step.key_quantization, Rotation{}, step.keys};
  const append_device::TokenTensorArgs values{p.value_cache, step.value_quantization, Rotation{}, step.values};
  // Both kinds' loads first: their round trips overlap.
  double key_part[kE], value_part[kE];
  append_device::load_token_part<kE, kElement>(keys, step.input, entry, kv_head, key_part);
  append_device::load_token_part<kE, kElement>(values, step.input, entry, kv_head, value_part);
  append_device::store_token_part<kE, kBits, kElement>(keys, token.target, kv_head, key_part);
  append_device::store_token_part<kE, kBits, kElement>(values, step_value_target(p, token), kv_head, value_part);
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

// The shared memory a block-wide step append takes (append_step_token_block):
// the rotation's staged rows and the token's float64 stage.
template <int D>
struct StepAppendShared {
  append_device::RotationRing<D> ring;
  double stage[1][D];
};

// One kind of the block's step token: by the block where the kind has a
// matrix rotation (append_rotated_rows, the rotated token kernel's), else
// by warp 0.
template <int kE, int kBits, ElementType kElement, int kThreads>
__device__ inline void append_step_kind_block(const append_device::TokenTensorArgs& t, ElementType input,
                                              int32_t entry, int32_t kv_head,
                                              const append_device::TokenTarget& target,
                                              StepAppendShared<32 * kE>& shared) {
  if (t.rotation.kind == RotationKind::kMatrix) {
    append_device::append_rotated_rows<kE, kBits, kElement, 1, kThreads>(
        t, input, kv_head, entry, [](int) { return true; }, [&](int64_t) { return target; }, shared.ring,
        shared.stage);
  } else if (__all_sync(0xffffffffu, threadIdx.x < 32)) {  // warp 0 (a vote: known warp-uniform)
    double part[kE];
    append_device::load_token_part<kE, kElement>(t, input, entry, kv_head, part);
    append_device::store_token_part<kE, kBits, kElement>(t, target, kv_head, part);
  }
}

template <int kE, int kBits, ElementType kElement, int kThreads>
__device__ inline void append_step_token_block_as(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                                  int32_t kv_head, const StepToken& token,
                                                  StepAppendShared<32 * kE>& shared) {
  const append_device::TokenTensorArgs keys{p.key_cache, step.key_quantization, step.key_rotation, step.keys};
  const append_device::TokenTensorArgs values{p.value_cache, step.value_quantization, step.value_rotation,
                                              step.values};
  append_step_kind_block<kE, kBits, kElement, kThreads>(keys, step.input, entry, kv_head, token.target, shared);
  append_step_kind_block<kE, kBits, kElement, kThreads>(values, step.input, entry, kv_head,
                                                        step_value_target(p, token), shared);
}

// The whole block (kThreads threads, every one of them): entry `entry`'s
// new token of KV head `kv_head`, keys and values, rotated where the kinds
// have a matrix, stored, and a page the step opens written. For a block of
// the exact ranges that reads the token back from its ring (or sink) row:
// on return the block's later reads see the stored bytes. kElement: the
// cache's.
template <int D, int kThreads, ElementType kElement>
__device__ inline void append_step_token_block(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                               int32_t kv_head, const StepToken& token,
                                               StepAppendShared<D>& shared) {
  constexpr int kE = D / 32;
  if (threadIdx.x == 0) write_step_page(p, step, token);
  if (p.key_cache.layout.spec.bits == 2) {
    append_step_token_block_as<kE, 2, kElement, kThreads>(p, step, entry, kv_head, token, shared);
  } else {
    append_step_token_block_as<kE, 4, kElement, kThreads>(p, step, entry, kv_head, token, shared);
  }
  __threadfence();
  __syncthreads();
}

}  // namespace kvforge::kernels::step_append_device
