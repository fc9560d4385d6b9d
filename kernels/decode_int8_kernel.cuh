#pragma once
// The 8-bit integer tensor-core decode attention (docs/runtime-layout.md,
// section 6.5): 2-bit uniform codes of post-RoPE keys (one group per token
// row, or per-channel) and values (one group per row, or per-token groups of
// 32 channels) enter mma.sync as the unsigned
// bytes they unpack to, which costs one shift and one mask per four codes
// (the bf16 kernel spends three operations per two); the other operands go
// in as two 8-bit parts:
//
//   - keys: score(t, h) = b_t (q'.c_t) + a_t sum(q') (per-token groups) or
//     (q' * b).c_t + q'.a (per-channel); the B operand q' (or q' * b) of
//     head h is s_h (hi + lo / 128), s_h = max |q'| / 127, so that
//     q'.c = s_h / 128 (128 hi.c + lo.c), exact int32 sums (the codes enter
//     masked, not shifted, times powers of 4 that the sums' scales divide
//     out: int8_mma_fragments.h; the combined sum rounds once to float32);
//   - values: out^T[d, h] = sum_t V^T[d, t] W[t, h] over a step of 32
//     tokens (the mma's K), W = p * b (softmax weight times the token's
//     scale) as U_h (256 hi + lo) (the two bytes of a 16-bit fixed-point
//     number) with U_h the step's largest W of head h (over its value
//     groups) over 65535: each step's int32 sums are scaled into float32
//     accumulators, and the a-term sum_t p_t a_t stays float32; the code
//     bytes of four tokens reach a lane by ldmatrix.trans with one value
//     group per row (int8_mma_fragments.h, "values by ldmatrix"), else by
//     three byte permutes of four rows' words;
//   - GQA groups of at most 4 heads (kPacked) put the two parts of head h
//     in the mma's columns 2h and 2h + 1 (int8_mma_fragments.h, "packed
//     parts"): one key and one value mma per tile instead of two, and lane
//     (g, c) holds both parts of head c, so it scores, weighs and
//     accumulates 4 tokens of that one head (its softmax reductions run over
//     8 lanes, once, and its accumulators hold 2 rows per m tile with both
//     parts added in), where the unpacked kernel takes 4 tokens of 2 heads;
//   - outlier entries correct the scores and outputs by q'_d (x - deq) and
//     p (x - deq) (float32, as the bf16 kernel); the sink, the windows and
//     every token not quantized for both keys and values are the general
//     kernel's (its "exact ranges" mode), merged with these states.
//
// Operand layouts: kernels/int8_mma_fragments.h (tested on the CPU through
// an emulation of the PTX fragments). One block of four warps per (context
// split, KV head, sequence); each warp walks 32-token steps of its run of the
// split (64-token steps, two 32-token stages each, in the wide variants:
// Int8Steps), its next stages' bytes in flight (cp.async), with the online
// softmax of the GQA group's heads (up to 8, the mma's N); the block merges
// its warps' states into one split state for decode_merge_kernel, or, its
// splits launched as one thread-block cluster (TensorCoreSplits::cluster_merge),
// merges the cluster's states itself (kernels/cluster_merge.cuh).
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/async_copy.cuh"
#include "kernels/bf16_mma_fragments.cuh"
#include "kernels/cluster_merge.cuh"
#include "kernels/decode_block_state.cuh"
#include "kernels/decode_params.h"
#include "kernels/element_access.cuh"
#include "kernels/fixed_divisor.h"
#include "kernels/int8_mma_fragments.h"
#include "kernels/page_reading.cuh"
#include "kernels/programmatic_launch.cuh"
#include "kernels/step_append.cuh"
#include "kernels/token_addressing.cuh"
#include "kernels/warp_run.h"
#include "kernels/warp_reductions.cuh"

namespace kvforge::kernels::decode_attention_device {

inline constexpr int kInt8Warps = 4;
inline constexpr int kInt8StepTokens = 32;  // tokens per warp step: the values' mma K
inline constexpr int kInt8Stages = 3;

__device__ inline void mma_u8s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ inline void mma_u8u8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared memory of one block (static). Each warp's output rows live in the
// dynamic part (int8_dynamic_shared_bytes): over the stages once every warp
// is done with them, or, with value outliers (whose corrections accumulate
// there during the walk), past them. A static array of its own would cost
// the fourth resident block per multiprocessor.
template <int D, int VG>
struct Int8Shared {
  // The group's queries, rotated by the keys' rotation (rows 16-byte
  // aligned for rotate_group_queries, as are raw_query's after them).
  alignas(16) float query[kMaxTensorCoreGroup][D];
  // The unrotated queries (the preamble only), then the step's weights
  // (float, for the value outliers' corrections).
  union {
    float raw_query[kMaxTensorCoreGroup][D];
    float weights[kInt8Warps][kInt8StepTokens][kMaxTensorCoreGroup];
  };
  // The two 8-bit parts of the step's W as the values' B operand reads
  // them, [group][part][head][k] (token of k: int8_mma::transposed_token_of_k
  // with one value group per row, else value_token_of_k).
  uint8_t weight_parts[kInt8Warps][VG][2][kMaxTensorCoreGroup][kInt8StepTokens];
  float alpha[kInt8Warps][kMaxTensorCoreGroup];
  float state_max[kInt8Warps][kMaxTensorCoreGroup], state_sum[kInt8Warps][kMaxTensorCoreGroup];
  // The step's per-token affines (lane j: token j).
  Affine key_affine[kInt8Warps][kInt8StepTokens], value_affine[kInt8Warps][kInt8StepTokens][VG];
  Affine channel[kInt8Warps][D];  // per-channel keys: the current token group's (or the offline) affines
};

// The static shared memory of the wide-step variants (Int8Steps'
// 64-token steps, kernels/decode_params.h): the layouts they serve (one
// value group per row, per-token keys, no outliers) need neither the
// per-channel affines nor the weights as floats, and the raw queries go
// over the stages (the preamble ends before the first copy), so that the
// weight parts and affines of 64 tokens fit in less than Int8Shared's 32.
template <int D, int kStepStages>
struct Int8WideShared {
  static constexpr int kStepTokens = kInt8StepTokens * kStepStages;
  alignas(16) float query[kMaxTensorCoreGroup][D];
  // [part][head][k]: k = 32 * (the token's stage in the step) + its k there.
  uint8_t weight_parts[kInt8Warps][1][2][kMaxTensorCoreGroup][kStepTokens];
  float state_max[kInt8Warps][kMaxTensorCoreGroup], state_sum[kInt8Warps][kMaxTensorCoreGroup];
  Affine key_affine[kInt8Warps][kStepTokens], value_affine[kInt8Warps][kStepTokens][1];
};

// One step's bytes (dynamic shared memory, kInt8Stages per warp): the 32
// tokens' code rows and group pairs, copied asynchronously, and (kPlaces)
// each token's page id and index in it (the same in both pools; for the
// outliers: the wide steps' layouts have none, and keep one unused entry).
template <int D, int VG, int kBits, bool kPlaces = true>
struct Int8Stage {
  static constexpr int kRowBytes = D * kBits / 8;
  static constexpr int kRowWords = kRowBytes / 4;
  static constexpr int kPlaceTokens = kPlaces ? kInt8StepTokens : 1;
  uint4 key_codes[kInt8StepTokens * kRowBytes / 16];
  uint4 value_codes[kInt8StepTokens * kRowBytes / 16];
  uint2 key_pairs[kInt8StepTokens];
  uint2 value_pairs[kInt8StepTokens][VG];
  int32_t page[kPlaceTokens], in_page[kPlaceTokens];
  // per_channel_tokens keys: the step starts a key group (or the warp's
  // run), and its group's channel pairs came with it (int8_channel_pairs_bytes).
  int32_t channel_pairs = 0;
};

// The stage and static shared memory of a variant: kStepStages stages of 32
// tokens per softmax step (1: every layout; 2: the wide steps).
template <int D, int VG, int kBits, int kStepStages>
using Int8StageOf = Int8Stage<D, VG, kBits, kStepStages == 1>;
template <int D, int VG, int kStepStages>
using Int8SharedOf = std::conditional_t<kStepStages == 1, Int8Shared<D, VG>, Int8WideShared<D, kStepStages>>;

// Every warp's output rows (the block's merge, and the value outliers'
// corrections during the walk).
template <int D>
using Int8Out = float[kInt8Warps][kMaxTensorCoreGroup][D];

template <int D, int VG, int kBits, int kStepStages = 1, int kStages = kInt8Stages>
constexpr int int8_stage_bytes() {
  return kInt8Warps * kStages * static_cast<int>(sizeof(Int8StageOf<D, VG, kBits, kStepStages>));
}

// per_channel_tokens keys (KIVI's): every stage's D channel pairs
// (pair_bytes each, channel d in slot d), for the steps that start a key
// group; 0 for the other groupings.
template <int D>
constexpr int int8_channel_pairs_bytes(int pair_bytes) {
  return kInt8Warps * kInt8Stages * D * pair_bytes;
}

// The stages, the channel pairs (channel_pair_bytes: a per_channel_tokens
// key pair's bytes, else 0), then (value outliers) the output rows. The
// wide steps' layouts have neither channel pairs nor outliers.
template <int D, int VG, int kBits, int kStepStages = 1, int kStages = kInt8Stages>
constexpr int int8_dynamic_shared_bytes(bool value_outliers, int channel_pair_bytes) {
  static_assert(int8_stage_bytes<D, VG, kBits, kStepStages, kStages>() >= static_cast<int>(sizeof(Int8Out<D>)),
                "the stages hold the output rows");
  static_assert(int8_stage_bytes<D, VG, kBits, kStepStages, kStages>() >=
                    static_cast<int>(sizeof(float[kMaxTensorCoreGroup][D])),
                "the stages hold the raw queries");
  return int8_stage_bytes<D, VG, kBits, kStepStages, kStages>() + int8_channel_pairs_bytes<D>(channel_pair_bytes) +
         (value_outliers ? static_cast<int>(sizeof(Int8Out<D>)) : 0);
}

// 2^x on the special-function unit (relative error about 2^-22; 0 at -inf):
// exp2f's handling of denormal results costs four more instructions per
// weight.
__device__ inline float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Where 16-byte chunk `block` of token row `row` lies in a stage's value
// codes (one value group per row), in chunks, so that the 8 rows one
// ldmatrix matrix reads fall in 8 different groups of 4 banks: with two
// chunks a row (32 bytes apart) rows 4-7 of each octet swap them; with four
// (64 bytes apart) rows 2i and 2i + 1 take chunk block ^ i.
template <int kRowChunks>
__device__ inline int value_chunk(int row, int block) {
  if constexpr (kRowChunks == 2) return 2 * row + (block ^ ((row >> 2) & 1));
  if constexpr (kRowChunks == 4) return 4 * row + (block ^ ((row >> 1) & 3));
  return row * kRowChunks + block;
}

// 1 / x on the special-function unit (rcp.approx.ftz: within 1 ulp; a
// denormal or zero x gives +inf, as in __fdividef), without __fdividef's
// extra operations for |x| > 2^126.
__device__ inline float fast_reciprocal(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// affine_of_pair on a pair already in registers (uniform grids: the int8
// kernel's).
__device__ inline Affine uniform_affine(ElementType element, float clip_ratio, uint2 raw, int top) {
  float min, max;
  if (element == ElementType::kBFloat16) {
    min = __uint_as_float(raw.x << 16), max = __uint_as_float(raw.x & 0xffff0000u);
  } else if (element == ElementType::kFloat16) {
    min = __half2float(__ushort_as_half(static_cast<unsigned short>(raw.x & 0xffffu)));
    max = __half2float(__ushort_as_half(static_cast<unsigned short>(raw.x >> 16)));
  } else {
    min = __uint_as_float(raw.x), max = __uint_as_float(raw.y);
  }
  return pair_affine(min, max, clip_ratio, false, top);
}

// A group pair (4 or 8 bytes) into its slot of the stage.
__device__ inline void copy_pair_async_to(uint32_t shared, const uint8_t* global, int32_t pair_bytes, bool copy) {
  copy_async_to<4>(shared, global, copy && pair_bytes == 4);
  copy_async_to<8>(shared, global, copy && pair_bytes != 4);
}

// VG: the values' channel groups per row (1: one per row; D / 32: per-token
// groups of 32 channels, KIVI's, two m tiles each).
// kPacked: the group has at most int8_mma::kPackedHeads heads.
// kBits: 2 or 4 (int8_mma_fragments.h, "4-bit codes").
// kStepStages: 32-token stages per softmax step (Int8Steps,
// kernels/decode_params.h): 1 for every layout, 2 (64-token steps) for one
// value group per row, per-token keys and no outliers; kStages: the stages
// a warp holds, of which kStages - kStepStages are in flight while it
// computes.
// Four blocks per multiprocessor at 2 bits with one value group per row (128
// registers, about 51 KB of shared memory): the kernel waits on shared
// memory and its copies, so resident warps are what hides that. The larger
// stages of 4 bits and of KIVI's value groups leave room for fewer. The
// wide steps' as many as their shared memory allows (228 KB a
// multiprocessor, 1 KB of it reserved per block), at most four.
template <int D, int VG, int kBits, int kStepStages, int kStages>
constexpr int int8_blocks_per_multiprocessor() {
  if constexpr (kStepStages == 1) {
    return kBits == 2 ? (VG == 1 ? 4 : 3) : (VG == 1 ? 3 : 2);
  } else {
    constexpr int kBlockBytes = static_cast<int>(sizeof(Int8WideShared<D, kStepStages>)) +
                                int8_stage_bytes<D, VG, kBits, kStepStages, kStages>() + 1024;
    constexpr int kFit = 228 * 1024 / kBlockBytes;
    return kFit < 4 ? kFit : 4;
  }
}
// kStepAppend: each entry's new token (its last) is appended by the block
// whose split ends there (its keys by the warp whose run ends there, before
// that warp reads it, its values by another: step_append_warps), the wide
// steps only.
template <int D, int VG, bool kPacked, int kBits, int kStepStages = 1, int kStages = kInt8Stages,
          bool kStepAppend = false>
__global__ void __launch_bounds__(kInt8Warps * kWarpSize,
                                  (int8_blocks_per_multiprocessor<D, VG, kBits, kStepStages, kStages>()))
    decode_int8_kernel(const DecodeParams p, const SplitWorkspace workspace, const TensorCoreSplits splits,
                       const __grid_constant__ StepAppendParam<kStepAppend> step_append) {
  static_assert(kBits == 2 || kBits == 4, "2 or 4 bits");
  static_assert(!kStepAppend || kStepStages == 2, "the step's append in the wide steps' variants");
  constexpr bool kNibbles = kBits == 4;
  constexpr int kSteps = D / 32;    // key k steps (32 channels each)
  constexpr int kMTiles = D / 16;   // value m tiles (16 channels each)
  constexpr int kTop = (1 << kBits) - 1;
  static_assert(VG == 1 || VG == D / 32, "value groups: one per row or of 32 channels");
  static_assert(kStepStages == 1 || kStepStages == 2, "steps of 32 or 64 tokens");
  static_assert(kStages > kStepStages, "stages in flight while a step computes");
  // The wide steps serve one value group per row, per-token keys and no
  // outliers (the launcher's int8_wide_steps_supported): what the other
  // layouts need is compiled out of them.
  constexpr bool kGeneral = kStepStages == 1;
  static_assert(kGeneral || VG == 1, "wide steps: one value group per row");
  constexpr int kStepTokens = kInt8StepTokens * kStepStages;
  // A masked code byte is at most 3 * 64 (2 bits) or 15 * 16 (4 bits); a
  // step's value sums add kStepTokens of them times a weight part.
  static_assert(kStepTokens * 240 * 255 < (1 << 22), "the packed value sums convert by a float add");
  constexpr int kTilesPerGroup = kMTiles / VG;
  using Stage = Int8StageOf<D, VG, kBits, kStepStages>;
  using Shared = Int8SharedOf<D, VG, kStepStages>;
  // Key mmas per k step and row block (packed: one for both parts), and the
  // token rows a lane scores (for 2 heads each): 4 of each stage.
  constexpr int kKeyParts = kPacked ? 1 : 2;
  constexpr int kItemRows = 4 * kStepStages;
  // The heads a lane scores and accumulates (packed: head c; else 2c, 2c + 1)
  // and its output registers per m tile (packed: rows g and g + 8 of head c;
  // else the C fragment).
  constexpr int kHeads = kPacked ? 1 : 2;
  constexpr int kAccRegisters = kPacked ? 2 : 4;
  constexpr int kRowWords = Stage::kRowWords;
  constexpr int kKeyWords = kNibbles ? int8_mma::nibble_key_words(D) : int8_mma::key_words(D);
  static_assert(int8_mma::key_mmas(D) == D / 32, "one key mma per 32 channels");
  constexpr int kRowChunks = Stage::kRowBytes / 16;
  // The query rotation's rows in flight (rotate_group_queries): at most 4
  // blocks a multiprocessor leave 128 registers a thread, free before the
  // step loop: 64 rows, two round trips to L2 at head_dim 128 instead of 8.
  constexpr int kQueryRowsInFlight = 64;
  // Raw bytes: a __shared__ variable is never constructed, and the
  // struct's members have default initializers (Affine's).
  __shared__ __align__(16) uint8_t shared_bytes[sizeof(Shared)];
  auto& shared = *reinterpret_cast<Shared*>(shared_bytes);
  extern __shared__ __align__(16) uint8_t dynamic_shared[];

  const int split = blockIdx.x, kv_head = blockIdx.y, entry = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;
  // The lane's item j's token row in the step (stage j / 4, its row block
  // j % 4 / 2, C row g + 8 (j % 2)) and its heads h < kHeads (packed: c, the
  // head of its C columns' two parts; else the columns 2c, 2c + 1).
  auto item_row = [g](int j) { return kInt8StepTokens * (j / 4) + 16 * (j % 4 / 2) + g + 8 * (j % 2); };
  auto lane_head = [c](int h) { return kPacked ? c : 2 * c + h; };
  // Lanes that write a head's per-lane state.
  const bool head_writer = g == 0;
  // The exact ranges' kernel, launched behind this one as its dependent,
  // may start as soon as every block of this one runs (with the queries
  // rotated beforehand, once it has them: load_group_queries); launched
  // behind it (DecodePlan::exact_first), this one waits for it before it
  // exits, so that its completion (what the merge waits for) implies theirs.
  if (workspace.queries == nullptr) allow_dependent_launch();
  const BlockTokens block = block_tokens(p, splits, split, kv_head, entry);
  const int group = block.group;
  const int64_t first = block.first, last = block.last, state_base = block.state_base;
  // The cluster merge (splits.cluster_merge): its scratch over the query
  // rows, the block's joined value sums over the start of the stages (the
  // first warp's output rows there without value outliers). Taken where
  // they are used: pointers kept from here would be live through the walk.
  static_assert(sizeof(ClusterMergeShared<kInt8Warps>) <= sizeof(shared.query), "the cluster merge's scratch");
  auto cluster_shared = [&] { return reinterpret_cast<ClusterMergeShared<kInt8Warps>*>(&shared.query[0][0]); };
  auto merged_rows = [&] { return reinterpret_cast<float (*)[D]>(dynamic_shared); };
  if (first >= last) {  // an empty split: a state the merge skips
    if (splits.cluster_merge) {
      merge_in_cluster<D, kInt8Warps>(p.io, p.output, state_base, group, false, cluster_shared(), nullptr, nullptr,
                                      nullptr, merged_rows());
    } else {
      write_empty_state(workspace, block, split);
    }
    wait_for_prerequisite_grid();
    return;
  }
  const int32_t slot = entry_slot(p, entry);
  const int32_t* page_row = p.batch.page_table + slot * p.batch.page_table_stride;
  const TensorPageLayout& kl = p.key_cache.layout;
  const TensorPageLayout& vl = p.value_cache.layout;
  const int sink = kl.spec.sink_tokens;
  const bool per_channel_keys = kGeneral && per_channel_groups(kl.spec);
  // Keys in per-channel token groups (int8_decode_supported: only with
  // values in groups of 32 channels, VG > 1).
  const bool channel_tokens = VG > 1 && kl.spec.grouping == ScaleGrouping::kPerChannelTokens;
  const int channel_pair_bytes = channel_tokens ? static_cast<int>(kl.pair_bytes) : 0;

  const bool key_outliers = kGeneral && kl.outlier_spans > 0, value_outliers = kGeneral && vl.outlier_spans > 0;
  // The output rows: past the stages with value outliers (zeroed here, their
  // corrections accumulate during the walk), else over the stages (written
  // once every warp is done with them).
  auto& out = *reinterpret_cast<Int8Out<D>*>(
      dynamic_shared +
      (value_outliers ? int8_stage_bytes<D, VG, kBits>() + int8_channel_pairs_bytes<D>(channel_pair_bytes) : 0));
  // This warp's steps: a contiguous run of the split's (warp_run), in 32
  // bits from its first token; the last step may be partial.
  const WarpRun my_run = warp_run(first, last, warp, kInt8Warps, kStepTokens);
  const int64_t run_first = my_run.first;
  const int32_t run_steps = my_run.steps, run_tokens = my_run.tokens;
  const int page_size = kl.spec.page_size;
  // Lane j's token of the next stage to issue: its page's index in the page
  // table and its slot there, advanced by 32 tokens per stage (one division
  // per block, not two per step), and its page id, read one step ahead so
  // that no issue waits on the page table. Keys and values share the page
  // table and, at 2 bits both, the rows' offsets in a page.
  // (By shifts at a power-of-two page size: on the way to the first page
  // table load, where a 64-bit division is a subroutine call.)
  const FixedDivisor per_page(static_cast<uint32_t>(page_size));
  const auto step_pages = static_cast<int32_t>(per_page.quotient(kInt8StepTokens));
  const auto step_rest = static_cast<int32_t>(per_page.remainder(kInt8StepTokens));
  int32_t next_page_index = 0, next_in_page = 0;
  {
    const int64_t s_index = run_first + lane - sink;
    if (s_index <= int64_t{0xffffffff}) {
      next_page_index = static_cast<int32_t>(per_page.quotient(static_cast<uint32_t>(s_index)));
      next_in_page = static_cast<int32_t>(per_page.remainder(static_cast<uint32_t>(s_index)));
    } else {
      next_page_index = static_cast<int32_t>(s_index / page_size);
      next_in_page = static_cast<int32_t>(s_index % page_size);
    }
  }
  // A step's append (kStepAppend), by the block whose split ends at the new
  // token (step_append_warps): the values by the keys' warp's neighbour,
  // and the keys by the warp whose run ends at the token, before it reads
  // the token's page id or bytes: before the block's first barrier (the
  // one that ends load_group_queries) where the token's stage is among the
  // first ones the warp issues, else once those are in flight (below: the
  // keys' latency under their copies). The early ones load the token's rows
  // before the queries and store them after the queries' loads, before that
  // barrier: the two round trips overlap. No warp reads the token before
  // that barrier (the first stages are issued after it), which so orders
  // the values' stores (fenced at device scope) before the keys' warp's
  // copies of them. The conditions go through votes, which the compiler
  // knows to be warp-uniform: as a plain branch it compiled the step loop's
  // shuffles for a possibly diverged warp (~300 more instructions in the
  // loop, and retry loops around it).
  constexpr int32_t kFirstIssued = (kStages - kStepStages) * kInt8StepTokens;
  [[maybe_unused]] StepAppendWarps step_warps;
  [[maybe_unused]] bool stores_early = false, early_keys = false;
  [[maybe_unused]] step_append_device::StepToken early_token;
  [[maybe_unused]] double early_part[kStepAppend ? D / 32 : 1];
  if constexpr (kStepAppend) {
    const int64_t length = entry_length(p, entry);
    step_warps = step_append_warps(first, last, length, kInt8Warps, kStepTokens);
    early_keys = __all_sync(0xffffffffu, warp == step_warps.keys && run_tokens <= kFirstIssued);
    stores_early = early_keys || __all_sync(0xffffffffu, warp == step_warps.values);
    if (stores_early) {
      early_token = step_append_device::step_token(p, step_append, entry, slot, length, page_row);
      if (early_keys) step_append_device::open_step_page(p, step_append, early_token);
      step_append_device::load_step_rows<D>(p, step_append, entry, kv_head, early_keys, early_part);
    }
  }
  auto store_early = [&] {
    if constexpr (kStepAppend) {
      if (stores_early) {
        step_append_device::store_step_rows<D, kBits>(p, step_append, kv_head, early_keys, early_token, early_part);
      }
    }
  };
  // Loaded before the queries (before the wait for them where they were
  // rotated first), so that its round trip overlaps theirs (on the H200
  // within noise of loading it after the key operands: bench/README.md).
  int32_t next_page = lane < run_tokens ? page_row[next_page_index] : 0;
  if constexpr (kGeneral) {
    load_group_queries<D, kQueryRowsInFlight, true>(p, workspace.queries, state_base, group, kv_head, shared.query,
                                                    shared.raw_query, &out[0][0][0],
                                                    value_outliers ? kInt8Warps * kMaxTensorCoreGroup * D : 0,
                                                    store_early);
  } else {  // the raw queries over the stages: no copy has started
    load_group_queries<D, kQueryRowsInFlight, true>(
        p, workspace.queries, state_base, group, kv_head, shared.query,
        *reinterpret_cast<float(*)[kMaxTensorCoreGroup][D]>(dynamic_shared), nullptr, 0, store_early);
  }

  // B column g's head (zeros past the group); packed: part
  // packed_part(g) of head packed_head(g).
  const int column_head = kPacked ? int8_mma::packed_head(g) : g;
  const float* my_query = shared.query[column_head];

  // Scores in base 2: the softmax scale times log2(e), folded into the keys'
  // scales and a-terms (and the outliers' corrections).
  const float log2e_scale = p.softmax_scale * 1.4426950408889634f;
  // Key B operands of column g: [k step][register][part] (packed: the one
  // part of the column) and the scale s / 128 of the combined int32 sums;
  // the a-term sum(q') (per-token keys) or q'.a (per-channel), over the 4
  // lanes of column g.
  uint32_t key_b[kSteps][2][kKeyParts];
  // The lane's heads lane_head(h): their scale and a-term times
  // log2e_scale, from the lanes that built them.
  float scale_h[kHeads], a_term_h[kHeads];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) scale_h[h] = a_term_h[h] = 0.0f;
  // From the query and (per-channel keys) the channel affines in
  // shared.channel[warp], which every lane reads. `per_channel`:
  // per_channel_keys, as std::true_type in the step loop's rebuild (KIVI's
  // keys), which so carries no per-token branch.
  auto build_key_operands = [&](auto per_channel) {
    // Lane (g, c) holds channels key_channel(D, j, c, h, i) (at 4 bits
    // nibble_key_channel's) of its column's head: D / 4 of them. Packed,
    // lanes g and g ^ 1 (lane ^ kPartPartnerLaneMask) are the two parts of
    // one head: each computes half the k steps (the low part's lane the
    // upper half) in both parts and they swap the parts the other one's
    // column takes.
    constexpr int kOwnSteps = kPacked ? kSteps / 2 : kSteps;
    [[maybe_unused]] constexpr int kPartner = int8_mma::kPartPartnerLaneMask;
    const bool upper_steps = kPacked && int8_mma::packed_part(g) == 1;
    auto channel = [&](int s, int half, int i) {
      const int step = s + (upper_steps ? kOwnSteps : 0);
      return kNibbles ? int8_mma::nibble_key_channel(D, step, c, half, i) : int8_mma::key_channel(D, step, c, half, i);
    };
    // The wide steps build the operands with their first stages' copies in
    // flight (below), the issue state live: they read the query twice, for
    // the maxima and again for the parts, rather than hold its D / 4
    // elements through the maxima's shuffles (16 more live registers).
    constexpr bool kTwice = !kGeneral;
    float x[kTwice ? 1 : kOwnSteps][2][4];
    float largest = 0.0f, a_term = 0.0f;
#pragma unroll
    for (int s = 0; s < kOwnSteps; ++s) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int d = channel(s, half, i);
          float q = my_query[d];
          bool channel_affines = false;  // the wide steps' keys are per token
          if constexpr (kGeneral) {
            if (per_channel) {
              const Affine affine = shared.channel[warp][d];
              a_term = __fmaf_rn(q, affine.a, a_term);
              q = __fmul_rn(q, affine.b);
              channel_affines = true;
            }
          }
          if (!channel_affines) a_term += q;
          if constexpr (!kTwice) x[s][half][i] = q;
          largest = fmaxf(largest, fabsf(q));
        }
      }
    }
    if constexpr (kPacked) {
      largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, kPartner));
      a_term += __shfl_xor_sync(0xffffffffu, a_term, kPartner);
    }
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 1));
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 2));
    a_term += __shfl_xor_sync(0xffffffffu, a_term, 1);
    a_term += __shfl_xor_sync(0xffffffffu, a_term, 2);
    const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
#pragma unroll
    for (int s = 0; s < kOwnSteps; ++s) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t hi = 0, lo = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float q;
          if constexpr (kTwice) {
            q = my_query[channel(s, half, i)];
          } else {
            q = x[s][half][i];
          }
          const int8_mma::SignedParts parts = int8_mma::signed_parts(q, inverse);
          hi |= static_cast<uint32_t>(static_cast<uint8_t>(parts.hi)) << (8 * i);
          lo |= static_cast<uint32_t>(static_cast<uint8_t>(parts.lo)) << (8 * i);
        }
        if constexpr (kPacked) {
          // The column's part of this lane's steps; the other part goes to
          // the partner lane, whose steps' part comes back.
          const bool high = int8_mma::packed_part(g) == 0;
          const uint32_t kept = high ? hi : lo;
          const uint32_t got = __shfl_xor_sync(0xffffffffu, high ? lo : hi, kPartner);
          key_b[s][half][0] = upper_steps ? got : kept;
          key_b[s + kOwnSteps][half][0] = upper_steps ? kept : got;
        } else {
          key_b[s][half][0] = hi;
          key_b[s][half][1] = lo;
        }
      }
    }
    // The combined sums 128 hi.c + lo.c carry key_plane_scale (a power of 4;
    // at 4 bits 16).
    constexpr int kPlaneScale = kNibbles ? int8_mma::kNibbleKeyScale : int8_mma::key_plane_scale(D);
    const float key_scale = largest / (127.0f * 128.0f * static_cast<float>(kPlaneScale));
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      // A lane of the head's (high part's) column: g = that column, c = 0.
      const int source = 4 * (kPacked ? int8_mma::packed_column(lane_head(h), 0) : lane_head(h));
      scale_h[h] = __shfl_sync(0xffffffffu, key_scale, source) * log2e_scale;
      a_term_h[h] = __shfl_sync(0xffffffffu, a_term, source) * log2e_scale;
    }
  };
  if constexpr (kGeneral) {
    if (kl.spec.grouping == ScaleGrouping::kPerChannelOffline) {
      for (int d = lane; d < D; d += kWarpSize) {
        shared.channel[warp][d] =
            channel_affine(p.key_cache, p.key_dequantization, page_row, ChannelStream{}, kv_head, d, kTop);
      }
      __syncwarp();
    }
  }
  // The wide steps build them once their first stages' copies are in flight.
  if (kGeneral && !channel_tokens) build_key_operands(per_channel_keys);

  // The lane's heads: the maxima (every lane of the heads alike) and the
  // sums of this lane's own weights (over the heads' lanes at the end).
  float running_max[kHeads], running_sum[kHeads];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) running_max[h] = -INFINITY, running_sum[h] = 0.0f;
  // values: m tile, channel rows g, g + 8 (acc_row) of head acc_head (the C
  // fragment's columns; packed: both parts of head c combined), rows times
  // 4^value_row_log4 (codes masked, not shifted; divided out once at the
  // end, exactly)
  float acc[kMTiles][kAccRegisters];
#pragma unroll
  for (int t = 0; t < kMTiles; ++t) {
#pragma unroll
    for (int i = 0; i < kAccRegisters; ++i) acc[t][i] = 0.0f;
  }
  auto acc_row = [g](int i) { return kPacked ? g + 8 * i : g + 8 * (i / 2); };
  auto acc_head = [&lane_head](int i) { return kPacked ? lane_head(0) : lane_head(i % 2); };
  float value_a_term[VG][kHeads];  // [group][lane_head], this lane's tokens (summed over the lanes at the end)
#pragma unroll
  for (int vg = 0; vg < VG; ++vg) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) value_a_term[vg][h] = 0.0f;
  }

  Stage* stages = reinterpret_cast<Stage*>(dynamic_shared) + warp * kStages;
  const auto stages_address = static_cast<uint32_t>(__cvta_generic_to_shared(stages));
  const auto key_page_bytes = static_cast<uint32_t>(kl.page_bytes);
  const auto value_page_bytes = static_cast<uint32_t>(vl.page_bytes);
  const auto row_bytes = static_cast<int32_t>(kl.row_bytes);
  const auto head_rows = static_cast<int32_t>(code_row_offset(kl, kv_head, 0));
  const PairPlace key_pairs = pair_place(kl, kv_head, 1), value_pairs = pair_place(vl, kv_head, VG);
  const bool outliers = key_outliers || value_outliers;
  int issue_stage = 0;   // the stage the next issue fills (issues go round the kStages)
  int32_t to_issue = run_tokens;  // tokens of the run not yet issued

  // Starts the copies of the next 32 tokens into their stage (every lane
  // takes part): lane j's token's key and value pairs, then the code rows.
  auto issue = [&]() {
    const int tokens = to_issue < kInt8StepTokens ? to_issue : kInt8StepTokens;
    const int stage_index = issue_stage;
    const uint32_t stage_address = stages_address + stage_index * static_cast<uint32_t>(sizeof(Stage));
    Stage& stage = stages[stage_index];
    issue_stage = issue_stage + 1 == kStages ? 0 : issue_stage + 1;
    const int32_t issued = run_tokens - to_issue;  // the stage's first token in the run
    to_issue -= kInt8StepTokens;
    const bool valid = lane < tokens;
    const int32_t page = next_page, in_page = next_in_page;
    next_page_index += step_pages;
    next_in_page += step_rest;
    if (next_in_page >= page_size) {
      next_in_page -= page_size;
      ++next_page_index;
    }
    next_page = lane < to_issue ? page_row[next_page_index] : 0;
    const uint8_t* key_page = p.key_cache.pages + static_cast<uint64_t>(static_cast<uint32_t>(page)) * key_page_bytes;
    const uint8_t* value_page =
        p.value_cache.pages + static_cast<uint64_t>(static_cast<uint32_t>(page)) * value_page_bytes;
    copy_pair_async_to(stage_address + static_cast<uint32_t>(offsetof(Stage, key_pairs)) + 8 * lane,
                       key_page + key_pairs.base + in_page * key_pairs.token_stride, static_cast<int32_t>(kl.pair_bytes),
                       valid && !per_channel_keys);
#pragma unroll
    for (int vg = 0; vg < VG; ++vg) {
      copy_pair_async_to(stage_address + static_cast<uint32_t>(offsetof(Stage, value_pairs)) + 8 * (VG * lane + vg),
                         value_page + value_pairs.base + in_page * value_pairs.token_stride + vg * value_pairs.group_stride,
                         static_cast<int32_t>(vl.pair_bytes), valid);
    }
    if constexpr (kGeneral) {
      if (outliers) {
        stage.page[lane] = page;
        stage.in_page[lane] = in_page;
      }
    }
    if constexpr (kBits == 2) {
      // Code rows at 2 bits (the loop is bound by its instructions): lane j
      // copies its own token's rows, chunk `part` of row j at 16 part bytes
      // from the row's start (an immediate offset of one address a tensor:
      // no shuffle for another lane's page, no address per chunk). Where a
      // row is more than one chunk, a warp's copy of one part reads every
      // other 16 bytes of the step's rows and the next part the rest, so L2
      // serves each 32-byte sector twice (the DRAM bytes are the same).
      const auto row_at = static_cast<uint32_t>(head_rows + in_page * row_bytes);
      const uint8_t* key_row = key_page + row_at;
      const uint8_t* value_row = value_page + row_at;
#pragma unroll
      for (int part = 0; part < kRowChunks; ++part) {
        copy_async_to<16>(stage_address + static_cast<uint32_t>(offsetof(Stage, key_codes)) +
                              16 * (lane * kRowChunks + part),
                          key_row + 16 * part, valid);
        copy_async_to<16>(stage_address + static_cast<uint32_t>(offsetof(Stage, value_codes)) +
                              16 * (VG == 1 ? value_chunk<kRowChunks>(lane, part) : lane * kRowChunks + part),
                          value_row + 16 * part, valid);
      }
    } else {
      // At 4 bits (bound by DRAM): 16-byte chunks, chunk i of the step's 32
      // rows by lane i % 32 (whole sectors a warp), at the offset of row
      // i / kRowChunks's page (a shuffle); every lane runs every round and
      // every shuffle.
      const int32_t row_offset = head_rows + in_page * row_bytes;
#pragma unroll
      for (int round = 0; round < kInt8StepTokens * kRowChunks / kWarpSize; ++round) {
        const int chunk = round * kWarpSize + lane;
        const int row = chunk / kRowChunks, part = chunk % kRowChunks;
        const auto row_page = static_cast<uint32_t>(__shfl_sync(0xffffffffu, page, row));
        const auto at = static_cast<uint32_t>(__shfl_sync(0xffffffffu, row_offset, row) + part * 16);
        const bool copy = row < tokens;
        copy_async_to<16>(stage_address + static_cast<uint32_t>(offsetof(Stage, key_codes)) + 16 * chunk,
                          p.key_cache.pages + (static_cast<uint64_t>(row_page) * key_page_bytes + at), copy);
        copy_async_to<16>(stage_address + static_cast<uint32_t>(offsetof(Stage, value_codes)) +
                              16 * (VG == 1 ? value_chunk<kRowChunks>(row, part) : chunk),
                          p.value_cache.pages + (static_cast<uint64_t>(row_page) * value_page_bytes + at), copy);
      }
    }
    // per_channel_tokens keys: the key group's channel pairs come with the
    // step that starts the group (or the run), lane j taking channels
    // j + 32 i from their stream positions (docs/runtime-layout.md 3.2). A
    // pair lies in a page of one of its group's slots: where the step holds
    // a slot of that page, the page id is a lane's (a shuffle; the page
    // table's load would hold up the issue), else the page table's.
    if constexpr (VG > 1) {
      if (!channel_tokens) return;
      const int32_t slot_index = static_cast<int32_t>(run_first - sink) + issued;  // the step's first s
      const int32_t in_group = slot_index % kl.spec.group;
      const bool starts = in_group == 0 || issued == 0;
      if (lane == 0) stage.channel_pairs = starts;
      if (starts) {
        const auto per_slot = static_cast<int32_t>(kl.pairs_per_slot);
        const int32_t per_page = page_size * per_slot;
        const StreamPlace first = stream_place(slot_index - in_group, per_slot, per_page, kv_head * D + lane);
        const uint32_t slots = static_cast<uint32_t>(__cvta_generic_to_shared(dynamic_shared)) +
                               static_cast<uint32_t>(int8_stage_bytes<D, VG, kBits>()) +
                               static_cast<uint32_t>(((warp * kInt8Stages + stage_index) * D + lane) * channel_pair_bytes);
#pragma unroll
        for (int i = 0; i < D / kWarpSize; ++i) {
          const StreamPlace at = stream_advance(first, i * kWarpSize, per_page);
          const int32_t source = step_slot_in_page(at.entry, page_size, slot_index, tokens);  // < tokens <= 32
          int32_t pair_page = __shfl_sync(0xffffffffu, page, source > 0 ? source : 0);
          if (source < 0) pair_page = page_row[at.entry];
          copy_pair_async_to(slots + static_cast<uint32_t>(i * kWarpSize * channel_pair_bytes),
                             p.key_cache.pages + static_cast<uint64_t>(static_cast<uint32_t>(pair_page)) * key_page_bytes +
                                 kl.params_offset + at.offset * channel_pair_bytes,
                             channel_pair_bytes, true);
        }
      }
    }
  };

  // kStages - kStepStages stages in flight while a step computes: each
  // stage its own commit group, so that a step's wait leaves that many.
  constexpr int kAhead = kStages - kStepStages;
#pragma unroll
  for (int ahead = 0; ahead < kAhead; ++ahead) {
    if (to_issue > 0) issue();
    copy_async_commit();
  }
  // Under the first stages' round trip to memory (the wide steps, whose
  // keys are per token).
  if constexpr (!kGeneral) build_key_operands(per_channel_keys);
  // The step's keys where its token's stage comes later (above); the next
  // stage's page ids read again (the append may have opened its page).
  if constexpr (kStepAppend) {
    if (__all_sync(0xffffffffu, warp == step_warps.keys && run_tokens > kFirstIssued)) {
      const int64_t length = entry_length(p, entry);
      step_append_device::append_step_rows<D, kBits>(
          p, step_append, entry, kv_head, true,
          step_append_device::step_token(p, step_append, entry, slot, length, page_row));
      next_page = lane < to_issue ? page_row[next_page_index] : 0;
    }
  }
  int compute_stage = 0;
  int32_t left = run_tokens;  // tokens of the run from this step on
  for (int32_t step = 0; step < run_steps; ++step) {
    const int tokens = left < kStepTokens ? left : kStepTokens;
    left -= kStepTokens;
#pragma unroll
    for (int s = 0; s < kStepStages; ++s) {
      if (to_issue > 0) issue();
      copy_async_commit();
    }
    copy_async_wait<kAhead>();  // this step's groups are complete
    __syncwarp();
    // The step's stages (wide steps: a last step of at most 32 tokens has
    // no second one: its rows are past `tokens`, weigh nothing and carry
    // zero weight parts, whatever the stage's bytes).
    int stage_index[kStepStages];
#pragma unroll
    for (int s = 0; s < kStepStages; ++s) {
      stage_index[s] = compute_stage;
      compute_stage = compute_stage + 1 == kStages ? 0 : compute_stage + 1;
    }
    [[maybe_unused]] const Stage& stage = stages[stage_index[0]];  // the general kernel's one stage
    {  // the step's affines from its pairs: lane j token j of each stage
#pragma unroll
      for (int s = 0; s < kStepStages; ++s) {
        const Stage& from = stages[stage_index[s]];
        const int token = kInt8StepTokens * s + lane;
        const bool valid = token < tokens;
        if (!per_channel_keys) {
          const Affine affine = uniform_affine(kl.spec.element, p.key_dequantization.clip_ratio, from.key_pairs[lane], kTop);
          shared.key_affine[warp][token] = valid ? affine : Affine{0.0f, 0.0f};
        }
#pragma unroll
        for (int vg = 0; vg < VG; ++vg) {
          const Affine affine =
              uniform_affine(vl.spec.element, p.value_dequantization.clip_ratio, from.value_pairs[lane][vg], kTop);
          shared.value_affine[warp][token][vg] = valid ? affine : Affine{0.0f, 0.0f};
        }
      }
      __syncwarp();
    }
    if constexpr (VG > 1) {
      if (channel_tokens && stage.channel_pairs) {
        // The step starts a key group (steps never straddle one: G % 32 == 0)
        // or the run: the group's channel affines from the pairs that came
        // with it, then the key operands.
        const uint8_t* pairs = dynamic_shared + int8_stage_bytes<D, VG, kBits>() +
                               (warp * kInt8Stages + stage_index[0]) * D * channel_pair_bytes;
        for (int d = lane; d < D; d += kWarpSize) {
          const uint2 raw = channel_pair_bytes == 4 ? make_uint2(*reinterpret_cast<const uint32_t*>(pairs + 4 * d), 0u)
                                                    : *reinterpret_cast<const uint2*>(pairs + 8 * d);
          shared.channel[warp][d] = uniform_affine(kl.spec.element, p.key_dequantization.clip_ratio, raw, kTop);
        }
        __syncwarp();
        build_key_operands(std::true_type{});
      }
    }
    // ---- keys: row block rb of stage s holds its tokens 16 rb + g and
    // 16 rb + g + 8
    float score[kItemRows][kHeads];  // [item][head]: token item_row(j), head lane_head(h)
#pragma unroll
    for (int s = 0; s < kStepStages; ++s) {
      int dots[2][kKeyParts][4];  // [rb][part][C register]: token 16 rb + g + 8 (i / 2), column 2c + i % 2
#pragma unroll
      for (int rb = 0; rb < 2; ++rb) {
        // The lane's words of rows g and g + 8 (key_first_word onwards; at 4
        // bits nibble_key_words of them from word nibble_key_words * c).
        uint32_t words_g[kKeyWords], words_g8[kKeyWords];
        const auto* codes = reinterpret_cast<const uint32_t*>(stages[stage_index[s]].key_codes) +
                            (kNibbles ? kKeyWords * c : int8_mma::key_first_word(D, c));
        if constexpr (kKeyWords == 4) {
          const uint4 u = *reinterpret_cast<const uint4*>(codes + (16 * rb + g) * kRowWords);
          const uint4 v = *reinterpret_cast<const uint4*>(codes + (16 * rb + g + 8) * kRowWords);
          words_g[0] = u.x, words_g[1] = u.y, words_g[2] = u.z, words_g[3] = u.w;
          words_g8[0] = v.x, words_g8[1] = v.y, words_g8[2] = v.z, words_g8[3] = v.w;
        } else if constexpr (kKeyWords == 2) {
          const uint2 u = *reinterpret_cast<const uint2*>(codes + (16 * rb + g) * kRowWords);
          const uint2 v = *reinterpret_cast<const uint2*>(codes + (16 * rb + g + 8) * kRowWords);
          words_g[0] = u.x, words_g[1] = u.y, words_g8[0] = v.x, words_g8[1] = v.y;
        } else {
          words_g[0] = codes[(16 * rb + g) * kRowWords];
          words_g8[0] = codes[(16 * rb + g + 8) * kRowWords];
        }
#pragma unroll
        for (int part = 0; part < kKeyParts; ++part) dots[rb][part][0] = dots[rb][part][1] = dots[rb][part][2] = dots[rb][part][3] = 0;
        // Horner over the planes: the sums times key_horner before mma ks (at
        // 4 bits times 16 before the first plane-1 mma).
#pragma unroll
        for (int ks = 0; ks < kSteps; ++ks) {
          uint32_t a[4];
#pragma unroll
          for (int which = 0; which < 4; ++which) {
            a[which] = kNibbles ? int8_mma::nibble_key_a_register(D, words_g, words_g8, ks, which)
                                : int8_mma::key_a_register(D, words_g, words_g8, ks, which);
          }
#pragma unroll
          for (int part = 0; part < kKeyParts; ++part) {
            const int times = int8_mma::key_horner_factor(kBits, D, ks);
            if (times != 1) {
#pragma unroll
              for (int i = 0; i < 4; ++i) dots[rb][part][i] *= times;
            }
            mma_u8s8(dots[rb][part], a, key_b[ks][0][part], key_b[ks][1][part]);
          }
        }
      }
      int combined[4][kHeads];  // 128 hi + lo, of the stage's items 4 s + j
      if constexpr (kPacked) {
        // Both parts of head c, rows g (registers 0, 1) and g + 8 (2, 3).
#pragma unroll
        for (int rb = 0; rb < 2; ++rb) {
          combined[2 * rb][0] = int8_mma::packed_sum(dots[rb][0], 0, 128);
          combined[2 * rb + 1][0] = int8_mma::packed_sum(dots[rb][0], 2, 128);
        }
      } else {
#pragma unroll
        for (int rb = 0; rb < 2; ++rb) {
#pragma unroll
          for (int i = 0; i < 4; ++i) combined[2 * rb + i / 2][i % 2] = 128 * dots[rb][0][i] + dots[rb][1][i];
        }
      }
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * s + jj;
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          const float dot = static_cast<float>(combined[jj][h]) * scale_h[h];
          if (per_channel_keys) {
            score[j][h] = dot + a_term_h[h];
          } else {
            const Affine affine = shared.key_affine[warp][item_row(j)];
            score[j][h] = __fmaf_rn(affine.b, dot, affine.a * a_term_h[h]);
          }
        }
      }
    }
    if constexpr (kGeneral) {
      if (key_outliers) {
#pragma unroll
        for (int j = 0; j < kItemRows; ++j) {
          const int row = item_row(j);
          if (row >= tokens) continue;
          const SlotAddress at{p.key_cache.pages + static_cast<int64_t>(stage.page[row]) * kl.page_bytes,
                               stage.in_page[row]};
          float correction[kHeads];
#pragma unroll
          for (int h = 0; h < kHeads; ++h) correction[h] = 0.0f;
          for_each_outlier(p.key_cache, slot, at, kv_head, [&](int d, float x) {
            const int code = code_at<kBits>(kl, at, kv_head, d);
            const Affine affine = per_channel_keys ? shared.channel[warp][d] : shared.key_affine[warp][row];
            const float delta = x - __fmaf_rn(affine.b, static_cast<float>(code), affine.a);
#pragma unroll
            for (int h = 0; h < kHeads; ++h) correction[h] = __fmaf_rn(shared.query[lane_head(h)][d], delta, correction[h]);
          });
#pragma unroll
          for (int h = 0; h < kHeads; ++h) score[j][h] = __fmaf_rn(correction[h], log2e_scale, score[j][h]);
        }
      }
    }
    if (tokens < kStepTokens) {  // the split's last step (warp-uniform): rows past it weigh nothing
#pragma unroll
      for (int j = 0; j < kItemRows; ++j) {
        if (item_row(j) >= tokens) {
#pragma unroll
          for (int h = 0; h < kHeads; ++h) score[j][h] = -INFINITY;
        }
      }
    }

    // ---- online softmax per head, over the step's rows (the lanes of
    // each head: its 8 g). Once the maxima settle (most steps of a long
    // context) no score passes them: one vote instead of the reductions,
    // and every alpha is exactly 1, so nothing is rescaled. A step whose
    // score passes a running maximum takes the reductions for every head,
    // and then alpha = 1 exactly wherever that head's maximum held.
    float alpha[kHeads], weight[kItemRows][kHeads];
    float step_max[kHeads];
    bool passes = false;
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      step_max[h] = score[0][h];
#pragma unroll
      for (int j = 1; j < kItemRows; ++j) step_max[h] = fmaxf(step_max[h], score[j][h]);
      passes = passes || step_max[h] > running_max[h];
    }
    const bool rescale = __any_sync(0xffffffffu, passes);
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      float new_max = running_max[h];
      alpha[h] = 1.0f;
      if (rescale) {
        float m = step_max[h];
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        new_max = fmaxf(running_max[h], m);
        alpha[h] = fast_exp2(running_max[h] - new_max);  // 0 on the first step, 1 where the max holds
      }
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kItemRows; ++j) {
        weight[j][h] = fast_exp2(score[j][h] - new_max);
        sum += weight[j][h];
      }
      running_sum[h] = __fmaf_rn(running_sum[h], alpha[h], sum);
      running_max[h] = new_max;
    }
    if (rescale) {
#pragma unroll
      for (int t = 0; t < kMTiles; ++t) {
#pragma unroll
        for (int i = 0; i < kAccRegisters; ++i) acc[t][i] *= alpha[kPacked ? 0 : i % 2];
      }
    }
    // W = p * b per token, head and value group, the a-terms, and the
    // step's largest W per head over the head's lanes and its groups: one
    // unit U_h for every group (the error bound is in the head's largest
    // |v'| either way, and groups of 32 channels so share one reduction);
    // the two 8-bit parts into shared memory as the values' B operand reads
    // them.
    float largest[kHeads];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) largest[h] = 0.0f;
    float kept_w[kItemRows][kHeads];  // one value group: W kept for its parts (more groups recompute it)
#pragma unroll
    for (int vg = 0; vg < VG; ++vg) {
      if (rescale) {
#pragma unroll
        for (int h = 0; h < kHeads; ++h) value_a_term[vg][h] *= alpha[h];
      }
#pragma unroll
      for (int j = 0; j < kItemRows; ++j) {
        const Affine affine = shared.value_affine[warp][item_row(j)][vg];  // {0, 0} past the range
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          value_a_term[vg][h] = __fmaf_rn(weight[j][h], affine.a, value_a_term[vg][h]);
          kept_w[j][h] = weight[j][h] * affine.b;
          largest[h] = fmaxf(largest[h], kept_w[j][h]);
        }
      }
    }
    float part_scale[kHeads];  // the scale of the int32 sums 256 hi + lo (packed: of the low part's)
    // Any inverse near 65535 / largest will do (the parts' bound holds for
    // the unit above; weight_parts clamps at 65535).
    float inverse[kHeads];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      largest[h] = fmaxf(largest[h], __shfl_xor_sync(0xffffffffu, largest[h], 4));
      largest[h] = fmaxf(largest[h], __shfl_xor_sync(0xffffffffu, largest[h], 8));
      largest[h] = fmaxf(largest[h], __shfl_xor_sync(0xffffffffu, largest[h], 16));
      part_scale[h] = largest[h] * (1.0f / int8_mma::kWeightSteps);
      inverse[h] = largest[h] > 0.0f ? int8_mma::kWeightSteps * fast_reciprocal(largest[h]) : 0.0f;
    }
    // Packed: the high part's sums' scale (exact: times a power of 2).
    const float high_scale = part_scale[0] * 256.0f;
#pragma unroll
    for (int vg = 0; vg < VG; ++vg) {
#pragma unroll
      for (int j = 0; j < kItemRows; ++j) {
        // the values' k order (wide steps: stage j / 4's k after the k of
        // the stages before it)
        const int k = VG == 1 ? kInt8StepTokens * (j / 4) + int8_mma::transposed_k_of_token(item_row(j % 4))
                              : int8_mma::value_token_of_k(item_row(j));
        const float b = VG == 1 ? 0.0f : shared.value_affine[warp][item_row(j)][vg].b;
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          const float w = VG == 1 ? kept_w[j][h] : weight[j][h] * b;
          const int8_mma::WeightParts parts = int8_mma::weight_parts(w, inverse[h]);
          shared.weight_parts[warp][vg][0][lane_head(h)][k] = parts.hi;
          shared.weight_parts[warp][vg][1][lane_head(h)][k] = parts.lo;
        }
      }
    }
    if constexpr (kGeneral) {
      if (value_outliers) {
#pragma unroll
        for (int j = 0; j < kItemRows; ++j) {
#pragma unroll
          for (int h = 0; h < kHeads; ++h) shared.weights[warp][item_row(j)][lane_head(h)] = weight[j][h];
        }
      }
      if (head_writer) {
#pragma unroll
        for (int h = 0; h < kHeads; ++h) shared.alpha[warp][lane_head(h)] = alpha[h];
      }
    }
    __syncwarp();

    // ---- values: m tile T's channel rows g, g + 8 against the step's
    // tokens, with the weights of T's value group: one mma per stage (its
    // 32 tokens, the mma's K; a[s]) into the same int32 sums, converted once
    auto accumulate_tile = [&](int tile, const uint32_t (&a)[kStepStages][4]) {
      const int vg = tile / kTilesPerGroup;
      // B column g: packed, part packed_part(g) of head packed_head(g);
      // else head g's high and low parts in two mmas; k half `half` of
      // stage s.
      auto b_register = [&](int part, int head, int s, int half) {
        return *reinterpret_cast<const uint32_t*>(
            &shared.weight_parts[warp][vg][part][head][kInt8StepTokens * s + 16 * half + 4 * c]);
      };
      if constexpr (kPacked) {
        // Both parts of head c, rows g (registers 0, 1) and g + 8 (2, 3).
        // The sums start from kIntegerBiasBits: at most 64 tokens x 192 (a
        // code times its plane) x 255 < 2^22, they convert to float in one
        // float add each, not on the conversion pipe (an eighth of the
        // rate, shared with ex2), and the high part's weight 256 rides in
        // its scale.
        int sum[4] = {int8_mma::kIntegerBiasBits, int8_mma::kIntegerBiasBits, int8_mma::kIntegerBiasBits,
                      int8_mma::kIntegerBiasBits};
#pragma unroll
        for (int s = 0; s < kStepStages; ++s) {
          mma_u8u8(sum, a[s], b_register(int8_mma::packed_part(g), column_head, s, 0),
                   b_register(int8_mma::packed_part(g), column_head, s, 1));
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float low = __fmaf_rn(int8_mma::unbiased_float(sum[2 * r + 1]), part_scale[0], acc[tile][r]);
          acc[tile][r] = __fmaf_rn(int8_mma::unbiased_float(sum[2 * r]), high_scale, low);
        }
      } else {
        int sum_hi[4] = {0, 0, 0, 0}, sum_lo[4] = {0, 0, 0, 0};
#pragma unroll
        for (int s = 0; s < kStepStages; ++s) {
          mma_u8u8(sum_hi, a[s], b_register(0, g, s, 0), b_register(0, g, s, 1));
          mma_u8u8(sum_lo, a[s], b_register(1, g, s, 0), b_register(1, g, s, 1));
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[tile][i] = __fmaf_rn(static_cast<float>(256 * sum_hi[i] + sum_lo[i]), part_scale[i % 2], acc[tile][i]);
        }
      }
    };
    if constexpr (VG == 1) {
      // By ldmatrix (int8_mma_fragments.h, "values by ldmatrix"): lane l
      // addresses token l's 16 bytes of column block mb, so one load gives
      // a lane its unit of the four token octets; a byte permute per
      // gathered word and a mask per A register.
      uint32_t codes_address[kStepStages];
#pragma unroll
      for (int s = 0; s < kStepStages; ++s) {
        codes_address[s] = stages_address + static_cast<uint32_t>(stage_index[s] * sizeof(Stage)) +
                           static_cast<uint32_t>(offsetof(Stage, value_codes));
      }
#pragma unroll
      for (int mb = 0; mb < kRowChunks; ++mb) {
        uint32_t octets[kStepStages][4];  // each stage's tokens 0-7, 8-15, 16-23, 24-31
#pragma unroll
        for (int s = 0; s < kStepStages; ++s) {
          load_matrices_transposed(octets[s], codes_address[s] + static_cast<uint32_t>(
                                                                     16 * value_chunk<kRowChunks>(lane, mb)));
        }
#pragma unroll
        for (int beta = 0; beta < 2; ++beta) {
          uint32_t gathered[kStepStages][2];
#pragma unroll
          for (int s = 0; s < kStepStages; ++s) {
            gathered[s][0] = int8_mma::transposed_gather(octets[s][0], octets[s][1], beta);
            gathered[s][1] = int8_mma::transposed_gather(octets[s][2], octets[s][3], beta);
          }
          if constexpr (kNibbles) {  // tile 2 mb + beta: rows g, g + 8 the two planes
            uint32_t a[kStepStages][4];
#pragma unroll
            for (int s = 0; s < kStepStages; ++s) {
              a[s][0] = int8_mma::nibble_transposed_value_a_register(gathered[s][0], 0);
              a[s][1] = int8_mma::nibble_transposed_value_a_register(gathered[s][0], 1);
              a[s][2] = int8_mma::nibble_transposed_value_a_register(gathered[s][1], 0);
              a[s][3] = int8_mma::nibble_transposed_value_a_register(gathered[s][1], 1);
            }
            accumulate_tile(2 * mb + beta, a);
          } else {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
              const int tile = 4 * mb + 2 * beta + q;
              uint32_t a[kStepStages][4];
#pragma unroll
              for (int s = 0; s < kStepStages; ++s) {
                a[s][0] = int8_mma::transposed_value_a_register(gathered[s][0], tile, 0);
                a[s][1] = int8_mma::transposed_value_a_register(gathered[s][0], tile, 1);
                a[s][2] = int8_mma::transposed_value_a_register(gathered[s][1], tile, 0);
                a[s][3] = int8_mma::transposed_value_a_register(gathered[s][1], tile, 1);
              }
              accumulate_tile(tile, a);
            }
          }
        }
      }
    } else {
      // Groups of 32 channels: each gathering row's words of four m tiles
      // at once (16-byte loads; the lanes of one column c read the same four
      // rows, in different banks).
      int value_row[2][4];  // the tokens of k = 16 part + 4c + i
#pragma unroll
      for (int part = 0; part < 2; ++part) {
#pragma unroll
        for (int i = 0; i < 4; ++i) value_row[part][i] = int8_mma::value_token_of_k(16 * part + 4 * c + i);
      }
#pragma unroll
      for (int w4 = 0; w4 < kRowWords / 4; ++w4) {
        // Each part's words are gathered into the A registers of the four m
        // tiles before the next part's are loaded (the fence keeps the loads
        // apart), so that 16 words are live at a time, not 32.
        uint32_t a_of[4][1][4];  // [tile - 4 w4][the step's one stage][A register]
#pragma unroll
        for (int part = 0; part < 2; ++part) {
          uint32_t words[4][4];  // [i][tile - 4 w4]
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint4 u = stage.value_codes[value_row[part][i] * kRowChunks + w4];
            words[i][0] = u.x, words[i][1] = u.y, words[i][2] = u.z, words[i][3] = u.w;
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t gathered = int8_mma::gather_byte(words[0][j], words[1][j], words[2][j], words[3][j], g % 4);
            if constexpr (kNibbles) {  // word j is tile 2 w4 + j / 2's rows g (j even) or g + 8
              a_of[j / 2][0][2 * part + j % 2] = int8_mma::nibble_value_a_register(gathered, g);
            } else {
              a_of[j][0][2 * part] = int8_mma::value_a_register(gathered, g, 0);
              a_of[j][0][2 * part + 1] = int8_mma::value_a_register(gathered, g, 1);
            }
          }
          asm volatile("" ::: "memory");
        }
        constexpr int kTilesPerChunk = kNibbles ? 2 : 4;
#pragma unroll
        for (int j = 0; j < kTilesPerChunk; ++j) accumulate_tile(kTilesPerChunk * w4 + j, a_of[j]);
      }
    }
    if constexpr (kGeneral) {
      if (value_outliers) {
        // Rescale this warp's corrections to the new maxima, then add the
        // step's: lane j takes token j.
        for (int i = lane; i < group * D; i += kWarpSize) out[warp][i / D][i % D] *= shared.alpha[warp][i / D];
        __syncwarp();
        const auto at = [&](int l) {
          return SlotAddress{p.value_cache.pages + static_cast<int64_t>(stage.page[l]) * vl.page_bytes,
                             stage.in_page[l]};
        };
        add_value_outliers(
            p.value_cache, slot, kv_head, tokens, group, at,
            [&](int l, int d, float x) {
              const int code = code_at<kBits>(vl, at(l), kv_head, d);
              const Affine affine = shared.value_affine[warp][l][VG == 1 ? 0 : d / 32];
              return x - __fmaf_rn(affine.b, static_cast<float>(code), affine.a);
            },
            [&](int l, int h) { return shared.weights[warp][l][h]; }, out[warp]);
      }
    }
    __syncwarp();  // the step's weights are read before the next step writes them
  }

  // ---- this warp's state: the sums over the lanes of each head into shared memory, the a-terms
  // summed in every lane (each adds its heads' to the rows it writes)
  auto sum_over_head_lanes = [](float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    x += __shfl_xor_sync(0xffffffffu, x, 8);
    return x + __shfl_xor_sync(0xffffffffu, x, 16);
  };
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    running_sum[h] = sum_over_head_lanes(running_sum[h]);
#pragma unroll
    for (int vg = 0; vg < VG; ++vg) value_a_term[vg][h] = sum_over_head_lanes(value_a_term[vg][h]);
  }
  if (head_writer) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      shared.state_max[warp][lane_head(h)] = running_max[h];
      shared.state_sum[warp][lane_head(h)] = running_sum[h];
    }
  }
  // Without value outliers the rows go over the stages: every warp's copies
  // and reads of them end first. The lanes' acc registers cover every row
  // of every head once.
  copy_async_wait<0>();
  if (!value_outliers) __syncthreads();
  {
#pragma unroll
    for (int t = 0; t < kMTiles; ++t) {
#pragma unroll
      for (int i = 0; i < kAccRegisters; ++i) {
        const int row = acc_row(i);
        // The row's channel and the power of 2 its codes carried.
        int channel, shift;
        if constexpr (kNibbles) {
          channel = VG == 1 ? int8_mma::nibble_transposed_value_channel(t, row) : int8_mma::nibble_value_channel_of_row(t, row);
          shift = 4 * (VG == 1 ? int8_mma::nibble_transposed_value_row_log16(row) : int8_mma::nibble_value_row_log16(row));
        } else {
          channel = VG == 1 ? int8_mma::transposed_value_channel(t, row) : 16 * t + int8_mma::value_channel_of_row(row);
          shift = 2 * (VG == 1 ? int8_mma::transposed_value_row_log4(t, row) : int8_mma::value_row_log4(row));
        }
        const float value = acc[t][i] * (1.0f / static_cast<float>(1 << shift));
        // The row's a-term (every lane holds its heads' whole sums): m
        // tiles 2 vg and 2 vg + 1 hold value group vg's channels.
        const float a_term = value_a_term[VG == 1 ? 0 : t / 2][kPacked ? 0 : i % 2];
        float& o = out[warp][acc_head(i)][channel];
        o = (value_outliers ? o + value : value) + a_term;
      }
    }
  }
  __syncthreads();

  if (splits.cluster_merge) {
    merge_in_cluster<D, kInt8Warps>(p.io, p.output, state_base, group, true, cluster_shared(), shared.state_max,
                                    shared.state_sum, out, merged_rows());
  } else {
    write_block_state<D, kInt8Warps>(workspace, state_base, split, group, shared.state_max, shared.state_sum, out);
  }
  wait_for_prerequisite_grid();
}

}  // namespace kvforge::kernels::decode_attention_device
