#pragma once
// The runtime KV cache's bytes (docs/runtime-layout.md states them): the
// element types, one tensor kind's page layout (codes, group parameters,
// outlier row pointers), the exact-token store, the outlier entry pages, the
// window rules and the size formulas (bytes held, bytes a decoding step
// reads). Plain C++ with no framework: the CPU reference, the host cache and
// the CUDA kernels (host and device code) include it.
#include <cstdint>

#if defined(__CUDACC__)
#define KVFORGE_HOST_DEVICE __host__ __device__
#else
#define KVFORGE_HOST_DEVICE
#endif

namespace kvforge::kernels {

// The dtype of every number the cache keeps exactly: sink and window tokens,
// outlier values and the group minima and maxima. fp16 and bf16 are the
// serving layouts (the model's dtype); fp32 is a reference layout.
enum class ElementType : int32_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// How one layer's keys (or values) share their dequantization parameters
// (formats/quantizer_config.h's Grouping, with fixed numbers for kernels).
enum class ScaleGrouping : int32_t {
  kPerToken = 0,            // (min, max) per token, head and G' channels
  kPerChannelTokens = 1,    // (min, max) per channel for every G tokens
  kPerChannelOffline = 2,   // channel_scale/channel_offset of the artifact, per layer
  kPerTokenAllHeads = 3,    // (min, max) per token over all kv_heads * D channels
};

enum class WindowRule : int32_t { kSliding = 0, kBlockFlush = 1 };

inline constexpr int64_t kSectionAlignment = 16;  // every page section and page starts on 16 bytes
inline constexpr int64_t kRowPointerBytes = 4;    // uint32 outlier row pointers
inline constexpr int64_t kPageTableEntryBytes = 4;  // int32 page ids

KVFORGE_HOST_DEVICE inline int64_t align_up(int64_t bytes, int64_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}
KVFORGE_HOST_DEVICE inline int64_t element_bytes(ElementType element) {
  return element == ElementType::kFloat32 ? 4 : 2;
}

// What a tensor kind's layout is made from (the configuration and the cache
// options); page_layout() derives the rest.
struct TensorLayoutSpec {
  int32_t kv_heads = 0;
  int32_t head_dim = 0;
  int32_t bits = 2;        // 2 or 4
  int32_t page_size = 16;  // tokens per page
  ScaleGrouping grouping = ScaleGrouping::kPerToken;
  int32_t group = 0;  // kPerToken: G' = min(G, D) channels; kPerChannelTokens: G tokens; else 0
  ElementType element = ElementType::kFloat16;
  int32_t sink_tokens = 0;
  int32_t residual_tokens = 0;
  WindowRule window_rule = WindowRule::kSliding;
  bool outliers = false;
  int32_t outlier_page_entries = 256;  // entries per outlier page
};

struct TensorPageLayout {
  TensorLayoutSpec spec;
  int64_t row_bytes = 0;        // one token's codes of one head: D * bits / 8
  int64_t group_pairs_per_token = 0;  // (min, max) pairs per token: per-token groupings; 0 otherwise
  int64_t pairs_per_slot = 0;   // kPerChannelTokens: W = ceil(kv_heads * D / G) pairs striped per token slot
  int64_t pair_bytes = 0;       // one (min, max) pair: 2 elements
  int64_t codes_bytes = 0;      // [kv_heads][page_size][row_bytes]
  int64_t params_offset = 0, params_bytes = 0;
  int64_t row_pointers_offset = 0, row_pointers_bytes = 0;  // (page_size * spans + 1) uint32
  int64_t page_bytes = 0;
  int32_t outlier_spans = 0;      // CSR rows per token: 0 without outliers, 1 (all heads) or kv_heads
  int32_t outlier_span_size = 0;  // n: elements one row's indices count in
  int32_t outlier_index_bytes = 0;  // 2 (n <= 65536) or 4
  int64_t outlier_page_bytes = 0;   // entries * index bytes, then entries * element bytes
  int32_t ring_capacity = 0;        // window tokens one sequence's ring holds
  int64_t exact_slot_bytes = 0;     // one sequence: [kv_heads][sink + ring][D] elements
};

// Tokens a sequence's ring of 16-bit window tokens must hold: every token
// of the window [end, T) and, for kPerChannelTokens, the incomplete group.
KVFORGE_HOST_DEVICE inline int32_t ring_capacity(const TensorLayoutSpec& s) {
  if (s.grouping == ScaleGrouping::kPerChannelTokens && s.window_rule == WindowRule::kSliding) {
    return s.residual_tokens + s.group - 1;
  }
  return s.residual_tokens;
}

// The derived sizes and offsets (the spec must be valid: the host cache
// checks it with one-line errors first).
KVFORGE_HOST_DEVICE inline TensorPageLayout page_layout(const TensorLayoutSpec& s) {
  TensorPageLayout l;
  l.spec = s;
  const int64_t heads = s.kv_heads, dim = s.head_dim, page = s.page_size;
  const int64_t element = element_bytes(s.element);
  l.row_bytes = dim * s.bits / 8;
  l.pair_bytes = 2 * element;
  l.codes_bytes = heads * page * l.row_bytes;
  switch (s.grouping) {
    case ScaleGrouping::kPerToken:
      l.group_pairs_per_token = heads * (dim / s.group);
      l.params_bytes = page * l.group_pairs_per_token * l.pair_bytes;
      break;
    case ScaleGrouping::kPerTokenAllHeads:
      l.group_pairs_per_token = 1;
      l.params_bytes = page * l.pair_bytes;
      break;
    case ScaleGrouping::kPerChannelTokens:
      l.pairs_per_slot = (heads * dim + s.group - 1) / s.group;
      l.params_bytes = page * l.pairs_per_slot * l.pair_bytes;
      break;
    case ScaleGrouping::kPerChannelOffline:
      break;
  }
  l.params_offset = align_up(l.codes_bytes, kSectionAlignment);
  if (s.outliers) {
    const bool all_heads = s.grouping == ScaleGrouping::kPerTokenAllHeads;
    l.outlier_spans = all_heads ? 1 : s.kv_heads;
    l.outlier_span_size = static_cast<int32_t>(all_heads ? heads * dim : dim);
    l.outlier_index_bytes = l.outlier_span_size <= 65536 ? 2 : 4;
    l.outlier_page_bytes =
        align_up(static_cast<int64_t>(s.outlier_page_entries) * (l.outlier_index_bytes + element), kSectionAlignment);
    l.row_pointers_bytes = (page * l.outlier_spans + 1) * kRowPointerBytes;
  }
  l.row_pointers_offset = align_up(l.params_offset + l.params_bytes, kSectionAlignment);
  l.page_bytes = align_up(l.row_pointers_offset + l.row_pointers_bytes, kSectionAlignment);
  l.ring_capacity = ring_capacity(s);
  l.exact_slot_bytes = heads * (s.sink_tokens + l.ring_capacity) * dim * element;
  return l;
}

// The tokens [begin, end) read back dequantized at context T (rule 1 of
// docs/artifact.md); the others are exact.
KVFORGE_HOST_DEVICE inline int64_t quantized_begin(const TensorLayoutSpec& s, int64_t tokens) {
  return tokens < s.sink_tokens ? tokens : s.sink_tokens;
}
KVFORGE_HOST_DEVICE inline int64_t quantized_end(const TensorLayoutSpec& s, int64_t tokens) {
  const int64_t begin = quantized_begin(s, tokens);
  if (s.window_rule == WindowRule::kBlockFlush) {
    return begin + (tokens - begin) / s.residual_tokens * s.residual_tokens;
  }
  int64_t end = tokens - s.residual_tokens;
  if (end < begin) end = begin;
  if (s.grouping == ScaleGrouping::kPerChannelTokens) end = begin + (end - begin) / s.group * s.group;
  return end;
}

// Whether keys `k` and values `v` quantize the same tokens at every context
// (quantized_begin and quantized_end equal for all T): the same sink, window
// rule and residual, and the same token groups where the sliding window's
// end is rounded to them. Then a token outside the tensor-core kernels'
// range (the later of the begins to the earlier of the ends) is exact in
// both tensors, and the decode's exact blocks read no codes
// (decode_exact_kernel.cuh); KIVI's block-flushed keys with sliding values
// do not.
KVFORGE_HOST_DEVICE inline bool same_quantized_ranges(const TensorLayoutSpec& k, const TensorLayoutSpec& v) {
  const auto rounding = [](const TensorLayoutSpec& s) {
    return s.window_rule != WindowRule::kBlockFlush && s.grouping == ScaleGrouping::kPerChannelTokens ? s.group : 1;
  };
  return k.sink_tokens == v.sink_tokens && k.window_rule == v.window_rule &&
         k.residual_tokens == v.residual_tokens && rounding(k) == rounding(v);
}

// Byte offsets inside a page of the token slot `in_page` (0..page_size-1).
KVFORGE_HOST_DEVICE inline int64_t code_row_offset(const TensorPageLayout& l, int64_t head, int64_t in_page) {
  return (head * l.spec.page_size + in_page) * l.row_bytes;
}
// kPerToken: group g of head `head`; kPerTokenAllHeads: head and g are 0.
KVFORGE_HOST_DEVICE inline int64_t token_pair_offset(const TensorPageLayout& l, int64_t head, int64_t in_page,
                                                     int64_t group) {
  // The head's pairs per token: D / G' (32-bit; group_pairs_per_token / kv_heads
  // was a 64-bit division, a subroutine call per pair in the kernels).
  const int64_t per_head =
      l.spec.grouping == ScaleGrouping::kPerToken ? l.spec.head_dim / l.spec.group : l.group_pairs_per_token;
  return l.params_offset + ((head * l.spec.page_size + in_page) * per_head + group) * l.pair_bytes;
}
// kPerChannelTokens: the pair of channel `channel` (= head * D + d) of token
// group `group` lies in the parameter stream at pair
//   sigma = group * G * W + channel,
// i.e. in the sequence's page sigma / (page_size * W), pair sigma mod
// (page_size * W) of that page's parameter section: the pages of the group's
// own G token slots.
KVFORGE_HOST_DEVICE inline int64_t channel_pair_stream_index(const TensorPageLayout& l, int64_t group, int64_t channel) {
  return group * l.spec.group * l.pairs_per_slot + channel;
}
KVFORGE_HOST_DEVICE inline int64_t pairs_per_page(const TensorPageLayout& l) {
  return l.spec.page_size * l.pairs_per_slot;
}
// A stream position split into its page-table entry and its pair index in
// that page's parameter section, in 32-bit arithmetic (the int8 decode's:
// streams of fewer than 2^31 pairs).
struct StreamPlace {
  int32_t entry = 0, offset = 0;
};
// Channel `channel`'s pair of the group whose first slot is `group_first`
// (= group * G): channel_pair_stream_index over pairs_per_page.
KVFORGE_HOST_DEVICE inline StreamPlace stream_place(int32_t group_first, int32_t pairs_per_slot, int32_t per_page,
                                                    int32_t channel) {
  const int32_t sigma = group_first * pairs_per_slot + channel;
  return {sigma / per_page, sigma % per_page};
}
// `by` >= 0 pairs further on, without a division while it stays in the page.
KVFORGE_HOST_DEVICE inline StreamPlace stream_advance(StreamPlace place, int32_t by, int32_t per_page) {
  int32_t entry = place.entry, offset = place.offset + by;
  if (offset >= per_page) {
    entry += offset / per_page;
    offset %= per_page;
  }
  return {entry, offset};
}
// The first of a step's token slots [step_first, step_first + tokens) that
// lies in the page of page-table entry `entry`, as its index in the step
// (a lane that holds the page id), or -1 where none does.
KVFORGE_HOST_DEVICE inline int32_t step_slot_in_page(int32_t entry, int32_t page_size, int32_t step_first,
                                                     int32_t tokens) {
  const int32_t from = entry * page_size - step_first;  // the page's first slot, from the step's
  if (from <= -page_size || from >= tokens) return -1;
  return from > 0 ? from : 0;
}
// Row pointers: row r = in_page * spans + span; its entries are
// [pointer[r], pointer[r + 1]) (sequence-wide entry numbers).
KVFORGE_HOST_DEVICE inline int64_t row_pointer_offset(const TensorPageLayout& l, int64_t row) {
  return l.row_pointers_offset + row * kRowPointerBytes;
}
// Outlier entry e of a sequence: page e / entries (through the sequence's
// outlier page table), index at slot * index_bytes, value after all indices.
KVFORGE_HOST_DEVICE inline int64_t outlier_index_offset(const TensorPageLayout& l, int64_t slot) {
  return slot * l.outlier_index_bytes;
}
KVFORGE_HOST_DEVICE inline int64_t outlier_value_offset(const TensorPageLayout& l, int64_t slot) {
  return static_cast<int64_t>(l.spec.outlier_page_entries) * l.outlier_index_bytes +
         slot * element_bytes(l.spec.element);
}
// The exact store of one sequence: sink token t at row t, window token t at
// row sink + (t - sink) mod ring_capacity; each row [kv_heads][...] per head.
// exact_store_row: the row of token t (< T) outside the quantized range (32
// bits: a sequence's tokens are under 2^31, and the kernels' 64-bit modulo
// is a subroutine call).
KVFORGE_HOST_DEVICE inline int32_t exact_store_row(const TensorPageLayout& l, int32_t token) {
  const int32_t sink = l.spec.sink_tokens;
  return token < sink || l.ring_capacity <= 0 ? token : sink + (token - sink) % l.ring_capacity;
}
KVFORGE_HOST_DEVICE inline int64_t exact_row_offset(const TensorPageLayout& l, int64_t head, int64_t row) {
  const int64_t rows = l.spec.sink_tokens + l.ring_capacity;
  return (head * rows + row) * l.spec.head_dim * element_bytes(l.spec.element);
}

// kPerChannelTokens: the ring rows of a completing group's earlier tokens.
// Token i < G - 1 of the group whose first slot is `first` (= g G) is in row
// exact_store_row(sink + first + i) = sink + (first + i) mod ring_capacity;
// the ring holds at least G - 1 rows (ring_capacity), so from first mod ring
// the token index wraps it at most once: a comparison a token, no modulo.
struct GroupRing {
  int32_t sink = 0, ring = 0, first_row = 0;
  KVFORGE_HOST_DEVICE int32_t row(int32_t i) const {
    int32_t r = first_row + i;
    if (r >= ring) r -= ring;
    return sink + r;
  }
};
KVFORGE_HOST_DEVICE inline GroupRing group_ring(const TensorPageLayout& l, int32_t first) {
  return {l.spec.sink_tokens, l.ring_capacity, l.ring_capacity > 0 ? first % l.ring_capacity : 0};
}
// exact_row_offset(l, head, row) + d * element bytes, split into a row's part
// (row * exact_row_stride) and a channel's (exact_channel_offset of
// channel = head * D + d), so that a loop over tokens and channels computes
// each once.
KVFORGE_HOST_DEVICE inline int64_t exact_row_stride(const TensorPageLayout& l) {
  return static_cast<int64_t>(l.spec.head_dim) * element_bytes(l.spec.element);
}
KVFORGE_HOST_DEVICE inline int64_t exact_channel_offset(const TensorPageLayout& l, int32_t channel) {
  const int32_t head = channel / l.spec.head_dim, d = channel % l.spec.head_dim;
  const int64_t rows = l.spec.sink_tokens + l.ring_capacity;
  return (head * rows * l.spec.head_dim + d) * element_bytes(l.spec.element);
}
// The 32-bit word of channel `channel` (= head * D + d) in a code row:
// code_row_offset(l, head, in_page) + 4 * word = in_page * row_bytes +
// code_channel_offset(l, channel).
KVFORGE_HOST_DEVICE inline int64_t code_channel_offset(const TensorPageLayout& l, int32_t channel) {
  const int32_t head = channel / l.spec.head_dim, d = channel % l.spec.head_dim;
  return code_row_offset(l, head, 0) + 4 * (d / (32 / l.spec.bits));
}

// Bytes of one layer's keys (or values) of one sequence at context T.
struct TensorBytes {
  int64_t exact = 0;          // sink and window tokens read (or the exact slot held)
  int64_t codes = 0;
  int64_t group_params = 0;
  int64_t row_pointers = 0;
  int64_t outlier_entries = 0;
  int64_t page_table = 0;         // int32 page ids
  int64_t outlier_page_table = 0;
  int64_t total() const {
    return exact + codes + group_params + row_pointers + outlier_entries + page_table + outlier_page_table;
  }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// What one decoding step reads of one sequence's tensor at context T, KV
// heads and the tokens of the query's GQA group counted once, when
// `visible_outliers` entries belong to the quantized tokens [begin, end).
// Per-layer constants (grids, channel parameters, rotations, RoPE
// frequencies) are not in it: layer_constant_bytes().
inline TensorBytes bytes_read(const TensorPageLayout& l, int64_t tokens, int64_t visible_outliers) {
  const TensorLayoutSpec& s = l.spec;
  const int64_t begin = quantized_begin(s, tokens), end = quantized_end(s, tokens);
  const int64_t quantized = end - begin, exact = tokens - quantized;
  const int64_t element = element_bytes(s.element);
  TensorBytes b;
  b.exact = exact * s.kv_heads * s.head_dim * element;
  b.codes = quantized * s.kv_heads * l.row_bytes;
  switch (s.grouping) {
    case ScaleGrouping::kPerToken:
    case ScaleGrouping::kPerTokenAllHeads:
      b.group_params = quantized * l.group_pairs_per_token * l.pair_bytes;
      break;
    case ScaleGrouping::kPerChannelTokens:
      b.group_params = quantized / s.group * s.kv_heads * s.head_dim * l.pair_bytes;
      break;
    case ScaleGrouping::kPerChannelOffline:
      break;
  }
  const int64_t pages = ceil_div(quantized, s.page_size);
  b.page_table = pages * kPageTableEntryBytes;
  if (s.outliers && quantized > 0) {
    b.row_pointers = (quantized * l.outlier_spans + pages) * kRowPointerBytes;
    b.outlier_entries = visible_outliers * (l.outlier_index_bytes + element);
    b.outlier_page_table = ceil_div(visible_outliers, s.outlier_page_entries) * kPageTableEntryBytes;
  }
  return b;
}

// What one sequence holds for one layer's tensor at context T with
// `outliers` entries stored (the window's tokens are quantized on arrival,
// so the pages hold codes for every token past the sink): whole pages, the
// exact slot, whole outlier pages and both page tables' used entries.
inline TensorBytes bytes_held(const TensorPageLayout& l, int64_t tokens, int64_t outliers) {
  const TensorLayoutSpec& s = l.spec;
  const int64_t slots = tokens > s.sink_tokens ? tokens - s.sink_tokens : 0;
  const int64_t pages = ceil_div(slots, s.page_size);
  TensorBytes b;
  b.exact = l.exact_slot_bytes;
  b.codes = pages * l.page_bytes;  // the whole pages: codes, parameters, row pointers and padding
  b.page_table = pages * kPageTableEntryBytes;
  if (s.outliers) {
    const int64_t outlier_pages = ceil_div(outliers, s.outlier_page_entries);
    b.outlier_entries = outlier_pages * l.outlier_page_bytes;
    b.outlier_page_table = outlier_pages * kPageTableEntryBytes;
  }
  return b;
}

// Per-layer constants a decoding step reads once per sequence batch: the
// dequantization table (2^bits float32) and, for kPerChannelOffline, the
// float32 channel scale and offset.
inline int64_t layer_constant_bytes(const TensorPageLayout& l) {
  int64_t bytes = (int64_t{1} << l.spec.bits) * 4;
  if (l.spec.grouping == ScaleGrouping::kPerChannelOffline) bytes += 2 * l.spec.kv_heads * l.spec.head_dim * 4;
  return bytes;
}

}  // namespace kvforge::kernels
