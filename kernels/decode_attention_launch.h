#pragma once
// The CUDA decode_attention kernels' launcher (kernels/decode_attention.cu):
// one query per sequence over its paged, quantized KV cache, as
// docs/runtime-layout.md section 6.3 states and decode_attention_reference
// computes; every pointer of params is device memory.
//
// Plan, then run: plan_decode_attention says which kernel takes the context
// and how it is split (from the batch's longest sequence and the device's
// multiprocessors); a caller that decodes many steps sizes params.workspace
// once by decode_workspace_bytes.
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <utility>

#include "kernels/decode_params.h"
#include "kernels/step_append.h"

namespace kvforge::kernels {

struct DecodePlan {
  // The tensor-core kernel (section 6.4) takes the tokens quantized for both
  // keys and values; the general kernel the others (sink, windows). Without
  // it (or the lookup kernel below) the general kernel takes every token.
  bool tensor_cores = false;
  // The lookup kernel (decode_lookup_kernel.cuh, CUDA cores) takes the
  // quantized tokens instead, split and merged as the tensor-core kernels'
  // (tokens_per_split, exact_splits, exact_kernel, exact_chunk as theirs).
  bool lookup = false;
  bool int8 = false;  // the tensor-core kernel is the 8-bit integer one (DecodeKernel::kInt8TensorCores)
  Int8Steps int8_steps = Int8Steps::kSteps32;  // int8: its steps (DecodeParams::int8_steps resolved)
  int64_t tokens_per_split = 0;  // the context split of the kernel that takes the quantized tokens (0: one split)
  int32_t splits = 0;            // its blocks per (KV head, sequence)
  int32_t exact_splits = 0;      // tensor cores: blocks over the exact ranges per (KV head, sequence)
  // Tokens each of them takes (DecodeParams::exact_chunk_tokens, else 128
  // for the exact kernel: the sink and a 256-token window in 3 blocks; 64
  // for the general kernel's).
  int32_t exact_chunk = 64;
  // They are decode_exact_kernel's (every token of the ranges exact in both
  // tensors: same_quantized_ranges, one element type, aligned stores), else
  // the general kernel's.
  bool exact_kernel = false;
  // int8: the exact ranges' blocks are few (at most an eighth of the int8
  // kernel's resident blocks: batch 1, 2 at some layouts;
  // exact_slots_reserved, below), so they
  // launch first and run beside the int8 kernel's, whose splits are planned
  // for the slots they leave, unless the keys have a matrix rotation and
  // DecodeParams::rotate_before_exact_blocks (the default) moves them behind
  // the query rotation; else the int8 kernel launches first and their
  // blocks fill its last wave.
  bool exact_first = false;
  // Tensor cores with a matrix key rotation, the exact blocks not first: the
  // queries are rotated once for the call (rotate_group_queries_kernel,
  // into the workspace) before the kernels that read them, not once per
  // block. (With exact_first the int8 kernel would have to wait for the
  // rotation behind the exact blocks, or launch first and hold the exact
  // blocks back until its last wave started: batch 1 at 128K, 47 -> 57 us.)
  bool rotate_queries_first = false;
  // rotate_queries_first, and the rotation's step variant (a decoding
  // step's append inside it, StepAppendHost::kRotateQueries: a second block
  // per (KV head, sequence) for the value row) runs all its blocks at once
  // on the device. A wave more would hold back the decode's kernels, which
  // wait for it: at head_dim 128 its blocks take 82 registers a thread (one
  // of 512 threads per multiprocessor, where the rotation alone fits two),
  // and int2-rot's step at batch 32 (32K, 2 bits, H100) took 286 -> 297 us
  // where at batch 8, in one wave, it fell 93 -> 89 us.
  bool rotation_step_in_one_wave = false;
  // The exact blocks are few (exact_first's condition), and the int8
  // kernel's splits are planned for the slots they leave, whether they
  // launch first (exact_first) or, with
  // DecodeParams::rotate_before_exact_blocks, behind the int8 kernel after
  // the query rotation: once every int8 block has its queries they take
  // those slots, beside the int8 blocks rather than after the last wave
  // (where that wave is the only one).
  bool exact_slots_reserved = false;
  int64_t states = 0;            // split states per query head: splits + exact_splits
  // The merge's blocks take four groups of head_dim threads, each loading
  // 16 states' rows at once: many states (over 8) and at most one such
  // block per multiprocessor (query heads times sequences; batch 1). Else
  // one group of 8 states' rows, blocks small enough for batch 32's in one
  // wave.
  bool wide_merge = false;
  // Query heads per merge block: 4 where the output is rotated back, the
  // blocks one-group and the GQA group a multiple of 4 (split_plan.h's
  // merge_heads), so that they read each row of R_v once; else 1.
  int32_t merge_heads = 1;
  // int8: the splits of a (KV head, sequence) run as one thread-block
  // cluster that merges their states in shared memory and writes the output
  // (kernels/cluster_merge.cuh): no merge kernel. Where the int8 kernel
  // writes every state (no exact ranges), nothing is rotated, at most 8
  // splits (split_plan.h's cluster_merge_applies), and the device holds as
  // many blocks at once in such clusters (clusters_add_no_wave): on the
  // H200 rtn at batch 32 (2 splits) at Llama-3-8B's shapes, not batch 8
  // (64 clusters of 8 do not fit at once). wide_merge and merge_heads then
  // do not apply; the workspace's states are not used.
  bool cluster_merge = false;
};

// Whether the configuration's layout is one the tensor-core kernel reads:
// head_dim 64 or 128, 2 or 4 bits, uniform levels, post-RoPE keys, at most 8
// query heads per KV head, per-token groups of a multiple of 16 channels
// (at most 4 per head) or all-heads groups, per-channel key groups of a
// multiple of 16 tokens or offline ones.
bool tensor_core_decode_supported(const DecodeParams& params);

// Whether the 8-bit integer tensor-core kernel reads it: 2 or 4 bits, head_dim 64
// or 128, uniform levels, post-RoPE keys, at most 8 query heads per KV head;
// values with one group per token row (all-heads, or per_token groups of
// head_dim) or per_token groups of 32 channels; keys with one group per row
// or per-channel (offline, or groups of a multiple of 32 tokens with values
// in groups of 32 channels).
bool int8_decode_supported(const DecodeParams& params);

// Whether the lookup kernel reads it: head_dim 64 or 128, 2 or 4 bits, at
// most 8 query heads per KV head, keys per channel offline (any levels,
// before or after RoPE, any outliers), values with one scale group per
// token row (all heads, or per_token groups of head_dim; any levels and
// outliers), one page size.
bool lookup_decode_supported(const DecodeParams& params);

// Whether its 64-token steps (Int8Steps) read it: the int8 kernel reads it
// with one scale group per key and value row (all-heads, or per_token groups
// of head_dim), no key or value outliers, at most 4 query heads per KV head.
bool int8_wide_steps_supported(const DecodeParams& params);
// Int8Steps::kAuto's choice for the layout: kSteps64Stages4 where
// int8_wide_steps_supported, else kSteps32.
Int8Steps default_int8_steps(const DecodeParams& params);

// params.kernel picks among the kernels that read the layout.
DecodePlan plan_decode_attention(const DecodeParams& params, int multiprocessors);

// Which kernel of the decode's launch runs a decoding step's append
// (DecodePlanner::launch_step, kernels/step_append.cuh), if any. Both need
// the token-parallel append's layout (takes_token_parallel) into the
// decode's pools and page table, one row per entry, and inline arrays (both
// or neither) that show the same slots, one token each, at the decode's
// lengths minus one.
// - kInt8Kernel: no rotation, sink or window, and every token on the int8
//   kernel's 64-token steps with no exact ranges (rtn's layout at 2 and 4
//   bits, GQA groups of at most 4 heads): in the block whose split ends at
//   the token, the warp whose run ends there stores its keys and another
//   warp its values (step_append_warps).
// - kRotateQueries: the keys' matrix rotation (the values' a matrix or
//   none) the decode's own, a sliding window in both kinds, and a plan that
//   rotates the queries first (int2-rot's layout from batch 8 at 32K
//   tokens): the query rotation's kernel rotates and stores the token
//   beside the queries. The token is in the window, so no kernel reads its
//   codes in this call, and those that read its exact rows start after
//   that kernel has completed.
// (The exact kernel's blocks hosting a window's append were measured slower
// than two launches: bench/README.md.)
enum class StepAppendHost { kNone, kInt8Kernel, kRotateQueries };
StepAppendHost step_append_host(const AppendParams& append, const DecodeParams& decode, const DecodePlan& plan);

// Plans and launches on one device (the current one at its first plan),
// asking the runtime for its multiprocessors once and for each kernel
// variant's resident blocks (an occupancy query and a shared-memory
// attribute) once per variant: a server's every decode step would pay those
// host calls twice (workspace size, then launch) otherwise. launch checks
// the params before it asks the device anything.
class DecodePlanner {
 public:
  DecodePlan plan(const DecodeParams& params);
  // Bytes of params.workspace the launch of `plan` needs.
  static int64_t workspace_bytes(const DecodeParams& params, const DecodePlan& plan);
  int64_t workspace_bytes(const DecodeParams& params);
  // A workspace smaller than workspace_bytes (or none) is allocated and
  // freed on the stream for this launch. With `plan` (this planner's plan of
  // the same params): planned once for both the workspace and the launch.
  void launch(const DecodeParams& params, cudaStream_t stream);
  void launch(const DecodeParams& params, const DecodePlan& plan, cudaStream_t stream);
  // A decoding step: `append`, one new token for each entry of `decode`
  // in its order (decode's lengths count it), then `decode`, with
  // launch_append's and launch's results and refusals (the decode's checked
  // first). Inside the decode's launch where step_append_host names a
  // kernel (returns true), else as the two launches. With `plan`: this
  // planner's plan of `decode`.
  bool launch_step(const AppendParams& append, const DecodeParams& decode, cudaStream_t stream);
  bool launch_step(const AppendParams& append, const DecodeParams& decode, const DecodePlan& plan,
                   cudaStream_t stream);

 private:
  struct SplitQuestion {
    int64_t longest = -1, per_split = -1, resident = -1, max_splits = -1;
    bool operator==(const SplitQuestion& o) const {  // (this header is C++17 too: no defaulted ==)
      return longest == o.longest && per_split == o.per_split && resident == o.resident && max_splits == o.max_splits;
    }
  };
  int resident_blocks(const DecodeParams& params, bool int8, bool lookup, Int8Steps steps);
  int resident_clusters(const DecodeParams& params, Int8Steps steps, int32_t splits);
  int rotation_step_resident(const DecodeParams& params);
  // launch_step after the decode's checks.
  bool run_step(const AppendParams& append, const DecodeParams& decode, const DecodePlan& plan, cudaStream_t stream);
  // `step`: a step's append, run by the kernel `host` names (null or
  // kNone: none).
  void run(const DecodeParams& params, const DecodePlan& plan, cudaStream_t stream, const StepAppendArgs* step,
           StepAppendHost host);
  int multiprocessors_ = 0;  // 0: not asked yet
  std::map<int, int> resident_;  // kernel variant -> blocks per multiprocessor
  std::map<std::pair<int, int32_t>, int> resident_clusters_;  // (int8 variant, splits) -> clusters on the device
  std::map<int, int> rotation_step_resident_;  // (head_dim, bits, element) -> the step rotation's blocks per multiprocessor
  SplitQuestion last_question_;  // the last split search and its answer
  int64_t last_splits_ = 1;
};

// A planner of the current device for one call (what DecodePlanner caches
// is asked again).
int64_t decode_workspace_bytes(const DecodeParams& params);
void launch_decode_attention(const DecodeParams& params, cudaStream_t stream);

}  // namespace kvforge::kernels
