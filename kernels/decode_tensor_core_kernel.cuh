#pragma once
// The tensor-core decode attention (docs/runtime-layout.md, section 6.4):
// the bandwidth path for uniform codes of post-RoPE keys, which is rtn, kivi
// and int2-rot where the int8 kernel does not take them (kvquant's
// non-uniform grids and pre-RoPE keys take the lookup kernel,
// decode_lookup_kernel.cuh). What the other kernels share with this one
// lives in bf16_mma_fragments.cuh (registers), token_addressing.cuh (where
// a token's bytes lie) and decode_block_state.cuh (queries, tokens, split
// state).
//
// Why tensor cores: at 2 bits a token's key and value rows of one KV head are
// 64 bytes, and scoring them for a GQA group of 4 is 1024 multiply-adds, 16 per
// byte: the H200's float32 units run out before its memory does (about half
// the bandwidth). So the codes go into mma.sync as they are:
//
//   - A operand: the codes themselves, as bf16 integers (0..15 are exact):
//     (word >> shift) & 0x000?000? | 0x4300.. is bf16 (128 + code) in each
//     half, minus 128. No per-element dequantization at all: a group's affine
//     x = a + b * code is factored out of the sums.
//   - keys: score(t, h) = sum_d q'_hd (a + b c_td): per-token groups give
//     b_t (q'.c) + a_t sum(q'), per-channel groups (q' * b).c + q'.a. The B
//     operand (q' or q' * b) is split into bf16 hi + lo (2^-16 relative), two
//     mmas; the codes are exact, the products and sums float32.
//   - values: out^T[d, h] = sum_t V^T[d, t] W[t, h], A = V^T codes, W = p * b
//     (softmax weight times the token's scale, again hi + lo), plus the
//     a-term sum_t p_t a_t in float32.
//   - outlier entries correct the scores and the outputs by
//     q'_d (x - deq) and p (x - deq); the sink, the windows and every token
//     not quantized for both keys and values are the general kernel's (its
//     "exact ranges" mode), merged with these states.
//
// One block of four warps per (context split, KV head, sequence); each warp
// takes a contiguous run of 16-token tiles of the split, keeps the online
// softmax of the GQA group's heads (up to 8: the mma's N), and the block
// merges its warps' states into one split state for decode_merge_kernel.
//
// Fragment layouts (PTX m16n8k16, g = lane / 4, c = lane % 4): A rows g and
// g + 8, k columns 2c, 2c+1 and 2c+8, 2c+9; B k rows 2c, 2c+1, 2c+8, 2c+9 of
// column g; C rows g, g+8, columns 2c, 2c+1. A dot product is the same
// under any permutation of k applied to both operands, so the codes are
// unpacked in the order the shifts give and the queries placed to match:
//   2 bits, word = 16 channels: k (2c, 2c+1) holds channels (2c, 2c+8),
//     k (2c+8, 2c+9) channels (2c+1, 2c+9);
//   4 bits, words of 8 channels: k (2c, 2c+1) holds (c, c+4) of the first
//     word, k (2c+8, 2c+9) holds (8+c, 12+c).
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/async_copy.cuh"
#include "kernels/bf16_mma_fragments.cuh"
#include "kernels/decode_attention_kernel.cuh"
#include "kernels/decode_block_state.cuh"
#include "kernels/token_addressing.cuh"
#include "kernels/warp_channel_sums.cuh"

namespace kvforge::kernels::decode_attention_device {

inline constexpr int kTensorCoreWarps = 4;
inline constexpr int kTileRows = 16;  // tokens per mma tile

// ---------------------------------------------------------------- kernel

// Shared memory of one block.
template <int D>
struct TensorCoreShared {
  // The group's queries, rotated by the keys' rotation (rows 16-byte
  // aligned for rotate_group_queries, as are raw_query's after them).
  alignas(16) float query[kMaxTensorCoreGroup][D];
  float raw_query[kMaxTensorCoreGroup][D];
  float weights[kTensorCoreWarps][kTileRows][kMaxTensorCoreGroup];  // p of the tile, per warp
  float alpha[kTensorCoreWarps][kMaxTensorCoreGroup];
  float state_max[kTensorCoreWarps][kMaxTensorCoreGroup], state_sum[kTensorCoreWarps][kMaxTensorCoreGroup];
  float out[kTensorCoreWarps][kMaxTensorCoreGroup][D];  // value outlier corrections, then each warp's acc
  // The tile's per-token group affines, from its stage's pairs (lane j keys,
  // lane 16 + j values of token j).
  Affine key_affine[kTensorCoreWarps][kTileRows][4], value_affine[kTensorCoreWarps][kTileRows][4];
  Affine channel[kTensorCoreWarps][D];  // per-channel keys: the current token group's (or the offline) affines
};

inline constexpr int kStages = 3;  // tiles per warp in flight: the one computed and two loading

// One tile's bytes in shared memory (dynamic, kStages per warp): the 16
// tokens' code rows and group pairs of keys and values, copied
// asynchronously, and where each token lies (for the outliers).
template <int D, int kBits, int KG, int VG>
struct TileStage {
  static constexpr int kRowBytes = D * kBits / 8;
  uint4 key_codes[kTileRows * kRowBytes / 16];
  uint4 value_codes[kTileRows * kRowBytes / 16];
  uint2 key_pairs[kTileRows][KG];  // (min, max), 4 or 8 bytes each
  uint2 value_pairs[kTileRows][VG];
  SlotAddress key_at[kTileRows], value_at[kTileRows];  // page null: past the range
};

template <int D, int kBits, int KG, int VG>
constexpr int tensor_core_dynamic_shared_bytes() {
  return kTensorCoreWarps * kStages * static_cast<int>(sizeof(TileStage<D, kBits, KG, VG>));
}

// KG, VG: the most channel groups of a per-token grouping a key and a value
// row may have (1: one group per row, as all-heads, per-channel keys and
// G' = D; 4: G' = D/4, D/2 or D, counted at run time).
template <int D, int kBits, int KG, int VG>
__global__ void __launch_bounds__(kTensorCoreWarps * kWarpSize)
    decode_tensor_core_kernel(const DecodeParams p, const SplitWorkspace workspace, const TensorCoreSplits splits) {
  constexpr int kSteps = D / 16;               // k steps of the keys = m tiles of the values
  constexpr int kWords = D * kBits / 32;       // 32-bit code words per row
  constexpr int kTop = (1 << kBits) - 1;
  using Stage = TileStage<D, kBits, KG, VG>;
  constexpr int kRowChunks = Stage::kRowBytes / 16;  // 16-byte copies per code row
  // Raw bytes: a __shared__ variable is never constructed, and the
  // struct's members have default initializers (Affine's).
  __shared__ __align__(16) uint8_t shared_bytes[sizeof(TensorCoreShared<D>)];
  auto& shared = *reinterpret_cast<TensorCoreShared<D>*>(shared_bytes);
  extern __shared__ __align__(16) uint8_t dynamic_shared[];

  const int split = blockIdx.x, kv_head = blockIdx.y, entry = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, c = lane % 4;
  const BlockTokens block = block_tokens(p, splits, split, kv_head, entry);
  const int group = block.group;
  const int64_t first = block.first, last = block.last, state_base = block.state_base;
  if (first >= last) {  // an empty split: a state the merge skips
    write_empty_state(workspace, block, split);
    return;
  }
  const int32_t slot = entry_slot(p, entry);
  const int32_t* page_row = p.batch.page_table + slot * p.batch.page_table_stride;
  const TensorPageLayout& kl = p.key_cache.layout;
  const TensorPageLayout& vl = p.value_cache.layout;
  const int sink = kl.spec.sink_tokens;
  const bool per_channel_keys = per_channel_groups(kl.spec);
  const int key_group_channels = KG == 1 || per_channel_keys ? D : kl.spec.group;
  const int value_group_channels =
      VG == 1 || vl.spec.grouping == ScaleGrouping::kPerTokenAllHeads ? D : vl.spec.group;
  const int key_groups = D / key_group_channels, value_groups = D / value_group_channels;
  const int key_pairs_per_head = D / key_group_channels, value_pairs_per_head = D / value_group_channels;

  load_group_queries<D>(p, workspace.queries, state_base, group, kv_head, shared.query, shared.raw_query, &shared.out[0][0][0],
                        kTensorCoreWarps * kMaxTensorCoreGroup * D);

  // This warp's tiles: a contiguous run of the split's.
  const int64_t tiles = (last - first + kTileRows - 1) / kTileRows;
  const int64_t per_warp = (tiles + kTensorCoreWarps - 1) / kTensorCoreWarps;
  const int64_t tile_begin = warp * per_warp, tile_end = tile_begin + per_warp < tiles ? tile_begin + per_warp : tiles;
  const float* my_query = shared.query[g];  // B column g (zeros past the group)

  // Key B fragments (hi, lo) per k step and the a-terms: per-token keys
  // sum_{d in group} q'_d per key group (head g); per-channel keys q'.a.
  uint32_t key_b[kSteps][2][2];  // [step][register][hi, lo]
  float key_a_term[KG];          // per-token keys: of head g; per-channel: [0] of head g
  int64_t key_params_group = -1;  // per_channel_tokens: the token group key_b was built for
  auto build_key_operands = [&](int64_t s) {
    if (per_channel_keys) {  // the group's D channel affines, 4 per lane, then read by every lane
      const ChannelStream stream = channel_stream(kl, s, kv_head);
      for (int d = lane; d < D; d += kWarpSize) {
        shared.channel[warp][d] = channel_affine(p.key_cache, p.key_dequantization, page_row, stream, kv_head, d, kTop);
      }
      __syncwarp();
    }
    float partial[KG];
#pragma unroll
    for (int kg = 0; kg < KG; ++kg) partial[kg] = 0.0f;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
#pragma unroll
      for (int which = 0; which < 2; ++which) {
        int d0, d1;
        key_channels<kBits>(c, which, d0, d1);
        d0 += 16 * step;
        d1 += 16 * step;
        float x0 = my_query[d0], x1 = my_query[d1];
        if (per_channel_keys) {
          const Affine a0 = shared.channel[warp][d0], a1 = shared.channel[warp][d1];
          partial[0] = __fmaf_rn(x0, a0.a, __fmaf_rn(x1, a1.a, partial[0]));
          x0 = __fmul_rn(x0, a0.b);
          x1 = __fmul_rn(x1, a1.b);
        } else {
#pragma unroll
          for (int kg = 0; kg < KG; ++kg) {
            if (kg == (16 * step) / key_group_channels) partial[kg] += x0 + x1;
          }
        }
        const SplitBf16x2 split_q = split_bf16(x0, x1);
        key_b[step][which][0] = split_q.hi;
        key_b[step][which][1] = split_q.lo;
      }
    }
#pragma unroll
    for (int kg = 0; kg < KG; ++kg) {  // over the 4 lanes of column g
      partial[kg] += __shfl_xor_sync(0xffffffffu, partial[kg], 1);
      partial[kg] += __shfl_xor_sync(0xffffffffu, partial[kg], 2);
      key_a_term[kg] = partial[kg];
    }
  };
  if (kl.spec.grouping != ScaleGrouping::kPerChannelTokens) build_key_operands(0);

  float running_max[2] = {-INFINITY, -INFINITY}, running_sum[2] = {0.0f, 0.0f};  // heads 2c, 2c+1
  float acc[kSteps][4];  // values: m tile, C fragment (rows g, g+8 x heads 2c, 2c+1)
#pragma unroll
  for (int t = 0; t < kSteps; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  float value_a_term[VG];  // head g, this lane's tokens (summed over the 4 lanes at the end)
#pragma unroll
  for (int vg = 0; vg < VG; ++vg) value_a_term[vg] = 0.0f;
  const float log2e_scale = p.softmax_scale * 1.4426950408889634f;
  const bool key_outliers = kl.outlier_spans > 0, value_outliers = vl.outlier_spans > 0;

  Stage* stages = reinterpret_cast<Stage*>(dynamic_shared) + warp * kStages;
  const int page_size = kl.spec.page_size;
  const int pair_bytes = static_cast<int>(kl.pair_bytes);

  // Starts the copies of tile `tile` into its stage (every lane takes part).
  auto issue = [&](int64_t tile) {
    Stage& stage = stages[tile % kStages];
    const int64_t t0 = first + tile * kTileRows;
    const int j = lane % kTileRows;
    const bool values = lane >= kTileRows;
    const int64_t t = t0 + j;
    const bool valid = t < last;
    const int32_t s_index = static_cast<int32_t>(t - sink);
    // Each lane reads its token's page id (the tile's 16 tokens share at
    // most three entries: one cached load; as fast as a window of the table
    // kept in the lanes, measured on the H200 at 4K-128K, batch 32).
    const int page = valid ? page_row[s_index / page_size] : 0;
    const PagedTensor& cache = values ? p.value_cache : p.key_cache;
    SlotAddress at;
    if (valid) at = {cache.pages + static_cast<int64_t>(page) * cache.layout.page_bytes, s_index % page_size};
    (values ? stage.value_at : stage.key_at)[j] = at;
    // Group pairs: lane j the keys', lane 16 + j the values' of token j.
    const int groups = values ? value_groups : (per_channel_keys ? 0 : key_groups);
    const int pairs_per_head = values ? value_pairs_per_head : key_pairs_per_head;
    if (valid) {
      for (int kg = 0; kg < groups; ++kg) {
        const int32_t index =
            token_pair_index(cache.layout.spec, kv_head, static_cast<int32_t>(at.in_page), kg, pairs_per_head);
        const uint8_t* source = at.page + cache.layout.params_offset + index * pair_bytes;
        uint2* target = values ? &stage.value_pairs[j][kg] : &stage.key_pairs[j][kg];
        if (pair_bytes == 4) {
          copy_async<4>(target, source);
        } else {
          copy_async<8>(target, source);
        }
      }
    }
    // Code rows: 16-byte chunks, chunk i of the kind's 16 rows by lane i % 32.
    // Every lane runs every round and every shuffle: with 16 chunks (2-bit
    // rows of 64 channels) lanes 16..31 have no chunk, and a full-mask
    // shuffle they skipped was undefined (garbage addresses in the decode
    // matrix's d64 2-bit case under memcheck, 2026-12-01).
    const uint8_t* page_base = at.page;
    const int32_t in_page = static_cast<int32_t>(at.in_page);
    constexpr int kChunks = kTileRows * kRowChunks;
#pragma unroll
    for (int kind = 0; kind < 2; ++kind) {
      const PagedTensor& tensor = kind == 0 ? p.key_cache : p.value_cache;
#pragma unroll
      for (int round = 0; round < (kChunks + kWarpSize - 1) / kWarpSize; ++round) {
        const int chunk = round * kWarpSize + lane;
        const bool has_chunk = chunk < kChunks;
        const int row = has_chunk ? chunk / kRowChunks : 0, part = chunk % kRowChunks;
        const int source_lane = row + kind * kTileRows;
        const auto base = reinterpret_cast<const uint8_t*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(page_base), source_lane));
        const int32_t row_in_page = __shfl_sync(0xffffffffu, in_page, source_lane);
        if (has_chunk && t0 + row < last) {
          const uint8_t* source = base + code_row_offset(tensor.layout, kv_head, row_in_page) + part * 16;
          copy_async<16>((kind == 0 ? stage.key_codes : stage.value_codes) + chunk, source);
        }
      }
    }
  };

#pragma unroll
  for (int ahead = 0; ahead < kStages - 1; ++ahead) {
    if (tile_begin + ahead < tile_end) issue(tile_begin + ahead);
    copy_async_commit();
  }
  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const int64_t t0 = first + tile * kTileRows;
    if (tile + kStages - 1 < tile_end) issue(tile + kStages - 1);
    copy_async_commit();
    copy_async_wait<kStages - 1>();  // this tile's group is complete
    __syncwarp();
    const Stage& stage = stages[tile % kStages];
    {  // the tile's affines from its pairs: lane j the keys, lane 16 + j the values of token j
      const int j = lane % kTileRows;
      const bool values = lane >= kTileRows;
      const bool valid = t0 + j < last;
      const PagedTensor& cache = values ? p.value_cache : p.key_cache;
      const Dequantization& dq = values ? p.value_dequantization : p.key_dequantization;
      const int groups = values ? value_groups : (per_channel_keys ? 0 : key_groups);
      for (int kg = 0; kg < groups; ++kg) {
        const uint2* pair = values ? &stage.value_pairs[j][kg] : &stage.key_pairs[j][kg];
        (values ? shared.value_affine : shared.key_affine)[warp][j][kg] =
            valid ? affine_of_pair(cache.layout, dq, reinterpret_cast<const uint8_t*>(pair), kTop)
                  : Affine{0.0f, 0.0f};
      }
      __syncwarp();
    }
    // ---- keys: tokens g and g + 8 (A rows)
    const int64_t key_tokens[2] = {t0 + g, t0 + g + 8};
    uint32_t words[2][kWords];
    SlotAddress key_at[2];
    Affine key_affine[2][KG];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = g + 8 * r;
      key_at[r] = stage.key_at[row];
#pragma unroll
      for (int w4 = 0; w4 < kWords / 4; ++w4) {
        const uint4 v = stage.key_codes[row * kRowChunks + w4];
        words[r][4 * w4] = v.x;
        words[r][4 * w4 + 1] = v.y;
        words[r][4 * w4 + 2] = v.z;
        words[r][4 * w4 + 3] = v.w;
      }
#pragma unroll
      for (int kg = 0; kg < KG; ++kg) {
        key_affine[r][kg] = !per_channel_keys && kg < key_groups ? shared.key_affine[warp][row][kg] : Affine{0.0f, 0.0f};
      }
    }
    if (kl.spec.grouping == ScaleGrouping::kPerChannelTokens) {
      const int64_t key_group = (t0 - sink) / kl.spec.group;  // tiles never straddle a group (G % 16 == 0)
      if (key_group != key_params_group) {
        build_key_operands(t0 - sink);
        key_params_group = key_group;
      }
    }
    float dots[KG][4];
#pragma unroll
    for (int kg = 0; kg < KG; ++kg) dots[kg][0] = dots[kg][1] = dots[kg][2] = dots[kg][3] = 0.0f;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      uint32_t a[4];
      key_fragment<kBits, kWords>(words[0], words[1], step, c, a);
      const int step_group = KG == 1 ? 0 : (16 * step) / key_group_channels;
#pragma unroll
      for (int kg = 0; kg < KG; ++kg) {  // a select, not an indexed (local memory) array
        if (kg != step_group) continue;
        mma_bf16(dots[kg], a, key_b[step][0][0], key_b[step][1][0]);
        mma_bf16(dots[kg], a, key_b[step][0][1], key_b[step][1][1]);
      }
    }
    // Scores of C (token g + 8 (i / 2), head 2c + (i % 2)), in log2 units.
    float score[4];
    float a_terms[2][KG];  // the a-terms of heads 2c, 2c+1 (lanes of column 2c, 2c+1)
#pragma unroll
    for (int kg = 0; kg < KG; ++kg) {
      a_terms[0][kg] = shfl(key_a_term[kg], 4 * (2 * c));
      a_terms[1][kg] = shfl(key_a_term[kg], 4 * (2 * c + 1));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = i / 2, h = i % 2;
      float dot = 0.0f;
      if (per_channel_keys) {
        dot = dots[0][i] + a_terms[h][0];
      } else {
#pragma unroll
        for (int kg = 0; kg < KG; ++kg) dot += __fmaf_rn(key_affine[r][kg].b, dots[kg][i], key_affine[r][kg].a * a_terms[h][kg]);
      }
      score[i] = dot;
    }
    if (key_outliers) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (key_tokens[r] >= last) continue;
        float correction[2] = {0.0f, 0.0f};
        for_each_outlier(p.key_cache, slot, key_at[r], kv_head, [&](int d, float x) {
          const int code = code_at<kBits>(kl, key_at[r], kv_head, d);
          Affine affine;
          if (per_channel_keys) {
            affine = shared.channel[warp][d];  // the tile's token group's
          } else {
            affine = key_affine[r][0];
#pragma unroll
            for (int kg = 1; kg < KG; ++kg) {
              if (kg == d / key_group_channels) affine = key_affine[r][kg];
            }
          }
          const float delta = x - __fmaf_rn(affine.b, static_cast<float>(code), affine.a);
          correction[0] = __fmaf_rn(shared.query[2 * c][d], delta, correction[0]);
          correction[1] = __fmaf_rn(shared.query[2 * c + 1][d], delta, correction[1]);
        });
        score[2 * r] += correction[0];
        score[2 * r + 1] += correction[1];
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) score[i] = key_tokens[i / 2] < last ? score[i] * log2e_scale : -INFINITY;

    // ---- online softmax per head (columns 2c, 2c+1), over the tile's 16 rows
    float alpha[2], weight[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = fmaxf(score[h], score[2 + h]);
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
      const float new_max = fmaxf(running_max[h], m);
      alpha[h] = exp2f(running_max[h] - new_max);  // 0 on the first tile
      weight[h] = exp2f(score[h] - new_max);
      weight[2 + h] = exp2f(score[2 + h] - new_max);
      float sum = weight[h] + weight[2 + h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      sum += __shfl_xor_sync(0xffffffffu, sum, 8);
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      running_sum[h] = __fmaf_rn(running_sum[h], alpha[h], sum);
      running_max[h] = new_max;
    }
    rescale_columns(acc, alpha);
    shared.weights[warp][g][2 * c] = weight[0];
    shared.weights[warp][g][2 * c + 1] = weight[1];
    shared.weights[warp][g + 8][2 * c] = weight[2];
    shared.weights[warp][g + 8][2 * c + 1] = weight[3];
    if (g == 0) {
      shared.alpha[warp][2 * c] = alpha[0];
      shared.alpha[warp][2 * c + 1] = alpha[1];
    }
    __syncwarp();

    // ---- values: tokens 2c, 2c+1, 2c+8, 2c+9 (B rows), column g
    const int value_rows[4] = {2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9};
    SlotAddress value_at[4];
    float w_token[4];
    Affine value_affine[4][VG];
    const float alpha_g = shared.alpha[warp][g];
#pragma unroll
    for (int vg = 0; vg < VG; ++vg) value_a_term[vg] *= alpha_g;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t t = t0 + value_rows[u];
      const bool valid = t < last && g < group;
      w_token[u] = valid ? shared.weights[warp][value_rows[u]][g] : 0.0f;
#pragma unroll
      for (int vg = 0; vg < VG; ++vg) value_affine[u][vg] = {0.0f, 0.0f};
      if (t >= last) continue;
      value_at[u] = stage.value_at[value_rows[u]];
#pragma unroll
      for (int vg = 0; vg < VG; ++vg) {
        if (vg >= value_groups) continue;
        value_affine[u][vg] = shared.value_affine[warp][value_rows[u]][vg];
        value_a_term[vg] = __fmaf_rn(w_token[u], value_affine[u][vg].a, value_a_term[vg]);
      }
    }
    uint32_t value_b[VG][2][2];  // [group][register][hi, lo]
#pragma unroll
    for (int vg = 0; vg < VG; ++vg) {
      const SplitBf16x2 b01 = split_bf16(w_token[0] * value_affine[0][vg].b, w_token[1] * value_affine[1][vg].b);
      const SplitBf16x2 b89 = split_bf16(w_token[2] * value_affine[2][vg].b, w_token[3] * value_affine[3][vg].b);
      value_b[vg][0][0] = b01.hi;
      value_b[vg][0][1] = b01.lo;
      value_b[vg][1][0] = b89.hi;
      value_b[vg][1][1] = b89.lo;
    }
    // 64 channels (4 m tiles) of the four tokens' rows at a time.
    constexpr int kChunkWords = 64 * kBits / 32;
#pragma unroll
    for (int chunk = 0; chunk < D / 64; ++chunk) {
      uint32_t chunk_words[4][kChunkWords];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int w = 0; w < kChunkWords; ++w) chunk_words[u][w] = 0;
        if (t0 + value_rows[u] >= last) continue;
        const uint4* row = stage.value_codes + value_rows[u] * kRowChunks + chunk * (kChunkWords / 4);
#pragma unroll
        for (int w4 = 0; w4 < kChunkWords / 4; ++w4) {
          const uint4 v = row[w4];
          chunk_words[u][4 * w4] = v.x;
          chunk_words[u][4 * w4 + 1] = v.y;
          chunk_words[u][4 * w4 + 2] = v.z;
          chunk_words[u][4 * w4 + 3] = v.w;
        }
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const int tile_index = chunk * 4 + mt;
        const uint32_t e0 = value_codes<kBits>(chunk_words[0], mt, g), e1 = value_codes<kBits>(chunk_words[1], mt, g);
        const uint32_t e8 = value_codes<kBits>(chunk_words[2], mt, g), e9 = value_codes<kBits>(chunk_words[3], mt, g);
        const uint32_t a[4] = {__byte_perm(e0, e1, 0x5410), __byte_perm(e0, e1, 0x7632), __byte_perm(e8, e9, 0x5410),
                               __byte_perm(e8, e9, 0x7632)};
        const int tile_group = VG == 1 ? 0 : (16 * tile_index) / value_group_channels;
#pragma unroll
        for (int vg = 0; vg < VG; ++vg) {  // a select, not an indexed array
          if (vg != tile_group) continue;
          mma_bf16(acc[tile_index], a, value_b[vg][0][0], value_b[vg][1][0]);
          mma_bf16(acc[tile_index], a, value_b[vg][0][1], value_b[vg][1][1]);
        }
      }
    }
    if (value_outliers) {
      // Rescale this warp's corrections to the new maxima, then add the
      // tile's: lanes 0..15 take one token each.
      for (int i = lane; i < group * D; i += kWarpSize) shared.out[warp][i / D][i % D] *= shared.alpha[warp][i / D];
      __syncwarp();
      const int tokens = static_cast<int>(last - t0 < kTileRows ? last - t0 : kTileRows);
      add_value_outliers(
          p.value_cache, slot, kv_head, tokens, group, [&](int l) { return stage.value_at[l]; },
          [&](int l, int d, float x) {
            const int code = code_at<kBits>(vl, stage.value_at[l], kv_head, d);
            const Affine affine = shared.value_affine[warp][l][d / value_group_channels];
            return x - __fmaf_rn(affine.b, static_cast<float>(code), affine.a);
          },
          [&](int l, int h) { return shared.weights[warp][l][h]; }, shared.out[warp]);
    }
    __syncwarp();  // the tile's weights are read before the next tile writes them
  }

  // ---- this warp's state into shared memory (the a-terms over the 4 lanes of column g)
#pragma unroll
  for (int vg = 0; vg < VG; ++vg) {
    value_a_term[vg] += __shfl_xor_sync(0xffffffffu, value_a_term[vg], 1);
    value_a_term[vg] += __shfl_xor_sync(0xffffffffu, value_a_term[vg], 2);
  }
  if (g == 0) {
    shared.state_max[warp][2 * c] = running_max[0];
    shared.state_max[warp][2 * c + 1] = running_max[1];
    shared.state_sum[warp][2 * c] = running_sum[0];
    shared.state_sum[warp][2 * c + 1] = running_sum[1];
  }
#pragma unroll
  for (int t = 0; t < kSteps; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = i < 2 ? g : g + 8, h = 2 * c + (i % 2);
      shared.out[warp][h][16 * t + value_channel<kBits>(row)] += acc[t][i];
    }
  }
  __syncwarp();
  if (g < group) {
    for (int d = c; d < D; d += 4) {
      float a_term = value_a_term[0];
#pragma unroll
      for (int vg = 1; vg < VG; ++vg) {
        if (vg == d / value_group_channels) a_term = value_a_term[vg];
      }
      shared.out[warp][g][d] += a_term;
    }
  }
  __syncthreads();

  write_block_state<D, kTensorCoreWarps>(workspace, state_base, split, group, shared.state_max, shared.state_sum,
                                         shared.out);
}

}  // namespace kvforge::kernels::decode_attention_device
