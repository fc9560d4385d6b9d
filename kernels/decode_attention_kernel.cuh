#pragma once
// The device code of decode_attention (docs/runtime-layout.md, section 6.3):
// one query token per sequence over its paged, quantized KV cache, split
// over the context as flash-decoding, the splits merged by a second kernel.
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
//   decode_merge_kernel<D, kParts, kHeads>: one block of merge_threads() per
//     kHeads query heads of a KV head and sequence merges the non-empty split
//     states (these and the tensor-core kernel's,
//     decode_tensor_core_kernel.cuh), rotates the output back by the values'
//     rotation and stores it in the io type.
//
// Every page of a split is read once for all query heads of its KV head.
// Inside a split the order of the sums differs from the CPU reference's
// (tile-wise rescaling, sequential dot products per lane); the splits, the
// merge and the dequantization arithmetic are the reference's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/angle_reduction.h"
#include "kernels/async_copy.cuh"
#include "kernels/decode_params.h"
#include "kernels/fixed_divisor.h"
#include "kernels/pair_affine.h"
#include "kernels/programmatic_launch.cuh"
#include "kernels/tile_entries.h"
#include "kernels/word_store_order.h"

namespace kvforge::kernels::decode_attention_device {

inline constexpr int kTileTokens = 32;  // tokens dequantized per pass: one per lane when scoring
inline constexpr int kWarpSize = 32;
inline constexpr int kMaxLevels = 16;   // 2^4

// ---------------------------------------------------------------- bytes

__device__ inline float load_element(ElementType element, const uint8_t* at) {
  switch (element) {
    case ElementType::kFloat16:
      return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(at)));
    case ElementType::kBFloat16:
      return __uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(at)) << 16);
    case ElementType::kFloat32:
      break;
  }
  return *reinterpret_cast<const float*>(at);
}

// kCount consecutive elements from `at` into out[0..kCount): in 16-byte
// loads where `at` is 16-byte aligned (an exact row's run of a code word's
// elements is, in a cache from cudaMalloc), else one load per element.
template <int kCount>
__device__ inline void load_elements(ElementType element, const uint8_t* at, float* out) {
  const bool aligned = (reinterpret_cast<uintptr_t>(at) & 15u) == 0;
  if (element == ElementType::kFloat32) {
    if constexpr (kCount % 4 == 0) {
      if (aligned) {
#pragma unroll
        for (int i = 0; i < kCount / 4; ++i) {
          const float4 v = reinterpret_cast<const float4*>(at)[i];
          out[4 * i] = v.x, out[4 * i + 1] = v.y, out[4 * i + 2] = v.z, out[4 * i + 3] = v.w;
        }
        return;
      }
    }
  } else if constexpr (kCount % 8 == 0) {
    if (aligned) {
#pragma unroll
      for (int i = 0; i < kCount / 8; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(at)[i];
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const auto low = static_cast<unsigned short>(words[w] & 0xffffu);
          const auto high = static_cast<unsigned short>(words[w] >> 16);
          if (element == ElementType::kBFloat16) {
            out[8 * i + 2 * w] = __uint_as_float(static_cast<uint32_t>(low) << 16);
            out[8 * i + 2 * w + 1] = __uint_as_float(static_cast<uint32_t>(high) << 16);
          } else {
            out[8 * i + 2 * w] = __half2float(__ushort_as_half(low));
            out[8 * i + 2 * w + 1] = __half2float(__ushort_as_half(high));
          }
        }
      }
      return;
    }
  }
  const int64_t bytes = element_bytes(element);
#pragma unroll
  for (int c = 0; c < kCount; ++c) out[c] = load_element(element, at + c * bytes);
}

// kCount floats (a multiple of 4) to a 16-byte aligned `out` in 16-byte
// stores.
template <int kCount>
__device__ inline void store_floats(float* out, const float (&x)[kCount]) {
  static_assert(kCount % 4 == 0, "whole 16-byte stores");
#pragma unroll
  for (int i = 0; i < kCount / 4; ++i) {
    reinterpret_cast<float4*>(out)[i] = make_float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
  }
}

__device__ inline float load_io(ElementType io, const void* base, int64_t index) {
  return load_element(io, static_cast<const uint8_t*>(base) + index * element_bytes(io));
}

// Rows first_row .. first_row + rows of a [.][D] tensor of `io` elements
// (raw queries, or float32 ones rotated by rotate_group_queries_kernel)
// into out[padded_rows][D] as float32 (16-byte aligned), the rows
// past `rows` zero: the block's threads together, 8 elements a thread and
// round, each round's loads (load_elements: one or two 16-byte loads where
// the rows are 16-byte aligned) issued before its stores. A block of 128
// threads at head_dim 128 so takes one round trip to memory for up to 8
// rows, where one element a thread and iteration took one per element
// (GQA 4: four, ~1.7 us of the int8 kernel's ~11 us that do not scale with
// the context, bench/results/ncu-int8-fixed-cost-h200-2026-12-05.md).
template <int D>
__device__ inline void load_rows(ElementType io, const void* base, int64_t first_row, int rows, int padded_rows,
                                 float* out) {
  static_assert(D % 8 == 0, "rows of whole 8-element chunks");
  const int64_t bytes = element_bytes(io);
  const auto* first = static_cast<const uint8_t*>(base) + first_row * D * bytes;
  for (int i = 8 * static_cast<int>(threadIdx.x); i < padded_rows * D; i += 8 * static_cast<int>(blockDim.x)) {
    float x[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (i < rows * D) load_elements<8>(io, first + i * bytes, x);
    store_floats<8>(out + i, x);
  }
}

// Rounds to nearest, ties to even, once (as the reference's store_element of
// a float widened to double).
__device__ inline void store_io(ElementType io, void* base, int64_t index, float value) {
  switch (io) {
    case ElementType::kFloat16:
      static_cast<__half*>(base)[index] = __float2half_rn(value);
      return;
    case ElementType::kBFloat16:
      static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(value);
      return;
    case ElementType::kFloat32:
      break;
  }
  static_cast<float*>(base)[index] = value;
}

__device__ inline uint32_t load_u32(const uint8_t* at) { return *reinterpret_cast<const uint32_t*>(at); }

__device__ inline uint32_t load_index(const uint8_t* at, int32_t bytes) {
  return bytes == 4 ? load_u32(at) : static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(at));
}

__device__ inline float warp_max(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ inline float warp_sum(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// ---------------------------------------------------------------- dequantization

// (a, b) of x^ = fma(b, L[code], a) from a stored (min, max) in memory
// (kernels/pair_affine.h).
__device__ inline Affine affine_of_pair(const TensorPageLayout& l, const Dequantization& dq, const uint8_t* pair,
                                        int top) {
  const ElementType element = l.spec.element;
  const float min = load_element(element, pair), max = load_element(element, pair + element_bytes(element));
  return pair_affine(min, max, dq.clip_ratio, dq.non_uniform, top);
}

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

// Where a token's group pairs lie in its page: base + in_page * token_stride
// + group * group_stride (token_pair_offset's arithmetic in 32 bits, hoisted out of the
// int8 walk and the general tiles). Written out rather than taken as token_pair_offset's differences:
// those 64-bit products cost the kernel 28 more bytes of spills (ptxas).
struct PairPlace {
  int32_t base = 0, token_stride = 0, group_stride = 0;
};
__device__ inline PairPlace pair_place(const TensorPageLayout& l, int head, int pairs_per_head) {
  const auto pair_bytes = static_cast<int32_t>(l.pair_bytes);
  const auto params = static_cast<int32_t>(l.params_offset);
  if (l.spec.grouping == ScaleGrouping::kPerTokenAllHeads) return {params, pair_bytes, 0};
  return {params + head * l.spec.page_size * pairs_per_head * pair_bytes, pairs_per_head * pair_bytes, pair_bytes};
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

// Entry e's place in a sequence's outlier pages: its page (through the
// sequence's outlier page table) and slot (FixedDivisor: not a 64-bit
// division per entry).
struct OutlierPages {
  const int32_t* table = nullptr;
  FixedDivisor per_page;

  __device__ OutlierPages(const PagedTensor& cache, int32_t slot)
      : table(cache.outlier_page_table + slot * cache.outlier_table_stride),
        per_page(static_cast<uint32_t>(cache.layout.spec.outlier_page_entries)) {}
  __device__ const uint8_t* page(const PagedTensor& cache, uint32_t e) const {
    return cache.outlier_pages + static_cast<int64_t>(table[per_page.quotient(e)]) * cache.layout.outlier_page_bytes;
  }
  __device__ uint32_t slot_in_page(uint32_t e) const { return per_page.remainder(e); }
  __device__ uint32_t index(const PagedTensor& cache, uint32_t e) const {
    return load_index(page(cache, e) + outlier_index_offset(cache.layout, slot_in_page(e)),
                      cache.layout.outlier_index_bytes);
  }
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

// Element j of query q (D floats) rotated by the keys' rotation of KV head
// `kv_head` (docs/runtime-layout.md 6.3 step 1, float32): a matrix as fmas
// over i ascending, pair angles with the float64 tables rounded to float32.
template <int D>
__device__ inline float rotated_query_element(const Rotation& rotation, const float* q, int kv_head, int j) {
  if (rotation.kind == RotationKind::kMatrix) {
    const float* matrix = rotation.matrix + static_cast<int64_t>(kv_head) * D * D;
    float out = 0.0f;
    // The fmas stay one chain in k order (6.3's arithmetic); unrolled, the
    // matrix loads of 16 steps are in flight at once instead of one load
    // per fma of the chain (every block rotates its group's queries, also
    // the exact ranges' short ones).
#pragma unroll 16
    for (int k = 0; k < D; ++k) out = __fmaf_rn(q[k], matrix[k * D + j], out);
    return out;
  }
  if (rotation.kind == RotationKind::kPairAngles) {
    constexpr int kHalf = D / 2;
    const int pair = j % kHalf;
    const float c = static_cast<float>(rotation.pair_cos[kv_head * kHalf + pair]);
    const float s = static_cast<float>(rotation.pair_sin[kv_head * kHalf + pair]);
    const float a = q[pair], b = q[pair + kHalf];
    return j < kHalf ? __fmaf_rn(a, c, -__fmul_rn(b, s)) : __fmaf_rn(a, s, __fmul_rn(b, c));
  }
  return q[j];
}

// The GQA group's queries rotated by the keys' rotation of `kv_head`:
// query[h * D + j] = rotated_query_element of raw[h * D ...] for h < group
// (raw: rows of D floats in shared memory, 16-byte aligned; read up to the
// next multiple of 4 rows), 0 for group <= h < heads (an mma's padding).
// The block's threads together; the caller synchronizes. A matrix column
// is read once for four heads, whose sums (each rotated_query_element's one
// fma chain in k order) run side by side: each block rotates its group's
// queries, also the exact ranges' blocks of 64 tokens, where one chain per
// element was half of their time. kRowsInFlight rows' loads are issued
// together: each batch is a round trip to L2, the rotation's latency
// (D / kRowsInFlight of them), and costs kRowsInFlight registers, which a
// kernel with registers to spare before its main loop gives (the int8
// kernel: 64, 2 round trips at head_dim 128).
template <int D, int kRowsInFlight = 16>
__device__ inline void rotate_group_queries(const Rotation& rotation, int kv_head, int group, int heads,
                                            const float* raw, float* query) {
  for (int i = group * D + static_cast<int>(threadIdx.x); i < heads * D; i += blockDim.x) query[i] = 0.0f;
  if (rotation.kind != RotationKind::kMatrix) {
    for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
      query[i] = rotated_query_element<D>(rotation, raw + (i / D) * D, kv_head, i % D);
    }
    return;
  }
  constexpr int kHeads = 4;  // per thread
  static_assert(D % kRowsInFlight == 0 && kRowsInFlight % 4 == 0, "whole batches of rows");
  const float* matrix = rotation.matrix + static_cast<int64_t>(kv_head) * D * D;
  const int units = (group + kHeads - 1) / kHeads * D;
  for (int unit = threadIdx.x; unit < units; unit += blockDim.x) {
    const int j = unit % D, first_head = unit / D * kHeads;
    const float* rows = raw + first_head * D;
    float sum[kHeads] = {0.0f, 0.0f, 0.0f, 0.0f};
    // kRowsInFlight rows' loads before their fmas: a row's fmas wait on its
    // loads and the next rows' loads issue after those fmas, so each batch
    // is a round trip to L2 (8 rows a batch had made 16 per block, the
    // preamble's longest chain where the keys are rotated).
#pragma unroll 1
    for (int k0 = 0; k0 < D; k0 += kRowsInFlight) {
      float r[kRowsInFlight];
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) r[i] = matrix[(k0 + i) * D + j];
#pragma unroll
      for (int i = 0; i < kRowsInFlight; i += 4) {
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          const float4 x = *reinterpret_cast<const float4*>(rows + h * D + k0 + i);
          sum[h] = __fmaf_rn(x.w, r[i + 3], __fmaf_rn(x.z, r[i + 2], __fmaf_rn(x.y, r[i + 1], __fmaf_rn(x.x, r[i], sum[h]))));
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (first_head + h < group) query[(first_head + h) * D + j] = sum[h];
    }
  }
}

// sin and cos of a float32 angle: reduced_angle (kernels/angle_reduction.h,
// under 2^-21 for |angle| < 2^21), then the special-function unit's (2^-21.4
// on [-pi, pi]): within ~1e-6 absolute. sincosf costs ~40 instructions a
// call up to |angle| = 105615 and takes a slow path beyond it, which
// 128K-token contexts reach. RoPE's angle t inv_freq is the one argument.
__device__ inline void reduced_sin_cos(float angle, float& sin_angle, float& cos_angle) {
  __sincosf(reduced_angle(angle), &sin_angle, &cos_angle);
}

// One RoPE pair (a, b) = (x_i, x_{i + D/2}) at `position`: angle =
// float(t) * inv_freq[i] (float32, as the reference), then x cos +
// rotate_half(x) sin with reduced_sin_cos.
__device__ inline void rope_pair(float position, float inverse_frequency, float& a, float& b) {
  const float angle = __fmul_rn(position, inverse_frequency);
  float sin_angle, cos_angle;
  reduced_sin_cos(angle, sin_angle, cos_angle);
  const float x = a, y = b;
  a = x * cos_angle + (-y) * sin_angle;
  b = y * cos_angle + x * sin_angle;
}

// RoPE at each token's position over a tile of keys. A thread takes four
// pairs of a token (16-byte loads and stores of both halves; the
// frequencies in shared memory, 16-byte aligned): one pair per thread had
// spent as much on its indices, loads and stores as on the rotation.
template <int D>
__device__ void rope_tile(const float* inverse_frequencies, int64_t first, int count, float* tile, int stride) {
  constexpr int kHalf = D / 2, kQuads = kHalf / 4;
  for (int unit = threadIdx.x; unit < count * kQuads; unit += blockDim.x) {
    const int j = unit / kQuads, i = unit % kQuads * 4;
    const float position = static_cast<float>(first + j);
    float* row = tile + j * stride;
    const float4 f = *reinterpret_cast<const float4*>(inverse_frequencies + i);
    float4 a = *reinterpret_cast<const float4*>(row + i), b = *reinterpret_cast<const float4*>(row + i + kHalf);
    rope_pair(position, f.x, a.x, b.x);
    rope_pair(position, f.y, a.y, b.y);
    rope_pair(position, f.z, a.z, b.z);
    rope_pair(position, f.w, a.w, b.w);
    *reinterpret_cast<float4*>(row + i) = a;
    *reinterpret_cast<float4*>(row + i + kHalf) = b;
  }
}

// ---------------------------------------------------------------- kernels

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

// The merge's rounds: kParts groups of D threads, each summing every
// kParts-th state of a round of kParts * merge_per_part() states, whose
// rows are all loaded before the block knows their weights (one round trip
// to L2 for the states of a round, instead of one per 8 states of one fma
// chain). Four groups where the states are many (over 8) and the blocks at
// most one per multiprocessor (DecodePlan::wide_merge: batch 1's 64 splits
// and more), else one: a block of 4 D threads and its ~120 registers take a
// whole multiprocessor, which at batch 32 (1024 blocks) ran the merge in 8
// waves; the one-group blocks keep to 64 registers at head_dim 128 (eight
// blocks per multiprocessor: batch 32's in one wave).
inline constexpr int kMergeMaxParts = 4;
template <int kParts>
constexpr int merge_per_part() {
  return kParts == 1 ? 8 : 16;
}
// Query heads per merge block: where the output is rotated and the states
// fit one-group blocks, the four heads of a GQA group (a multiple of 4)
// share one block and each row of their R_v, which is read from L2 once per
// block: with one head a block, batch 8's 256 blocks read 16 MB of
// rotations, and the merge took 13.4 us instead of 5.3 without them (ncu,
// 32K tokens, H200).
inline constexpr int kMergeGroupHeads = 4;
// The value rotation's rows a warp of a one-group, one-head block holds at
// a time (lane l: columns l + 32 j; in 64 registers). The other blocks
// stage R_v in shared memory (merge_stages_rotation).
inline constexpr int kMergeMatrixRows = 4;
template <int D, int kParts, int kHeads = 1>
constexpr int merge_threads() {
  return D * kParts * kHeads;
}
template <int kParts, int kHeads>
constexpr int merge_min_blocks() {
  return kParts > 1 ? 1 : 8 / kHeads;
}
// Whether a block that rotates its output back stages the whole R_v of its
// KV head in shared memory (by cp.async, issued before it waits for the
// split kernels, so the copies overlap their tail) and rotates from there:
// blocks of several thread groups or heads (the wide merge at batch 1, the
// GQA group's four heads from batch 8). Their warps' dot products over rows
// held in registers had loaded the second half of each warp's rows after
// the wait (an L2 round trip on the critical path) and reduced each (row,
// head) by a 5-shuffle warp sum. The one-group, one-head blocks keep those
// register rows: at batch 32 their 1024 blocks would read 64 MB of R_v
// into shared memory and run in waves of three.
template <int kParts, int kHeads>
constexpr bool merge_stages_rotation() {
  return kParts * kHeads > 1;
}
// The staged rotation's dynamic shared memory: R_v (D x D float32, each
// row's 16-byte chunks XOR-swizzled by the row's index mod 8) and the
// column groups' partial dot products (merge_threads() / D groups of
// kHeads x D).
template <int D, int kParts, int kHeads>
constexpr int merge_rotation_shared_bytes() {
  constexpr int kGroups = merge_threads<D, kParts, kHeads>() / D;
  return merge_stages_rotation<kParts, kHeads>()
             ? static_cast<int>(sizeof(float)) * (D * D + kGroups * kHeads * D)
             : 0;
}
// Chunk c (4 floats) of row r of the staged R_v: at chunk c ^ (r mod 8) of
// that row, so that 8 lanes reading chunk c of 8 consecutive rows (one
// 16-byte load's phase) hit 8 different groups of 4 banks.
template <int D>
__device__ inline int staged_rotation_offset(int row, int chunk) {
  return row * D + 4 * (chunk ^ (row & 7));
}

// o = o' R_v^T for the kHeads heads of `merged_rows` from the R_v staged
// in `staged` (merge_rotation_shared_bytes; its copies still in flight),
// into the output from element `output`: the merge block's kThreads
// threads together (see decode_merge_kernel).
template <int D, int kThreads, int kHeads>
__device__ inline void rotate_from_staged(const DecodeParams& p, float* staged, const float (&merged_rows)[kHeads][D],
                                          int64_t output) {
  constexpr int kGroups = kThreads / D, kGroupChunks = D / 4 / kGroups;
  static_assert(kThreads % D == 0 && kGroups > 1 && (D / 4) % kGroups == 0 && kHeads * D <= kThreads,
                "the staged rotation's column groups split the row's chunks evenly");
  float* const partial = staged + D * D;  // [kGroups][kHeads][D]
  copy_async_wait<0>();
  __syncthreads();  // R_v and o' (merged_rows) complete
  const int row = threadIdx.x % D, group = threadIdx.x / D;
  float dot[kHeads];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) dot[h] = 0.0f;
#pragma unroll
  for (int c = group * kGroupChunks; c < (group + 1) * kGroupChunks; ++c) {
    const float4 m = *reinterpret_cast<const float4*>(staged + staged_rotation_offset<D>(row, c));
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      const float4 o = *reinterpret_cast<const float4*>(&merged_rows[h][4 * c]);
      dot[h] = __fmaf_rn(o.w, m.w, __fmaf_rn(o.z, m.z, __fmaf_rn(o.y, m.y, __fmaf_rn(o.x, m.x, dot[h]))));
    }
  }
#pragma unroll
  for (int h = 0; h < kHeads; ++h) partial[(group * kHeads + h) * D + row] = dot[h];
  __syncthreads();
  if (threadIdx.x < kHeads * D) {
    const int h = threadIdx.x / D, r = threadIdx.x % D;
    float sum = partial[h * D + r];
#pragma unroll
    for (int g = 1; g < kGroups; ++g) sum = __fadd_rn(sum, partial[(g * kHeads + h) * D + r]);
    store_io(p.io, p.output, output + h * D + r, sum);
  }
}

// One block of merge_threads<D, kParts, kHeads>() threads per kHeads query
// heads (of one KV head) and sequence entry: the non-empty split states
// merged (M = max m_k, L = sum l_k e^(m_k - M), o' = sum acc_k e^(m_k - M) /
// L; FlashInfer's merge_state, in its own order: each group's fma chain over
// its states, then the groups in order), then o = o' R_v^T. Staged
// (merge_stages_rotation): thread (g, r) of the block's D-thread groups
// sums columns [g D / G, (g + 1) D / G) of row r of the staged R_v with
// each head's o' (4-column chunks in order), and the G partial sums of
// (head, r) are added in group order. Else each row of R_v is one warp's
// dot products with o' (its first kMergeMatrixRows rows loaded before the
// split kernels end). Launched as their dependent, the merge runs its
// preamble (the rows' loads or copies) while they do.
template <int D, int kParts, int kHeads>
__global__ void __launch_bounds__(merge_threads<D, kParts, kHeads>(), merge_min_blocks<kParts, kHeads>())
    decode_merge_kernel(const DecodeParams p, const SplitWorkspace workspace) {
  constexpr int kHeadThreads = merge_threads<D, kParts>(), kHeadWarps = kHeadThreads / kWarpSize;
  constexpr int kThreads = kHeadThreads * kHeads, kWarps = kThreads / kWarpSize;
  constexpr int kPerPart = merge_per_part<kParts>(), kRound = kParts * kPerPart;
  constexpr int kRowsPerWarp = D / kWarps, kRowWords = D / kWarpSize;
  constexpr bool kStaged = merge_stages_rotation<kParts, kHeads>();
  // The register rows (one-group, one-head blocks only): D / 32 warps of
  // 32 rows each, kMergeMatrixRows at a time.
  constexpr int kMatrixRows = kMergeMatrixRows;
  static_assert(kStaged || (D % kWarps == 0 && kRowsPerWarp % kMatrixRows == 0),
                "the rotation's rows split evenly over the warps");
  static_assert(kHeadThreads >= kRound, "a round's weights take one thread each");
  static_assert(kHeads == 1 || kParts == 1, "grouped heads with one thread group each");
  __shared__ float weights[kHeads][kRound];
  __shared__ float parts[kHeads][kParts][D];
  __shared__ float reduce[kHeads][kHeadWarps];
  __shared__ __align__(16) float merged_rows[kHeads][D];
  const int first_head = blockIdx.x * kHeads, entry = blockIdx.y, t = threadIdx.x;
  const int local = t / kHeadThreads, ht = t % kHeadThreads;  // the thread's head in the block, its index there
  const int head = first_head + local;
  const int d = ht % D, part = ht / D, warp = t / kWarpSize, head_warp = ht / kWarpSize, lane = t % kWarpSize;
  const Rotation& rotation = p.value_rotation;
  const bool rotated = rotation.kind == RotationKind::kMatrix;
  const int kv_head = first_head / (p.num_heads / p.key_cache.layout.spec.kv_heads);
  const float* matrix = rotation.matrix + static_cast<int64_t>(kv_head) * D * D;
  // Rows [first_row, first_row + kMatrixRows) of the rotation in the lanes'
  // columns: the split kernels do not write them.
  float matrix_rows[kMatrixRows][kRowWords];
  auto load_matrix_rows = [&](int first_row) {
#pragma unroll
    for (int r = 0; r < kMatrixRows; ++r) {
#pragma unroll
      for (int j = 0; j < kRowWords; ++j) matrix_rows[r][j] = matrix[(first_row + r) * D + lane + kWarpSize * j];
    }
  };
  extern __shared__ __align__(16) uint8_t dynamic_shared[];
  float* const staged = reinterpret_cast<float*>(dynamic_shared);
  if (rotated) {
    if constexpr (kStaged) {
      constexpr int kChunks = D / 4;
      for (int i = t; i < D * kChunks; i += kThreads) {
        const int row = i / kChunks, chunk = i % kChunks;
        copy_async<16>(staged + staged_rotation_offset<D>(row, chunk), matrix + row * D + 4 * chunk);
      }
      copy_async_commit();
    } else {
      load_matrix_rows(warp * kRowsPerWarp);
    }
  }
  wait_for_prerequisite_grid();  // launched as a dependent: the split states are complete from here on
  const int64_t states = workspace.max_splits;
  const int64_t base = (static_cast<int64_t>(entry) * p.num_heads + head) * states;
  float sum = 0.0f, out = 0.0f, max = -INFINITY;
  // Every head of the block has the same states (workspace.max_splits): the
  // rounds and their __syncthreads are the block's.
  for (int64_t round = 0; round < states; round += kRound) {
    // Every state's row of the round is loaded (an empty split's may be
    // anything: its zero weight's select keeps it out).
    float rows[kPerPart];
#pragma unroll
    for (int u = 0; u < kPerPart; ++u) {
      const int64_t k = round + part + kParts * u;
      rows[u] = k < states ? workspace.acc[(base + k) * D + d] : 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    if (ht < kRound && round + ht < states) {
      m = workspace.max_sum[2 * (base + round + ht)];
      l = workspace.max_sum[2 * (base + round + ht) + 1];
    }
    if (round == 0) {
      // The maximum over every state (a round's with the loads above).
      float all = m;
      for (int64_t k = kRound + ht; k < states; k += kHeadThreads) all = fmaxf(all, workspace.max_sum[2 * (base + k)]);
      all = warp_max(all);
      if (lane == 0) reduce[local][head_warp] = all;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < kHeadWarps; ++w) max = fmaxf(max, reduce[local][w]);
    }
    __syncthreads();  // the previous round's weights (and the reduction) are read
    if (ht < kRound) {
      const float weight = m != -INFINITY ? expf(m - max) : 0.0f;
      if (m != -INFINITY) sum = __fmaf_rn(l, weight, sum);
      weights[local][ht] = weight;
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kPerPart; ++u) {
      const float weight = weights[local][part + kParts * u];
      out = weight != 0.0f ? __fmaf_rn(rows[u], weight, out) : out;
    }
  }
  sum = warp_sum(sum);
  parts[local][part][d] = out;
  __syncthreads();  // reduce's maxima are read
  if (lane == 0) reduce[local][head_warp] = sum;
  __syncthreads();
  sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kHeadWarps; ++w) sum += reduce[local][w];
  if (ht < D) {
    float merged = parts[local][0][ht];
#pragma unroll
    for (int q = 1; q < kParts; ++q) merged += parts[local][q][ht];
    merged = __fdiv_rn(merged, sum);
    if (!rotated) {
      store_io(p.io, p.output, (static_cast<int64_t>(entry) * p.num_heads + head) * D + ht, merged);
    } else {
      merged_rows[local][ht] = merged;
    }
  }
  if (!rotated) return;
  if constexpr (kStaged) {
    rotate_from_staged<D, kThreads, kHeads>(p, staged, merged_rows,
                                             (static_cast<int64_t>(entry) * p.num_heads + first_head) * D);
  } else {
    __syncthreads();  // o' in merged_rows: every warp reads all of it
    float merged[kHeads][kRowWords];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
#pragma unroll
      for (int j = 0; j < kRowWords; ++j) merged[h][j] = merged_rows[h][lane + kWarpSize * j];
    }
    const int64_t output = (static_cast<int64_t>(entry) * p.num_heads + first_head) * D;
#pragma unroll 1
    for (int first_row = warp * kRowsPerWarp; first_row < (warp + 1) * kRowsPerWarp; first_row += kMatrixRows) {
      if (first_row != warp * kRowsPerWarp) load_matrix_rows(first_row);
#pragma unroll
      for (int r = 0; r < kMatrixRows; ++r) {
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          float dot = 0.0f;
#pragma unroll
          for (int j = 0; j < kRowWords; ++j) dot = __fmaf_rn(merged[h][j], matrix_rows[r][j], dot);
          dot = warp_sum(dot);
          if (lane == 0) store_io(p.io, p.output, output + h * D + first_row + r, dot);
        }
      }
    }
  }
}

}  // namespace kvforge::kernels::decode_attention_device
