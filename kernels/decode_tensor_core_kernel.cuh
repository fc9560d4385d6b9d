#pragma once
// The tensor-core decode attention (docs/runtime-layout.md, section 6.4):
// the bandwidth path for uniform codes of post-RoPE keys, which is rtn, kivi
// and int2-rot (kvquant's non-uniform grids and pre-RoPE keys take the
// general kernel in decode_attention_kernel.cuh).
//
// Why tensor cores: at 2 bits a token's key and value rows of one KV head are
// 64 bytes, and scoring them for a GQA group of 4 is 1024 multiply-adds, 16 per
// byte: the H200's float32 units run out before its memory does (about half
// the bandwidth). So the codes go into mma.sync as they are:
//
//   - A operand: the codes themselves, as bf16 integers (0..15 are exact):
//     (word >> shift) & 0x000?000? | 0x4300.. is bf16 (128 + code) in each
//     half, minus 128. No per-element dequantization at all: a group's affine
//     x = a + b * code is factored out of the sums.
//   - keys: score(t, h) = sum_d q'_hd (a + b c_td): per-token groups give
//     b_t (q'.c) + a_t sum(q'), per-channel groups (q' * b).c + q'.a. The B
//     operand (q' or q' * b) is split into bf16 hi + lo (2^-16 relative), two
//     mmas; the codes are exact, the products and sums float32.
//   - values: out^T[d, h] = sum_t V^T[d, t] W[t, h], A = V^T codes, W = p * b
//     (softmax weight times the token's scale, again hi + lo), plus the
//     a-term sum_t p_t a_t in float32.
//   - outlier entries correct the scores and the outputs by
//     q'_d (x - deq) and p (x - deq); the sink, the windows and every token
//     not quantized for both keys and values are the general kernel's (its
//     "exact ranges" mode), merged with these states.
//
// One block of four warps per (context split, KV head, sequence); each warp
// takes a contiguous run of 16-token tiles of the split, keeps the online
// softmax of the GQA group's heads (up to 8: the mma's N), and the block
// merges its warps' states into one split state for decode_merge_kernel.
//
// Fragment layouts (PTX m16n8k16, g = lane / 4, c = lane % 4): A rows g and
// g + 8, k columns 2c, 2c+1 and 2c+8, 2c+9; B k rows 2c, 2c+1, 2c+8, 2c+9 of
// column g; C rows g, g+8, columns 2c, 2c+1. A dot product is the same
// under any permutation of k applied to both operands, so the codes are
// unpacked in the order the shifts give and the queries placed to match:
//   2 bits, word = 16 channels: k (2c, 2c+1) holds channels (2c, 2c+8),
//     k (2c+8, 2c+9) channels (2c+1, 2c+9);
//   4 bits, words of 8 channels: k (2c, 2c+1) holds (c, c+4) of the first
//     word, k (2c+8, 2c+9) holds (8+c, 12+c).
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/async_copy.cuh"
#include "kernels/decode_attention_kernel.cuh"
#include "kernels/warp_channel_sums.cuh"

namespace kvforge::kernels::decode_attention_device {

inline constexpr int kTensorCoreWarps = 4;
inline constexpr int kTileRows = 16;  // tokens per mma tile
inline constexpr int kMaxTensorCoreGroup = 8;  // query heads per KV head: the mma's N

// ---------------------------------------------------------------- registers

__device__ inline uint32_t bf16x2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// x = hi + lo + O(2^-16 |x|), hi and lo bf16; two halves of a B register.
struct SplitBf16x2 {
  uint32_t hi = 0, lo = 0;
};
__device__ inline SplitBf16x2 split_bf16(float x0, float x1) {
  const __nv_bfloat162 hi = __floats2bfloat162_rn(x0, x1);
  const float r0 = x0 - __low2float(hi), r1 = x1 - __high2float(hi);  // exact in float32
  return {bf16x2_bits(hi), bf16x2_bits(__floats2bfloat162_rn(r0, r1))};
}

// Two codes of `word`, at bits [shift, shift + bits) and [shift + 16, ...),
// as exact bf16 integers (low half the first).
template <int kBits>
__device__ inline uint32_t codes_bf16x2(uint32_t word, int shift) {
  constexpr uint32_t kMask = kBits == 2 ? 0x00030003u : 0x000F000Fu;
  const uint32_t biased = ((word >> shift) & kMask) | 0x43004300u;  // bf16 128 + code
  const __nv_bfloat162 v = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&biased), __floats2bfloat162_rn(128.f, 128.f));
  return bf16x2_bits(v);
}

// ldmatrix.m8n8.x4.trans (the int8 kernel's values, int8_mma_fragments.h
// "values by ldmatrix"; the exact kernel's bf16 value rows): lane l gives
// the shared address of row l % 8 of matrix l / 8.
__device__ inline void load_matrices_transposed(uint32_t (&d)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(address)
               : "memory");
}

__device__ inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The channels (within a 16-channel k step) of B register `which` (0: k 2c,
// 2c+1; 1: k 2c+8, 2c+9) of lane c: see the header comment.
template <int kBits>
__device__ inline void key_channels(int c, int which, int& d0, int& d1) {
  if (kBits == 2) {
    d0 = which == 0 ? 2 * c : 2 * c + 1;
    d1 = d0 + 8;
  } else {
    d0 = which == 0 ? c : 8 + c;
    d1 = d0 + 4;
  }
}

// The key A fragment of k step `step` of tokens g (w_g) and g + 8 (w_g8),
// rows given as their code words.
template <int kBits, int kWords>
__device__ inline void key_fragment(const uint32_t (&w_g)[kWords], const uint32_t (&w_g8)[kWords], int step, int c,
                                    uint32_t (&a)[4]) {
  if (kBits == 2) {
    a[0] = codes_bf16x2<2>(w_g[step], 4 * c);
    a[1] = codes_bf16x2<2>(w_g8[step], 4 * c);
    a[2] = codes_bf16x2<2>(w_g[step], 4 * c + 2);
    a[3] = codes_bf16x2<2>(w_g8[step], 4 * c + 2);
  } else {
    a[0] = codes_bf16x2<4>(w_g[2 * step], 4 * c);
    a[1] = codes_bf16x2<4>(w_g8[2 * step], 4 * c);
    a[2] = codes_bf16x2<4>(w_g[2 * step + 1], 4 * c);
    a[3] = codes_bf16x2<4>(w_g8[2 * step + 1], 4 * c);
  }
}

// The channel (within a 16-channel m tile) of value A row `row` (0..15).
template <int kBits>
__device__ inline int value_channel(int row) {
  if (kBits == 2) return row;
  const int g = row % 8, upper = row / 8;
  return g < 4 ? g + 4 * upper : g + 4 + 4 * upper;
}

// Value codes of m tile `tile` for rows g, g + 8 of one token, as a bf16x2
// (low half row g), from the token's words.
template <int kBits>
__device__ inline uint32_t value_codes(const uint32_t* words, int tile, int g) {
  if (kBits == 2) return codes_bf16x2<2>(words[tile], 2 * g);
  return g < 4 ? codes_bf16x2<4>(words[2 * tile], 4 * g) : codes_bf16x2<4>(words[2 * tile + 1], 4 * (g - 4));
}

__device__ inline float shfl(float x, int lane) { return __shfl_sync(0xffffffffu, x, lane); }

// The online softmax's rescale of C fragments (columns 2c, 2c + 1 in
// registers 0/2 and 1/3) by their heads' alphas.
template <int kTiles>
__device__ inline void rescale_columns(float (&acc)[kTiles][4], const float (&alpha)[2]) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    acc[t][0] *= alpha[0];
    acc[t][1] *= alpha[1];
    acc[t][2] *= alpha[0];
    acc[t][3] *= alpha[1];
  }
}

// ---------------------------------------------------------------- addressing

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

// ---------------------------------------------------------------- block parts

// The GQA group's queries (state_base + h, h < group) into `raw`, rotated by
// the keys' rotation into `query` (float32, 6.3 step 1; heads past the group
// are the mma's padding: zero), and `out_count` floats of `out` zeroed; the
// block's threads together, synchronized on return. kRowsInFlight:
// rotate_group_queries's. With `rotated` (SplitWorkspace::queries) the
// queries are rotate_group_queries_kernel's (rotate_queries_kernel.cuh):
// the kernel, launched as its programmatic dependent, waits for it here,
// and lets its own dependent launch only then (that one reads them too,
// and what that kernel's step append stored, without waiting: its
// prerequisite is this kernel). kRowLoads: the raw queries by load_rows
// (one round trip), and where the keys have no rotation straight into
// `query` (`raw` untouched); else one element a thread and iteration (the
// lookup and bf16 kernels: at their register cap, ptxas spilled in their
// main loops with the row loads in the prologue).
template <int D, int kRowsInFlight = 16, bool kRowLoads = false>
__device__ inline void load_group_queries(const DecodeParams& p, const float* rotated, int64_t state_base, int group,
                                          int kv_head, float (&query)[kMaxTensorCoreGroup][D],
                                          float (&raw)[kMaxTensorCoreGroup][D], float* out, int out_count) {
  for (int i = threadIdx.x; i < out_count; i += blockDim.x) out[i] = 0;
  if (rotated != nullptr) {
    wait_for_prerequisite_grid();
    allow_dependent_launch();
    load_rows<D>(ElementType::kFloat32, rotated, state_base, group, kMaxTensorCoreGroup, &query[0][0]);
    __syncthreads();
    return;
  }
  if constexpr (kRowLoads) {
    // Keys without a rotation: the raw queries are the queries.
    const bool rotate = p.key_rotation.kind != RotationKind::kNone;
    load_rows<D>(p.io, p.queries, state_base, group, kMaxTensorCoreGroup, rotate ? &raw[0][0] : &query[0][0]);
    __syncthreads();
    if (!rotate) return;
  } else {
    for (int i = threadIdx.x; i < kMaxTensorCoreGroup * D; i += blockDim.x) {
      const int h = i / D, d = i % D;
      raw[h][d] = h < group ? load_io(p.io, p.queries, (state_base + h) * D + d) : 0.0f;
    }
    __syncthreads();
  }
  rotate_group_queries<D, kRowsInFlight>(p.key_rotation, kv_head, group, kMaxTensorCoreGroup, &raw[0][0],
                                         &query[0][0]);
  __syncthreads();
}

// Head h's state over a block's kWarps warps' (max and sum in log2 units;
// a warp without tokens, m_w = -inf, weighs 0): its max m, returned, its
// sum and each warp's weight 2^(m_w - m) into rescale[w].
template <int kWarps>
__device__ inline float join_warp_states(const float (*state_max)[kMaxTensorCoreGroup],
                                         const float (*state_sum)[kMaxTensorCoreGroup], int h, float& sum,
                                         float* rescale) {
  float m = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, state_max[w][h]);
  sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const float weight = state_max[w][h] == -INFINITY ? 0.0f : exp2f(state_max[w][h] - m);
    if (weight != 0.0f) sum = __fmaf_rn(state_sum[w][h], weight, sum);
    rescale[w] = weight;
  }
  return m;
}

// The block's split state from its kWarps warps' (max and sum in log2
// units, turned back into natural units for the merge kernel; each warp's
// output rows): the block's threads together, after a __syncthreads. A
// head's warp weights 2^(m_w - m) are computed once, by one thread per
// head, not once per channel; a warp without tokens (m_w = -inf) weighs 0
// and its rows are skipped.
template <int D, int kWarps>
__device__ inline void write_block_state(const SplitWorkspace& workspace, int64_t state_base, int split, int group,
                                         const float (&state_max)[kWarps][kMaxTensorCoreGroup],
                                         const float (&state_sum)[kWarps][kMaxTensorCoreGroup],
                                         const float (&out)[kWarps][kMaxTensorCoreGroup][D]) {
  __shared__ float rescale[kMaxTensorCoreGroup][kWarps];
  if (static_cast<int>(threadIdx.x) < group) {
    const int h = threadIdx.x;
    float sum;
    const float m = join_warp_states<kWarps>(state_max, state_sum, h, sum, rescale[h]);
    const int64_t index = (state_base + h) * workspace.max_splits + split;
    workspace.max_sum[2 * index] = m == -INFINITY ? -INFINITY : m * 0.6931471805599453f;  // log2 units to natural
    workspace.max_sum[2 * index + 1] = sum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    const int h = i / D, d = i % D;
    float value = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = rescale[h][w];
      value = weight != 0.0f ? __fmaf_rn(out[w][h][d], weight, value) : value;
    }
    workspace.acc[((state_base + h) * workspace.max_splits + split) * D + d] = value;
  }
}

// ---------------------------------------------------------------- kernel

struct TensorCoreSplits {
  int64_t tokens_per_split = 0;  // a multiple of kTensorCoreWarps * kTileRows
  // The int8 kernel's splits of a (KV head, sequence) are one thread-block
  // cluster that merges their states and writes the output
  // (DecodePlan::cluster_merge, kernels/cluster_merge.cuh).
  bool cluster_merge = false;
};

// The quantized tokens [first, last) of a tensor-core block (context split
// `split` of KV head `kv_head` of batch entry `entry`), its GQA group size,
// and the index of its first query head's state (entry * H + kv_head * group).
struct BlockTokens {
  int64_t first = 0, last = 0, state_base = 0;
  int group = 0;
};

__device__ inline BlockTokens block_tokens(const DecodeParams& p, const TensorCoreSplits& splits, int split, int kv_head,
                                           int entry) {
  BlockTokens b;
  b.group = p.num_heads / p.key_cache.layout.spec.kv_heads;
  int64_t range_begin, range_end;
  tensor_core_range(p, entry_length(p, entry), range_begin, range_end);
  b.first = range_begin + static_cast<int64_t>(split) * splits.tokens_per_split;
  b.last = b.first + splits.tokens_per_split < range_end ? b.first + splits.tokens_per_split : range_end;
  b.state_base = static_cast<int64_t>(entry) * p.num_heads + static_cast<int64_t>(kv_head) * b.group;
  return b;
}

// An empty split's states (one per query head of the group): a max of -inf,
// which the merge skips.
__device__ inline void write_empty_state(const SplitWorkspace& workspace, const BlockTokens& block, int split) {
  if (threadIdx.x < block.group) {
    workspace.max_sum[2 * ((block.state_base + threadIdx.x) * workspace.max_splits + split)] = -INFINITY;
  }
}

// Keys whose (a, b) are per channel: every token's codes share them.
__device__ inline bool per_channel_groups(const TensorLayoutSpec& spec) {
  return spec.grouping == ScaleGrouping::kPerChannelTokens || spec.grouping == ScaleGrouping::kPerChannelOffline;
}

// Shared memory of one block.
template <int D>
struct TensorCoreShared {
  // The group's queries, rotated by the keys' rotation (rows 16-byte
  // aligned for rotate_group_queries, as are raw_query's after them).
  alignas(16) float query[kMaxTensorCoreGroup][D];
  float raw_query[kMaxTensorCoreGroup][D];
  float weights[kTensorCoreWarps][kTileRows][kMaxTensorCoreGroup];  // p of the tile, per warp
  float alpha[kTensorCoreWarps][kMaxTensorCoreGroup];
  float state_max[kTensorCoreWarps][kMaxTensorCoreGroup], state_sum[kTensorCoreWarps][kMaxTensorCoreGroup];
  float out[kTensorCoreWarps][kMaxTensorCoreGroup][D];  // value outlier corrections, then each warp's acc
  // The tile's per-token group affines, from its stage's pairs (lane j keys,
  // lane 16 + j values of token j).
  Affine key_affine[kTensorCoreWarps][kTileRows][4], value_affine[kTensorCoreWarps][kTileRows][4];
  Affine channel[kTensorCoreWarps][D];  // per-channel keys: the current token group's (or the offline) affines
};

inline constexpr int kStages = 3;  // tiles per warp in flight: the one computed and two loading

// One tile's bytes in shared memory (dynamic, kStages per warp): the 16
// tokens' code rows and group pairs of keys and values, copied
// asynchronously, and where each token lies (for the outliers).
template <int D, int kBits, int KG, int VG>
struct TileStage {
  static constexpr int kRowBytes = D * kBits / 8;
  uint4 key_codes[kTileRows * kRowBytes / 16];
  uint4 value_codes[kTileRows * kRowBytes / 16];
  uint2 key_pairs[kTileRows][KG];  // (min, max), 4 or 8 bytes each
  uint2 value_pairs[kTileRows][VG];
  SlotAddress key_at[kTileRows], value_at[kTileRows];  // page null: past the range
};

template <int D, int kBits, int KG, int VG>
constexpr int tensor_core_dynamic_shared_bytes() {
  return kTensorCoreWarps * kStages * static_cast<int>(sizeof(TileStage<D, kBits, KG, VG>));
}

// KG, VG: the most channel groups of a per-token grouping a key and a value
// row may have (1: one group per row, as all-heads, per-channel keys and
// G' = D; 4: G' = D/4, D/2 or D, counted at run time).
template <int D, int kBits, int KG, int VG>
__global__ void __launch_bounds__(kTensorCoreWarps * kWarpSize)
    decode_tensor_core_kernel(const DecodeParams p, const SplitWorkspace workspace, const TensorCoreSplits splits) {
  constexpr int kSteps = D / 16;               // k steps of the keys = m tiles of the values
  constexpr int kWords = D * kBits / 32;       // 32-bit code words per row
  constexpr int kTop = (1 << kBits) - 1;
  using Stage = TileStage<D, kBits, KG, VG>;
  constexpr int kRowChunks = Stage::kRowBytes / 16;  // 16-byte copies per code row
  // Raw bytes: a __shared__ variable is never constructed, and the
  // struct's members have default initializers (Affine's).
  __shared__ __align__(16) uint8_t shared_bytes[sizeof(TensorCoreShared<D>)];
  auto& shared = *reinterpret_cast<TensorCoreShared<D>*>(shared_bytes);
  extern __shared__ __align__(16) uint8_t dynamic_shared[];

  const int split = blockIdx.x, kv_head = blockIdx.y, entry = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;
  const BlockTokens block = block_tokens(p, splits, split, kv_head, entry);
  const int group = block.group;
  const int64_t first = block.first, last = block.last, state_base = block.state_base;
  if (first >= last) {  // an empty split: a state the merge skips
    write_empty_state(workspace, block, split);
    return;
  }
  const int32_t slot = entry_slot(p, entry);
  const int32_t* page_row = p.batch.page_table + slot * p.batch.page_table_stride;
  const TensorPageLayout& kl = p.key_cache.layout;
  const TensorPageLayout& vl = p.value_cache.layout;
  const int sink = kl.spec.sink_tokens;
  const bool per_channel_keys = per_channel_groups(kl.spec);
  const int key_group_channels = KG == 1 || per_channel_keys ? D : kl.spec.group;
  const int value_group_channels =
      VG == 1 || vl.spec.grouping == ScaleGrouping::kPerTokenAllHeads ? D : vl.spec.group;
  const int key_groups = D / key_group_channels, value_groups = D / value_group_channels;
  const int key_pairs_per_head = D / key_group_channels, value_pairs_per_head = D / value_group_channels;

  load_group_queries<D>(p, workspace.queries, state_base, group, kv_head, shared.query, shared.raw_query, &shared.out[0][0][0],
                        kTensorCoreWarps * kMaxTensorCoreGroup * D);

  // This warp's tiles: a contiguous run of the split's.
  const int64_t tiles = (last - first + kTileRows - 1) / kTileRows;
  const int64_t per_warp = (tiles + kTensorCoreWarps - 1) / kTensorCoreWarps;
  const int64_t tile_begin = warp * per_warp, tile_end = tile_begin + per_warp < tiles ? tile_begin + per_warp : tiles;
  const float* my_query = shared.query[g];  // B column g (zeros past the group)

  // Key B fragments (hi, lo) per k step and the a-terms: per-token keys
  // sum_{d in group} q'_d per key group (head g); per-channel keys q'.a.
  uint32_t key_b[kSteps][2][2];  // [step][register][hi, lo]
  float key_a_term[KG];          // per-token keys: of head g; per-channel: [0] of head g
  int64_t key_params_group = -1;  // per_channel_tokens: the token group key_b was built for
  auto build_key_operands = [&](int64_t s) {
    if (per_channel_keys) {  // the group's D channel affines, 4 per lane, then read by every lane
      const ChannelStream stream = channel_stream(kl, s, kv_head);
      for (int d = lane; d < D; d += kWarpSize) {
        shared.channel[warp][d] = channel_affine(p.key_cache, p.key_dequantization, page_row, stream, kv_head, d, kTop);
      }
      __syncwarp();
    }
    float partial[KG];
#pragma unroll
    for (int kg = 0; kg < KG; ++kg) partial[kg] = 0.0f;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
#pragma unroll
      for (int which = 0; which < 2; ++which) {
        int d0, d1;
        key_channels<kBits>(c, which, d0, d1);
        d0 += 16 * step;
        d1 += 16 * step;
        float x0 = my_query[d0], x1 = my_query[d1];
        if (per_channel_keys) {
          const Affine a0 = shared.channel[warp][d0], a1 = shared.channel[warp][d1];
          partial[0] = __fmaf_rn(x0, a0.a, __fmaf_rn(x1, a1.a, partial[0]));
          x0 = __fmul_rn(x0, a0.b);
          x1 = __fmul_rn(x1, a1.b);
        } else {
#pragma unroll
          for (int kg = 0; kg < KG; ++kg) {
            if (kg == (16 * step) / key_group_channels) partial[kg] += x0 + x1;
          }
        }
        const SplitBf16x2 split_q = split_bf16(x0, x1);
        key_b[step][which][0] = split_q.hi;
        key_b[step][which][1] = split_q.lo;
      }
    }
#pragma unroll
    for (int kg = 0; kg < KG; ++kg) {  // over the 4 lanes of column g
      partial[kg] += __shfl_xor_sync(0xffffffffu, partial[kg], 1);
      partial[kg] += __shfl_xor_sync(0xffffffffu, partial[kg], 2);
      key_a_term[kg] = partial[kg];
    }
  };
  if (kl.spec.grouping != ScaleGrouping::kPerChannelTokens) build_key_operands(0);

  float running_max[2] = {-INFINITY, -INFINITY}, running_sum[2] = {0.0f, 0.0f};  // heads 2c, 2c+1
  float acc[kSteps][4];  // values: m tile, C fragment (rows g, g+8 x heads 2c, 2c+1)
#pragma unroll
  for (int t = 0; t < kSteps; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  float value_a_term[VG];  // head g, this lane's tokens (summed over the 4 lanes at the end)
#pragma unroll
  for (int vg = 0; vg < VG; ++vg) value_a_term[vg] = 0.0f;
  const float log2e_scale = p.softmax_scale * 1.4426950408889634f;
  const bool key_outliers = kl.outlier_spans > 0, value_outliers = vl.outlier_spans > 0;

  Stage* stages = reinterpret_cast<Stage*>(dynamic_shared) + warp * kStages;
  const int page_size = kl.spec.page_size;
  const int pair_bytes = static_cast<int>(kl.pair_bytes);

  // Starts the copies of tile `tile` into its stage (every lane takes part).
  auto issue = [&](int64_t tile) {
    Stage& stage = stages[tile % kStages];
    const int64_t t0 = first + tile * kTileRows;
    const int j = lane % kTileRows;
    const bool values = lane >= kTileRows;
    const int64_t t = t0 + j;
    const bool valid = t < last;
    const int32_t s_index = static_cast<int32_t>(t - sink);
    // Each lane reads its token's page id (the tile's 16 tokens share at
    // most three entries: one cached load; as fast as a window of the table
    // kept in the lanes, measured on the H200 at 4K-128K, batch 32).
    const int page = valid ? page_row[s_index / page_size] : 0;
    const PagedTensor& cache = values ? p.value_cache : p.key_cache;
    SlotAddress at;
    if (valid) at = {cache.pages + static_cast<int64_t>(page) * cache.layout.page_bytes, s_index % page_size};
    (values ? stage.value_at : stage.key_at)[j] = at;
    // Group pairs: lane j the keys', lane 16 + j the values' of token j.
    const int groups = values ? value_groups : (per_channel_keys ? 0 : key_groups);
    const int pairs_per_head = values ? value_pairs_per_head : key_pairs_per_head;
    if (valid) {
      for (int kg = 0; kg < groups; ++kg) {
        const int32_t index =
            token_pair_index(cache.layout.spec, kv_head, static_cast<int32_t>(at.in_page), kg, pairs_per_head);
        const uint8_t* source = at.page + cache.layout.params_offset + index * pair_bytes;
        uint2* target = values ? &stage.value_pairs[j][kg] : &stage.key_pairs[j][kg];
        if (pair_bytes == 4) {
          copy_async<4>(target, source);
        } else {
          copy_async<8>(target, source);
        }
      }
    }
    // Code rows: 16-byte chunks, chunk i of the kind's 16 rows by lane i % 32.
    // Every lane runs every round and every shuffle: with 16 chunks (2-bit
    // rows of 64 channels) lanes 16..31 have no chunk, and a full-mask
    // shuffle they skipped was undefined (garbage addresses in the decode
    // matrix's d64 2-bit case under memcheck, 2026-12-01).
    const uint8_t* page_base = at.page;
    const int32_t in_page = static_cast<int32_t>(at.in_page);
    constexpr int kChunks = kTileRows * kRowChunks;
#pragma unroll
    for (int kind = 0; kind < 2; ++kind) {
      const PagedTensor& tensor = kind == 0 ? p.key_cache : p.value_cache;
#pragma unroll
      for (int round = 0; round < (kChunks + kWarpSize - 1) / kWarpSize; ++round) {
        const int chunk = round * kWarpSize + lane;
        const bool has_chunk = chunk < kChunks;
        const int row = has_chunk ? chunk / kRowChunks : 0, part = chunk % kRowChunks;
        const int source_lane = row + kind * kTileRows;
        const auto base = reinterpret_cast<const uint8_t*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(page_base), source_lane));
        const int32_t row_in_page = __shfl_sync(0xffffffffu, in_page, source_lane);
        if (has_chunk && t0 + row < last) {
          const uint8_t* source = base + code_row_offset(tensor.layout, kv_head, row_in_page) + part * 16;
          copy_async<16>((kind == 0 ? stage.key_codes : stage.value_codes) + chunk, source);
        }
      }
    }
  };

#pragma unroll
  for (int ahead = 0; ahead < kStages - 1; ++ahead) {
    if (tile_begin + ahead < tile_end) issue(tile_begin + ahead);
    copy_async_commit();
  }
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t t0 = first + tile * kTileRows;
    if (tile + kStages - 1 < tile_end) issue(tile + kStages - 1);
    copy_async_commit();
    copy_async_wait<kStages - 1>();  // this tile's group is complete
    __syncwarp();
    const Stage& stage = stages[tile % kStages];
    {  // the tile's affines from its pairs: lane j the keys, lane 16 + j the values of token j
      const int j = lane % kTileRows;
      const bool values = lane >= kTileRows;
      const bool valid = t0 + j < last;
      const PagedTensor& cache = values ? p.value_cache : p.key_cache;
      const Dequantization& dq = values ? p.value_dequantization : p.key_dequantization;
      const int groups = values ? value_groups : (per_channel_keys ? 0 : key_groups);
      for (int kg = 0; kg < groups; ++kg) {
        const uint2* pair = values ? &stage.value_pairs[j][kg] : &stage.key_pairs[j][kg];
        (values ? shared.value_affine : shared.key_affine)[warp][j][kg] =
            valid ? affine_of_pair(cache.layout, dq, reinterpret_cast<const uint8_t*>(pair), kTop)
                  : Affine{0.0f, 0.0f};
      }
      __syncwarp();
    }
    // ---- keys: tokens g and g + 8 (A rows)
    const int64_t key_tokens[2] = {t0 + g, t0 + g + 8};
    uint32_t words[2][kWords];
    SlotAddress key_at[2];
    Affine key_affine[2][KG];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r;
      key_at[r] = stage.key_at[row];
#pragma unroll
      for (int w4 = 0; w4 < kWords / 4; ++w4) {
        const uint4 v = stage.key_codes[row * kRowChunks + w4];
        words[r][4 * w4] = v.x;
        words[r][4 * w4 + 1] = v.y;
        words[r][4 * w4 + 2] = v.z;
        words[r][4 * w4 + 3] = v.w;
      }
#pragma unroll
      for (int kg = 0; kg < KG; ++kg) {
        key_affine[r][kg] = !per_channel_keys && kg < key_groups ? shared.key_affine[warp][row][kg] : Affine{0.0f, 0.0f};
      }
    }
    if (kl.spec.grouping == ScaleGrouping::kPerChannelTokens) {
      const int64_t key_group = (t0 - sink) / kl.spec.group;  // tiles never straddle a group (G % 16 == 0)
      if (key_group != key_params_group) {
        build_key_operands(t0 - sink);
        key_params_group = key_group;
      }
    }
    float dots[KG][4];
#pragma unroll
    for (int kg = 0; kg < KG; ++kg) dots[kg][0] = dots[kg][1] = dots[kg][2] = dots[kg][3] = 0.0f;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      uint32_t a[4];
      key_fragment<kBits, kWords>(words[0], words[1], step, c, a);
      const int step_group = KG == 1 ? 0 : (16 * step) / key_group_channels;
#pragma unroll
      for (int kg = 0; kg < KG; ++kg) {  // a select, not an indexed (local memory) array
        if (kg != step_group) continue;
        mma_bf16(dots[kg], a, key_b[step][0][0], key_b[step][1][0]);
        mma_bf16(dots[kg], a, key_b[step][0][1], key_b[step][1][1]);
      }
    }
    // Scores of C (token g + 8 (i / 2), head 2c + (i % 2)), in log2 units.
    float score[4];
    float a_terms[2][KG];  // the a-terms of heads 2c, 2c+1 (lanes of column 2c, 2c+1)
#pragma unroll
    for (int kg = 0; kg < KG; ++kg) {
      a_terms[0][kg] = shfl(key_a_term[kg], 4 * (2 * c));
      a_terms[1][kg] = shfl(key_a_term[kg], 4 * (2 * c + 1));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = i / 2, h = i % 2;
      float dot = 0.0f;
      if (per_channel_keys) {
        dot = dots[0][i] + a_terms[h][0];
      } else {
#pragma unroll
        for (int kg = 0; kg < KG; ++kg) dot += __fmaf_rn(key_affine[r][kg].b, dots[kg][i], key_affine[r][kg].a * a_terms[h][kg]);
      }
      score[i] = dot;
    }
    if (key_outliers) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (key_tokens[r] >= last) continue;
        float correction[2] = {0.0f, 0.0f};
        for_each_outlier(p.key_cache, slot, key_at[r], kv_head, [&](int d, float x) {
          const int code = code_at<kBits>(kl, key_at[r], kv_head, d);
          Affine affine;
          if (per_channel_keys) {
            affine = shared.channel[warp][d];  // the tile's token group's
          } else {
            affine = key_affine[r][0];
#pragma unroll
            for (int kg = 1; kg < KG; ++kg) {
              if (kg == d / key_group_channels) affine = key_affine[r][kg];
            }
          }
          const float delta = x - __fmaf_rn(affine.b, static_cast<float>(code), affine.a);
          correction[0] = __fmaf_rn(shared.query[2 * c][d], delta, correction[0]);
          correction[1] = __fmaf_rn(shared.query[2 * c + 1][d], delta, correction[1]);
        });
        score[2 * r] += correction[0];
        score[2 * r + 1] += correction[1];
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) score[i] = key_tokens[i / 2] < last ? score[i] * log2e_scale : -INFINITY;

    // ---- online softmax per head (columns 2c, 2c+1), over the tile's 16 rows
    float alpha[2], weight[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = fmaxf(score[h], score[2 + h]);
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      const float new_max = fmaxf(running_max[h], m);
      alpha[h] = exp2f(running_max[h] - new_max);  // 0 on the first tile
      weight[h] = exp2f(score[h] - new_max);
      weight[2 + h] = exp2f(score[2 + h] - new_max);
      float sum = weight[h] + weight[2 + h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      sum += __shfl_xor_sync(0xffffffffu, sum, 8);
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      running_sum[h] = __fmaf_rn(running_sum[h], alpha[h], sum);
      running_max[h] = new_max;
    }
    rescale_columns(acc, alpha);
    shared.weights[warp][g][2 * c] = weight[0];
    shared.weights[warp][g][2 * c + 1] = weight[1];
    shared.weights[warp][g + 8][2 * c] = weight[2];
    shared.weights[warp][g + 8][2 * c + 1] = weight[3];
    if (g == 0) {
      shared.alpha[warp][2 * c] = alpha[0];
      shared.alpha[warp][2 * c + 1] = alpha[1];
    }
    __syncwarp();

    // ---- values: tokens 2c, 2c+1, 2c+8, 2c+9 (B rows), column g
    const int value_rows[4] = {2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9};
    SlotAddress value_at[4];
    float w_token[4];
    Affine value_affine[4][VG];
    const float alpha_g = shared.alpha[warp][g];
#pragma unroll
    for (int vg = 0; vg < VG; ++vg) value_a_term[vg] *= alpha_g;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t t = t0 + value_rows[u];
      const bool valid = t < last && g < group;
      w_token[u] = valid ? shared.weights[warp][value_rows[u]][g] : 0.0f;
#pragma unroll
      for (int vg = 0; vg < VG; ++vg) value_affine[u][vg] = {0.0f, 0.0f};
      if (t >= last) continue;
      value_at[u] = stage.value_at[value_rows[u]];
#pragma unroll
      for (int vg = 0; vg < VG; ++vg) {
        if (vg >= value_groups) continue;
        value_affine[u][vg] = shared.value_affine[warp][value_rows[u]][vg];
        value_a_term[vg] = __fmaf_rn(w_token[u], value_affine[u][vg].a, value_a_term[vg]);
      }
    }
    uint32_t value_b[VG][2][2];  // [group][register][hi, lo]
#pragma unroll
    for (int vg = 0; vg < VG; ++vg) {
      const SplitBf16x2 b01 = split_bf16(w_token[0] * value_affine[0][vg].b, w_token[1] * value_affine[1][vg].b);
      const SplitBf16x2 b89 = split_bf16(w_token[2] * value_affine[2][vg].b, w_token[3] * value_affine[3][vg].b);
      value_b[vg][0][0] = b01.hi;
      value_b[vg][0][1] = b01.lo;
      value_b[vg][1][0] = b89.hi;
      value_b[vg][1][1] = b89.lo;
    }
    // 64 channels (4 m tiles) of the four tokens' rows at a time.
    constexpr int kChunkWords = 64 * kBits / 32;
#pragma unroll
    for (int chunk = 0; chunk < D / 64; ++chunk) {
      uint32_t chunk_words[4][kChunkWords];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int w = 0; w < kChunkWords; ++w) chunk_words[u][w] = 0;
        if (t0 + value_rows[u] >= last) continue;
        const uint4* row = stage.value_codes + value_rows[u] * kRowChunks + chunk * (kChunkWords / 4);
#pragma unroll
        for (int w4 = 0; w4 < kChunkWords / 4; ++w4) {
          const uint4 v = row[w4];
          chunk_words[u][4 * w4] = v.x;
          chunk_words[u][4 * w4 + 1] = v.y;
          chunk_words[u][4 * w4 + 2] = v.z;
          chunk_words[u][4 * w4 + 3] = v.w;
        }
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const int tile_index = chunk * 4 + mt;
        const uint32_t e0 = value_codes<kBits>(chunk_words[0], mt, g), e1 = value_codes<kBits>(chunk_words[1], mt, g);
        const uint32_t e8 = value_codes<kBits>(chunk_words[2], mt, g), e9 = value_codes<kBits>(chunk_words[3], mt, g);
        const uint32_t a[4] = {__byte_perm(e0, e1, 0x5410), __byte_perm(e0, e1, 0x7632), __byte_perm(e8, e9, 0x5410),
                               __byte_perm(e8, e9, 0x7632)};
        const int tile_group = VG == 1 ? 0 : (16 * tile_index) / value_group_channels;
#pragma unroll
        for (int vg = 0; vg < VG; ++vg) {  // a select, not an indexed array
          if (vg != tile_group) continue;
          mma_bf16(acc[tile_index], a, value_b[vg][0][0], value_b[vg][1][0]);
          mma_bf16(acc[tile_index], a, value_b[vg][0][1], value_b[vg][1][1]);
        }
      }
    }
    if (value_outliers) {
      // Rescale this warp's corrections to the new maxima, then add the
      // tile's: lanes 0..15 take one token each.
      for (int i = lane; i < group * D; i += kWarpSize) shared.out[warp][i / D][i % D] *= shared.alpha[warp][i / D];
      __syncwarp();
      const int tokens = static_cast<int>(last - t0 < kTileRows ? last - t0 : kTileRows);
      add_value_outliers(
          p.value_cache, slot, kv_head, tokens, group, [&](int l) { return stage.value_at[l]; },
          [&](int l, int d, float x) {
            const int code = code_at<kBits>(vl, stage.value_at[l], kv_head, d);
            const Affine affine = shared.value_affine[warp][l][d / value_group_channels];
            return x - __fmaf_rn(affine.b, static_cast<float>(code), affine.a);
          },
          [&](int l, int h) { return shared.weights[warp][l][h]; }, shared.out[warp]);
    }
    __syncwarp();  // the tile's weights are read before the next tile writes them
  }

  // ---- this warp's state into shared memory (the a-terms over the 4 lanes of column g)
#pragma unroll
  for (int vg = 0; vg < VG; ++vg) {
    value_a_term[vg] += __shfl_xor_sync(0xffffffffu, value_a_term[vg], 1);
    value_a_term[vg] += __shfl_xor_sync(0xffffffffu, value_a_term[vg], 2);
  }
  if (g == 0) {
    shared.state_max[warp][2 * c] = running_max[0];
    shared.state_max[warp][2 * c + 1] = running_max[1];
    shared.state_sum[warp][2 * c] = running_sum[0];
    shared.state_sum[warp][2 * c + 1] = running_sum[1];
  }
#pragma unroll
  for (int t = 0; t < kSteps; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = i < 2 ? g : g + 8, h = 2 * c + (i % 2);
      shared.out[warp][h][16 * t + value_channel<kBits>(row)] += acc[t][i];
    }
  }
  __syncwarp();
  if (g < group) {
    for (int d = c; d < D; d += 4) {
      float a_term = value_a_term[0];
#pragma unroll
      for (int vg = 1; vg < VG; ++vg) {
        if (vg == d / value_group_channels) a_term = value_a_term[vg];
      }
      shared.out[warp][g][d] += a_term;
    }
  }
  __syncthreads();

  write_block_state<D, kTensorCoreWarps>(workspace, state_base, split, group, shared.state_max, shared.state_sum,
                                         shared.out);
}

}  // namespace kvforge::kernels::decode_attention_device
