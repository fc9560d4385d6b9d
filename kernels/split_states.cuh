#pragma once
// Flash-decoding's splits: where each split's (max, sum, acc) state lives
// (SplitWorkspace), and which tokens a block of the general or exact kernel
// takes (SplitAssignment, split_tokens) beside the tensor-core kernels'
// range (tensor_core_range).
#include <cstdint>

#include "kernels/decode_params.h"

namespace kvforge::kernels::decode_attention_device {

// The split states of query head h of sequence entry: max and sum at
// max_sum[2 i], max_sum[2 i + 1] and acc at acc[i * D], i = (entry * H + h) *
// max_splits + state. A state whose max is -inf is empty (the merge skips it;
// its sum and acc are not written).
struct SplitWorkspace {
  float* max_sum = nullptr;
  float* acc = nullptr;
  int32_t max_splits = 0;
  // [sequence][query head][D]: the queries rotated by the keys' matrix
  // (rotate_group_queries_kernel, DecodePlan::rotate_queries_first), once
  // per decode call instead of once per block; null: each block rotates its
  // own (decode_split_kernel always does).
  float* queries = nullptr;
};

// Tokens per pass of a block of the exact ranges (decode_exact_kernel's
// four warps of 16); a block's chunk (SplitAssignment::exact_chunk) is a
// multiple of it.
inline constexpr int kExactPass = 64;
// decode_exact_kernel's default chunk: two passes, so that int2-rot's sink
// and window of 256 tokens take 3 blocks per sequence and KV head. Swept
// at 32K and 128K tokens, batch 1, 8 and 32 (H200,
// bench/results/decode-attention-exact-chunks-h200-2026-12-03.json and,
// 64 in the same run as the default 128,
// decode-attention-general-l2-prefetch-h200-2026-12-03.json): 128 within
// 0.5% of 64 or faster at every point (-1.6 to -1.9% at 32K batch 32), 256
// and 320 30% slower at 32K batch 1. The general kernel's exact ranges
// (KIVI's) keep one pass a block (DecodePlan::exact_chunk).
inline constexpr int kExactChunk = 2 * kExactPass;

// Which tokens block x of decode_split_kernel takes, and which state it writes:
//   splits of tokens_per_split tokens over the whole context (the general
//   path; tokens_per_split 0: one split), or
//   exact_ranges: the tokens the tensor-core kernel leaves, [0, begin) and
//   [end, T) of tensor_core_range, in chunks of exact_chunk tokens (a
//   multiple of kExactPass: DecodePlan::exact_chunk), written after the
//   tensor-core states (state first_state + x).
struct SplitAssignment {
  int64_t tokens_per_split = 0;
  bool exact_ranges = false;
  int32_t first_state = 0;
  int32_t exact_chunk = kExactChunk;
};

// The token range the tensor cores take: quantized for keys and values.
__device__ inline void tensor_core_range(const DecodeParams& p, int64_t tokens, int64_t& begin, int64_t& end) {
  const TensorLayoutSpec& k = p.key_cache.layout.spec;
  const TensorLayoutSpec& v = p.value_cache.layout.spec;
  begin = quantized_begin(k, tokens);
  const int64_t ke = quantized_end(k, tokens), ve = quantized_end(v, tokens);
  end = ke < ve ? ke : ve;
  if (end < begin) end = begin;
}

__device__ inline void split_tokens(const DecodeParams& p, const SplitAssignment& assignment, int64_t tokens, int split,
                                    int64_t& first, int64_t& last) {
  if (!assignment.exact_ranges) {
    const int64_t size = assignment.tokens_per_split > 0 ? assignment.tokens_per_split : tokens;
    first = static_cast<int64_t>(split) * size;
    last = first + size < tokens ? first + size : tokens;
    return;
  }
  int64_t begin, end;
  tensor_core_range(p, tokens, begin, end);
  const int64_t chunk = assignment.exact_chunk;
  const int64_t head_chunks = (begin + chunk - 1) / chunk;
  if (split < head_chunks) {
    first = static_cast<int64_t>(split) * chunk;
    last = first + chunk < begin ? first + chunk : begin;
  } else {
    first = end + (split - head_chunks) * chunk;
    last = first + chunk < tokens ? first + chunk : tokens;
  }
}

}  // namespace kvforge::kernels::decode_attention_device
