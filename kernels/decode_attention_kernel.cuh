#pragma once
// The general decode kernel (docs/runtime-layout.md, section 6.3): one query
// token per sequence over its paged, quantized KV cache, split over the
// context as flash-decoding; the splits are merged by decode_merge_kernel
// (decode_merge_kernel.cuh). It takes every layout, and the exact ranges
// (sink, windows) of layouts the tensor-core kernels read.
//
//   decode_split_kernel<D, kBits, kWarps>: one block per (split, KV head,
//     sequence). The block dequantizes a tile of kTileTokens tokens of keys
//     and values into shared memory once (codes as 32-bit words, the level
//     table in shared memory, (min, max) pairs or offline channel
//     parameters, then the outlier entries of the tokens' CSR rows, then
//     RoPE for pre-RoPE keys), and warp w < group computes query head
//     kv_head * group + w over it: lane j scores token j of the tile, the
//     warp keeps the running max, sum and D/32 accumulators per lane
//     (online softmax in float32, updated once per tile). It writes the
//     split's (max, sum, acc[D]) state.
//
// Every page of a split is read once for all query heads of its KV head.
// Inside a split the order of the sums differs from the CPU reference's
// (tile-wise rescaling, sequential dot products per lane); the splits, the
// merge and the dequantization arithmetic are the reference's.
//
// The device pieces every decode kernel shares live in their own headers,
// included here so that the other kernels' files get them with this one:
// element loads and stores (element_access.cuh), warp reductions, the
// paged cache's addressing (page_reading.cuh), the query rotation, RoPE
// (rope_device.cuh) and the split states (split_states.cuh).
#include <cstdint>

#include "kernels/decode_params.h"
#include "kernels/element_access.cuh"
#include "kernels/fixed_divisor.h"
#include "kernels/page_reading.cuh"
#include "kernels/pair_affine.h"
#include "kernels/programmatic_launch.cuh"
#include "kernels/query_rotation.cuh"
#include "kernels/rope_device.cuh"
#include "kernels/split_states.cuh"
#include "kernels/tile_entries.h"
#include "kernels/warp_reductions.cuh"
#include "kernels/word_store_order.h"

namespace kvforge::kernels::decode_attention_device {

inline constexpr int kTileTokens = 32;  // tokens dequantized per pass: one per lane when scoring
inline constexpr int kMaxLevels = 16;   // 2^4

// ---------------------------------------------------------------- dequantization

// Where the tokens of a sequence with `tokens` cached are read from: its
// quantized range [begin, end) (rule 1 of docs/artifact.md) and the page
// arithmetic of its slots, worked out once per tile instead of per unit.
struct TileReading {
  int32_t begin = 0, end = 0;  // a sequence's tokens: under 2^31
  FixedDivisor page_size;

  __device__ TileReading(const TensorLayoutSpec& spec, int64_t tokens)
      : begin(static_cast<int32_t>(quantized_begin(spec, tokens))),
        end(static_cast<int32_t>(quantized_end(spec, tokens))),
        page_size(static_cast<uint32_t>(spec.page_size)) {}
};


// Slot s's page-table entry and its row in that page (s < 2^31: a
// sequence's slots).
__device__ inline void page_place(const TileReading& r, int32_t s, int32_t& entry, int32_t& in_page) {
  entry = static_cast<int32_t>(r.page_size.quotient(static_cast<uint32_t>(s)));
  in_page = static_cast<int32_t>(r.page_size.remainder(static_cast<uint32_t>(s)));
}

// Calls f(q, bits) for each 16-byte quarter q of a code word, in the
// rotated store order (kernels/word_store_order.h), bits = the word shifted
// to the quarter's first code.
template <int kBits, class F>
__device__ inline void for_each_word_quarter(uint32_t word, int word_index, F&& f) {
#pragma unroll
  for (int i = 0; i < word_quarters(kBits); ++i) {
    const int q = word_store_quarter<kBits>(word_index, i);
    f(q, word >> (q * 4 * kBits));
  }
}

// A word's kPerWord codes as x = fma(b, L[code], a) with one affine, into
// `out` (16-byte aligned) in 16-byte stores.
template <int kBits>
__device__ inline void store_word(uint32_t word, const float* levels, Affine affine, float* out, int word_index) {
  constexpr uint32_t kMask = (1u << kBits) - 1;
  for_each_word_quarter<kBits>(word, word_index, [&](int q, uint32_t bits) {
    float x[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = __fmaf_rn(affine.b, levels[(bits >> (k * kBits)) & kMask], affine.a);
    reinterpret_cast<float4*>(out)[q] = make_float4(x[0], x[1], x[2], x[3]);
  });
}

// The same with channel c's offline (offset, scale) (kPerChannelOffline):
// offset and scale point at the word's first channel, 16-byte aligned, and
// are read four channels per load (read-only, from L1).
template <int kBits>
__device__ inline void store_word_by_channel(uint32_t word, const float* levels, const float* offset,
                                             const float* scale, float* out, int word_index) {
  constexpr uint32_t kMask = (1u << kBits) - 1;
  for_each_word_quarter<kBits>(word, word_index, [&](int q, uint32_t bits) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(offset) + q);
    const float4 b = __ldg(reinterpret_cast<const float4*>(scale) + q);
    const float x0 = __fmaf_rn(b.x, levels[bits & kMask], a.x);
    const float x1 = __fmaf_rn(b.y, levels[(bits >> kBits) & kMask], a.y);
    const float x2 = __fmaf_rn(b.z, levels[(bits >> (2 * kBits)) & kMask], a.z);
    const float x3 = __fmaf_rn(b.w, levels[(bits >> (3 * kBits)) & kMask], a.w);
    reinterpret_cast<float4*>(out)[q] = make_float4(x0, x1, x2, x3);
  });
}

// How a tile's quantized units find their affines; one choice per tensor,
// made once per tile (the grouping is the layout's), not per element.
enum class UnitAffine : int32_t {
  kTokenPair = 0,      // one stored pair per unit: all heads', or a per-token group holding the whole word
  kChannelOffline = 1, // the channels' offline (offset, scale)
  kPerElement = 2,     // groups narrower than a word, per-channel token groups (or unaligned offline tables)
};

__device__ inline UnitAffine unit_affine(const TensorLayoutSpec& spec, const Dequantization& dq, int per_word) {
  switch (spec.grouping) {
    case ScaleGrouping::kPerTokenAllHeads:
      return UnitAffine::kTokenPair;
    case ScaleGrouping::kPerToken:
      return spec.group % per_word == 0 ? UnitAffine::kTokenPair : UnitAffine::kPerElement;
    case ScaleGrouping::kPerChannelOffline:  // the tables in 16-byte loads where they allow them
      return ((reinterpret_cast<uintptr_t>(dq.channel_offset) | reinterpret_cast<uintptr_t>(dq.channel_scale)) & 15u) == 0
                 ? UnitAffine::kChannelOffline
                 : UnitAffine::kPerElement;
    case ScaleGrouping::kPerChannelTokens:
      break;
  }
  return UnitAffine::kPerElement;
}

// Byte offsets inside a page of one head's code rows and per-token pairs,
// in 32 bits (a page is under 2 GiB) from constants worked out once per
// tile: runtime_layout.h's code_row_offset and token_pair_offset are int64
// and divide by the heads (a 64-bit division call per unit, which with the
// pair's address had cost kvquant's values ~7% of the general kernel's
// instructions).
struct HeadPageOffsets {
  int32_t code_row0 = 0, row_bytes = 0;  // row r of the head: code_row0 + r * row_bytes
  PairPlace pairs;                        // per-token groupings: the pair of row r and channel group g
};

template <int D>
__device__ inline HeadPageOffsets head_page_offsets(const TensorPageLayout& l, int head) {
  HeadPageOffsets o;
  o.row_bytes = static_cast<int32_t>(l.row_bytes);
  o.code_row0 = head * l.spec.page_size * o.row_bytes;
  o.pairs = pair_place(l, head, l.spec.grouping == ScaleGrouping::kPerToken ? D / l.spec.group : 1);
  return o;
}

// Head `head` of tokens [first, first + count) into tile[j * stride + d], in
// the stored basis, without the outliers: every thread of the block takes
// (token, 32-bit code word) units and stores each unit's elements in 16-byte
// stores (tile and stride keep every row 16-byte aligned). A thread's units
// read their page ids, then their words and pairs, each round's loads in
// flight together, before any element is made. The affine is found once per
// unit where the grouping allows (UnitAffine): kvquant's per-channel keys
// and per-token values had spent a third of their instructions on a switch
// over the grouping and its loads for every element.
template <int D, int kBits, int kThreads>
__device__ void dequantize_tile(const PagedTensor& cache, const Dequantization& dq, const float* levels, int32_t slot,
                                const int32_t* page_row, int64_t tokens, int64_t first, int count, int head,
                                float* tile, int stride) {
  constexpr int kPerWord = 32 / kBits;
  constexpr int kWords = D / kPerWord;
  constexpr int kUnits = (kTileTokens * kWords + kThreads - 1) / kThreads;  // a thread's units at most
  constexpr uint32_t kMask = (1u << kBits) - 1;
  constexpr int kTop = (1 << kBits) - 1;
  const TensorPageLayout& l = cache.layout;
  const TensorLayoutSpec& spec = l.spec;
  const int64_t element = element_bytes(spec.element);
  const TileReading reading(spec, tokens);
  const UnitAffine affine_kind = unit_affine(spec, dq, kPerWord);
  const HeadPageOffsets offsets = head_page_offsets<D>(l, head);
  // Units in batches of two at 2 bits; one at 4 (a batch of two spilled
  // there, 164 bytes at head_dim 128).
  constexpr int kBatch = kBits == 2 && kUnits >= 2 ? 2 : 1;
#pragma unroll 1
  for (int batch = 0; batch < kUnits; batch += kBatch) {
    // Round 1: each quantized unit's page id (-1: no unit, or an exact token).
    int32_t page_id[kBatch];
    int32_t in_page[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int unit = static_cast<int>(threadIdx.x) + (batch + u) * kThreads;
      page_id[u] = -1;
      in_page[u] = 0;
      const int32_t token = static_cast<int32_t>(first) + unit / kWords;
      if (unit < count * kWords && token >= reading.begin && token < reading.end) {
        int32_t entry;
        page_place(reading, token - spec.sink_tokens, entry, in_page[u]);
        page_id[u] = page_row[entry];
      }
    }
    // Round 2: the words and, one pair per unit, the pairs.
    uint32_t word[kBatch];
    Affine token_affine[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      word[u] = 0;
      if (page_id[u] >= 0) {
        const int word_index = (static_cast<int>(threadIdx.x) + (batch + u) * kThreads) % kWords;
        const uint8_t* page = cache.pages + static_cast<int64_t>(page_id[u]) * l.page_bytes;
        word[u] = load_u32(page + offsets.code_row0 + in_page[u] * offsets.row_bytes + word_index * 4);
        if (affine_kind == UnitAffine::kTokenPair) {
          // The word's group (all heads: group 0); kTokenPair's groups hold whole words.
          const int32_t group = spec.grouping == ScaleGrouping::kPerToken ? word_index * kPerWord / spec.group : 0;
          const int32_t at = offsets.pairs.base + in_page[u] * offsets.pairs.token_stride + group * offsets.pairs.group_stride;
          token_affine[u] = affine_of_pair(l, dq, page + at, kTop);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int unit = static_cast<int>(threadIdx.x) + (batch + u) * kThreads;
      if (unit >= count * kWords) break;
      const int j = unit / kWords, word_index = unit % kWords, d0 = word_index * kPerWord;
      float* out = tile + j * stride + d0;  // 16-byte aligned (the tiles' rows are, and d0 is a multiple of 8)
      if (page_id[u] < 0) {  // an exact token
        const int32_t row = exact_store_row(l, static_cast<int32_t>(first + j));
        const uint8_t* in = cache.exact + slot * l.exact_slot_bytes + exact_row_offset(l, head, row);
        float x[kPerWord];
        load_elements<kPerWord>(spec.element, in + d0 * element, x);
        store_floats(out, x);
        continue;
      }
      if (affine_kind == UnitAffine::kTokenPair) {
        store_word<kBits>(word[u], levels, token_affine[u], out, word_index);
        continue;
      }
      if (affine_kind == UnitAffine::kChannelOffline) {
        const int64_t channel = static_cast<int64_t>(head) * D + d0;
        store_word_by_channel<kBits>(word[u], levels, dq.channel_offset + channel, dq.channel_scale + channel, out,
                                     word_index);
        continue;
      }
      // kPerElement.
      const uint8_t* page = cache.pages + static_cast<int64_t>(page_id[u]) * l.page_bytes;
      float x[kPerWord];
      Affine affine;
#pragma unroll
      for (int c = 0; c < kPerWord; ++c) {
        const int d = d0 + c;
        if (spec.grouping == ScaleGrouping::kPerToken) {
          if (c == 0 || d % spec.group == 0) {
            // token_pair_offset, not offsets.pairs: kept live through this
            // path, they spill 24 more bytes at 4 bits (ptxas).
            affine = affine_of_pair(l, dq, page + token_pair_offset(l, head, in_page[u], d / spec.group), kTop);
          }
        } else if (spec.grouping == ScaleGrouping::kPerChannelOffline) {
          affine = {dq.channel_offset[head * D + d], dq.channel_scale[head * D + d]};
        } else {  // kPerChannelTokens
          const int64_t s = first + j - spec.sink_tokens;
          const int64_t sigma = channel_pair_stream_index(l, s / spec.group, static_cast<int64_t>(head) * D + d);
          const int64_t per_page = pairs_per_page(l);
          const uint8_t* params =
              cache.pages + static_cast<int64_t>(page_row[sigma / per_page]) * l.page_bytes + l.params_offset;
          affine = affine_of_pair(l, dq, params + (sigma % per_page) * l.pair_bytes, kTop);
        }
        const uint32_t code = (word[u] >> (c * kBits)) & kMask;
        x[c] = __fmaf_rn(affine.b, levels[code], affine.a);
        // Each 16-byte quarter as soon as it is done: storing the word's 16
        // elements at the end kept them all live and cost the kernel a
        // resident block (96 registers against 80; bench/README.md, ninth
        // session).
        if (c % 4 == 3) reinterpret_cast<float4*>(out)[c / 4] = make_float4(x[c - 3], x[c - 2], x[c - 1], x[c]);
      }
    }
  }
}

// The outlier entries of the quantized tokens of a tile replace their
// elements, for keys and values together, in two rounds of loads: each
// token's row pointers (warp 0 the keys', warp 1 the values', lane j token
// j), then every entry of the tile at once (the block's threads over the
// entries). One warp per token and its entries in turn had made a chain of
// ~64 dependent loads per tile, most of kvquant's time.
struct TileOutlierRows {
  uint32_t begin[2][kTileTokens];  // [keys, values][token]: the token row's first entry
  uint32_t end[2][kTileTokens];    // the entries of tokens 0..j of the tile (inclusive prefix)
};

// Round 1 (warps 0 and 1; the caller synchronizes before round 2). An
// all-heads row (one span per token) is narrowed to the block's head.
template <int D>
__device__ inline void read_outlier_rows(const PagedTensor& cache, int which, int32_t slot, const int32_t* page_row,
                                         int64_t tokens, int64_t first, int count, int head, TileOutlierRows& rows) {
  const TensorPageLayout& l = cache.layout;
  const int lane = threadIdx.x % kWarpSize;
  uint32_t begin = 0, entries = 0;
  if (l.outlier_spans > 0 && lane < count) {
    const TileReading reading(l.spec, tokens);
    const int32_t token = static_cast<int32_t>(first) + lane;
    if (token >= reading.begin && token < reading.end) {
      int32_t entry, in_page;
      page_place(reading, token - l.spec.sink_tokens, entry, in_page);
      const uint8_t* page = cache.pages + static_cast<int64_t>(page_row[entry]) * l.page_bytes;
      const int64_t span = l.outlier_spans == 1 ? 0 : head;
      const uint8_t* pointer = page + row_pointer_offset(l, in_page * l.outlier_spans + span);
      begin = load_u32(pointer);
      entries = load_u32(pointer + kRowPointerBytes) - begin;
      if (l.outlier_spans == 1 && entries > 0) {
        const OutlierPages pages(cache, slot);
        const auto lo = static_cast<uint32_t>(head) * D;
        tile_entries::narrow_to_span<8>(begin, entries, lo, lo + D,
                                        [&](uint32_t e) { return pages.index(cache, e); });
      }
    }
  }
  uint32_t through = entries;  // inclusive prefix over the lanes
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const uint32_t below = __shfl_up_sync(0xffffffffu, through, offset);
    if (lane >= offset) through += below;
  }
  rows.begin[which][lane] = begin;
  rows.end[which][lane] = through;
}

// Round 2: entry f of the tile's `which` rows (every thread of the block).
template <int D>
__device__ void put_back_outlier_entries(const PagedTensor& cache, int which, int32_t slot, int head,
                                         const TileOutlierRows& rows, float* tile, int stride) {
  const TensorPageLayout& l = cache.layout;
  if (l.outlier_spans == 0) return;
  const OutlierPages pages(cache, slot);
  const uint32_t total = rows.end[which][kTileTokens - 1];
  for (uint32_t f = threadIdx.x; f < total; f += blockDim.x) {
    const int j = tile_entries::row_of<kTileTokens>(rows.end[which], f);  // the entry's token
    const uint32_t e = tile_entries::entry_of(rows.begin[which], rows.end[which], j, f);
    const uint8_t* outlier_page = pages.page(cache, e);
    const uint32_t in_page = pages.slot_in_page(e);
    uint32_t index = load_index(outlier_page + outlier_index_offset(l, in_page), l.outlier_index_bytes);
    if (l.outlier_spans == 1) index %= D;  // all heads: head * D + d, only the head's (read_outlier_rows)
    tile[j * stride + index] = load_element(l.spec.element, outlier_page + outlier_value_offset(l, in_page));
  }
}

// ---------------------------------------------------------------- the kernel

// Residency: 24 warps per multiprocessor (80 registers at 4 and 8 warps a
// block). Unbounded, ptxas took 96 registers at head_dim 128 (20 warps) and
// 128 at 64 (16), which cost kvquant 8-10% at batch 8 and 32, where the grid
// runs many waves; 32 warps (64 registers) spilled at head_dim 64.
template <int D, int kBits, int kWarps>
__global__ void __launch_bounds__(kWarps * kWarpSize, 24 / kWarps)
    decode_split_kernel(const DecodeParams p, const SplitWorkspace workspace, const SplitAssignment assignment) {
  // Launched as the int8 kernel's dependent (the exact ranges), it reads
  // nothing that kernel writes, and waits for it before it exits, so that
  // its completion (what the merge waits for) implies the int8 kernel's;
  // launched first (DecodePlan::exact_first), the int8 kernel may start
  // once every block of this one runs.
  allow_dependent_launch();
  // Lane j reads key row j in 16-byte loads: rows 16-byte aligned and 4
  // banks apart, so that the 8 lanes of a load's phase hit 8 different
  // groups of 4 banks.
  constexpr int kKeyStride = D + 4;
  // Lane l accumulates channels [kPerLane l, kPerLane (l + 1)) of its
  // head's output (one 16- or 8-byte load of a value row per token).
  constexpr int kPerLane = D / kWarpSize;
  static_assert(kPerLane == 2 || kPerLane == 4, "head_dim 64 or 128");
  __shared__ __align__(16) float keys[kTileTokens * kKeyStride];
  __shared__ __align__(16) float values[kTileTokens * D];
  __shared__ __align__(16) float query[kWarps * D];
  static_assert(kWarps <= kTileTokens, "the raw queries are staged in the value tile");
  float* raw_query = values;  // before the first tile
  __shared__ float key_levels[kMaxLevels], value_levels[kMaxLevels];
  __shared__ __align__(16) float rope_frequencies[D / 2];  // pre-RoPE keys: the model's inv_freq
  __shared__ TileOutlierRows outlier_rows;
  const bool outliers = p.key_cache.layout.outlier_spans > 0 || p.value_cache.layout.outlier_spans > 0;

  const int split = blockIdx.x, kv_head = blockIdx.y, entry = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t tokens = entry_length(p, entry);
  int64_t first, last;
  split_tokens(p, assignment, tokens, split, first, last);
  const int kv_heads = p.key_cache.layout.spec.kv_heads;
  const int group = p.num_heads / kv_heads;
  const int state = assignment.first_state + split;
  if (first >= last) {  // an empty split: a state the merge skips
    if (threadIdx.x < group) {
      const int64_t index = (static_cast<int64_t>(entry) * p.num_heads + kv_head * group + threadIdx.x) *
                                workspace.max_splits + state;
      workspace.max_sum[2 * index] = -INFINITY;
    }
    wait_for_prerequisite_grid();
    return;
  }
  const int32_t slot = entry_slot(p, entry);
  const int32_t* page_row = p.batch.page_table + slot * p.batch.page_table_stride;

  // Level tables and the GQA group's queries, rotated by the keys' rotation.
  if (threadIdx.x < (1 << kBits)) {
    key_levels[threadIdx.x] = p.key_dequantization.levels[threadIdx.x];
    value_levels[threadIdx.x] = p.value_dequantization.levels[threadIdx.x];
  }
  if (p.keys_pre_rope) {
    for (int i = threadIdx.x; i < D / 2; i += blockDim.x) rope_frequencies[i] = p.rope_inverse_frequencies[i];
  }
  for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    raw_query[i] = load_io(p.io, p.queries, (static_cast<int64_t>(entry) * p.num_heads + kv_head * group + g) * D + d);
  }
  __syncthreads();
  // 32 rows at a time: the preamble's registers are free (80 a thread).
  rotate_group_queries<D, 32>(p.key_rotation, kv_head, group, group, raw_query, query);

  const bool scoring = warp < group;
  float running_max = -INFINITY, running_sum = 0.0f;
  float acc[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) acc[k] = 0.0f;
  const float* q = query + warp * D;

  for (int64_t tile_first = first; tile_first < last; tile_first += kTileTokens) {
    const int count = static_cast<int>(last - tile_first < kTileTokens ? last - tile_first : kTileTokens);
    __syncthreads();  // the previous tile is consumed (and the queries written)
    constexpr int kThreads = kWarps * kWarpSize;
    dequantize_tile<D, kBits, kThreads>(p.key_cache, p.key_dequantization, key_levels, slot, page_row, tokens,
                                        tile_first, count, kv_head, keys, kKeyStride);
    dequantize_tile<D, kBits, kThreads>(p.value_cache, p.value_dequantization, value_levels, slot, page_row, tokens,
                                        tile_first, count, kv_head, values, D);
    if (outliers && warp < 2) {
      read_outlier_rows<D>(warp == 0 ? p.key_cache : p.value_cache, warp, slot, page_row, tokens, tile_first, count,
                           kv_head, outlier_rows);
    }
    __syncthreads();
    if (outliers) {
      put_back_outlier_entries<D>(p.key_cache, 0, slot, kv_head, outlier_rows, keys, kKeyStride);
      put_back_outlier_entries<D>(p.value_cache, 1, slot, kv_head, outlier_rows, values, D);
    }
    if (p.keys_pre_rope) {
      __syncthreads();
      rope_tile<D>(rope_frequencies, tile_first, count, keys, kKeyStride);
    }
    __syncthreads();
    if (!scoring) continue;
    float score = -INFINITY;
    if (lane < count) {
      // One fma chain in d order, four elements of the query and the key
      // row per load.
      const float4* k = reinterpret_cast<const float4*>(keys + lane * kKeyStride);
      const float4* q4 = reinterpret_cast<const float4*>(q);
      float dot = 0.0f;
#pragma unroll 8
      for (int d4 = 0; d4 < D / 4; ++d4) {
        const float4 x = q4[d4], y = k[d4];
        dot = __fmaf_rn(x.w, y.w, __fmaf_rn(x.z, y.z, __fmaf_rn(x.y, y.y, __fmaf_rn(x.x, y.x, dot))));
      }
      score = __fmul_rn(dot, p.softmax_scale);
    }
    const float tile_max = warp_max(score);
    const float new_max = fmaxf(running_max, tile_max);
    const float rescale = expf(running_max - new_max);  // 0 on the first tile (running_max was -inf)
    const float weight = lane < count ? expf(score - new_max) : 0.0f;
    running_sum = running_sum * rescale + warp_sum(weight);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) acc[k] *= rescale;
    for (int j = 0; j < count; ++j) {
      const float w = __shfl_sync(0xffffffffu, weight, j);
      const float* v = values + j * D + kPerLane * lane;
      if constexpr (kPerLane == 4) {
        const float4 x = *reinterpret_cast<const float4*>(v);
        acc[0] = __fmaf_rn(w, x.x, acc[0]);
        acc[1] = __fmaf_rn(w, x.y, acc[1]);
        acc[2] = __fmaf_rn(w, x.z, acc[2]);
        acc[3] = __fmaf_rn(w, x.w, acc[3]);
      } else {
        const float2 x = *reinterpret_cast<const float2*>(v);
        acc[0] = __fmaf_rn(w, x.x, acc[0]);
        acc[1] = __fmaf_rn(w, x.y, acc[1]);
      }
    }
    running_max = new_max;
  }
  if (scoring) {
    const int64_t index =
        (static_cast<int64_t>(entry) * p.num_heads + kv_head * group + warp) * workspace.max_splits + state;
    if (lane == 0) {
      workspace.max_sum[2 * index] = running_max;
      workspace.max_sum[2 * index + 1] = running_sum;
    }
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) workspace.acc[index * D + kPerLane * lane + k] = acc[k];
  }
  wait_for_prerequisite_grid();
}

}  // namespace kvforge::kernels::decode_attention_device
