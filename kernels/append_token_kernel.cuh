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
#include "kernels/async_copy.cuh"
#include "kernels/element_extreme.h"

namespace kvforge::kernels::append_device {

inline constexpr int kTokenWarps = 4;  // warps per block: KV heads, or rows where a kind is rotated

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
  int64_t rows = 0;                        // input rows
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

// The shared-memory ring that stages a matrix rotation's rows for a block
// (the kinds' matrices are [kv_heads][D][D] float32, row i of a head
// contiguous): kChunks chunks of kRows rows in flight at once, the block's
// threads copying each chunk together (cp.async, 16 bytes a copy). A warp's
// lanes loading the rows from global memory had kept ~5 rows in flight
// (ptxas pipelines the fma chain so, whatever the unrolling): ~26 round
// trips to L2 a token, ~6 us of int2-rot's 16 us append step on the H200
// (bench/README.md).
template <int kDim>
struct RotationRing {
  static constexpr int kChunks = 4;
  static constexpr int kChunkFloats = 2048;  // 8 KB
  static constexpr int kRows = kChunkFloats / kDim;
  static constexpr int kSteps = kDim / kRows;  // chunks of a matrix
  static_assert(kRows * kDim == kChunkFloats && kSteps * kRows == kDim, "whole rows a chunk, whole chunks a matrix");
  float rows[kChunks][kChunkFloats];
};

// Chunk `chunk` of `matrix` (the head's) into its ring slot, by the block's
// kThreads threads (kCopies 16-byte copies each, unrolled: one shared
// address and one global pointer a chunk, the copies at constant offsets
// from them; a loop over blockDim.x had spent a quarter of a decoding step's
// instructions on its addresses), and the copy group committed (an empty one
// past the matrix's end, so that every thread counts the same groups).
template <int kDim, int kThreads>
__device__ inline void stage_rotation_chunk(RotationRing<kDim>& ring, const float* matrix, int chunk) {
  using Ring = RotationRing<kDim>;
  constexpr int kCopies = Ring::kChunkFloats / (4 * kThreads);
  static_assert(kCopies * 4 * kThreads == Ring::kChunkFloats, "whole 16-byte copies a thread");
  if (chunk < Ring::kSteps) {
    const int first = 4 * static_cast<int>(threadIdx.x);
    const float* from = matrix + static_cast<int64_t>(chunk) * Ring::kChunkFloats + first;
    const auto to = static_cast<uint32_t>(__cvta_generic_to_shared(ring.rows[chunk % Ring::kChunks] + first));
#pragma unroll
    for (int k = 0; k < kCopies; ++k) copy_async_to<16>(to + 16 * kThreads * k, from + 4 * kThreads * k, true);
  }
  copy_async_commit();
}

// Where one warp's token goes: its sequence's slot, its position, whether
// it also lands in the ring (the token is among the last ring_capacity of
// its append, so no later token of the same call writes its ring row), and
// its page (token slot's page; 0 within the sink).
struct TokenTarget {
  int32_t slot = 0;
  int64_t token = 0;
  bool to_ring = false;
  int32_t page_id = 0;
};

// The target of input row `row`, for the KV head `head` of kind `kind`; the
// warp of the entry's first row, keys, head 0 writes the page the call opens
// for the entry (read from the launch) into the table, for the calls after
// this one.
__device__ inline TokenTarget token_target(const TokenAppendArgs& args, const InlineBatchArrays& arrays, int64_t row,
                                           int kind, int32_t head) {
  const bool in_params = arrays.count > 0;
  const int64_t* offsets = in_params ? arrays.token_offsets : args.token_offsets;
  const int32_t count = args.batch.count;
  const int32_t entry = entry_of_row(offsets, count, row);
  const TensorPageLayout& l = args.kinds[kind].cache.layout;
  TokenTarget target;
  target.slot = in_params ? arrays.slots[entry] : args.batch.slots[entry];
  const int64_t length = in_params ? arrays.lengths[entry] : args.batch.lengths[entry];
  target.token = length + (row - offsets[entry]);
  const int32_t ring = l.ring_capacity;
  // A chunk longer than the ring: only its last ring tokens stay there.
  target.to_ring = ring > 0 && offsets[entry + 1] - row <= ring;
  const int64_t row_base = static_cast<int64_t>(target.slot) * args.batch.page_table_stride;
  const int32_t new_page = in_params ? arrays.new_page_plus_one[entry] - 1 : -1;
  const int32_t new_index = new_page_index(args.kinds[0].cache.layout.spec, length);
  if (new_page >= 0 && row == offsets[entry] && kind == 0 && head == 0 && threadIdx.x % 32 == 0) {
    args.page_table[row_base + new_index] = new_page;
  }
  const int32_t sink = l.spec.sink_tokens;
  if (target.token >= sink) {
    const int32_t index = static_cast<int32_t>(target.token - sink) / l.spec.page_size;
    target.page_id = index == new_index && new_page >= 0 ? new_page : args.batch.page_table[row_base + index];
  }
  return target;
}

// The lane's kE input elements of (row, head): channels [l kE, (l + 1) kE)
// of the head, as cache-element numbers.
template <int kE, ElementType kElement>
__device__ inline void load_token_part(const TokenTensorArgs& t, ElementType input_type, int64_t row, int32_t head,
                                       double (&y)[kE]) {
  constexpr int kDim = 32 * kE;
  const int lane = threadIdx.x % 32;
  const int64_t width = static_cast<int64_t>(t.cache.layout.spec.kv_heads) * kDim;
  const int64_t in_bytes = element_bytes(input_type);
  const auto* input = static_cast<const uint8_t*>(t.input) + ((row * width) + head * kDim + lane * kE) * in_bytes;
  load_rounded<kE, kElement>(input_type, input, y);
}

// The lane's kE elements, rotated where the kind has a matrix and already
// rounded to the cache's element type, into codes, pairs and exact rows
// (token `target.token`, KV head `head`).
template <int kE, int kBits, ElementType kElement>
__device__ void store_token_part(const TokenTensorArgs& t, const TokenTarget& target, int32_t head,
                                 const double (&y)[kE]) {
  constexpr int per_word = 32 / kBits;
  constexpr int lanes_per_word = per_word / kE;
  const int lane = threadIdx.x % 32;
  const TensorPageLayout& l = t.cache.layout;
  const int32_t sink = l.spec.sink_tokens;
  const int32_t first = lane * kE;  // the lane's first channel in the head
  constexpr int64_t element_size = kElement == ElementType::kFloat32 ? 4 : 2;
  uint8_t* exact = t.cache.exact + static_cast<int64_t>(target.slot) * l.exact_slot_bytes;
  const auto store_exact = [&](int64_t exact_row) {
    uint8_t* out = exact + exact_row_offset(l, head, exact_row) + first * element_size;
#pragma unroll
    for (int e = 0; e < kE; ++e) store_element(kElement, y[e], out + e * element_size);
  };
  if (target.token < sink) {
    store_exact(target.token);
    return;
  }
  const auto s = static_cast<int32_t>(target.token - sink);  // token slot (< 2^31)

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
  uint8_t* page = t.cache.pages + static_cast<int64_t>(target.page_id) * l.page_bytes;
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
  if (target.to_ring) store_exact(sink + s % l.ring_capacity);
}

// One warp: input row `row`, KV head `head`, kind `kind`, without a
// rotation.
template <int kE, int kBits, ElementType kElement>
__device__ inline void append_unrotated_token(const TokenAppendArgs& args, const InlineBatchArrays& arrays, int64_t row,
                                              int kind, int32_t head) {
  // The page first: its load is in flight while the token loads.
  const TokenTarget target = token_target(args, arrays, row, kind, head);
  double y[kE];
  load_token_part<kE, kElement>(args.kinds[kind], args.input_type, row, head, y);
  store_token_part<kE, kBits, kElement>(args.kinds[kind], target, head, y);
}

// Grid: x the input rows, y the KV heads in blocks of kTokenWarps, z the
// kind (0 keys, 1 values); a warp per (row, head, kind). For launches
// without a matrix rotation.
template <int kE, int kBits, ElementType kElement>
__global__ void __launch_bounds__(32 * kTokenWarps)
    append_token_kernel(const __grid_constant__ TokenAppendArgs args, const __grid_constant__ InlineBatchArrays arrays) {
  const int warp = threadIdx.x / 32;
  const int kind = static_cast<int>(blockIdx.z);
  const TokenTensorArgs& t = args.kinds[kind];
  const int32_t head = static_cast<int32_t>(blockIdx.y) * kTokenWarps + warp;
  if (head >= t.cache.layout.spec.kv_heads) return;  // a whole warp
  append_unrotated_token<kE, kBits, kElement>(args, arrays, blockIdx.x, kind, head);
}

// Grid: x the input rows in blocks of kBlockRows (1, 2 or 4), y the KV
// heads, z the kind; the block's warps share one head and kind, warp w < kBlockRows
// loading and storing row w. With a matrix rotation, its rows are staged once
// for the block (RotationRing) and thread t sums output channels t + 128 k of
// every row of the block:
// each matrix element is read from shared memory and widened to float64
// once for all of them, and the block's four schedulers share the work. A
// warp per token, its lanes summing their own channels, had widened every
// element on one scheduler (F2F.F64.F32, 16 a cycle a multiprocessor):
// ~2 us a token at head_dim 128, and its chain on top (bench/README.md).
// Fewer rows a block where the rows are few (a decoding step): each thread's
// float64 sums are one chain a row, and the block's time is their issue
// (rotated_block_rows, append_kernel.cu).
// For launches where a kind has a matrix rotation.
template <int kE, int kBits, ElementType kElement, int kBlockRows>
__global__ void __launch_bounds__(32 * kTokenWarps)
    append_token_rotated_kernel(const __grid_constant__ TokenAppendArgs args,
                                const __grid_constant__ InlineBatchArrays arrays) {
  constexpr int kDim = 32 * kE;
  constexpr int kThreads = 32 * kTokenWarps;
  // The output channels a thread sums (head_dim 64: threads 64 and up none).
  constexpr int kColumns = kDim > kThreads ? kDim / kThreads : 1;
  using Ring = RotationRing<kDim>;
  static_assert(Ring::kRows % 2 == 0, "rows taken two at a time");
  static_assert(kBlockRows >= 1 && kBlockRows <= kTokenWarps, "a warp per row at most");
  // Each row's token: x - c, then the rotated y (float64, before rounding).
  __shared__ __align__(16) double stages[kBlockRows][kDim];
  __shared__ __align__(16) Ring ring;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kind = static_cast<int>(blockIdx.z);
  const TokenTensorArgs& t = args.kinds[kind];
  const auto head = static_cast<int32_t>(blockIdx.y);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kBlockRows + warp;
  const bool has_row = warp < kBlockRows && row < args.rows;
  const Rotation& r = t.rotation;
  if (r.kind != RotationKind::kMatrix) {  // the kind without one: a warp per token, as append_token_kernel
    if (has_row) append_unrotated_token<kE, kBits, kElement>(args, arrays, row, kind, head);
    return;
  }
  // Every thread takes part in the ring's copies and barriers, with a row
  // or without.
  const float* matrix = r.matrix + static_cast<int64_t>(head) * kDim * kDim;
#pragma unroll
  for (int c = 0; c < Ring::kChunks; ++c) stage_rotation_chunk<kDim, kThreads>(ring, matrix, c);
  TokenTarget target;
  const int first = lane * kE;
  if (has_row) {
    target = token_target(args, arrays, row, kind, head);
    double x[kE];
    load_token_part<kE, kElement>(t, args.input_type, row, head, x);
    const float* centre = r.centre != nullptr ? r.centre + static_cast<int64_t>(head) * kDim : nullptr;
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      stages[warp][first + e] = centre != nullptr ? __dsub_rn(x[e], static_cast<double>(centre[first + e])) : x[e];
    }
  } else if (warp < kBlockRows) {  // past the last row: summed like the others', never stored
#pragma unroll
    for (int e = 0; e < kE; ++e) stages[warp][first + e] = 0.0;
  }
  // y_j = sum_i (x_i - c_i) R_ij, i ascending, one fma per term (the
  // reference's order), for j = threadIdx.x + kThreads k and each row w.
  const bool summing = static_cast<int>(threadIdx.x) < kDim;
  double sum[kBlockRows][kColumns] = {};
  // A chunk's row pairs unrolled: all of them at one row a block, so that
  // the chunk's shared loads are issued before its fma chain (two pairs at a
  // time had paid a load's and a widening's latency every four rows).
  constexpr int kPairsUnrolled = kBlockRows == 1 ? Ring::kRows / 2 : 2;
  for (int c = 0; c < Ring::kSteps; ++c) {
    copy_async_wait<Ring::kChunks - 1>();  // this thread's copies of chunk c are done
    __syncthreads();                       // and every thread's (and, first, every x - c)
    if (summing) {
      const float* chunk = ring.rows[c % Ring::kChunks];
#pragma unroll(kPairsUnrolled)
      for (int i = 0; i < Ring::kRows; i += 2) {
        double m0[kColumns], m1[kColumns];
#pragma unroll
        for (int k = 0; k < kColumns; ++k) {
          m0[k] = static_cast<double>(chunk[i * kDim + threadIdx.x + kThreads * k]);
          m1[k] = static_cast<double>(chunk[(i + 1) * kDim + threadIdx.x + kThreads * k]);
        }
#pragma unroll
        for (int w = 0; w < kBlockRows; ++w) {
          const double2 x = *reinterpret_cast<const double2*>(&stages[w][c * Ring::kRows + i]);
#pragma unroll
          for (int k = 0; k < kColumns; ++k) sum[w][k] = fma(x.y, m1[k], fma(x.x, m0[k], sum[w][k]));
        }
      }
    }
    if (c + Ring::kChunks < Ring::kSteps) {
      __syncthreads();  // every thread is done with the slot before it is refilled
      stage_rotation_chunk<kDim, kThreads>(ring, matrix, c + Ring::kChunks);
    } else {
      copy_async_commit();  // an empty group: the waits' counts stay the same
    }
  }
  __syncthreads();  // every x read: the stages take the sums
  if (summing) {
#pragma unroll
    for (int w = 0; w < kBlockRows; ++w) {
#pragma unroll
      for (int k = 0; k < kColumns; ++k) stages[w][threadIdx.x + kThreads * k] = sum[w][k];
    }
  }
  __syncthreads();
  if (!has_row) return;
  double y[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) y[e] = round_to_element(kElement, stages[warp][first + e]);
  store_token_part<kE, kBits, kElement>(t, target, head, y);
}

}  // namespace kvforge::kernels::append_device
