#pragma once
// A warp's share of its block's tokens in the int8 decode kernel
// (decode_int8_kernel.cuh): the block's steps of `step_tokens` tokens cut
// into `warps` contiguous runs of ceil(steps / warps) steps, the last step
// and the last runs possibly short or empty. Host and device: the kernel's
// partition, so that the host can say which warp holds a token
// (step_append_warps, kernels/step_append.h) and a test can check it.
#include <cstdint>

#include "kernels/decode_params.h"

namespace kvforge::kernels {

struct WarpRun {
  int64_t first = 0;   // the run's first token
  int32_t steps = 0;   // its steps (0: an empty run)
  int32_t tokens = 0;  // its tokens: steps * step_tokens, fewer where it ends the block
};

// The block's steps and each warp's share of them (the last run may be
// shorter, later ones empty).
struct BlockSteps {
  int64_t steps = 0;
  int64_t per_warp = 0;
};
KVFORGE_HOST_DEVICE inline BlockSteps block_steps(int64_t first, int64_t last, int warps, int step_tokens) {
  BlockSteps b;
  b.steps = (last - first + step_tokens - 1) / step_tokens;
  b.per_warp = (b.steps + warps - 1) / warps;
  return b;
}

// Warp `warp`'s run of the block's tokens [first, last) (first < last: a
// split is far under 2^31 tokens, so a run's counts fit 32 bits).
KVFORGE_HOST_DEVICE inline WarpRun warp_run(int64_t first, int64_t last, int warp, int warps, int step_tokens) {
  const BlockSteps b = block_steps(first, last, warps, step_tokens);
  const int64_t steps = b.steps, per_warp = b.per_warp;
  const int64_t step_begin = warp * per_warp;
  const int64_t step_end = step_begin + per_warp < steps ? step_begin + per_warp : steps;
  WarpRun run;
  run.first = first + step_begin * step_tokens;
  run.steps = step_end > step_begin ? static_cast<int32_t>(step_end - step_begin) : 0;
  const int64_t full = int64_t{run.steps} * step_tokens;
  // A warp past the block's steps: its run starts past `last`, no tokens.
  run.tokens = run.steps == 0 ? 0 : static_cast<int32_t>(last - run.first < full ? last - run.first : full);
  return run;
}

// The warp whose run holds the block's last token: the last non-empty one.
KVFORGE_HOST_DEVICE inline int last_run_warp(int64_t first, int64_t last, int warps, int step_tokens) {
  const BlockSteps b = block_steps(first, last, warps, step_tokens);
  return static_cast<int>((b.steps - 1) / b.per_warp);
}

}  // namespace kvforge::kernels
