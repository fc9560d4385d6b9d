#pragma once
// Device code of the token-parallel append (docs/runtime-layout.md, section
// 6.1): for layouts whose keys and values are both grouped per token
// (kPerToken) with no outliers (rtn and int2-rot, plain or with a matrix
// rotation, a sink and a window), every token is quantized on its own: no
// outlier entries to number in token order and no group that reads earlier
// tokens back. So one warp takes one (token, KV head, kind) from input to
// codes, with no block barrier: a decoding step's append is a chain of
// latencies, and the block-per-sequence kernel (append_kernel.cuh) spends
// its ~1,500 instructions per warp on generic paths and their instruction
// fetches (bench/results/ncu-append-h200-2026-12-01.md).
//
// The arithmetic is the CPU reference's (kernels/cpu_reference.cpp) in
// float64, in the same order, so codes, pairs and exact rows are bit for bit
// the reference's; append_kernel.cuh's grid and code functions are shared.
// The file is compiled without FMA contraction (--fmad=false).
#include <cstdint>

#include "kernels/append_kernel.cuh"
#include "kernels/element_extreme.h"

namespace kvforge::kernels::append_device {

inline constexpr int kTokenWarps = 4;  // warps (KV heads) per block

// One tensor kind's view: its pools, quantizers, rotation and input rows.
struct TokenTensorArgs {
  PagedTensor cache;
  Quantization quantization;
  Rotation rotation;
  const void* input = nullptr;  // [rows][kv_heads][D] of input_type
};

// Keys (kinds[0]) and values (kinds[1]) of one append.
struct TokenAppendArgs {
  TokenTensorArgs kinds[2];
  ElementType input_type = ElementType::kFloat32;
  SequenceBatch batch;                     // slots and lengths used when the inline arrays are empty
  const int64_t* token_offsets = nullptr;  // likewise
  int32_t* page_table = nullptr;           // batch.page_table, written: the inline arrays' new pages
};

// The batch entry whose new rows hold `row`: offsets ascending, offsets[0]
// = 0, offsets[count] = the rows.
__device__ inline int32_t entry_of_row(const int64_t* offsets, int32_t count, int64_t row) {
  int32_t low = 0, high = count - 1;  // offsets[low] <= row < offsets[high + 1]
  while (low < high) {
    const int32_t middle = (low + high + 1) / 2;
    if (offsets[middle] <= row) {
      low = middle;
    } else {
      high = middle - 1;
    }
  }
  return low;
}

// Lanes l and l ^ offset combine (lower, higher): symmetric, so every lane of
// a group ends with the group's extremes.
__device__ inline ElementExtreme shuffle_xor(ElementExtreme e, int offset) {
  return {__shfl_xor_sync(0xffffffffu, e.value, offset), __shfl_xor_sync(0xffffffffu, e.at, offset)};
}

// The lane's kE input elements as element-type numbers (the input type's
// switch once, not per element).
template <int kE, ElementType kElement>
__device__ inline void load_rounded(ElementType input_type, const uint8_t* input, double (&y)[kE]) {
  switch (input_type) {
    case ElementType::kFloat16:
#pragma unroll
      for (int e = 0; e < kE; ++e) y[e] = round_to_element(kElement, load_element(ElementType::kFloat16, input + 2 * e));
      return;
    case ElementType::kBFloat16:
#pragma unroll
      for (int e = 0; e < kE; ++e) y[e] = round_to_element(kElement, load_element(ElementType::kBFloat16, input + 2 * e));
      return;
    case ElementType::kFloat32:
      break;
  }
#pragma unroll
  for (int e = 0; e < kE; ++e) y[e] = round_to_element(kElement, load_element(ElementType::kFloat32, input + 4 * e));
}

// One warp: token `token` of a sequence (input row `row`), KV head `head`,
// one kind. Lane l holds channels [l kE, (l + 1) kE) of the head. `stage`:
// the warp's D doubles of shared memory (the matrix rotation's input).
// `to_ring`: the token is among the last ring_capacity of its append, so its
// ring row is written by no later token of the same call.
// `page_of`: the page id of a token slot's page (the inline new page or the
// page table's). The cache's element type is a template parameter: with it
// a runtime value, every element conversion ran all three types' code under
// predicates (ncu, bench/results/ncu-append-h200-2026-12-01.md).
template <int kE, int kBits, ElementType kElement, class PageOf>
__device__ void append_token_head(const TokenTensorArgs& t, ElementType input_type, PageOf&& page_of, int32_t slot,
                                  int64_t row, int64_t token, bool to_ring, int32_t head, double* stage) {
  constexpr int kDim = 32 * kE;
  constexpr int per_word = 32 / kBits;
  constexpr int lanes_per_word = per_word / kE;
  const int lane = threadIdx.x % 32;
  const TensorPageLayout& l = t.cache.layout;
  const int32_t sink = l.spec.sink_tokens;
  const int32_t first = lane * kE;  // the lane's first channel in the head
  // The page first: its load is in flight while the token is prepared.
  const bool quantized = token >= sink;
  const auto s = static_cast<int32_t>(token - sink);  // token slot (< 2^31)
  int32_t page_id = 0;
  if (quantized) page_id = page_of(s / l.spec.page_size);

  // A matrix rotation's rows (the lane's channels of each) on their way to
  // L2 while the token loads: the fma chain below keeps only ~5 rows' loads
  // in flight (ptxas pipelines them so, whatever the unrolling), and the
  // matrices leave L2 between decoding steps, so each of its ~26 batches had
  // been a round trip to memory: ~10 us of int2-rot's 16 us append step
  // on the H200 (bench/README.md, seventeenth session).
  if (t.rotation.kind == RotationKind::kMatrix) {
    const float* rows = t.rotation.matrix + static_cast<int64_t>(head) * kDim * kDim + first;
#pragma unroll 8
    for (int i = 0; i < kDim; ++i) asm volatile("prefetch.global.L2 [%0];" ::"l"(rows + i * kDim));
  }

  const int64_t width = static_cast<int64_t>(l.spec.kv_heads) * kDim;
  const int64_t in_bytes = element_bytes(input_type);
  const auto* input = static_cast<const uint8_t*>(t.input) + ((row * width) + head * kDim + first) * in_bytes;
  double y[kE];
  load_rounded<kE, kElement>(input_type, input, y);

  const Rotation& r = t.rotation;
  if (r.kind == RotationKind::kMatrix) {
    // y_j = sum_i (x_i - c_i) R_ij, i ascending, one fma per term.
    const float* centre = r.centre != nullptr ? r.centre + head * kDim : nullptr;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      stage[first + e] = centre != nullptr ? __dsub_rn(y[e], static_cast<double>(centre[first + e])) : y[e];
    }
    __syncwarp();
    const float* matrix = r.matrix + static_cast<int64_t>(head) * kDim * kDim + first;
    double sum[kE] = {};
#pragma unroll 8
    for (int i = 0; i < kDim; ++i) {
      const double x = stage[i];
#pragma unroll
      for (int e = 0; e < kE; ++e) sum[e] = fma(x, static_cast<double>(__ldg(matrix + i * kDim + e)), sum[e]);
    }
#pragma unroll
    for (int e = 0; e < kE; ++e) y[e] = round_to_element(kElement, sum[e]);
  }

  constexpr int64_t element_size = kElement == ElementType::kFloat32 ? 4 : 2;
  uint8_t* exact = t.cache.exact + static_cast<int64_t>(slot) * l.exact_slot_bytes;
  const auto store_exact = [&](int64_t exact_row) {
    uint8_t* out = exact + exact_row_offset(l, head, exact_row) + first * element_size;
#pragma unroll
    for (int e = 0; e < kE; ++e) store_element(kElement, y[e], out + e * element_size);
  };
  if (!quantized) {
    store_exact(token);
    return;
  }

  // The group's range in the reference's order (element_extreme.h): the lane's
  // channels in index order, then the group's lanes pairwise.
  const int32_t group = l.spec.group;
  const int lanes_per_group = group / kE;
  ElementExtreme low{static_cast<float>(y[0]), first}, high = low;
#pragma unroll
  for (int e = 1; e < kE; ++e) {
    const ElementExtreme here{static_cast<float>(y[e]), first + e};
    low = lower(low, here);
    high = higher(high, here);
  }
  for (int offset = lanes_per_group / 2; offset > 0; offset /= 2) {
    low = lower(low, shuffle_xor(low, offset));
    high = higher(high, shuffle_xor(high, offset));
  }
  const double min = static_cast<double>(low.value), max = static_cast<double>(high.value);

  const int32_t in_page = s % l.spec.page_size;
  uint8_t* page = t.cache.pages + static_cast<int64_t>(page_id) * l.page_bytes;
  if (lane % lanes_per_group == 0) {
    uint8_t* pair = page + token_pair_offset(l, head, in_page, first / group);
    store_element(kElement, min, pair);
    store_element(kElement, max, pair + element_size);
  }
  const RuntimeGrid grid = runtime_grid<kBits>(t.quantization, min, max);
  uint32_t bits = 0;
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    const auto code = static_cast<uint32_t>(runtime_code<kBits>(t.quantization, grid, y[e]));
    bits |= code << (((first + e) % per_word) * kBits);
  }
#pragma unroll
  for (int offset = lanes_per_word / 2; offset > 0; offset /= 2) bits |= __shfl_xor_sync(0xffffffffu, bits, offset);
  if (lane % lanes_per_word == 0) store_u32(page + code_row_offset(l, head, in_page) + 4 * (first / per_word), bits);
  if (to_ring) store_exact(sink + s % l.ring_capacity);
}

// Grid: x the input rows, y the KV heads in blocks of kTokenWarps, z the
// kind (0 keys, 1 values); a warp per (row, head, kind).
template <int kE, int kBits, ElementType kElement>
__global__ void __launch_bounds__(32 * kTokenWarps)
    append_token_kernel(const __grid_constant__ TokenAppendArgs args, const __grid_constant__ InlineBatchArrays arrays) {
  __shared__ double stages[kTokenWarps][32 * kE];
  const int warp = threadIdx.x / 32;
  const TokenTensorArgs& t = args.kinds[blockIdx.z];
  const int32_t head = static_cast<int32_t>(blockIdx.y) * kTokenWarps + warp;
  if (head >= t.cache.layout.spec.kv_heads) return;  // a whole warp
  const int64_t row = blockIdx.x;
  const bool in_params = arrays.count > 0;
  const int64_t* offsets = in_params ? arrays.token_offsets : args.token_offsets;
  const int32_t count = args.batch.count;
  const int32_t entry = entry_of_row(offsets, count, row);
  const int32_t slot = in_params ? arrays.slots[entry] : args.batch.slots[entry];
  const int64_t length = in_params ? arrays.lengths[entry] : args.batch.lengths[entry];
  const int64_t token = length + (row - offsets[entry]);
  const int32_t ring = t.cache.layout.ring_capacity;
  // A chunk longer than the ring: only its last ring tokens stay there.
  const bool to_ring = ring > 0 && offsets[entry + 1] - row <= ring;
  const int64_t row_base = static_cast<int64_t>(slot) * args.batch.page_table_stride;
  const int32_t* page_row = args.batch.page_table + row_base;
  // The page the call opens for this entry: read from the launch, and
  // written into the table by one warp (its first row's, keys, head 0) for
  // the calls after this one.
  const int32_t new_page = in_params ? arrays.new_page_plus_one[entry] - 1 : -1;
  const int32_t new_index = new_page_index(args.kinds[0].cache.layout.spec, length);
  if (new_page >= 0 && row == offsets[entry] && blockIdx.z == 0 && head == 0 && threadIdx.x % 32 == 0) {
    args.page_table[row_base + new_index] = new_page;
  }
  const auto page_of = [&](int32_t index) { return index == new_index && new_page >= 0 ? new_page : page_row[index]; };
  append_token_head<kE, kBits, kElement>(t, args.input_type, page_of, slot, row, token, to_ring, head, stages[warp]);
}

}  // namespace kvforge::kernels::append_device
