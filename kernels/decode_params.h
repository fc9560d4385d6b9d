#pragma once
// The plain parameter structs of the two runtime kernels, append
// (quantize-on-append) and decode_attention: pointers, strides and sizes
// only (as FlashInfer's decode params), so that the CPU reference
// (kernels/cpu_reference.h) and the CUDA kernels take the same structs and a
// binding fills them from its tensors. docs/runtime-layout.md states the
// bytes behind every pointer and the arithmetic of both kernels.
//
// Sequences are addressed by slot: a slot numbers a row of the page table,
// of the exact store, of the outlier page table and of the outlier counts.
// Pages are shared by all layers and both tensor kinds (one page table per
// sequence, as vLLM's block tables): page id p is page p of every layer's
// key pool and of every layer's value pool.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/runtime_layout.h"

namespace kvforge::kernels {

// One layer's keys or values as stored: the layout and its pools.
struct PagedTensor {
  TensorPageLayout layout;
  uint8_t* pages = nullptr;               // [num_pages][page_bytes]
  uint8_t* exact = nullptr;               // [num_slots][exact_slot_bytes]: sink and window tokens
  uint8_t* outlier_pages = nullptr;       // [num_outlier_pages][outlier_page_bytes]
  int32_t* outlier_page_table = nullptr;  // [num_slots][outlier_table_stride]
  int64_t outlier_table_stride = 0;
};

// How codes turn back into values (float32): x^ = fma(b, levels[code], a)
// with (a, b) from the group's stored (min, max) or the channel's offline
// (offset, scale); docs/runtime-layout.md, "Dequantization".
struct Dequantization {
  bool non_uniform = false;
  const float* levels = nullptr;  // [2^bits]: k (uniform runtime), the grid, or -1 + 2k/(2^bits-1) (uniform offline)
  float clip_ratio = 1.0f;
  const float* channel_scale = nullptr;  // kPerChannelOffline: [kv_heads][D]
  const float* channel_offset = nullptr;
};

enum class OutlierSelection : int32_t { kNone = 0, kChannelThresholds = 1, kTokenTopBottom = 2, kTokenTau = 3 };

// How append turns (rotated, element-rounded) values into codes: float64,
// the artifact's formulas (docs/artifact.md) in the order the layout page gives.
struct Quantization {
  int32_t bits = 2;
  bool non_uniform = false;
  const double* encode_midpoints = nullptr;  // non-uniform: [2^bits - 1] midpoints of the encode grid
  double clip_ratio = 1.0;
  const float* channel_scale = nullptr;  // kPerChannelOffline: [kv_heads][D]
  const float* channel_offset = nullptr;
  OutlierSelection outliers = OutlierSelection::kNone;
  const float* outlier_low = nullptr;  // kChannelThresholds: [kv_heads][D]
  const float* outlier_high = nullptr;
  int32_t top_bottom_count = 0;  // kTokenTopBottom: k largest and k smallest per span
  double outlier_tau = 0;        // kTokenTau
};

enum class RotationKind : int32_t { kNone = 0, kMatrix = 1, kPairAngles = 2 };

// One layer's rotation of keys or values (formats/kv_rotation.h).
struct Rotation {
  RotationKind kind = RotationKind::kNone;
  const float* matrix = nullptr;     // kMatrix: [kv_heads][D][D], x' = x R (row vectors), 16-byte aligned
  const float* centre = nullptr;     // keys, kMatrix: [kv_heads][D], or null
  const double* pair_cos = nullptr;  // kPairAngles: [kv_heads][D/2], cos and sin of the float32 angle in float64
  const double* pair_sin = nullptr;
};

// The outlier pages of one layer's tensor: a stack of free page ids that
// append takes from, and each slot's running entry and page counts.
struct OutlierAllocator {
  uint32_t* entry_counts = nullptr;  // [num_slots]: entries stored so far
  int32_t* pages_used = nullptr;     // [num_slots]: outlier pages in the slot's table
  int32_t* free_pages = nullptr;     // [capacity]: free page ids, the top at free_pages[*free_count - 1]
  int32_t* free_count = nullptr;
  int32_t* exhausted = nullptr;      // set to 1 when no page was free (or the slot's table was full)
};

struct SequenceBatch {
  int32_t count = 0;
  const int32_t* slots = nullptr;       // [count]
  const int32_t* page_table = nullptr;  // [num_slots][page_table_stride]: page ids of token slots (t - sink) / page_size
  int64_t page_table_stride = 0;
  const int64_t* lengths = nullptr;     // [count]: append: tokens cached before it; decode: tokens cached
  // The longest of lengths when the host knows it (decode_attention sizes its
  // context splits by it without reading lengths back); 0: unknown, the
  // page table's capacity is assumed.
  int64_t max_length = 0;
};

// A small batch's per-entry arrays carried by value in the append's launch
// parameters instead of backend memory, so that a decoding step's append
// queues its kernel and no copy before it (a copy on the stream and its host
// call cost microseconds, the step's whole budget at batch 1). count > 0:
// append reads these instead of batch.slots, batch.lengths and token_offsets
// (which may then be null); count == 0: the pointers.
// new_page_plus_one: 1 + the id of the one page an entry's new tokens open,
// carried here instead of uploaded into the page table before the launch (a
// decoding step opens a page per sequence every page_size tokens, and each
// upload was a copy on the stream); append writes the id into the entry's
// page-table row at index new_page_index(spec, length) before any read of
// that row, and its kernels read it from here. 0 (the default): none, or
// the entry's pages were uploaded.
inline constexpr int kInlineBatchEntries = 32;
struct InlineBatchArrays {
  int32_t count = 0;
  int32_t slots[kInlineBatchEntries] = {};
  int64_t lengths[kInlineBatchEntries] = {};
  int64_t token_offsets[kInlineBatchEntries + 1] = {};
  int32_t new_page_plus_one[kInlineBatchEntries] = {};
};

// The page-table index of the first page a sequence of `length` tokens does
// not hold yet: the pages of its token slots [0, length - sink).
KVFORGE_HOST_DEVICE inline int32_t new_page_index(const TensorLayoutSpec& spec, int64_t length) {
  const int64_t slots = length - spec.sink_tokens;
  return slots > 0 ? static_cast<int32_t>((slots + spec.page_size - 1) / spec.page_size) : 0;
}

// Whether `count` inline entries (InlineBatchArrays' or InlineDecodeArrays')
// can stand for a batch of `batch_count`: none, or the batch's and at most
// kInlineBatchEntries. Checked before anything reads the arrays.
inline bool inline_count_fits(int32_t count, int32_t batch_count) {
  return count == 0 || (count == batch_count && count > 0 && count <= kInlineBatchEntries);
}

// Refuses (std::invalid_argument, prefixed by `who`) an inline count that
// does not fit the batch (inline_count_fits). Host code: every reader's
// check before it reads the arrays.
inline void check_inline_count(const char* who, int32_t count, int32_t batch_count) {
  if (inline_count_fits(count, batch_count)) return;
  throw std::invalid_argument(std::string(who) + ": inline arrays of " + std::to_string(count) +
                              " entries for a batch of " + std::to_string(batch_count) +
                              ": expected 0 or the batch's, at most " + std::to_string(kInlineBatchEntries));
}

// Whether any entry of the inline arrays opens a page (append then writes
// AppendParams::page_table, which must be set). Reads at most
// kInlineBatchEntries entries.
inline bool opens_inline_pages(const InlineBatchArrays& arrays) {
  const int32_t count = arrays.count < kInlineBatchEntries ? arrays.count : kInlineBatchEntries;
  for (int32_t i = 0; i < count; ++i) {
    if (arrays.new_page_plus_one[i] > 0) return true;
  }
  return false;
}

// Which CUDA append kernel takes a call (the CPU reference ignores it):
// kAuto the token-parallel kernel where the layout allows it (both kinds
// per-token groups without outliers, kernels/append_token_kernel.cuh), else
// the block-per-sequence kernel; kPerSequence always the latter, to compare.
enum class AppendKernel : int32_t { kAuto = 0, kPerSequence = 1 };

struct AppendParams {
  SequenceBatch batch;
  int32_t* page_table = nullptr;  // batch.page_table, written: the inline arrays' new pages
  const int64_t* token_offsets = nullptr;  // [count + 1]: entry i's new tokens are rows [offsets[i], offsets[i + 1])
  // The rows of keys and values (offsets[count]) when the caller knows them
  // (a launcher sizes a token-parallel grid by it without reading the
  // offsets back); 0: unknown.
  int64_t rows = 0;
  AppendKernel kernel = AppendKernel::kAuto;
  InlineBatchArrays inline_arrays;         // or these (count > 0)
  const void* keys = nullptr;              // [rows][kv_heads][D]; pre-RoPE keys when the configuration says so
  const void* values = nullptr;
  ElementType input = ElementType::kFloat32;
  PagedTensor key_cache, value_cache;
  Quantization key_quantization, value_quantization;
  Rotation key_rotation, value_rotation;
  OutlierAllocator key_outliers, value_outliers;
};

// Which CUDA decode kernel takes the quantized tokens (the CPU reference
// ignores it): kAuto the fastest that reads the layout: the 8-bit integer
// tensor-core kernel (kernels/decode_int8_kernel.cuh; 2 bits, uniform
// grids), else the bf16 tensor-core kernel, else the general one;
// kInt8TensorCores the same, named by a caller that expects the int8 kernel;
// kBf16TensorCores the bf16 tensor-core kernel where it reads the layout,
// else the general one (the int8 kernel's predecessor, kept as its
// comparison and for its 4-bit layouts); kGeneral the general kernel for
// every token. Where neither tensor-core kernel reads the layout, kAuto and
// kInt8TensorCores take the lookup kernel (kernels/decode_lookup_kernel.cuh:
// keys per channel offline, KVQuant's non-uniform and pre-RoPE ones
// included, values of one scale group per row) where it reads it;
// kLookup asks for the lookup kernel wherever it reads the layout (else
// the general one), the tensor-core kernels not considered.
enum class DecodeKernel : int32_t { kAuto = 0, kGeneral = 1, kInt8TensorCores = 2, kBf16TensorCores = 3, kLookup = 4 };

// The int8 kernel's softmax steps (kernels/decode_int8_kernel.cuh; CUDA
// only). kSteps32: 32 tokens a step, each warp holding three 32-token
// stages, two of them in flight while it computes; every layout the kernel
// reads. kSteps64Stages3, kSteps64Stages4: 64 tokens a step (two stages:
// one conversion of the value sums, one softmax reduction and one weight
// scale per 64 tokens instead of per 32) with one or two stages in flight;
// layouts of one scale group per key and value row, without outliers, of at
// most 4 query heads per KV head (int8_wide_steps_supported). kAuto:
// kSteps64Stages4 where the layout allows it (on the H200 10-13% less
// decode time than kSteps32 at 32K and 128K tokens, batch 1 to 32;
// bench/README.md), else kSteps32 (default_int8_steps). A 64-token request
// that the layout or the kernel choice cannot take is refused.
enum class Int8Steps : int32_t { kAuto = 0, kSteps32 = 1, kSteps64Stages3 = 2, kSteps64Stages4 = 3 };

// A small decode batch's slots and lengths carried by value in the launch
// parameters, as append's InlineBatchArrays: count > 0 (then batch.count, at
// most kInlineBatchEntries) and the kernels read these instead of
// batch.slots and batch.lengths (which may then be null), so that a decode
// call copies nothing to the device before its kernels (that copy, on the
// stream, was 2-3 us of a decoding step's device time at batch 1 on the
// H200: bench/README.md, thirtieth session). A CUDA graph capture freezes
// them: a graph that is replayed over changing lengths takes the pointers.
struct InlineDecodeArrays {
  int32_t count = 0;
  int32_t slots[kInlineBatchEntries] = {};
  int64_t lengths[kInlineBatchEntries] = {};
};

struct DecodeParams {
  SequenceBatch batch;  // one query per entry, at position lengths[i] - 1
  const void* queries = nullptr;  // [count][num_heads][D], post-RoPE
  void* output = nullptr;         // [count][num_heads][D], in the model's basis (values rotated back)
  ElementType io = ElementType::kFloat32;
  int32_t num_heads = 0;
  float softmax_scale = 0;
  int32_t tokens_per_split = 0;  // flash-decoding splits of the context; 0: one split
  PagedTensor key_cache, value_cache;
  Dequantization key_dequantization, value_dequantization;
  Rotation key_rotation, value_rotation;  // queries are rotated by the keys', outputs back by the values'
  bool keys_pre_rope = false;
  const float* rope_inverse_frequencies = nullptr;  // [D/2], the model's (float32)
  void* read_tally = nullptr;  // CPU reference only: a ReadTally (cpu_reference.h) recording the bytes read
  DecodeKernel kernel = DecodeKernel::kAuto;  // CUDA only
  Int8Steps int8_steps = Int8Steps::kAuto;    // CUDA only
  // CUDA only: tokens a block of the exact ranges (sink and windows) takes
  // beside the tensor-core kernels, a multiple of 64; 0: the planner's
  // (DecodePlan::exact_chunk).
  int32_t exact_chunk_tokens = 0;
  // CUDA only: where the exact blocks are few enough to launch first
  // (DecodePlan::exact_slots_reserved: batch 1, 2 at some layouts) and the
  // keys have a matrix rotation, rotate the queries first and launch the
  // exact blocks behind the int8 kernel, into the slots the plan keeps for
  // them: the int8 and exact kernels' blocks then read the rotated queries,
  // and a decoding step's append joins the rotation's kernel
  // (step_append_host). Off: the exact blocks first (DecodePlan::exact_first),
  // each block rotating its own queries. On by default: on the H100, int2-rot
  // at batch 1 and 2, 4K-128K, 2 and 4 bits, a decode took within 0.2 us as
  // long or up to 3.3 us less, a step 2.3-5.3 us less
  // (bench/results/decode-rotation-first-h100-2026-12-05.json).
  bool rotate_before_exact_blocks = true;
  // CUDA only: scratch for the split states, planned once by the caller
  // (decode_workspace_bytes in decode_attention_launch.h); null or too small:
  // the launch allocates it on its stream.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  // CUDA and the CPU reference: a small batch's slots and lengths by value
  // (InlineDecodeArrays; count 0: batch.slots and batch.lengths).
  InlineDecodeArrays inline_arrays;
};

// Sequence entry `entry`'s slot and length (tokens cached): from the inline
// arrays where they are given, else from batch.slots and batch.lengths.
KVFORGE_HOST_DEVICE inline int32_t entry_slot(const DecodeParams& p, int32_t entry) {
  return p.inline_arrays.count > 0 ? p.inline_arrays.slots[entry] : p.batch.slots[entry];
}
KVFORGE_HOST_DEVICE inline int64_t entry_length(const DecodeParams& p, int32_t entry) {
  return p.inline_arrays.count > 0 ? p.inline_arrays.lengths[entry] : p.batch.lengths[entry];
}

}  // namespace kvforge::kernels
