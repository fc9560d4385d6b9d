// QuantizedKVCache::decode_step on CUDA against the same append and
// decode_attention as two calls: two CUDA caches get the same appends and
// queries, one by decode_step, one by append then decode_attention; the
// kernels and plans are the same, so every output must be equal bit for bit
// and the pools equal. What it checks is decode_step's host path: the
// decode's arrays and queries queued before the append's uploads and kernel,
// in their own buffer (a shared one would hand the append the decode's
// arrays), the lengths the decode reads (the append's) and the sync that
// hands back a host output (tests/test_torch_ops.py (g) runs the
// asynchronous form, device tensors). Prefill chunks of hundreds of
// tokens and single tokens across page, group and window boundaries, 3 to
// 40 sequences (the append's arrays carried in its launch or uploaded),
// sequences idle in some steps; every decode kernel takes part. Where
// every sequence gets one token the CUDA backend appends inside the
// decode's launch where it can (kernels/step_append.cuh): rtn's layout on
// the int8 kernel's 64-token steps (its warps), int2-rot's rotated layouts
// in the query rotation's kernel where the queries are rotated first; each
// case says whether its steps must have taken that path
// (CudaBackend::fused_steps), so that the bit-equality covers it and the
// other steps stay two launches. Skipped without a GPU.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda_backend.h"
#include "kernels/cuda_runtime_check.h"
#include "kernels/quantized_kv_cache.h"
#include "kernels/rotate_queries_launch.h"
#include "model/rope.h"
#include "tests/kernel_activations.h"
#include "tests/kernel_cases.h"

namespace kvforge {
namespace {

using kernels::DecodeKernel;
using kernels::TensorKind;
using testing::KernelCase;

constexpr int64_t kKvHeads = 2, kLayers = 2;

struct StepCase {
  KernelCase layout;
  DecodeKernel kernel = DecodeKernel::kAuto;
  int sequences = 3;
  int64_t tokens_per_split = 256;
  // The one-token steps append inside the decode's launch (a rotated
  // layout's: where this device holds the rotation's step blocks in one
  // wave).
  bool fuses = false;
  // The decoding steps from empty sequences: the first tokens land in the
  // sink, the window fills and wraps, the first pages open (else a prefill
  // of hundreds of tokens comes first).
  bool from_empty = false;
  // CacheOptions::rotate_before_exact_blocks off (both caches): the few
  // exact blocks of a matrix key rotation first, not behind the rotation.
  bool exact_blocks_first = false;
  // The prefill chunks' lengths divided by this (schedule): a short case
  // for the sanitizers, whose racecheck of the lookup kernel over the full
  // schedule ran past 270 s.
  int64_t prefill_divisor = 1;
};

void PrintTo(const StepCase& c, std::ostream* os) { *os << c.layout.name; }

// Rounds of (tokens per sequence): prefill chunks of different lengths (some
// sequences idle), then decoding steps; sequence s of n. The totals stay
// under 3000 tokens. `from_empty`: 40 one-token steps of every sequence
// first; `prefill_divisor`: the two long prefill chunks that much shorter.
std::vector<std::vector<int64_t>> schedule(int n, bool from_empty, int64_t prefill_divisor) {
  std::vector<std::vector<int64_t>> rounds;
  const auto round = [&](auto tokens_of) {
    std::vector<int64_t> r;
    for (int s = 0; s < n; ++s) r.push_back(tokens_of(s));
    rounds.push_back(r);
  };
  if (from_empty) {
    for (int i = 0; i < 40; ++i) round([](int) { return int64_t{1}; });
  }
  round([&](int s) { return (int64_t{700} + 131 * (s % 5)) / prefill_divisor; });
  for (int i = 0; i < 3; ++i) round([](int) { return int64_t{1}; });
  round([&](int s) { return s % 3 == 1 ? int64_t{0} : (int64_t{997} - 17 * (s % 7)) / prefill_divisor; });
  for (int i = 0; i < 18; ++i) round([i](int s) { return (s + i) % 4 == 3 ? int64_t{0} : int64_t{1}; });
  round([](int s) { return int64_t{33} + s % 40; });
  for (int i = 0; i < 3; ++i) round([](int) { return int64_t{1}; });
  return rounds;
}

class DecodeStepCuda : public ::testing::TestWithParam<StepCase> {};

TEST_P(DecodeStepCuda, EqualsAppendThenDecodeAttentionBitForBit) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const StepCase& c = GetParam();
  const KernelCase& l = c.layout;
  at::manual_seed(23);
  const RopeConfig rope_config;
  const RotaryEmbedding rope(rope_config, l.head_dim, at::kCPU);
  const QuantizerConfig config = testing::fitted_kernel_config(l.name, l.fit, kLayers, kKvHeads, l.head_dim, l.element,
                                                               l.key_rotation, l.value_rotation, l.key_centre, rope);
  kernels::CacheOptions options;
  options.page_size = l.page_size;
  options.element = l.element;
  options.max_sequences = c.sequences;
  options.max_context = 4096;
  options.outlier_page_entries = 64;
  options.tokens_per_split = c.tokens_per_split;
  options.decode_kernel = c.kernel;
  options.rotate_before_exact_blocks = !c.exact_blocks_first;
  const kernels::ModelDimensions dims = testing::kernel_model_dimensions(kLayers, l.heads, kKvHeads, l.head_dim, rope_config);
  auto stepped_backend = std::make_unique<kernels::CudaBackend>();
  const kernels::CudaBackend& stepped_cuda = *stepped_backend;
  kernels::QuantizedKVCache stepped(config, dims, options, std::move(stepped_backend));
  kernels::QuantizedKVCache plain(config, dims, options, std::make_unique<kernels::CudaBackend>());
  // A rotated step joins the query rotation's kernel only where that
  // kernel's two blocks per (KV head, sequence) run in one wave on this
  // device (DecodePlan::rotation_step_in_one_wave), counted here from the
  // step variant's occupancy: a device that holds fewer expects the two
  // launches its planner takes instead.
  bool fuses = c.fuses;
  if (fuses && l.key_rotation == RotationForm::kMatrix) {
    int multiprocessors = 0;
    KVFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0));
    const int per_multiprocessor = kernels::rotate_queries_step_blocks_per_multiprocessor(stepped.decode_params(0));
    fuses = int64_t{2} * kKvHeads * c.sequences <= int64_t{multiprocessors} * per_multiprocessor;
  }

  const std::vector<std::vector<int64_t>> rounds = schedule(c.sequences, c.from_empty, c.prefill_divisor);
  std::vector<int64_t> totals(static_cast<size_t>(c.sequences), 0);
  for (const auto& r : rounds) {
    for (int s = 0; s < c.sequences; ++s) totals[static_cast<size_t>(s)] += r[static_cast<size_t>(s)];
  }
  // [sequence][layer]: the activations every round takes its tokens from.
  std::vector<std::vector<testing::KernelActivations>> inputs(static_cast<size_t>(c.sequences));
  for (int s = 0; s < c.sequences; ++s) {
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      inputs[static_cast<size_t>(s)].push_back(testing::synthetic_activations(
          1, kKvHeads, totals[static_cast<size_t>(s)], l.head_dim, 1.0 + 0.5 * layer, l.element, rope));
    }
  }
  std::vector<int32_t> ids;
  for (int s = 0; s < c.sequences; ++s) {
    ids.push_back(stepped.add_sequence());
    ASSERT_EQ(plain.add_sequence(), ids.back());
  }
  std::vector<int64_t> lengths(static_cast<size_t>(c.sequences), 0);
  int64_t outputs_compared = 0;
  for (size_t r = 0; r < rounds.size(); ++r) {
    kernels::AppendBatch batch;
    for (int s = 0; s < c.sequences; ++s) {
      // A sequence that would hold no token after the step sits it out.
      if (lengths[static_cast<size_t>(s)] + rounds[r][static_cast<size_t>(s)] == 0) continue;
      batch.sequences.push_back(ids[static_cast<size_t>(s)]);
      batch.positions.push_back(lengths[static_cast<size_t>(s)]);
      batch.tokens.push_back(rounds[r][static_cast<size_t>(s)]);
    }
    const auto count = static_cast<int64_t>(batch.sequences.size());
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      std::vector<float> keys, values;
      for (int s = 0; s < c.sequences; ++s) {
        const int64_t n = rounds[r][static_cast<size_t>(s)];
        if (n == 0) continue;
        testing::append_token_rows(inputs[static_cast<size_t>(s)][static_cast<size_t>(layer)],
                                   config.settings.keys_pre_rope, lengths[static_cast<size_t>(s)], n, keys, values);
      }
      batch.keys = keys.data();
      batch.values = values.data();
      const at::Tensor queries = at::randn({count, l.heads, l.head_dim}).contiguous();
      std::vector<float> expected(static_cast<size_t>(queries.numel())), actual(expected.size());
      plain.append(layer, batch);
      plain.decode_attention(layer, batch.sequences, queries.data_ptr<float>(), expected.data());
      stepped.decode_step(layer, batch, queries.data_ptr<float>(), actual.data());
      for (size_t i = 0; i < expected.size(); ++i) {
        ASSERT_EQ(0, std::memcmp(&expected[i], &actual[i], sizeof(float)))
            << l.name << " round " << r << " layer " << layer << ": output " << i << " (sequence entry "
            << i / static_cast<size_t>(l.heads * l.head_dim) << ") is " << actual[i] << " after decode_step, "
            << expected[i] << " after append and decode_attention";
      }
      outputs_compared += static_cast<int64_t>(expected.size());
      for (int s = 0; s < c.sequences; ++s) {
        ASSERT_EQ(stepped.length(ids[static_cast<size_t>(s)], layer), plain.length(ids[static_cast<size_t>(s)], layer));
      }
    }
    for (int s = 0; s < c.sequences; ++s) lengths[static_cast<size_t>(s)] += rounds[r][static_cast<size_t>(s)];
  }
  EXPECT_GT(outputs_compared, 0);
  if (fuses) {
    EXPECT_GT(stepped_cuda.fused_steps(), 0) << l.name << ": no step appended inside the decode's launch";
  } else {
    EXPECT_EQ(stepped_cuda.fused_steps(), 0) << l.name << ": a step appended inside the decode's launch";
  }
  // The pools the two orders left (outlier pages aside: the append's blocks
  // take them from a shared stack in any order).
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    for (const TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
      const kernels::TensorPoolCopy a = plain.copy_pools(layer, kind), b = stepped.copy_pools(layer, kind);
      EXPECT_TRUE(a.exact == b.exact) << l.name << " layer " << layer;
      EXPECT_EQ(a.entry_counts, b.entry_counts) << l.name << " layer " << layer;
      if (plain.layout(kind).outlier_spans == 0) EXPECT_TRUE(a.pages == b.pages) << l.name << " layer " << layer;
    }
  }
  EXPECT_EQ(stepped.copy_page_table(), plain.copy_page_table());
}

std::vector<StepCase> step_cases() {
  using testing::make_kernel_case;
  std::vector<StepCase> all;
  const auto add = [&](KernelCase layout, DecodeKernel kernel = DecodeKernel::kAuto, int sequences = 3,
                       int64_t tokens_per_split = 256, bool fuses = false, bool from_empty = false,
                       bool exact_blocks_first = false, int64_t prefill_divisor = 1) {
    all.push_back({std::move(layout), kernel, sequences, tokens_per_split, fuses, from_empty, exact_blocks_first,
                   prefill_divisor});
  };
  const auto with_element = [](KernelCase layout, kernels::ElementType element) {
    layout.element = element;
    return layout;
  };
  // The int8 kernel's 64-token steps (rtn), per warp, the one-token steps'
  // appends inside its launch: fp16, bf16 and fp32 pairs; 40 sequences: the
  // arrays uploaded, not carried in the launches. GQA 8 (the 32-token
  // steps): the append launched on its own.
  add(make_kernel_case("rtn_2bit_d128_gqa4", QuantMethod::kRtn, 2, 128, 8), DecodeKernel::kAuto, 3, 256, true);
  add(with_element(make_kernel_case("rtn_4bit_d128_gqa4_bf16", QuantMethod::kRtn, 4, 128, 8),
                   kernels::ElementType::kBFloat16),
      DecodeKernel::kAuto, 3, 256, true);
  add(with_element(make_kernel_case("rtn_2bit_d64_gqa2_fp32_40_sequences", QuantMethod::kRtn, 2, 64, 4),
                   kernels::ElementType::kFloat32),
      DecodeKernel::kAuto, 40, 256, true);
  add(make_kernel_case("rtn_4bit_d64_gqa8_40_sequences", QuantMethod::kRtn, 4, 64, 16), DecodeKernel::kAuto, 40, 512);
  // int2-rot: a sink and a window (the exact ranges first at few blocks
  // without a key rotation, else behind the int8 kernel), rotated. With
  // the queries rotated first (the default where the keys have a matrix)
  // the one-token steps' appends run in the rotation's kernel: fp16, bf16
  // and fp32 rows, the values rotated or not, inline arrays (3, 20 and 24
  // sequences) and uploaded ones (40). Without a rotation, or with the
  // exact blocks first (CacheOptions::rotate_before_exact_blocks off, 3
  // sequences), the appends are launched on their own.
  // The rotation's step blocks must run in one wave
  // (DecodePlan::rotation_step_in_one_wave; the test counts them against
  // this device): two per (KV head, sequence) of the tests' 2 KV heads, at
  // head_dim 128 one a multiprocessor (80 blocks at 20 sequences), at 64
  // several (160 at 40). At head_dim 128, 40 sequences take 160 blocks:
  // past one wave on 132 multiprocessors, where those steps are the two
  // launches (the queries still rotated first, the arrays uploaded).
  add(testing::int2rot_window_layout("int2rot_window_2bit_d128_gqa4", 2, 128, 8));
  add(testing::int2rot_rotated_layout("int2rot_rotated_2bit_d64_gqa4_40_sequences", 2, 64, 8), DecodeKernel::kAuto, 40,
      256, true);
  add(testing::int2rot_rotated_layout("int2rot_rotated_2bit_d128_gqa4_40_sequences", 2, 128, 8), DecodeKernel::kAuto,
      40, 256, true);
  add(with_element(testing::int2rot_rotated_layout("int2rot_exact_blocks_first_4bit_d64_gqa8_bf16", 4, 64, 16),
                   kernels::ElementType::kBFloat16),
      DecodeKernel::kAuto, 3, 256, false, false, true);
  add(with_element(testing::int2rot_rotated_layout("int2rot_rotated_4bit_d64_gqa8_bf16_24_sequences", 4, 64, 16),
                   kernels::ElementType::kBFloat16),
      DecodeKernel::kAuto, 24, 256, true);
  {
    KernelCase keys_only = with_element(
        testing::int2rot_rotated_layout("int2rot_keys_rotated_2bit_d128_gqa4_fp32_20_sequences", 2, 128, 8),
        kernels::ElementType::kFloat32);
    keys_only.value_rotation = RotationForm::kNone;
    add(keys_only, DecodeKernel::kAuto, 20, 256, true);
  }
  // The few exact blocks of 3 sequences behind the query rotation
  // (CacheOptions::rotate_before_exact_blocks, the default): the appends in
  // the rotation's kernel there too.
  add(testing::int2rot_rotated_layout("int2rot_rotated_2bit_d128_gqa4", 2, 128, 8), DecodeKernel::kAuto, 3, 256, true);
  // Steps from empty sequences: the sink's rows, the window filling and
  // wrapping, the first pages (rtn: from the first token); int2-rot's
  // inside the query rotation (3 and 20 sequences) and with the exact
  // blocks first (3).
  add(testing::int2rot_rotated_layout("int2rot_rotated_from_empty_2bit_d128_gqa4", 2, 128, 8), DecodeKernel::kAuto, 3,
      256, true, true);
  add(testing::int2rot_rotated_layout("int2rot_rotated_from_empty_2bit_d128_gqa4_20_sequences", 2, 128, 8),
      DecodeKernel::kAuto, 20, 256, true, true);
  add(testing::int2rot_rotated_layout("int2rot_exact_blocks_first_from_empty_2bit_d128_gqa4", 2, 128, 8),
      DecodeKernel::kAuto, 3, 256, false, true, true);
  add(make_kernel_case("rtn_from_empty_2bit_d128_gqa4", QuantMethod::kRtn, 2, 128, 8), DecodeKernel::kAuto, 3, 256,
      true, true);
  // KIVI: keys in per-channel groups of tokens quantized when the group
  // completes (the int8 kernel's general variant, the general kernel's
  // exact ranges).
  add(testing::kivi_layout("kivi_2bit_d128_gqa4", 2, 128, 8));
  add(testing::kivi_sliding_sink_layout("kivi_sliding_sink_4bit_d64_gqa1", 4, 64, 2), DecodeKernel::kAuto, 3, 128);
  // KVQuant: the lookup kernel, outliers.
  add(testing::kvquant_layout("kvquant_2bit_d128_gqa4", 2, 128, 8));
  // The same with prefills of 70-122 and 98-99 tokens in splits of 64 (the
  // sanitizers' kvquant case: still several splits, pages and outlier pages).
  add(testing::kvquant_layout("kvquant_short_2bit_d128_gqa4", 2, 128, 8), DecodeKernel::kAuto, 3, 64, false, false,
      false, 10);
  // RTN with outliers on the int8 kernel's general variant, on the bf16
  // tensor-core kernel, and on the general kernel.
  add(testing::rtn_groups32_outliers_layout("rtn_groups32_outliers_2bit_d128_gqa4", 2, 128, 8));
  add(testing::rtn_groups32_outliers_layout("rtn_groups32_outliers_bf16_tensor_cores_2bit_d128_gqa4", 2, 128, 8),
      DecodeKernel::kBf16TensorCores);
  add(testing::int2rot_window_layout("int2rot_window_general_2bit_d64_gqa4", 2, 64, 8), DecodeKernel::kGeneral);
  return all;
}

INSTANTIATE_TEST_SUITE_P(Layouts, DecodeStepCuda, ::testing::ValuesIn(step_cases()),
                         [](const ::testing::TestParamInfo<StepCase>& info) { return info.param.layout.name; });

}  // namespace
}  // namespace kvforge
