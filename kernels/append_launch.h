#pragma once
// The CUDA append kernel's launcher (kernels/append_kernel.cu): checks the
// params (std::invalid_argument naming the field) and launches keys and
// values on `stream`: a warp per token, KV head and kind where the layout
// allows it, else one block per sequence of the batch and kind (KIVI's keys:
// per sequence and slice of 256 channels).
#include <cuda_runtime.h>

#include "kernels/decode_params.h"

namespace kvforge::kernels {

void launch_append(const AppendParams& params, cudaStream_t stream);

// launch_append's checks alone (std::invalid_argument naming the field),
// for a launcher that runs the append inside another kernel
// (DecodePlanner::launch_step).
void check_append_params(const AppendParams& params);

// Whether launch_append takes the call with the token-parallel kernel
// (kernels/append_token_kernel.cuh: AppendParams::kernel kAuto, the rows
// known, both kinds per-token groups of whole lanes' channels without
// outliers, no rotation or a matrix one, head_dim 64, 128 or 256, equal
// bits); otherwise one block per sequence and kind (or channel slice:
// kernels/append_slices.h).
bool takes_token_parallel(const AppendParams& params);

// Rows a block of the rotated token kernel takes (1, 2 or 4): the fewest
// whose blocks (rows / R per KV head and kind) stay within kRotatedBlocks.
// Each thread sums its channel over the head's matrix once per row of its
// block, a float64 chain a row, so a block's time grows with its rows while
// the matrix it reads from L2 stays one: few rows (a decoding step) take
// one a block, many (prefill) four. On the H200 (8 KV heads, int2-rot, 2
// bits), a step's device time at batch 1 / 8 / 32: 8.1 / 8.7 / 9.2 us at
// four rows, 7.5 / 8.3 us at one, 9.5 at two (bench/README.md); a budget of
// about a block a multiprocessor keeps batch 32 at four.
inline constexpr int64_t kRotatedBlocks = 128;
constexpr int rotated_block_rows(int64_t rows, int64_t kv_heads) {
  for (int r = 1; r < 4; r *= 2) {
    if ((rows + r - 1) / r * kv_heads * 2 <= kRotatedBlocks) return r;
  }
  return 4;
}

}  // namespace kvforge::kernels
