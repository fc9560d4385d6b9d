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
#include "kernels/decode_attention_kernel.cuh"
#include "kernels/decode_tensor_core_kernel.cuh"

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

// The warps' states in write_block_state's shapes (heads up to
// kMaxTensorCoreGroup; those past kHeads unused).
template <int D, int kHeads>
struct ExactShared {
  union {
    float raw_query[kHeads * D];                     // the group's queries as read (heads past the group: 0)
    float acc[kExactWarps][kMaxTensorCoreGroup][D];  // the warps' value sums, after the queries are rotated
  };
  float query[kHeads * D];  // rotated by the keys' rotation
  float weight[kExactWarps][kExactWarpTokens][kHeads];
  float max[kExactWarps][kMaxTensorCoreGroup], sum[kExactWarps][kMaxTensorCoreGroup];  // log2 units
};

// Residency: 4 blocks a multiprocessor with 16-bit rows (128 registers, an
// int8 block's: at batch 1 the plan counts an exact block as one int8 slot,
// DecodePlan::exact_first; ptxas spills a few bytes, 16 at GQA 4 and
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
  const int64_t tokens = p.batch.lengths[entry];
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
  const int32_t slot = p.batch.slots[entry];
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
  // The first pass's key rows first (their latency under the query
  // rotation's), its value rows on their way to L2, read after the scores.
  load_keys(0);
  prefetch_pass(0, false);

  // The group's queries, rotated by the keys' rotation: rotated beforehand
  // (SplitWorkspace::queries; complete when this kernel starts, since it
  // launches behind the int8 kernel, whose blocks let it launch only once
  // they had waited for them, or behind the bf16 kernel in stream order),
  // else here.
  if (workspace.queries != nullptr) {
    for (int i = threadIdx.x; i < kHeads * D; i += blockDim.x) {
      s.query[i] = i < group * D ? workspace.queries[query_row * D + i] : 0.0f;
    }
  } else {
    for (int i = threadIdx.x; i < kHeads * D; i += blockDim.x) {
      s.raw_query[i] = i < group * D ? load_io(p.io, p.queries, query_row * D + i) : 0.0f;
    }
    __syncthreads();
    rotate_group_queries<D, 32>(p.key_rotation, kv_head, group, kHeads, s.raw_query, s.query);
  }
  __syncthreads();

  // The warp's softmax state per head over its passes, in base 2 (the
  // scale times log2(e), as the tensor-core kernels': write_block_state
  // turns the maxima back), in s.max and s.sum between passes (in registers
  // across the loads, at GQA 8 they spilled), and lane l's sums of channels
  // [kPerLane l, kPerLane (l + 1)) of every head.
  const float log2e_scale = p.softmax_scale * 1.4426950408889634f;
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
      for (int offset = kExactWarpTokens / 2; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
      const float rescale = state_max[h] == -INFINITY ? 0.0f : exp2f(state_max[h] - m);  // m is finite where it is not
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
  __syncthreads();
  write_block_state<D, kExactWarps>(workspace, query_row, state, group, s.max, s.sum, s.acc);
  wait_for_prerequisite_grid();
}

}  // namespace kvforge::kernels::decode_attention_device
