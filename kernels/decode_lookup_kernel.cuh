#pragma once
// The lookup decode kernel (docs/runtime-layout.md section 6.6): keys
// quantized per channel offline (KVQuant's per-channel scale and offset on
// uniform or non-uniform levels, before or after RoPE, with or without
// sparse outliers) and values with one scale group per token row (all
// heads, or per_token groups of head_dim; any levels, any outliers), on the
// CUDA cores. The tensor-core kernels cannot take these keys: pre-RoPE keys
// turn by an angle per token and channel pair, and grid levels are not
// integers, so every key element is dequantized and rotated on its own
// before any product. The general kernel does that through shared memory
// with a barrier per 32-token tile (kvquant at 0.2x bf16 SDPA on the H200,
// 14.6 cycles per instruction, bench/results/ncu-decode-general-kvquant-*).
//
// One block of kLookupWarps warps per (context split, KV head, sequence);
// each warp walks its own run of 32-token steps, no block barrier inside:
//
//   - keys, lane t = token t of the step: its code row in registers (loaded
//     a step ahead); each 4-bit nibble of the row looks up its dequantized
//     channels in a table the block builds once (2 bits: the two channels
//     of the nibble as a float2, fma(scale, L[code], offset) for each of
//     the 16 nibble values; 4 bits: one channel), so a pair of channels
//     costs a shift, a mask and one shared load; RoPE at position t
//     (6.3 step 2's float32 angle and reduction), then the GQA group's
//     dot products with the queries, stored as (q_i, q_{i+D/2}, q_{i+1},
//     q_{i+1+D/2}) so that one broadcast load serves two RoPE pairs;
//     key outliers correct the dot by q . RoPE(x - x^ at channel d);
//   - the online softmax per head over the step's 32 lanes (log2 units),
//     each lane keeping its own partial sum and a-term sum_t p_t a_t;
//   - values, lane l = channels [l D/32, (l + 1) D/32): the step's value
//     rows staged in shared memory by cp.async a step ahead, its weights
//     W = p b per token and head from shared memory, levels looked up per
//     nibble as the keys', acc[h][c] += W[t][h] L[code]; value outliers add
//     p (x - x^) into a shared correction row (the lanes on one channel
//     summed into one of them, which writes; no atomics), folded into the
//     accumulators once per step.
//
// The block joins its warps' states (write_block_state) into one split
// state for decode_merge_kernel; the exact ranges (sink, windows) are the
// exact or the general kernel's, as beside the tensor-core kernels.
#include <cstdint>
#include <type_traits>

#include "kernels/async_copy.cuh"
#include "kernels/decode_block_state.cuh"
#include "kernels/decode_params.h"
#include "kernels/element_access.cuh"
#include "kernels/fixed_divisor.h"
#include "kernels/page_reading.cuh"
#include "kernels/pair_affine.h"
#include "kernels/programmatic_launch.cuh"
#include "kernels/rope_device.cuh"
#include "kernels/warp_channel_sums.cuh"
#include "kernels/warp_reductions.cuh"

namespace kvforge::kernels::decode_attention_device {

inline constexpr int kLookupWarps = 4;
inline constexpr int kLookupStepTokens = 32;  // a lane per token
inline constexpr int kLookupStages = 2;       // value rows: the step's and the next step's

// Shared memory of one block (dynamic: over the 48 KB a static block gets).
// kHeads: the query heads a warp scores (4 or 8; the GQA group padded).
template <int D, int kBits, int kHeads>
struct LookupShared {
  static constexpr int kRowWords = D * kBits / 32;
  // Keys: [nibble][16] dequantized (2 bits: float2 of channels 2n, 2n + 1;
  // 4 bits: channel n), D * 16 floats either way.
  alignas(16) float key_table[D * 16];
  // Values: [16] levels of a nibble's codes (2 bits: float2; 4 bits: float).
  alignas(16) float value_table[32];
  alignas(16) float query[kMaxTensorCoreGroup][D];
  // [head][m]: (q_2m, q_2m+D/2, q_2m+1, q_2m+1+D/2).
  alignas(16) float4 query_pairs[kHeads][D / 4];
  alignas(16) float inverse_frequencies[D / 2];
  alignas(16) float weights[kLookupWarps][kLookupStepTokens][kHeads];  // W = p b of the step
  float state_max[kLookupWarps][kMaxTensorCoreGroup], state_sum[kLookupWarps][kMaxTensorCoreGroup];
  // Value outlier corrections of the step, then each warp's accumulators.
  alignas(16) float out[kLookupWarps][kMaxTensorCoreGroup][D];
  union {
    float raw_query[kMaxTensorCoreGroup][D];  // the preamble only
    uint32_t value_rows[kLookupWarps][kLookupStages][kLookupStepTokens][kRowWords];
  };
};

template <int D, int kBits, int kHeads>
constexpr int lookup_shared_bytes() {
  return static_cast<int>(sizeof(LookupShared<D, kBits, kHeads>));
}

// Word w of a code row held in registers, w known at run time only (the
// outliers' channels): a select per word, not a local-memory array.
template <int kWords>
__device__ inline uint32_t row_word(const uint32_t (&row)[kWords], int w) {
  uint32_t word = row[0];
#pragma unroll
  for (int i = 1; i < kWords; ++i) word = w == i ? row[i] : word;
  return word;
}

template <int kBits, int kWords>
__device__ inline int row_code(const uint32_t (&row)[kWords], int d) {
  return static_cast<int>((row_word(row, d * kBits / 32) >> ((d * kBits) % 32)) & ((1u << kBits) - 1));
}

// Dequantized key channels c and c + 1 (c even, c mod 32 / kBits known at
// compile time) of the word holding them, from the block's table: nibble
// n = c kBits / 4 of the row.
template <int kBits>
__device__ inline float2 key_channel_pair(const float* table, uint32_t word, int c, int in_word) {
  if constexpr (kBits == 2) {
    const uint32_t x = (word >> (2 * in_word)) & 15u;
    return reinterpret_cast<const float2*>(table)[(c / 2) * 16 + x];
  } else {
    const uint32_t x0 = (word >> (4 * in_word)) & 15u, x1 = (word >> (4 * in_word + 4)) & 15u;
    return make_float2(table[c * 16 + x0], table[(c + 1) * 16 + x1]);
  }
}

// The outlier entries [begin, end) of a token's CSR row, four at a time
// (their pages, then their indices and values, loaded at once: two round
// trips per four entries instead of three per entry), f(d, x) for each of
// head `head` (an all-heads row's index is head * D + d; its indices
// ascend, so the walk ends at the first entry of a later head). An f returning
// bool stops the walk by returning false for an entry it did not take;
// the result is that entry (where a later walk resumes), else `end`.
template <int D, class F>
__device__ inline uint32_t for_each_row_entry(const PagedTensor& cache, const OutlierPages& pages, uint32_t begin,
                                              uint32_t end, int head, F&& f) {
  const TensorPageLayout& l = cache.layout;
  const bool all_heads = l.outlier_spans == 1;
  const uint32_t per_page = pages.per_page.divisor;
  for (uint32_t e0 = begin; e0 < end; e0 += 4) {
    // A row's entries are consecutive: the batch's four lie in e0's
    // outlier page and, past its end, the next one's.
    const uint32_t slot0 = pages.slot_in_page(e0);
    const uint8_t* first_page = pages.page(cache, e0);
    const uint8_t* next_page =
        slot0 + 3 >= per_page && e0 + (per_page - slot0) < end ? pages.page(cache, e0 + (per_page - slot0)) : first_page;
    const uint8_t* page[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) page[j] = e0 + j < end ? (slot0 + j < per_page ? first_page : next_page) : nullptr;
    uint32_t index[4];
    float value[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      index[j] = 0;
      value[j] = 0.0f;
      if (page[j] != nullptr) {
        const uint32_t slot = slot0 + j < per_page ? slot0 + j : slot0 + j - per_page;
        index[j] = load_index(page[j] + outlier_index_offset(l, slot), l.outlier_index_bytes);
        value[j] = load_element(l.spec.element, page[j] + outlier_value_offset(l, slot));
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (page[j] == nullptr) break;
      uint32_t d = index[j];
      if (all_heads) {
        const uint32_t entry_head = d / static_cast<uint32_t>(D);
        if (entry_head < static_cast<uint32_t>(head)) continue;
        if (entry_head > static_cast<uint32_t>(head)) return end;  // a row's indices ascend: the head's are behind
        d %= static_cast<uint32_t>(D);
      }
      if constexpr (std::is_same_v<decltype(f(0, 0.0f)), bool>) {
        if (!f(static_cast<int>(d), value[j])) return e0 + j;
      } else {
        f(static_cast<int>(d), value[j]);
      }
    }
  }
  return end;
}

// Element `which` (0: min, 1: max) of a (min, max) pair loaded as raw
// words (two 16-bit elements in .x, or two floats).
__device__ inline float pair_element(ElementType element, uint2 pair, int which) {
  if (element == ElementType::kFloat32) return __uint_as_float(which == 0 ? pair.x : pair.y);
  const uint32_t bits = which == 0 ? pair.x & 0xffffu : pair.x >> 16;
  if (element == ElementType::kBFloat16) return __uint_as_float(bits << 16);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// What a lane loads for its token of a step, a step ahead: the key code
// row, the value group's (min, max), and both CSR rows' bounds.
template <int kWords>
struct LookupLaneLoads {
  uint32_t key[kWords];
  uint2 value_pair;
  uint32_t key_entries[2], value_entries[2];
};

// The dots of lane's token with the GQA group's queries over the table's
// dequantized keys, RoPE at `position` where kRope. A word of the first
// half of the row and its partner D/2 channels on (the RoPE pairs' other
// halves) per iteration, not the whole row unrolled: the unrolled row (both
// variants, ~3,000 instructions) had the warps waiting on instruction
// fetches a third of the time (ncu, 32K tokens, batch 8).
template <int D, int kBits, int kHeads, bool kRope, int kWords>
__device__ inline void lookup_key_dots(const LookupShared<D, kBits, kHeads>& s, const uint32_t (&row)[kWords],
                                       float position, float (&dot)[kHeads]) {
  constexpr int kHalf = D / 2, kHalfWords = kWords / 2, kPerWord = 32 / kBits;
#pragma unroll
  for (int h = 0; h < kHeads; ++h) dot[h] = 0.0f;
  uint32_t words[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) words[i] = row[i];
#pragma unroll 1
  for (int w = 0; w < kHalfWords; ++w) {
    const uint32_t low_word = words[0], high_word = words[kHalfWords];
#pragma unroll
    for (int i = 0; i < kWords - 1; ++i) words[i] = words[i + 1];  // the next word first
#pragma unroll
    for (int j = 0; j < kPerWord; j += 2) {
      const int c = w * kPerWord + j;  // channels c, c + 1 and c + D/2, c + 1 + D/2
      const float2 low = key_channel_pair<kBits>(s.key_table, low_word, c, j);
      const float2 high = key_channel_pair<kBits>(s.key_table, high_word, c + kHalf, j);
      float r0 = low.x, r1 = high.x, r2 = low.y, r3 = high.y;
      if constexpr (kRope) {
        const float2 f = *reinterpret_cast<const float2*>(&s.inverse_frequencies[c]);
        float s0, c0, s1, c1;
        reduced_sin_cos(__fmul_rn(position, f.x), s0, c0);
        reduced_sin_cos(__fmul_rn(position, f.y), s1, c1);
        r0 = low.x * c0 + (-high.x) * s0;
        r1 = high.x * c0 + low.x * s0;
        r2 = low.y * c1 + (-high.y) * s1;
        r3 = high.y * c1 + low.y * s1;
      }
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        const float4 q = s.query_pairs[h][c / 2];
        dot[h] = __fmaf_rn(q.w, r3, __fmaf_rn(q.z, r2, __fmaf_rn(q.y, r1, __fmaf_rn(q.x, r0, dot[h]))));
      }
    }
  }
}

// kHeads: 4 (GQA groups up to 4) or 8.
template <int D, int kBits, int kHeads>
__global__ void __launch_bounds__(kLookupWarps * kWarpSize)
    decode_lookup_kernel(const DecodeParams p, const SplitWorkspace workspace, const TensorCoreSplits splits) {
  allow_dependent_launch();
  using Shared = LookupShared<D, kBits, kHeads>;
  constexpr int kWords = Shared::kRowWords;
  constexpr int kRowBytes = kWords * 4;
  constexpr int kChunks = kRowBytes / 16;  // 16-byte copies per value row
  constexpr int kHalf = D / 2;
  constexpr int kPerLane = D / kWarpSize;  // value channels per lane: 2 or 4
  constexpr int kLaneBits = kPerLane * kBits;  // 4, 8 or 16: within one word
  constexpr int kTop = (1 << kBits) - 1;
  static_assert(kChunks >= 1 && kRowBytes % 16 == 0, "code rows of whole 16-byte chunks");
  extern __shared__ __align__(16) uint8_t dynamic_shared[];
  Shared& s = *reinterpret_cast<Shared*>(dynamic_shared);

  const int split = blockIdx.x, kv_head = blockIdx.y, entry = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const BlockTokens block = block_tokens(p, splits, split, kv_head, entry);
  const int group = block.group;
  if (block.first >= block.last) {  // an empty split: a state the merge skips
    write_empty_state(workspace, block, split);
    return;
  }
  const int32_t slot = entry_slot(p, entry);
  const int32_t* page_row = p.batch.page_table + slot * p.batch.page_table_stride;
  const TensorPageLayout& kl = p.key_cache.layout;
  const TensorPageLayout& vl = p.value_cache.layout;

  // The queries (rotated by the keys' rotation), the out rows zeroed.
  load_group_queries<D>(p, nullptr, block.state_base, group, kv_head, s.query, s.raw_query, &s.out[0][0][0],
                        kLookupWarps * kMaxTensorCoreGroup * D);
  {
    const float* levels = p.key_dequantization.levels;
    const float* scale = p.key_dequantization.channel_scale + kv_head * D;
    const float* offset = p.key_dequantization.channel_offset + kv_head * D;
    for (int i = threadIdx.x; i < D * 16 / (kBits == 2 ? 2 : 1); i += blockDim.x) {
      const int n = i / 16, x = i % 16;
      if constexpr (kBits == 2) {
        s.key_table[2 * i] = __fmaf_rn(scale[2 * n], levels[x & 3], offset[2 * n]);
        s.key_table[2 * i + 1] = __fmaf_rn(scale[2 * n + 1], levels[x >> 2], offset[2 * n + 1]);
      } else {
        s.key_table[i] = __fmaf_rn(scale[n], levels[x], offset[n]);
      }
    }
    if (threadIdx.x < 16) {
      const float* v = p.value_dequantization.levels;
      const int x = threadIdx.x;
      if constexpr (kBits == 2) {
        s.value_table[2 * x] = v[x & 3];
        s.value_table[2 * x + 1] = v[x >> 2];
      } else {
        s.value_table[x] = v[x];
      }
    }
    for (int i = threadIdx.x; i < kHeads * (D / 4); i += blockDim.x) {
      const int h = i / (D / 4), m = i % (D / 4);
      const float* q = s.query[h];
      s.query_pairs[h][m] = make_float4(q[2 * m], q[2 * m + kHalf], q[2 * m + 1], q[2 * m + 1 + kHalf]);
    }
    if (p.keys_pre_rope) {
      for (int i = threadIdx.x; i < kHalf; i += blockDim.x) s.inverse_frequencies[i] = p.rope_inverse_frequencies[i];
    }
  }
  __syncthreads();  // the raw queries (under the value rows) are consumed too

  // This warp's run: whole 32-token steps of the block's tokens.
  const int32_t first = static_cast<int32_t>(block.first), last = static_cast<int32_t>(block.last);
  const int32_t steps = (last - first + kLookupStepTokens - 1) / kLookupStepTokens;
  const int32_t per_warp = (steps + kLookupWarps - 1) / kLookupWarps;
  const int32_t step_begin = warp * per_warp < steps ? warp * per_warp : steps;
  const int32_t step_end = step_begin + per_warp < steps ? step_begin + per_warp : steps;
  const int32_t run_first = first + step_begin * kLookupStepTokens;
  const int32_t run_last = first + step_end * kLookupStepTokens < last ? first + step_end * kLookupStepTokens : last;

  const int sink = kl.spec.sink_tokens;
  const FixedDivisor page_size(static_cast<uint32_t>(kl.spec.page_size));
  const uint32_t key_row0 = static_cast<uint32_t>(code_row_offset(kl, kv_head, 0));
  const uint32_t value_row0 = static_cast<uint32_t>(code_row_offset(vl, kv_head, 0));
  // One value group per row: all heads' (pair 0 of the token) or head_dim's.
  const int value_pair_head = vl.spec.grouping == ScaleGrouping::kPerTokenAllHeads ? 0 : kv_head;
  const int value_pair_bytes = static_cast<int>(vl.pair_bytes);
  const int key_span = kl.outlier_spans == 1 ? 0 : kv_head;
  const int value_span = vl.outlier_spans == 1 ? 0 : kv_head;
  const bool key_outliers = kl.outlier_spans > 0, value_outliers = vl.outlier_spans > 0;
  const float log2e_scale = p.softmax_scale * 1.4426950408889634f;

  // Lane's loads for the step at step_first, and its value row's copy into
  // stage `stage` (predicated: tokens past the run load nothing).
  auto issue = [&](int32_t step_first, int stage, LookupLaneLoads<kWords>& next) {
    const int32_t t = step_first + lane;
    const bool valid = t < run_last;
    const uint8_t* key_page = nullptr;
    const uint8_t* value_page = nullptr;
    int32_t in_page = 0;
    if (valid) {
      const auto s_ = static_cast<uint32_t>(t - sink);
      const int32_t page = page_row[page_size.quotient(s_)];
      in_page = static_cast<int32_t>(page_size.remainder(s_));
      key_page = p.key_cache.pages + static_cast<int64_t>(page) * kl.page_bytes;
      value_page = p.value_cache.pages + static_cast<int64_t>(page) * vl.page_bytes;
    }
    const uint8_t* value_row = value_page + value_row0 + in_page * kRowBytes;
    const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(&s.value_rows[warp][stage][lane][0]));
#pragma unroll
    for (int c = 0; c < kChunks; ++c) copy_async_to<16>(to + 16 * c, value_row + 16 * c, valid);
    copy_async_commit();
    if (!valid) return;
    const uint4* key_row = reinterpret_cast<const uint4*>(key_page + key_row0 + in_page * kRowBytes);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint4 w = key_row[c];
      next.key[4 * c] = w.x, next.key[4 * c + 1] = w.y, next.key[4 * c + 2] = w.z, next.key[4 * c + 3] = w.w;
    }
    const uint8_t* pair = value_page + token_pair_offset(vl, value_pair_head, in_page, 0);
    if (value_pair_bytes == 8) {
      next.value_pair = *reinterpret_cast<const uint2*>(pair);
    } else {
      next.value_pair = make_uint2(*reinterpret_cast<const uint32_t*>(pair), 0u);
    }
    if (key_outliers) {
      const uint8_t* at = key_page + row_pointer_offset(kl, in_page * kl.outlier_spans + key_span);
      next.key_entries[0] = load_u32(at);
      next.key_entries[1] = load_u32(at + kRowPointerBytes);
    }
    if (value_outliers) {
      const uint8_t* at = value_page + row_pointer_offset(vl, in_page * vl.outlier_spans + value_span);
      next.value_entries[0] = load_u32(at);
      next.value_entries[1] = load_u32(at + kRowPointerBytes);
    }
  };

  float acc[kHeads][kPerLane];
  float running_max[kHeads], lane_sum[kHeads], lane_a[kHeads];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    running_max[h] = -INFINITY;
    lane_sum[h] = 0.0f;
    lane_a[h] = 0.0f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) acc[h][k] = 0.0f;
  }
  const OutlierPages key_pages(p.key_cache, slot), value_pages(p.value_cache, slot);
  const int value_word = lane * kLaneBits / 32, value_shift = lane * kLaneBits % 32;

  LookupLaneLoads<kWords> next{};
  int stage = 0;
  if (run_first < run_last) issue(run_first, 0, next);
  for (int32_t step_first = run_first; step_first < run_last; step_first += kLookupStepTokens) {
    const LookupLaneLoads<kWords> current = next;
    __syncwarp();  // every lane is done with the stage the next copies overwrite
    if (step_first + kLookupStepTokens < run_last) {
      issue(step_first + kLookupStepTokens, stage ^ 1, next);
    } else {
      copy_async_commit();  // an empty group: the wait below counts one behind
    }
    const int32_t t = step_first + lane;
    const bool valid = t < run_last;
    const float position = static_cast<float>(t);

    // Keys: the dots, then the outliers' corrections.
    float dot[kHeads];
    if (p.keys_pre_rope) {
      lookup_key_dots<D, kBits, kHeads, true>(s, current.key, position, dot);
    } else {
      lookup_key_dots<D, kBits, kHeads, false>(s, current.key, position, dot);
    }
    if (key_outliers && valid) {
      for_each_row_entry<D>(p.key_cache, key_pages, current.key_entries[0], current.key_entries[1], kv_head,
                            [&](int d, float x) {
                              const int code = row_code<kBits>(current.key, d);
                              const int64_t c = static_cast<int64_t>(kv_head) * D + d;
                              const float deq = __fmaf_rn(p.key_dequantization.channel_scale[c],
                                                          p.key_dequantization.levels[code],
                                                          p.key_dequantization.channel_offset[c]);
                              const float delta = __fsub_rn(x, deq);
                              const int i = d % kHalf;
                              float at_i = delta, at_half = 0.0f;  // the change of channels i and i + D/2
                              if (p.keys_pre_rope) {
                                float sn, cs;
                                reduced_sin_cos(__fmul_rn(position, s.inverse_frequencies[i]), sn, cs);
                                at_i = d < kHalf ? __fmul_rn(delta, cs) : -__fmul_rn(delta, sn);
                                at_half = d < kHalf ? __fmul_rn(delta, sn) : __fmul_rn(delta, cs);
                              } else if (d >= kHalf) {
                                at_i = 0.0f;
                                at_half = delta;
                              }
#pragma unroll
                              for (int h = 0; h < kHeads; ++h) {
                                dot[h] = __fmaf_rn(s.query[h][i + kHalf], at_half,
                                                   __fmaf_rn(s.query[h][i], at_i, dot[h]));
                              }
                            });
    }

    // The value group's affine (6.2) and the step's softmax.
    Affine value_affine{0.0f, 0.0f};
    if (valid) {
      const ElementType element = vl.spec.element;
      value_affine = pair_affine(pair_element(element, current.value_pair, 0), pair_element(element, current.value_pair, 1),
                                 p.value_dequantization.clip_ratio, p.value_dequantization.non_uniform, kTop);
    }
    float alpha[kHeads], weight[kHeads];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      const float score = valid ? __fmul_rn(dot[h], log2e_scale) : -INFINITY;
      const float new_max = fmaxf(running_max[h], warp_max(score));
      alpha[h] = exp2f(running_max[h] - new_max);  // 0 on the first step (running_max was -inf)
      weight[h] = valid ? exp2f(score - new_max) : 0.0f;
      lane_sum[h] = __fmaf_rn(lane_sum[h], alpha[h], weight[h]);
      lane_a[h] = __fmaf_rn(weight[h], value_affine.a, __fmul_rn(lane_a[h], alpha[h]));
      running_max[h] = new_max;
      s.weights[warp][lane][h] = __fmul_rn(weight[h], value_affine.b);
    }

    copy_async_wait<1>();  // this step's value rows (the next step's may still fly)
    __syncwarp();
    if (value_outliers) {
      // The lane's entries of this head, up to kGathered at a time (x - x^
      // at channel d), then their corrections in rounds the warp's lanes
      // take together, until every lane's row is done (a head with more
      // entries than the list resumes the walk where it stopped; shared
      // atomics would be compare-and-swap loops, and issued inside the walk
      // they ran once per entry position and lane path).
      constexpr int kGathered = 4;
      const uint32_t row_end = valid ? current.value_entries[1] : 0u;
      uint32_t cursor = valid ? current.value_entries[0] : 0u;
      while (__any_sync(0xffffffffu, cursor < row_end)) {
        int channel[kGathered];
        float change[kGathered];
        int gathered = 0;
        if (cursor < row_end) {
          const uint32_t* row = s.value_rows[warp][stage][lane];
          cursor = for_each_row_entry<D>(p.value_cache, value_pages, cursor, row_end, kv_head, [&](int d, float x) {
            if (gathered == kGathered) return false;
            const int code =
                static_cast<int>((row[d * kBits / 32] >> ((d * kBits) % 32)) & static_cast<uint32_t>(kTop));
            const float deq = __fmaf_rn(value_affine.b, p.value_dequantization.levels[code], value_affine.a);
#pragma unroll
            for (int g = 0; g < kGathered; ++g) {
              if (g == gathered) channel[g] = d, change[g] = __fsub_rn(x, deq);
            }
            ++gathered;
            return true;
          });
        }
        // Round g: each lane's g-th entry, summed with the other lanes' on
        // its channel (add_at_channels); the round's stores are visible to
        // the next round's lanes after a __syncwarp.
#pragma unroll
        for (int g = 0; g < kGathered; ++g) {
          const bool has = g < gathered;
          if (!__any_sync(0xffffffffu, has)) break;
          __syncwarp();
          const unsigned active = __ballot_sync(0xffffffffu, has);
          if (has) {
            float sum[kHeads];
#pragma unroll
            for (int h = 0; h < kHeads; ++h) sum[h] = __fmul_rn(weight[h], change[g]);
            add_at_channels(active, channel[g], sum, group, s.out[warp]);
          }
        }
      }
    }
    __syncwarp();

    // Values: this lane's channels over the step's 32 tokens.
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) acc[h][k] = __fmul_rn(acc[h][k], alpha[h]);
    }
#pragma unroll 8
    for (int j = 0; j < kLookupStepTokens; ++j) {
      const uint32_t bits = s.value_rows[warp][stage][j][value_word] >> value_shift;
      float level[kPerLane];
      if constexpr (kBits == 2) {
#pragma unroll
        for (int n = 0; n < kPerLane / 2; ++n) {
          const float2 v = reinterpret_cast<const float2*>(s.value_table)[(bits >> (4 * n)) & 15u];
          level[2 * n] = v.x;
          level[2 * n + 1] = v.y;
        }
      } else {
#pragma unroll
        for (int n = 0; n < kPerLane; ++n) level[n] = s.value_table[(bits >> (4 * n)) & 15u];
      }
      float w[kHeads];
#pragma unroll
      for (int h = 0; h < kHeads; h += 4) {
        const float4 x = *reinterpret_cast<const float4*>(&s.weights[warp][j][h]);
        w[h] = x.x, w[h + 1] = x.y, w[h + 2] = x.z, w[h + 3] = x.w;
      }
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) acc[h][k] = __fmaf_rn(w[h], level[k], acc[h][k]);
      }
    }
    if (value_outliers) {
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        if (h >= group) break;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
          float& correction = s.out[warp][h][lane * kPerLane + k];
          acc[h][k] = __fadd_rn(acc[h][k], correction);
          correction = 0.0f;
        }
      }
    }
    stage ^= 1;
  }
  copy_async_wait<0>();

  // The warp's state: sums over the lanes, the a-term into every channel.
  __syncwarp();
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    const float sum = warp_sum(lane_sum[h]), a_term = warp_sum(lane_a[h]);
    if (h < kMaxTensorCoreGroup) {
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) s.out[warp][h][lane * kPerLane + k] = __fadd_rn(acc[h][k], a_term);
      if (lane == 0) {
        s.state_max[warp][h] = running_max[h];
        s.state_sum[warp][h] = sum;
      }
    }
  }
  __syncthreads();
  write_block_state<D, kLookupWarps>(workspace, block.state_base, split, group, s.state_max, s.state_sum, s.out);
}

}  // namespace kvforge::kernels::decode_attention_device
