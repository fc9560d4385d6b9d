#pragma once
// decode_exact_kernel<D, kHeads, E>: the decode's exact ranges (the sink and
// the window, docs/runtime-layout.md 6.3) where keys and values quantize the
// same tokens (same_quantized_ranges), so that every token of the ranges is
// an E-typed row of both exact stores and no code is read. One block per
// (chunk of SplitAssignment::exact_chunk tokens, KV head, sequence), as
// decode_split_kernel's exact blocks (split_tokens with
// SplitAssignment::exact_ranges), writing the same states for the merge; a
// block walks its chunk in passes of kExactPass tokens, the warps' softmax
// states carried from pass to pass (one pass: the same arithmetic as a
// 64-token chunk's).
//
// Why not decode_split_kernel: that one dequantizes a 32-token tile into
// shared memory a word per thread, with its page walk and outlier rounds,
// then scores it one token per lane in one fma chain of D and sums the
// values one token at a time: ~4,500 warp instructions a block at a
// latency-bound ~11 cycles each, 31 us for int2-rot's 320 exact blocks at
// 32K batch 8 on the H200 (bench/results/ncu-decode-int2rot-rotated-h200-2026-12-02.txt),
// most of it after the int8 kernel's last wave. Here warp w takes the
// pass's tokens [16 w, 16 w + 16): lanes j and j + 16 hold the two halves of
// token j's key row in registers (loaded before the query rotation, which
// hides their latency; the value rows are prefetched to L2 then and loaded
// during the scores), score all the group's heads at once, and the warp's
// softmax and value sums need no shared tile; the four warps' states are
// joined as the tensor-core kernels' are (write_block_state).
//
// bf16 rows (int2-rot's, the serving layouts' with a bf16 model) take the
// tensor cores instead (exact_passes_tensor_cores): a warp's pass on the
// CUDA cores was ~1,300 instructions for its 16 tokens at GQA 4 (the
// scores' and value sums' fmas, each bf16 element converted to float32),
// at one or two warps per scheduler a chain of ~5.6 cycles each: 14 us for
// batch 8's 192 blocks of 32K tokens, 30 us for batch 32's 768 (ncu, H200,
// bench/results/ncu-decode-int2rot-warm-durations-h200-2026-12-03.txt),
// much of it after the int8 kernel's single wave. On tensor cores it took
// 13.6 and 27.9 us (the same file): a block's time is mostly its chain of
// memory round trips (its first key rows, the queries, each pass's value
// rows, its state), which this does not shorten; it keeps the pass's
// instructions several times fewer and no register spills. fp16 and
// float32 rows keep the float32 path.
#include "kernels/async_copy.cuh"
#include "kernels/bf16_mma_fragments.cuh"
#include "kernels/decode_block_state.cuh"
#include "kernels/decode_params.h"
#include "kernels/element_access.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/query_rotation.cuh"
#include "kernels/split_states.cuh"
#include "kernels/warp_reductions.cuh"

namespace kvforge::kernels::decode_attention_device {

inline constexpr int kExactWarps = 4;
inline constexpr int kExactWarpTokens = kExactPass / kExactWarps;  // 16: lanes j and j + 16 score token j
static_assert(2 * kExactWarpTokens == kWarpSize, "two lanes a token");

template <ElementType E>
constexpr int exact_element_bytes() {
  return E == ElementType::kFloat32 ? 4 : 2;
}

// N 32-bit words from `at` (aligned to min(16, 4 N) bytes) in the widest loads.
template <int N>
__device__ inline void load_words(const uint8_t* at, uint32_t (&out)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(at)[i];
      out[4 * i] = v.x, out[4 * i + 1] = v.y, out[4 * i + 2] = v.z, out[4 * i + 3] = v.w;
    }
  } else if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(at);
    out[0] = v.x, out[1] = v.y;
  } else {
    static_assert(N == 1, "1, 2 or a multiple of 4 words");
    out[0] = *reinterpret_cast<const uint32_t*>(at);
  }
}

// Element i of E-typed elements packed in words (little-endian halves).
template <ElementType E, int N>
__device__ inline float word_element(const uint32_t (&words)[N], int i) {
  if constexpr (E == ElementType::kFloat32) {
    return __uint_as_float(words[i]);
  } else {
    const uint32_t word = words[i / 2];
    const auto bits = static_cast<unsigned short>(i % 2 == 0 ? word & 0xffffu : word >> 16);
    if constexpr (E == ElementType::kBFloat16) return __uint_as_float(static_cast<uint32_t>(bits) << 16);
    return __half2float(__ushort_as_half(bits));
  }
}

// bf16 rows (exact_tensor_cores): a warp's pass of value rows, staged by
// cp.async for ldmatrix.trans, each row padded by 16 bytes so that the 8
// rows one matrix reads fall in 8 different groups of 4 banks.
template <int D>
struct ExactValueTiles {
  static constexpr int kRowElements = D + 8;
  uint16_t rows[kExactWarps][kExactWarpTokens][kRowElements];
};

// The warps' states in write_block_state's shapes (heads up to
// kMaxTensorCoreGroup; those past kHeads unused).
template <int D, int kHeads>
struct ExactShared {
  union {
    alignas(16) float raw_query[kHeads * D];         // the group's queries as read (heads past the group: 0; load_rows)
    ExactValueTiles<D> values;                       // bf16 rows: the passes' value rows, after the rotation
    float acc[kExactWarps][kMaxTensorCoreGroup][D];  // the warps' value sums, after the passes
  };
  alignas(16) float query[kHeads * D];  // rotated by the keys' rotation (16-byte stores: load_rows)
  // bf16 rows: the scores' B operands of k step s for lane l, (b0, b1) hi
  // then lo (exact_tensor_cores).
  uint4 query_fragments[D / 16][kWarpSize];
  float weight[kExactWarps][kExactWarpTokens][kMaxTensorCoreGroup];
  float max[kExactWarps][kMaxTensorCoreGroup], sum[kExactWarps][kMaxTensorCoreGroup];  // log2 units
};

// Whether the passes run on tensor cores: bf16 rows enter mma.sync exactly
// (A operands: key rows, value rows by ldmatrix.trans), the queries and the
// softmax weights as bf16 hi + lo (2^-16 relative, as the tensor-core
// kernels' operands); fp16 and float32 rows take the float32 path.
template <ElementType E>
constexpr bool exact_tensor_cores() {
  return E == ElementType::kBFloat16;
}

// The passes on tensor cores (bf16 rows; decode_exact_kernel's warps, each
// its 16 tokens of a pass), lane (g, c) = (lane / 4, lane % 4):
//   - scores S[t][h] = sum_d K[t][d] q'[h][d], one m16n8k16 tile per warp
//     and k step: A = key rows g and g + 8 as loaded (load_key_rows: words
//     [kLaneWords c, kLaneWords (c + 1)) of each), so that k step s's
//     columns (2c, 2c + 1) hold word kLaneWords c + 2 s and (2c + 8, 2c + 9)
//     the next one (a permutation of the channels the B operand mirrors:
//     s.query_fragments); B = the group's queries (8 columns, heads past
//     kHeads zero) as bf16 hi + lo, two mmas a k step;
//   - the softmax per head over the warp's tokens (lane (g, c): tokens g and
//     g + 8, heads 2c and 2c + 1; the maxima and sums over g by xor
//     shuffles), its state in registers across the passes;
//   - values out^T[d][h] += sum_t V[t][d] W[t][h]: A = the pass's value rows
//     staged in s.values by cp.async (in flight during the scores) and read
//     transposed by ldmatrix, 16 channels a tile; B = the weights as bf16
//     hi + lo through s.weight (the scores' C fragment is their transpose).
// Past the chunk the key rows are zeros (scores masked to -inf) and the
// value rows zeros (weight 0 times 0: no stale or unwritten bits reach the
// sums). On return the warps' states are in s.max, s.sum and s.acc.
template <int D, int kHeads, class LoadKeys, class Prefetch>
__device__ inline void exact_passes_tensor_cores(ExactShared<D, kHeads>& s, uint32_t (&key_rows)[2][D / 8],
                                                 LoadKeys&& load_key_rows, Prefetch&& prefetch_pass,
                                                 const uint8_t* value_slot, const TensorPageLayout& vl, int kv_head,
                                                 int64_t first, int count, int passes, float log2e_scale) {
  constexpr int kSteps = D / 16;  // the scores' k steps, the values' m tiles
  constexpr int kLaneWords = D / 8;
  constexpr int kRowChunks = D * 2 / 16;  // 16-byte pieces of a value row
  constexpr int kRowBytes = ExactValueTiles<D>::kRowElements * 2;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;

  // The B operands of the scores, once per block: lane (g, c)'s k step s
  // takes head g's channel pairs kLaneWords c + 2 s (b0) and + 1 (b1).
  for (int i = threadIdx.x; i < kSteps * kWarpSize; i += blockDim.x) {
    const int step = i / kWarpSize, l = i % kWarpSize, head = l / 4;
    const int channel = 2 * (kLaneWords * (l % 4) + 2 * step);
    float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (head < kHeads) {
#pragma unroll
      for (int k = 0; k < 4; ++k) x[k] = s.query[head * D + channel + k];
    }
    const SplitBf16x2 b0 = split_bf16(x[0], x[1]), b1 = split_bf16(x[2], x[3]);
    s.query_fragments[step][l] = make_uint4(b0.hi, b1.hi, b0.lo, b1.lo);
  }
  __syncthreads();

  // The warp's value rows of pass q into its tile (zeros past the chunk).
  uint8_t* tile = reinterpret_cast<uint8_t*>(&s.values.rows[warp][0][0]);
  auto stage_values = [&](int q) {
#pragma unroll
    for (int i = lane; i < kExactWarpTokens * kRowChunks; i += kWarpSize) {
      const int r = i / kRowChunks, k = i % kRowChunks;
      const int in_chunk = kExactPass * q + warp * kExactWarpTokens + r;
      uint8_t* to = tile + r * kRowBytes + 16 * k;
      if (in_chunk < count) {
        const int32_t t = static_cast<int32_t>(first) + in_chunk;
        copy_async<16>(to, value_slot + exact_row_offset(vl, kv_head, exact_store_row(vl, t)) + 16 * k);
      } else {
        *reinterpret_cast<uint4*>(to) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    copy_async_commit();
  };
  // ldmatrix.trans rows: lane l reads row l % 8 of matrix l / 8, matrices 0
  // to 3 = (tokens 0-7, channels 0-7), (0-7, 8-15), (8-15, 0-7), (8-15,
  // 8-15) of a 16-channel tile: A fragments of V^T (channels by tokens).
  const uint32_t tile_address = static_cast<uint32_t>(__cvta_generic_to_shared(tile)) +
                                (lane % 8 + 8 * (lane / 16)) * kRowBytes + 16 * (lane / 8 % 2);

  float state_max[2] = {-INFINITY, -INFINITY}, state_sum[2] = {0.0f, 0.0f};  // heads 2c, 2c + 1
  float acc[kSteps][4];  // out^T: channels 16 t + g (+ 8) by heads 2c, 2c + 1
#pragma unroll
  for (int t = 0; t < kSteps; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  float* weight = &s.weight[warp][0][0];  // [token][head of 8]
  for (int q = 0; q < passes; ++q) {
    const int warp_count = max(0, min(count - kExactPass * q - warp * kExactWarpTokens, kExactWarpTokens));
    if (q > 0) load_key_rows(q);
    stage_values(q);

    float score[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      const uint4 b = s.query_fragments[step][lane];
      const uint32_t a[4] = {key_rows[0][2 * step], key_rows[1][2 * step], key_rows[0][2 * step + 1],
                             key_rows[1][2 * step + 1]};
      mma_bf16(score, a, b.x, b.y);
      mma_bf16(score, a, b.z, b.w);
    }
    // The next pass's rows on their way to L2 (this pass's keys are used).
    if (q + 1 < passes) prefetch_pass(q + 1, true);

    // The pass's softmax step for heads 2c + i: score[i] is token g's,
    // score[2 + i] token g + 8's.
    const bool valid[2] = {g < warp_count, g + 8 < warp_count};
    float w[4];
    float rescale[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float s0 = valid[0] ? __fmul_rn(score[i], log2e_scale) : -INFINITY;
      const float s1 = valid[1] ? __fmul_rn(score[2 + i], log2e_scale) : -INFINITY;
      float m = fmaxf(state_max[i], fmaxf(s0, s1));
#pragma unroll
      for (int offset = 4; offset < kWarpSize; offset *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
      // m is -inf only with neither a state nor a token: nothing to weigh.
      rescale[i] = state_max[i] == -INFINITY ? 0.0f : exp2f(state_max[i] - m);
      w[i] = valid[0] ? exp2f(s0 - m) : 0.0f;
      w[2 + i] = valid[1] ? exp2f(s1 - m) : 0.0f;
      float l = w[i] + w[2 + i];
#pragma unroll
      for (int offset = 4; offset < kWarpSize; offset *= 2) l += __shfl_xor_sync(0xffffffffu, l, offset);
      state_sum[i] = __fmaf_rn(state_sum[i], rescale[i], l);  // the first pass: 0 * 0 + l
      state_max[i] = m;
    }
    rescale_columns(acc, rescale);
    *reinterpret_cast<float2*>(&weight[g * kMaxTensorCoreGroup + 2 * c]) = make_float2(w[0], w[1]);
    *reinterpret_cast<float2*>(&weight[(g + 8) * kMaxTensorCoreGroup + 2 * c]) = make_float2(w[2], w[3]);
    copy_async_wait<0>();
    __syncwarp();  // the weights and the value rows are the warp's

    // B: tokens (2c, 2c + 1) and (2c + 8, 2c + 9) of head g.
    const SplitBf16x2 b0 = split_bf16(weight[2 * c * kMaxTensorCoreGroup + g],
                                      weight[(2 * c + 1) * kMaxTensorCoreGroup + g]);
    const SplitBf16x2 b1 = split_bf16(weight[(2 * c + 8) * kMaxTensorCoreGroup + g],
                                      weight[(2 * c + 9) * kMaxTensorCoreGroup + g]);
#pragma unroll
    for (int t = 0; t < kSteps; ++t) {
      uint32_t a[4];
      load_matrices_transposed(a, tile_address + 32 * t);  // channels 16 t: 32 bytes a tile
      mma_bf16(acc[t], a, b0.hi, b1.hi);
      mma_bf16(acc[t], a, b0.lo, b1.lo);
    }
    __syncwarp();  // the tile and the weights are read before the next pass writes them
  }

  // The warps' states for write_block_state, once every warp is done with
  // its value tile (s.acc overlays them).
  __syncthreads();
#pragma unroll
  for (int t = 0; t < kSteps; ++t) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s.acc[warp][2 * c + i][16 * t + g] = acc[t][i];
      s.acc[warp][2 * c + i][16 * t + g + 8] = acc[t][2 + i];
    }
  }
  if (g == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) s.max[warp][2 * c + i] = state_max[i], s.sum[warp][2 * c + i] = state_sum[i];
  }
}

// Residency: 4 blocks a multiprocessor with 16-bit rows (128 registers, an
// int8 block's: at batch 1 the plan counts an exact block as one int8 slot,
// DecodePlan::exact_slots_reserved; ptxas spills a few bytes, 16 at GQA 4 and
// head_dim 128, for the values' words and weights in flight; unbounded it
// took 168-190); float32 rows hold twice the words.
template <ElementType E>
constexpr int exact_min_blocks() {
  return E == ElementType::kFloat32 ? 2 : 4;
}

// kHeads: 4 or 8, at least the GQA group (the heads past it score zero
// queries and are not written).
template <int D, int kHeads, ElementType E>
__global__ void __launch_bounds__(kExactWarps * kWarpSize, exact_min_blocks<E>())
    decode_exact_kernel(const DecodeParams p, const SplitWorkspace workspace, const SplitAssignment assignment) {
  // As decode_split_kernel's exact blocks: launched as the int8 kernel's
  // dependent it reads nothing that kernel writes and waits for it before it
  // exits; launched first, the int8 kernel may start once every block runs.
  allow_dependent_launch();
  constexpr int kBytes = exact_element_bytes<E>();
  constexpr int kPerLane = D / kWarpSize;             // a lane's value channels
  constexpr int kKeyWords = D / 2 * kBytes / 4;       // a lane's half key row
  constexpr int kValueWords = kPerLane * kBytes / 4;  // a lane's channels of a value row
  static_assert(kHeads % 4 == 0, "whole float4s of heads");
  __shared__ __align__(16) ExactShared<D, kHeads> s;

  const int split = blockIdx.x, kv_head = blockIdx.y, entry = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t tokens = entry_length(p, entry);
  int64_t first, last;
  split_tokens(p, assignment, tokens, split, first, last);
  const int group = p.num_heads / p.key_cache.layout.spec.kv_heads;
  const int64_t query_row = static_cast<int64_t>(entry) * p.num_heads + kv_head * group;  // the group's first head
  const int state = assignment.first_state + split;
  if (first >= last) {  // an empty chunk: a state the merge skips
    write_empty_state(workspace, BlockTokens{first, last, query_row, group}, state);
    wait_for_prerequisite_grid();
    return;
  }
  const int32_t slot = entry_slot(p, entry);
  const TensorPageLayout& kl = p.key_cache.layout;
  const TensorPageLayout& vl = p.value_cache.layout;

  // Passes of kExactPass tokens over the block's chunk: in each, lanes j <
  // 16 and j + 16 take token j of the warp's 16.
  const int j = lane % kExactWarpTokens, half = lane / kExactWarpTokens;
  const int count = static_cast<int>(last - first);
  const int passes = (count + kExactPass - 1) / kExactPass;
  constexpr int kHalfRowBytes = D * kBytes / 2;
  // Pass q's token of lane j of this warp (first + kExactPass q + 16 w + j)
  // and whether it is in the chunk.
  auto pass_token = [&](int q, bool& valid) {
    const int in_chunk = kExactPass * q + warp * kExactWarpTokens + j;
    valid = in_chunk < count;
    return static_cast<int32_t>(first) + in_chunk;
  };
  const uint8_t* key_slot = p.key_cache.exact + slot * kl.exact_slot_bytes;
  const uint8_t* value_slot = p.value_cache.exact + slot * vl.exact_slot_bytes;
  // Pass q's key and value half rows on their way to L2 (the next pass's
  // during this one; the first pass's values before the query rotation).
  auto prefetch_pass = [&](int q, bool keys) {
    bool in = false;
    const int32_t t = pass_token(q, in);
    if (!in) return;
    const uint8_t* value = value_slot + exact_row_offset(vl, kv_head, exact_store_row(vl, t)) + half * kHalfRowBytes;
#pragma unroll
    for (int b = 0; b < kHalfRowBytes; b += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(value + b));
    if (keys) {
      const uint8_t* key = key_slot + exact_row_offset(kl, kv_head, exact_store_row(kl, t)) + half * kHalfRowBytes;
#pragma unroll
      for (int b = 0; b < kHalfRowBytes; b += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(key + b));
    }
  };
  // Lane j's half key row of pass q's token j (zeros past the chunk).
  uint32_t key_words[kKeyWords];
  auto load_keys = [&](int q) {
    bool in = false;
    const int32_t t = pass_token(q, in);
    if (in) {
      load_words(key_slot + exact_row_offset(kl, kv_head, exact_store_row(kl, t)) + half * kHalfRowBytes, key_words);
    } else {
#pragma unroll
      for (int i = 0; i < kKeyWords; ++i) key_words[i] = 0;
    }
  };
  // Tensor cores (bf16 rows): lane (g, c) = (lane / 4, lane % 4) holds the
  // words [kLaneWords c, kLaneWords (c + 1)) (channel pairs) of key rows g
  // and g + 8 of the warp's 16 tokens of pass q, which are the A operands
  // of the scores' k steps in the order the B operands mirror (see the
  // passes below); zeros past the chunk.
  constexpr bool kTensorCores = exact_tensor_cores<E>();
  constexpr int kLaneWords = D / 8;
  const int g = lane / 4, c = lane % 4;
  uint32_t key_rows[2][kLaneWords];
  auto load_key_rows = [&](int q) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int in_chunk = kExactPass * q + warp * kExactWarpTokens + g + 8 * r;
      if (in_chunk < count) {
        const int32_t t = static_cast<int32_t>(first) + in_chunk;
        load_words(key_slot + exact_row_offset(kl, kv_head, exact_store_row(kl, t)) + 4 * kLaneWords * c, key_rows[r]);
      } else {
#pragma unroll
        for (int i = 0; i < kLaneWords; ++i) key_rows[r][i] = 0;
      }
    }
  };
  // The first pass's key rows first (their latency under the query
  // rotation's), its value rows on their way to L2, read after the scores.
  if constexpr (kTensorCores) {
    load_key_rows(0);
  } else {
    load_keys(0);
  }
  prefetch_pass(0, false);

  // The group's queries, rotated by the keys' rotation: rotated beforehand
  // (SplitWorkspace::queries; complete when this kernel starts, since it
  // launches behind the int8 kernel, whose blocks let it launch only once
  // they had waited for them, or behind the bf16 kernel in stream order),
  // else here.
  if (workspace.queries != nullptr) {
    load_rows<D>(ElementType::kFloat32, workspace.queries, query_row, group, kHeads, s.query);
  } else {
    load_rows<D>(p.io, p.queries, query_row, group, kHeads, s.raw_query);
    __syncthreads();
    rotate_group_queries<D, 32>(p.key_rotation, kv_head, group, kHeads, s.raw_query, s.query);
  }
  __syncthreads();

  // The warp's softmax state per head over its passes, in base 2 (the
  // scale times log2(e), as the tensor-core kernels': write_block_state
  // turns the maxima back).
  const float log2e_scale = p.softmax_scale * 1.4426950408889634f;
  if constexpr (kTensorCores) {
    exact_passes_tensor_cores<D, kHeads>(s, key_rows, load_key_rows, prefetch_pass, value_slot, vl, kv_head, first,
                                         count, passes, log2e_scale);
  } else {
    // The float32 path: the state in s.max and s.sum between passes (in
    // registers across the loads, at GQA 8 they spilled), and lane l's sums
    // of channels [kPerLane l, kPerLane (l + 1)) of every head.
    if (lane == 0) {
#pragma unroll
      for (int h = 0; h < kHeads; ++h) s.max[warp][h] = -INFINITY, s.sum[warp][h] = 0.0f;
    }
    __syncwarp();
    float acc[kHeads][kPerLane];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
#pragma unroll
      for (int c = 0; c < kPerLane; ++c) acc[h][c] = 0.0f;
    }
    const uint8_t* value_rows = value_slot + lane * kPerLane * kBytes;
    for (int q = 0; q < passes; ++q) {
      bool valid = false;
      const int32_t t = pass_token(q, valid);
      const int warp_count = max(0, min(count - kExactPass * q - warp * kExactWarpTokens, kExactWarpTokens));
      if (q > 0) load_keys(q);

      // The warp's value rows, in flight during the scores (loaded before the
      // rotation with the keys, they cost its rows in flight registers: spills).
      const long long value_row = valid ? exact_row_offset(vl, kv_head, exact_store_row(vl, t)) : 0;
      uint32_t value_words[kExactWarpTokens][kValueWords];
#pragma unroll
      for (int i = 0; i < kExactWarpTokens; ++i) {
        const long long row = __shfl_sync(0xffffffffu, value_row, i);
        if (i < warp_count) {
          load_words(value_rows + row, value_words[i]);
        } else {  // weight 0 times value 0
#pragma unroll
          for (int w = 0; w < kValueWords; ++w) value_words[i][w] = 0;
        }
      }

      // Scores: each lane its half of the dot products, fma chains in channel
      // order, the halves added (the same sum in both lanes).
      float dot[kHeads];
#pragma unroll
      for (int h = 0; h < kHeads; ++h) dot[h] = 0.0f;
      const float* query = s.query + half * (D / 2);
#pragma unroll
      for (int c = 0; c < D / 2; c += 4) {
        const float k0 = word_element<E>(key_words, c), k1 = word_element<E>(key_words, c + 1);
        const float k2 = word_element<E>(key_words, c + 2), k3 = word_element<E>(key_words, c + 3);
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          const float4 x = *reinterpret_cast<const float4*>(query + h * D + c);
          dot[h] = __fmaf_rn(x.w, k3, __fmaf_rn(x.z, k2, __fmaf_rn(x.y, k1, __fmaf_rn(x.x, k0, dot[h]))));
        }
      }
      // The next pass's rows on their way to L2 while this one's softmax and
      // value sums run (its keys' registers free by now).
      if (q + 1 < passes) prefetch_pass(q + 1, true);

      // The pass's softmax step per head: its maximum M over the warp's state
      // (m, l) and the pass's scores, the state rescaled by 2^(m - M) (the
      // first pass: nothing to rescale, its weights against its own maximum),
      // the weights 2^(score - M); the xor shuffles below 16 stay in a half,
      // and both halves hold every token's score.
      float state_max[kHeads], state_sum[kHeads];
#pragma unroll
      for (int h = 0; h < kHeads; ++h) state_max[h] = s.max[warp][h], state_sum[h] = s.sum[warp][h];
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        const float total = dot[h] + __shfl_xor_sync(0xffffffffu, dot[h], kExactWarpTokens);
        const float score = valid ? __fmul_rn(total, log2e_scale) : -INFINITY;
        float m = fmaxf(score, state_max[h]);
#pragma unroll
        for (int offset = kExactWarpTokens / 2; offset > 0; offset /= 2) {
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
        }
        // m is finite where state_max is not -inf.
        const float rescale = state_max[h] == -INFINITY ? 0.0f : exp2f(state_max[h] - m);
        const float w = valid ? exp2f(score - m) : 0.0f;  // valid: m is finite
        float l = w;
#pragma unroll
        for (int offset = kExactWarpTokens / 2; offset > 0; offset /= 2) l += __shfl_xor_sync(0xffffffffu, l, offset);
        state_sum[h] = __fmaf_rn(state_sum[h], rescale, l);  // the first pass: 0 * 0 + l
        state_max[h] = m;
        if (q > 0) {
#pragma unroll
          for (int c = 0; c < kPerLane; ++c) acc[h][c] *= rescale;
        }
        dot[h] = w;
      }
      if (lane < kExactWarpTokens) {
#pragma unroll
        for (int h = 0; h < kHeads; h += 4) {
          *reinterpret_cast<float4*>(&s.weight[warp][j][h]) = make_float4(dot[h], dot[h + 1], dot[h + 2], dot[h + 3]);
        }
      }
      __syncwarp();  // every lane has read the state (and written its weights)
      if (lane == 0) {
#pragma unroll
        for (int h = 0; h < kHeads; ++h) s.max[warp][h] = state_max[h], s.sum[warp][h] = state_sum[h];
      }

      // Values: lane l's channels of every head, token by token.
#pragma unroll
      for (int i = 0; i < kExactWarpTokens; ++i) {
        float w[kHeads];
#pragma unroll
        for (int h = 0; h < kHeads; h += 4) {
          const float4 x = *reinterpret_cast<const float4*>(&s.weight[warp][i][h]);
          w[h] = x.x, w[h + 1] = x.y, w[h + 2] = x.z, w[h + 3] = x.w;
        }
#pragma unroll
        for (int c = 0; c < kPerLane; ++c) {
          const float x = word_element<E>(value_words[i], c);
#pragma unroll
          for (int h = 0; h < kHeads; ++h) acc[h][c] = __fmaf_rn(w[h], x, acc[h][c]);
        }
      }
      __syncwarp();  // the weights are read before the next pass writes its own
    }

    // The four warps' states joined by write_block_state (a warp without
    // tokens has max -inf and adds nothing; warp 0 has the chunk's first
    // token): m and l in s.max and s.sum, acc stored below.
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {  // one 16- or 8-byte store a head: no bank conflicts
      float* out = &s.acc[warp][h][kPerLane * lane];
      if constexpr (kPerLane == 4) {
        *reinterpret_cast<float4*>(out) = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
      } else {
        *reinterpret_cast<float2*>(out) = make_float2(acc[h][0], acc[h][1]);
      }
    }
  }
  __syncthreads();
  write_block_state<D, kExactWarps>(workspace, query_row, state, group, s.max, s.sum, s.acc);
  wait_for_prerequisite_grid();
}

}  // namespace kvforge::kernels::decode_attention_device
