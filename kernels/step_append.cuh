#pragma once
// Device code of a decoding step's append inside the decode's kernels
// (StepAppendArgs, kernels/step_append.h): the kernel that first reads an
// entry's new token, or one that every reader of it waits for, quantizes
// and stores that token, keys and values. A separate
// append launch costs a decoding step about an empty kernel's time (~2.7 us
// on the H200 under the benchmark's timer), more than a tenth of the decode
// at batch 1 (bench/README.md): inside the decode's launch the append is a
// warp's few hundred cycles.
//
// The layouts served are the token-parallel append's: each token is
// quantized on its own, so the code is append_token_kernel.cuh's (the same
// float64 operations in the same order as the CPU reference, written with
// explicit intrinsics and fmas, so that FMA contraction, on in the decode's
// files, changes nothing) and stores the same bytes as the append
// kernel. Two hosts (step_append_host):
// - Without a rotation, sink or window (rtn's) two warps of the int8
//   kernel's block whose split ends at the new token append it
//   (step_append_warps; load_step_rows, store_step_rows): the keys the warp
//   whose run ends there, the values its neighbour.
// - With matrix rotations and a sliding window in both kinds (int2-rot's),
//   where the queries are rotated first, the query rotation's kernel
//   (rotate_queries_kernel.cuh) rotates and stores the token, a block per
//   (KV head, entry, kind) (load_rotated_step_row, rotate_step_row,
//   store_rotated_step_row): the token lies in the
//   window, read from its exact row only by kernels that start after that
//   kernel has completed.
// (The exact kernel's block that reads a window's new token appending it, a
// matrix rotation included, was measured slower than two launches and
// removed: bench/README.md, the thirty-third session.)
#include <cstdint>

#include "kernels/append_token_kernel.cuh"
#include "kernels/step_append.h"

namespace kvforge::kernels::step_append_device {

// Where a step token goes (append_token_kernel.cuh's target), and the page
// the step opens for it.
struct StepToken {
  append_device::TokenTarget target;
  int32_t new_page_index = -1;  // the table index of a page the step opens; -1: none
  int32_t new_page = 0;
};

// Entry `entry`'s new token (step_token_place), outside the window (the
// rotated step sets to_ring for its window).
__device__ inline StepToken step_token(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                       int32_t slot, int64_t length, const int32_t* page_row) {
  const StepTokenPlace place = step_token_place(p.key_cache.layout.spec, step, entry, slot, length, page_row);
  StepToken t;
  t.target.slot = place.slot;
  t.target.token = place.token;
  t.target.page_id = place.page_id;
  t.target.to_ring = false;  // no window: rtn's layouts (step_append_host)
  t.new_page_index = place.new_page_index;
  t.new_page = place.new_page;
  return t;
}

// A page the step opens, written into the page table by one lane (every KV
// head's warp writes the same id, and reads it back after its own
// write: no other block's write to wait for).
__device__ inline void write_step_page(const DecodeParams& p, const StepAppendArgs& step, const StepToken& token) {
  if (token.new_page_index >= 0) {
    step.page_table[static_cast<int64_t>(token.target.slot) * p.batch.page_table_stride + token.new_page_index] =
        token.new_page;
  }
}

// One kind of entry `entry`'s new token of KV head `kv_head` (keys: its
// keys, else its values) as the whole warp loads and stores it, in two
// halves, so that the loads' round trip can overlap the warp's others
// (the int8 kernel's queries'): the lane's kE elements, rounded to the
// cache's element type, loaded by load_step_rows and stored by
// store_step_rows. No rotation here (step_append_host).
__device__ inline append_device::TokenTensorArgs step_rows_args(const DecodeParams& p, const StepAppendArgs& step,
                                                                bool keys) {
  return keys ? append_device::TokenTensorArgs{p.key_cache, step.key_quantization, Rotation{}, step.keys}
              : append_device::TokenTensorArgs{p.value_cache, step.value_quantization, Rotation{}, step.values};
}

template <int D>
__device__ inline void load_step_rows(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                      int32_t kv_head, bool keys, double (&part)[D / 32]) {
  constexpr int kE = D / 32;
  const append_device::TokenTensorArgs args = step_rows_args(p, step, keys);
  switch (p.key_cache.layout.spec.element) {
    case ElementType::kFloat16:
      append_device::load_token_part<kE, ElementType::kFloat16>(args, step.input, entry, kv_head, part);
      break;
    case ElementType::kBFloat16:
      append_device::load_token_part<kE, ElementType::kBFloat16>(args, step.input, entry, kv_head, part);
      break;
    case ElementType::kFloat32:
      append_device::load_token_part<kE, ElementType::kFloat32>(args, step.input, entry, kv_head, part);
      break;
  }
}

// Stored at device scope before it returns: the warp's own later reads
// (its copies into shared memory go through L2) see them, and so do the
// reads of any warp of the block after a __syncthreads that follows. The
// keys' warp opens a page the step opens beforehand (open_step_page),
// before it reads the page table.
template <int D, int kBits>
__device__ inline void store_step_rows(const DecodeParams& p, const StepAppendArgs& step, int32_t kv_head, bool keys,
                                       const StepToken& token, const double (&part)[D / 32]) {
  constexpr int kE = D / 32;
  const append_device::TokenTensorArgs args = step_rows_args(p, step, keys);
  switch (p.key_cache.layout.spec.element) {
    case ElementType::kFloat16:
      append_device::store_token_part<kE, kBits, ElementType::kFloat16>(args, token.target, kv_head, part);
      break;
    case ElementType::kBFloat16:
      append_device::store_token_part<kE, kBits, ElementType::kBFloat16>(args, token.target, kv_head, part);
      break;
    case ElementType::kFloat32:
      append_device::store_token_part<kE, kBits, ElementType::kFloat32>(args, token.target, kv_head, part);
      break;
  }
  __threadfence();
  __syncwarp();
}

// A page the step opens, by the keys' warp (every KV head's writes the same
// id) before any of its lanes reads the page table: the warp's own reads see
// it after the __syncwarp.
__device__ inline void open_step_page(const DecodeParams& p, const StepAppendArgs& step, const StepToken& token) {
  if (threadIdx.x % 32 == 0) write_step_page(p, step, token);
  __syncwarp();
}

// Both halves at once (the keys' late store in the int8 kernel, with its
// first stages' copies in flight): the keys' warp opens the step's page.
template <int D, int kBits>
__device__ inline void append_step_rows(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                        int32_t kv_head, bool keys, const StepToken& token) {
  if (keys) open_step_page(p, step, token);
  double part[D / 32];
  load_step_rows<D>(p, step, entry, kv_head, keys, part);
  store_step_rows<D, kBits>(p, step, kv_head, keys, token, part);
}

// ---------------------------------------------------------------- rotated
// int2-rot's step append beside the query rotation (StepAppendHost::
// kRotateQueries): block (KV head, entry, kind) of the query rotation's
// kernel stores entry's new token of that kind. y_j = sum_i (x_i - c_i) R_ij,
// i ascending, one float64 fma per term (the CPU reference's order, as
// append_token_rotated_kernel's): a chain that cannot be cut, so the
// block's kSlices slices of the matrix's rows take turns, slice s continuing
// slice s - 1's sums over its own rows from the registers that hold them
// (thread (slice, j): rows [s D / kSlices, (s + 1) D / kSlices) of column j,
// the query rotation's own registers for the keys), a barrier a turn. The
// matrix is widened to float64 element by element (16 conversions a cycle a
// multiprocessor): a kind a block halves a block's share.

template <int D>
struct RotatedStepShared {
  double x[D];    // the row as the cache's element, minus the centre where there is one
  double sum[D];  // y_j so far: every slice's turn adds its rows
  StepToken token;  // where it goes (place_rotated_step_token)
};

// The block's one RotatedStepShared (declared here, so that only the
// kernels that call this hold it).
template <int D>
__device__ inline RotatedStepShared<D>& rotated_step_shared() {
  __shared__ RotatedStepShared<D> shared;
  return shared;
}

// Thread i < D: channel i of entry `entry`'s new row of `kind`, KV head
// `kv_head`, into shared.x (the caller synchronizes before the sums read it).
template <int D, ElementType kElement>
__device__ inline void load_rotated_step_row(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                             int32_t kv_head, int kind, RotatedStepShared<D>& shared) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= D) return;
  const int64_t width = static_cast<int64_t>(p.key_cache.layout.spec.kv_heads) * D;
  const auto* input = static_cast<const uint8_t*>(kind == 0 ? step.keys : step.values) +
                      (entry * width + kv_head * D + i) * element_bytes(step.input);
  double x = append_device::round_to_element(kElement, append_device::load_element(step.input, input));
  const Rotation& rotation = kind == 0 ? p.key_rotation : p.value_rotation;
  if (rotation.kind == RotationKind::kMatrix && rotation.centre != nullptr) {
    x = __dsub_rn(x, static_cast<double>(rotation.centre[static_cast<int64_t>(kv_head) * D + i]));
  }
  shared.x[i] = x;
}

// The sums y_j = sum_i x_i R_ij into shared.sum, slice by slice (`column`:
// this thread's rows of column j, threadIdx.x = slice * D + j). Every
// thread of the block calls it (a barrier a slice), after a barrier that
// made shared.x visible; on return shared.sum is.
template <int D, int kSlices>
__device__ inline void rotate_step_row(const float (&column)[D / kSlices], RotatedStepShared<D>& shared) {
  constexpr int kRows = D / kSlices;
  const int j = static_cast<int>(threadIdx.x) % D, slice = static_cast<int>(threadIdx.x) / D;
  for (int s = 0; s < kSlices; ++s) {
    if (slice == s) {
      double sum = s == 0 ? 0.0 : shared.sum[j];
      const double* x = shared.x + s * kRows;
#pragma unroll
      for (int i = 0; i < kRows; ++i) sum = fma(x[i], static_cast<double>(column[i]), sum);
      shared.sum[j] = sum;
    }
    __syncthreads();
  }
}

// Thread 0: entry `entry`'s new token (step_token) into shared.token for
// warp 0's store, taken before the sums so that its page-table load is not
// behind them, nor its registers live through them (the caller's barriers
// make it visible).
template <int D>
__device__ inline void place_rotated_step_token(const DecodeParams& p, const StepAppendArgs& step, int32_t entry,
                                                RotatedStepShared<D>& shared) {
  if (threadIdx.x != 0) return;
  const int32_t slot = entry_slot(p, entry);
  const int32_t* page_row = p.batch.page_table + static_cast<int64_t>(slot) * p.batch.page_table_stride;
  shared.token = step_token(p, step, entry, slot, entry_length(p, entry), page_row);
}

// Warp 0: the row (shared.sum where the kind is rotated, else shared.x)
// rounded to the cache's element and stored as append_token_kernel's
// store_token_part stores it at shared.token (place_rotated_step_token's): codes and
// pair, the sink's or the window's exact row; the keys' block of KV head 0
// writes a page the step opens into the page table (for the calls after
// this one: this call's kernels read no code of the token, it is in the
// window).
template <int D, int kBits, ElementType kElement>
__device__ inline void store_rotated_step_row(const DecodeParams& p, const StepAppendArgs& step, int32_t kv_head,
                                              int kind, bool rotated, const RotatedStepShared<D>& shared) {
  constexpr int kE = D / 32;
  if (threadIdx.x >= 32) return;
  const int lane = static_cast<int>(threadIdx.x);
  const StepToken token = shared.token;
  if (kind == 0 && kv_head == 0 && lane == 0) write_step_page(p, step, token);
  const PagedTensor& cache = kind == 0 ? p.key_cache : p.value_cache;
  append_device::TokenTarget target = token.target;
  target.to_ring = cache.layout.ring_capacity > 0;  // one token: the last of its append
  const double* row = rotated ? shared.sum : shared.x;
  double y[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) y[e] = append_device::round_to_element(kElement, row[lane * kE + e]);
  const append_device::TokenTensorArgs args{cache, kind == 0 ? step.key_quantization : step.value_quantization,
                                            Rotation{}, nullptr};
  append_device::store_token_part<kE, kBits, kElement>(args, target, kv_head, y);
}

}  // namespace kvforge::kernels::step_append_device
