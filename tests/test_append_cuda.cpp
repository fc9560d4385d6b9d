// The CUDA append kernel against the CPU reference (kernels/append_kernel.cuh,
// kernels/cpu_reference.cpp): for every layout, two QuantizedKVCache
// instances, one on the CPU reference backend and one on CudaBackend, are
// fed the same prefill chunks and decoding tokens for a batch of sequences
// of mixed lengths; after every append of every layer
//   - the pages (codes, group (min, max) pairs, outlier row pointers), the
//     exact store (sink and ring) and the outlier entry counts are equal
//     byte for byte: the kernel computes in float64 in the reference's
//     order, so there is nothing to tolerate;
//   - every token reads back equal through read_token (values, codes and
//     outlier positions bit for bit), which compares the outlier entries
//     whatever outlier pages each cache gave them (the blocks pop the free
//     stack concurrently, so page ids may differ).
// AppendCudaLarge does the same at scale: batches of 64 sequences of mixed
// lengths (1..8192) and one 128K context, pools byte-equal after every round
// and every token read back equal at the end.
// A layout with a tiny outlier pool checks that both backends report
// exhaustion. Skipped without a GPU.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numbers>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "calib/kv_rotation.h"
#include "calib/quantizer_fit.h"
#include "kernels/append_launch.h"
#include "kernels/cuda_backend.h"
#include "kernels/cuda_runtime_check.h"
#include "kernels/quantized_kv_cache.h"
#include "tests/hooked_cpu_backend.h"
#include "tests/kernel_activations.h"
#include "tests/kernel_cases.h"
#include "model/rope.h"

namespace kvforge {
namespace {

using kernels::ElementType;
using kernels::TensorKind;

constexpr int64_t kKvHeads = 2, kLayers = 2;

// The layouts (tests/kernel_cases.h): the CPU reference's, and some more.
using Case = testing::KernelCase;
using testing::make_kernel_case;

using testing::to_element;
using Activations = testing::KernelActivations;
Activations synthetic(int64_t windows, int64_t tokens, int64_t dim, double layer_scale, ElementType element,
                      const RotaryEmbedding& rope) {
  return testing::synthetic_activations(windows, kKvHeads, tokens, dim, layer_scale, element, rope);
}

kernels::ModelDimensions dimensions(const Case& c, const RopeConfig& rope) {
  return testing::kernel_model_dimensions(kLayers, c.heads, kKvHeads, c.head_dim, rope);
}

// The case's configuration, fitted by calib on synthetic windows (rotated
// ones for a rotated case), as test_runtime_kernels_cpu builds it.
QuantizerConfig fitted_config(const Case& c, const RotaryEmbedding& rope) {
  return testing::fitted_kernel_config(c.name, c.fit, kLayers, kKvHeads, c.head_dim, c.element, c.key_rotation,
                                       c.value_rotation, c.key_centre, rope);
}

// The case's cache options: its page size, element type and append kernel.
kernels::CacheOptions case_options(const Case& c) {
  kernels::CacheOptions options;
  options.page_size = c.page_size;
  options.element = c.element;
  options.append_kernel = c.append_kernel;
  return options;
}

struct Step {
  std::vector<std::pair<int, int64_t>> appends;  // (sequence index, tokens)
};

// Prefill chunks and decoding steps over three sequences of mixed lengths,
// across flushes, groups and page boundaries; the long schedule reaches
// 3003 and 1404 tokens.
std::vector<Step> schedule(bool long_context) {
  std::vector<Step> steps;
  if (long_context) {
    steps.push_back({{{0, 1000}, {1, 700}}});
    steps.push_back({{{0, 1000}, {1, 1}}});
    steps.push_back({{{0, 1000}, {1, 700}}});
    for (int i = 0; i < 3; ++i) steps.push_back({{{0, 1}, {1, 1}}});
    return steps;
  }
  steps.push_back({{{0, 37}, {1, 5}}});
  for (int i = 0; i < 4; ++i) steps.push_back({{{0, 1}, {1, 1}}});
  steps.push_back({{{1, 20}, {0, 1}, {2, 33}}});
  for (int i = 0; i < 8; ++i) steps.push_back({{{2, 1}, {0, 1}, {1, 1}}});
  steps.push_back({{{0, 41}, {2, 1}}});
  for (int i = 0; i < 6; ++i) steps.push_back({{{0, 1}, {1, 1}, {2, 1}}});
  return steps;
}

// The first differing byte of two pools, for the failure message.
std::string first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) {
      return "byte " + std::to_string(i) + ": cpu " + std::to_string(a[i]) + ", cuda " + std::to_string(b[i]);
    }
  }
  return "none";
}

// The CUDA cache's pools of one layer equal the CPU reference's, byte for
// byte (pages, exact store, outlier counts); `where` names the step.
void expect_equal_pools(const kernels::QuantizedKVCache& cpu, const kernels::QuantizedKVCache& cuda, int64_t layer,
                        const std::string& where) {
  for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
    const std::string at = where + " layer " + std::to_string(layer) + (kind == TensorKind::kKeys ? " keys" : " values");
    const kernels::TensorPoolCopy expected = cpu.copy_pools(layer, kind), actual = cuda.copy_pools(layer, kind);
    ASSERT_TRUE(expected.pages == actual.pages) << at << ": pages differ at " << first_difference(expected.pages, actual.pages);
    ASSERT_TRUE(expected.exact == actual.exact) << at << ": exact store differs at " << first_difference(expected.exact, actual.exact);
    ASSERT_EQ(expected.entry_counts, actual.entry_counts) << at;
    ASSERT_EQ(expected.outlier_pages_used, actual.outlier_pages_used) << at;
  }
}

class AppendCuda : public ::testing::TestWithParam<Case> {};

TEST_P(AppendCuda, PoolsEqualTheCpuReferenceAfterEveryAppend) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  at::manual_seed(11);
  const RopeConfig rope_config;
  const RotaryEmbedding rope(rope_config, c.head_dim, at::kCPU);
  const QuantizerConfig config = fitted_config(c, rope);
  kernels::CacheOptions options = case_options(c);
  options.max_sequences = 4;
  options.max_context = c.long_context ? 4096 : 256;
  options.outlier_page_entries = 64;
  kernels::QuantizedKVCache cpu(config, dimensions(c, rope_config), options);
  kernels::QuantizedKVCache cuda(config, dimensions(c, rope_config), options, std::make_unique<kernels::CudaBackend>());

  const std::vector<Step> steps = schedule(c.long_context);
  std::vector<int64_t> totals(3, 1);
  for (const Step& step : steps) {
    for (auto [seq, n] : step.appends) totals[seq] += n;
  }
  std::vector<std::vector<Activations>> inputs(3);
  for (int s = 0; s < 3; ++s) {
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      Activations a = synthetic(1, totals[s], c.head_dim, 1.0 + 0.5 * layer, c.element, rope);
      if (c.activation_step > 0) {
        for (at::Tensor* t : {&a.keys_pre, &a.keys, &a.values}) {
          *t = testing::to_element(at::round(*t / c.activation_step) * c.activation_step, c.element);
        }
      }
      inputs[s].push_back(a);
    }
  }
  std::vector<int32_t> ids(3, -1);
  std::vector<int64_t> lengths(3, 0);
  int64_t outliers_compared = 0, tokens_compared = 0;
  for (size_t step_index = 0; step_index < steps.size(); ++step_index) {
    const Step& step = steps[step_index];
    kernels::AppendBatch batch;
    for (auto [seq, n] : step.appends) {
      if (ids[seq] < 0) {
        ids[seq] = cpu.add_sequence();
        ASSERT_EQ(cuda.add_sequence(), ids[seq]);
      }
      batch.sequences.push_back(ids[seq]);
      batch.positions.push_back(lengths[seq]);
      batch.tokens.push_back(n);
    }
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      std::vector<float> keys, values;
      for (auto [seq, n] : step.appends) {
        testing::append_token_rows(inputs[seq][layer], config.settings.keys_pre_rope, lengths[seq], n, keys, values);
      }
      batch.keys = keys.data();
      batch.values = values.data();
      cpu.append(layer, batch);
      cuda.append(layer, batch);
      ASSERT_NO_FATAL_FAILURE(expect_equal_pools(cpu, cuda, layer, c.name + " step " + std::to_string(step_index)));
      // The pages a step opens reach the device's page table (written by
      // the kernel when they travel in the launch).
      const std::span<const int32_t> host_table = cuda.page_table();
      ASSERT_EQ(cuda.copy_page_table(), std::vector<int32_t>(host_table.begin(), host_table.end()))
          << c.name << " step " << step_index << " layer " << layer;
    }
    for (auto [seq, n] : step.appends) lengths[seq] += n;
    // Every token of every sequence reads back the same (outliers through
    // each cache's own outlier pages); long contexts: the newest 300.
    for (int s = 0; s < 3; ++s) {
      if (ids[s] < 0) continue;
      for (int64_t layer = 0; layer < kLayers; ++layer) {
        for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
          for (int64_t t = c.long_context ? std::max<int64_t>(0, lengths[s] - 300) : 0; t < lengths[s]; ++t) {
            const kernels::TokenReadout e = cpu.read_token(layer, kind, ids[s], t);
            const kernels::TokenReadout a = cuda.read_token(layer, kind, ids[s], t);
            ASSERT_EQ(e.quantized, a.quantized);
            ASSERT_EQ(e.codes, a.codes) << c.name << " token " << t;
            ASSERT_EQ(e.outliers, a.outliers) << c.name << " token " << t;
            ASSERT_EQ(0, std::memcmp(e.values.data(), a.values.data(), e.values.size() * sizeof(float)))
                << c.name << " token " << t;
            for (uint8_t o : e.outliers) outliers_compared += o;
            ++tokens_compared;
          }
        }
      }
    }
  }
  EXPECT_GT(tokens_compared, 0);
  const bool any_outliers = cpu.layout(TensorKind::kKeys).outlier_spans > 0 || cpu.layout(TensorKind::kValues).outlier_spans > 0;
  if (any_outliers) EXPECT_GT(outliers_compared, 0) << "the case must exercise the outlier rows";
}

std::vector<Case> cases() {
  std::vector<Case> all = testing::layout_cases();
  {  // KVQuant with per-head top/bottom values.
    Case c = make_kernel_case("kvquant_per_head_values_4bit_d128_gqa8", QuantMethod::kKvquant, 4, 128, 16);
    c.fit.value_grouping = Grouping::kPerToken;
    c.fit.outlier_fraction = 0.05;
    all.push_back(c);
  }
  {  // KIVI sliding without a residual: a ring of G - 1 tokens, the completing token takes the first one's row.
    Case c = make_kernel_case("kivi_sliding_no_residual_2bit_d64_gqa4", QuantMethod::kKivi, 2, 64, 8);
    c.fit.residual_tokens = 0;
    c.fit.key_group = 16;
    c.fit.key_residual_rule = ResidualRule::kSliding;
    all.push_back(c);
  }
  // KIVI keys in groups whose ring (G - 1 rows without a residual) wraps
  // inside a group (append_kernel.cuh, quantize_channel_group: a token's
  // ring row found by one conditional wrap from the group's first): 6, a
  // ring of 5, and 12, a ring of 11 and groups across page boundaries.
  for (const int group : {6, 12}) {
    Case c = make_kernel_case("kivi_group" + std::to_string(group) + "_2bit_d64_gqa4", QuantMethod::kKivi, 2, 64, 8);
    c.fit.residual_tokens = 0;
    c.fit.key_group = group;
    c.fit.key_residual_rule = ResidualRule::kSliding;
    all.push_back(c);
  }
  // KIVI keys over more channels than an append block's threads (2 KV heads
  // of 256: two channel slices, kernels/append_slices.h, each its own
  // block; the values' 16 groups of 32 two slices of 8 groups too), with a
  // residual and with a ring that wraps inside a group.
  for (const int residual : {0, 64}) {
    Case c = make_kernel_case("kivi_slices_residual" + std::to_string(residual) + "_2bit_d256_gqa2",
                              QuantMethod::kKivi, 2, 256, 4);
    c.fit.residual_tokens = residual;
    c.fit.key_group = residual == 0 ? 12 : 32;
    c.fit.key_residual_rule = ResidualRule::kSliding;
    all.push_back(c);
  }
  {  // Per-token groups of 32 without outliers at 2 KV heads of 192 (not the
     // token-parallel kernel's head_dim): 12 groups a token, keys and values
     // each in a slice of 8 groups and a narrower one of 4 (append_slices.h).
    Case c = make_kernel_case("rtn_groups32_slices_2bit_d192_gqa2", QuantMethod::kRtn, 2, 192, 4);
    c.fit.key_group = 32;
    c.fit.value_group = 32;
    all.push_back(c);
  }
  {  // KIVI over a long context (as the layouts' long KVQuant and int2-rot).
    Case k = make_kernel_case("kivi_long_2bit_d128_gqa4", QuantMethod::kKivi, 2, 128, 8);
    k.fit.residual_tokens = 128;
    k.long_context = true;
    all.push_back(k);
  }
  // Inputs on a grid of 0.25 (signed zeros too): ties among the largest
  // and smallest of a token's all-heads row (token_top_bottom by rounds,
  // top_bottom_rounds.h) and of its per-head spans, and among the groups'
  // extremes.
  for (const char* name : {"kvquant_2bit_d128_gqa4", "rtn_groups32_outliers_2bit_d128_gqa4"}) {
    const auto layout = std::find_if(all.begin(), all.end(), [&](const Case& c) { return c.name == name; });
    if (layout == all.end()) throw std::logic_error(std::string("the ties cases' layout ") + name + " is gone");
    Case c = *layout;
    c.name += "_ties";
    c.activation_step = 0.25;
    all.push_back(c);
  }
  // head_dim 256 (eight channels a lane), rotated: the append's rotation
  // staged in 32 chunks of 8 rows, four in flight (no decode case: the
  // decode kernels take head_dim 64 and 128).
  all.push_back(testing::int2rot_rotated_layout("int2rot_rotated_2bit_d256_gqa2", 2, 256, 4));
  // The token-parallel kernel's layouts again through the block-per-sequence
  // kernel, which keeps serving them on request (and every other layout).
  for (const char* name : {"rtn_2bit_d128_gqa1", "int2rot_rotated_2bit_d128_gqa4", "int2rot_4bit_d64_gqa1_page12",
                           "int2rot_rotated_long_4bit_d128_gqa4"}) {
    const auto layout = std::find_if(all.begin(), all.end(), [&](const Case& c) { return c.name == name; });
    if (layout == all.end()) continue;  // EveryTokenParallelLayoutIsNamed fails
    Case c = *layout;
    c.name += "_per_sequence";
    c.append_kernel = kernels::AppendKernel::kPerSequence;
    all.push_back(c);
  }
  return all;
}

// The layouts the token-parallel append kernel takes: per-token groups for
// keys and values, no outliers, no rotation or a matrix one.
const std::vector<std::string>& token_parallel_layouts() {
  static const std::vector<std::string> names = {"int2rot_rotated_2bit_d128_gqa4", "int2rot_4bit_d64_gqa1_page12",
                                                 "rtn_2bit_d128_gqa1", "rtn_4bit_d64_gqa4_split64",
                                                 "int2rot_rotated_long_4bit_d128_gqa4", "int2rot_rotated_2bit_d256_gqa2"};
  return names;
}

// Runs without a GPU: the launcher takes exactly the named layouts with the
// token-parallel kernel, prefill chunks and decoding tokens alike, and no
// layout asked for the block-per-sequence kernel.
TEST(AppendCudaCases, TokenParallelKernelTakesThePerTokenLayoutsWithoutOutliers) {
  const std::vector<std::string>& named = token_parallel_layouts();
  int taken = 0;
  for (const Case& c : cases()) {
    const RopeConfig rope_config;
    const RotaryEmbedding rope(rope_config, c.head_dim, at::kCPU);
    const QuantizerConfig config = fitted_config(c, rope);
    kernels::CacheOptions options = case_options(c);
    options.max_sequences = 2;
    options.max_context = 64;
    // Whether the CUDA launcher would take each append with the token-parallel kernel.
    int token_parallel = 0, per_sequence = 0;
    auto backend = std::make_unique<testing::HookedCpuBackend>();
    backend->before_append = [&](const kernels::AppendParams& params) {
      (kernels::takes_token_parallel(params) ? token_parallel : per_sequence) += 1;
    };
    kernels::QuantizedKVCache cache(config, dimensions(c, rope_config), options, std::move(backend));
    const int32_t a = cache.add_sequence(), b = cache.add_sequence();
    std::vector<float> rows(static_cast<size_t>(6 * kKvHeads * c.head_dim), 0.25f);
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>((i * 37) % 11) - 5.0f;
    kernels::AppendBatch prefill;
    prefill.sequences = {a, b};
    prefill.positions = {0, 0};
    prefill.tokens = {4, 1};
    prefill.keys = prefill.values = rows.data();
    cache.append(0, prefill);
    kernels::AppendBatch step = prefill;
    step.positions = {4, 1};
    step.tokens = {1, 0};
    cache.append(0, step);
    const bool expected = std::find(named.begin(), named.end(), c.name) != named.end();
    EXPECT_EQ(token_parallel, expected ? 2 : 0) << c.name;
    EXPECT_EQ(per_sequence, expected ? 0 : 2) << c.name;
    taken += expected ? 1 : 0;
  }
  EXPECT_EQ(taken, static_cast<int>(named.size())) << "every named layout is a case";
}

// Runs without a GPU: the schedules' appends reach every block size of the
// rotated token kernel (one, two and four rows a block).
TEST(AppendCudaCases, SchedulesReachEveryRotatedBlockSize) {
  std::set<int> reached;
  for (bool long_context : {false, true}) {
    for (const Step& step : schedule(long_context)) {
      int64_t rows = 0;
      for (auto [seq, n] : step.appends) rows += n;
      reached.insert(kernels::rotated_block_rows(rows, kKvHeads));
    }
  }
  EXPECT_EQ(reached, (std::set<int>{1, 2, 4}));
}

// Runs without a GPU: every case is a configuration the runtime serves (so
// that a GPU run compares kernels, not refusals).
TEST(AppendCudaCases, EveryCaseIsServedByTheRuntime) {
  for (const Case& c : cases()) {
    const RopeConfig rope_config;
    const RotaryEmbedding rope(rope_config, c.head_dim, at::kCPU);
    const QuantizerConfig config = fitted_config(c, rope);
    EXPECT_NO_THROW(kernels::QuantizedKVCache(config, dimensions(c, rope_config), case_options(c))) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, AppendCuda, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// ------------------------------------------------------------ large batches and contexts

// A batch of 64 sequences of mixed lengths (1..8192, log-uniform) or one
// context of 128K tokens: every sequence is prefilled in rounds of chunks of
// up to `prefill_chunk` tokens, all sequences in one append per round and
// layer, then decoded for 3 rounds of one token each.
struct LargeWorkload {
  Case layout;
  std::vector<int64_t> lengths;
  int64_t prefill_chunk = 1000;
};

void PrintTo(const LargeWorkload& w, std::ostream* os) { *os << w.layout.name; }

// A device cache's token read back from host copies of its pools, with the
// host cache's page table and dequantization constants (equal in both
// caches: the host allocates the pages, and the constants come from the same
// configuration): what read_token gives, without copying the pools per token.
struct HostPoolReader {
  kernels::TensorPoolCopy pools;
  kernels::PagedTensor paged;
  kernels::Dequantization dequantization;
  const int32_t* page_table = nullptr;
  int64_t page_table_stride = 0;

  HostPoolReader(const kernels::QuantizedKVCache& device_cache, const kernels::QuantizedKVCache& host_cache,
                 int64_t layer, TensorKind kind)
      : pools(device_cache.copy_pools(layer, kind)) {
    const kernels::DecodeParams host = host_cache.decode_params(layer);
    paged = kind == TensorKind::kKeys ? host.key_cache : host.value_cache;
    dequantization = kind == TensorKind::kKeys ? host.key_dequantization : host.value_dequantization;
    page_table = host.batch.page_table;
    page_table_stride = host.batch.page_table_stride;
    paged.pages = pools.pages.data();
    paged.exact = pools.exact.data();
    paged.outlier_pages = pools.outlier_pages.empty() ? nullptr : pools.outlier_pages.data();
    paged.outlier_page_table = pools.outlier_page_table.empty() ? nullptr : pools.outlier_page_table.data();
  }
  kernels::TokenReadout read(int32_t slot, int64_t tokens, int64_t token) const {
    return kernels::read_token_reference(paged, dequantization, slot, page_table + slot * page_table_stride, tokens,
                                         token);
  }
};

class AppendCudaLarge : public ::testing::TestWithParam<LargeWorkload> {};

// After every round and layer the pages, the exact store, the outlier entry
// counts and the outlier pages used are equal byte for byte; at the end
// every token of every sequence reads back equal (values, codes and outlier
// positions bit for bit; the outlier entries through each cache's own
// outlier pages).
TEST_P(AppendCudaLarge, PoolsEqualTheCpuReferenceAfterEveryRound) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const LargeWorkload& w = GetParam();
  const Case& c = w.layout;
  at::manual_seed(17);
  const RopeConfig rope_config;
  const RotaryEmbedding rope(rope_config, c.head_dim, at::kCPU);
  const QuantizerConfig config = fitted_config(c, rope);
  const auto count = static_cast<int64_t>(w.lengths.size());
  const int64_t longest = *std::max_element(w.lengths.begin(), w.lengths.end());
  int64_t total = 0;
  for (int64_t n : w.lengths) total += n;
  kernels::CacheOptions options;
  options.page_size = c.page_size;
  options.max_sequences = count;
  options.max_context = longest;
  options.max_pages = count * (kernels::ceil_div(longest, c.page_size) + 1);
  options.element = c.element;
  options.outlier_page_entries = 256;
  // Room for an eighth of all elements as outliers: above every rule here.
  const int64_t width = kKvHeads * c.head_dim;
  options.max_outlier_pages_per_sequence = kernels::ceil_div(longest * width / 8, options.outlier_page_entries) + 1;
  options.max_outlier_pages = kernels::ceil_div(total * width / 8, options.outlier_page_entries) + count;
  kernels::QuantizedKVCache cpu(config, dimensions(c, rope_config), options);
  kernels::QuantizedKVCache cuda(config, dimensions(c, rope_config), options, std::make_unique<kernels::CudaBackend>());

  // Each sequence's rows [tokens][kv_heads][D] per layer, keys in the configuration's domain.
  std::vector<std::vector<at::Tensor>> keys(static_cast<size_t>(count)), values(static_cast<size_t>(count));
  std::vector<int32_t> ids;
  for (int64_t s = 0; s < count; ++s) {
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      const Activations a = synthetic(1, w.lengths[s], c.head_dim, 1.0 + 0.5 * layer, c.element, rope);
      keys[s].push_back((config.settings.keys_pre_rope ? a.keys_pre : a.keys)[0].permute({1, 0, 2}).contiguous());
      values[s].push_back(a.values[0].permute({1, 0, 2}).contiguous());
    }
    ids.push_back(cpu.add_sequence());
    ASSERT_EQ(cuda.add_sequence(), ids.back());
  }
  constexpr int64_t kDecodeRounds = 3;
  std::vector<int64_t> lengths(static_cast<size_t>(count), 0);
  int64_t rounds = 0;
  for (;; ++rounds) {
    // This round's tokens per sequence: a prefill chunk until the last 3 tokens, then single tokens.
    kernels::AppendBatch batch;
    std::vector<int64_t> entries;  // the sequence index of each batch entry
    for (int64_t s = 0; s < count; ++s) {
      const int64_t left = w.lengths[s] - lengths[s];
      const int64_t n = left > kDecodeRounds ? std::min(w.prefill_chunk, left - kDecodeRounds) : std::min<int64_t>(left, 1);
      if (n == 0) continue;
      entries.push_back(s);
      batch.sequences.push_back(ids[s]);
      batch.positions.push_back(lengths[s]);
      batch.tokens.push_back(n);
    }
    if (batch.sequences.empty()) break;
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      std::vector<float> k, v;
      for (size_t e = 0; e < batch.sequences.size(); ++e) {
        const int64_t s = entries[e];
        const float* kp = keys[s][layer].data_ptr<float>() + batch.positions[e] * width;
        const float* vp = values[s][layer].data_ptr<float>() + batch.positions[e] * width;
        k.insert(k.end(), kp, kp + batch.tokens[e] * width);
        v.insert(v.end(), vp, vp + batch.tokens[e] * width);
      }
      batch.keys = k.data();
      batch.values = v.data();
      cpu.append(layer, batch);
      cuda.append(layer, batch);
      ASSERT_NO_FATAL_FAILURE(expect_equal_pools(cpu, cuda, layer, c.name + " round " + std::to_string(rounds)));
    }
    for (size_t e = 0; e < entries.size(); ++e) lengths[entries[e]] += batch.tokens[e];
  }
  ASSERT_EQ(lengths, w.lengths);
  EXPECT_GE(rounds, kDecodeRounds + 1);

  int64_t outliers_compared = 0, tokens_compared = 0;
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
      const HostPoolReader device_tokens(cuda, cpu, layer, kind);
      for (int64_t s = 0; s < count; ++s) {
        const int64_t n = w.lengths[s];
        // Tokens in parallel (read_token only reads host memory); the first mismatch reported after.
        std::vector<int64_t> outliers(static_cast<size_t>(n), 0);
        std::vector<uint8_t> equal(static_cast<size_t>(n), 0);
        at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            const kernels::TokenReadout e = cpu.read_token(layer, kind, ids[s], t);
            const kernels::TokenReadout a = device_tokens.read(ids[s], n, t);
            equal[t] = e.quantized == a.quantized && e.codes == a.codes && e.outliers == a.outliers &&
                       std::memcmp(e.values.data(), a.values.data(), e.values.size() * sizeof(float)) == 0;
            for (uint8_t o : e.outliers) outliers[t] += o;
          }
        });
        const auto bad = std::find(equal.begin(), equal.end(), uint8_t{0});
        ASSERT_TRUE(bad == equal.end()) << c.name << " layer " << layer << (kind == TensorKind::kKeys ? " keys" : " values")
                                        << " sequence " << s << " (T=" << n << "): token " << (bad - equal.begin())
                                        << " reads back differently";
        for (int64_t o : outliers) outliers_compared += o;
        tokens_compared += n;
      }
    }
  }
  EXPECT_EQ(tokens_compared, 2 * kLayers * total);
  const bool any_outliers = cpu.layout(TensorKind::kKeys).outlier_spans > 0 || cpu.layout(TensorKind::kValues).outlier_spans > 0;
  if (any_outliers) EXPECT_GT(outliers_compared, 0) << "the case must exercise the outlier rows";
  std::printf("[ %s ] %lld sequences, %lld tokens, %lld rounds: pools byte-equal after every round and layer, "
              "%lld token reads and %lld outliers equal\n",
              c.name.c_str(), static_cast<long long>(count), static_cast<long long>(total),
              static_cast<long long>(rounds), static_cast<long long>(tokens_compared),
              static_cast<long long>(outliers_compared));
}

std::vector<LargeWorkload> large_workloads() {
  std::vector<LargeWorkload> all;
  {  // KVQuant's tau variant at batch 64: per-token outliers of 64 sequences popping the free stack at once.
    Case c = make_kernel_case("kvquant_tau_2bit_d128_gqa4_batch64", QuantMethod::kKvquant, 2, 128, 8);
    c.fit.value_outlier_rule = OutlierRule::kTokenTau;
    c.fit.outlier_fraction = 0.03;
    all.push_back({c, testing::mixed_lengths(64, 8192, 5), 1000});
  }
  {  // int2-rot rotated at 4 bits, batch 64: sink, ring and rotation per sequence; page 12.
    Case c = make_kernel_case("int2rot_rotated_4bit_d64_gqa8_page12_batch64", QuantMethod::kInt2Rot, 4, 64, 16);
    c.fit.sink_tokens = 4;
    c.fit.residual_tokens = 16;
    c.key_rotation = c.value_rotation = RotationForm::kMatrix;
    c.key_centre = true;
    c.page_size = 12;
    all.push_back({c, testing::mixed_lengths(64, 8192, 6), 700});
  }
  {  // One 128K context: KVQuant (pre-RoPE keys with thresholds, value outliers, sink 1) in chunks of 8192.
    Case c = make_kernel_case("kvquant_2bit_d128_gqa4_128k", QuantMethod::kKvquant, 2, 128, 8);
    c.fit.outlier_fraction = 0.02;
    all.push_back({c, {131072}, 8192});
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(Large, AppendCudaLarge, ::testing::ValuesIn(large_workloads()),
                         [](const ::testing::TestParamInfo<LargeWorkload>& info) { return info.param.layout.name; });

// Runs without a GPU: the large workloads' layouts are served too.
TEST(AppendCudaCases, EveryLargeWorkloadIsServedByTheRuntime) {
  for (const LargeWorkload& w : large_workloads()) {
    const RopeConfig rope_config;
    const RotaryEmbedding rope(rope_config, w.layout.head_dim, at::kCPU);
    const QuantizerConfig config = fitted_config(w.layout, rope);
    kernels::CacheOptions options;
    options.page_size = w.layout.page_size;
    options.element = w.layout.element;
    EXPECT_NO_THROW(kernels::QuantizedKVCache(config, dimensions(w.layout, rope_config), options)) << w.layout.name;
  }
}

// The case fitted (after at::manual_seed(seed)) and two caches of it with
// `options`: the CPU reference and CUDA, the latter with asynchronous_append
// as asked.
struct CpuAndCuda {
  RotaryEmbedding rope;
  QuantizerConfig config;
  std::unique_ptr<kernels::QuantizedKVCache> cpu, cuda;
};
CpuAndCuda cpu_and_cuda(const Case& c, uint64_t seed, kernels::CacheOptions options, bool asynchronous) {
  at::manual_seed(seed);
  const RopeConfig rope_config;
  CpuAndCuda r{RotaryEmbedding(rope_config, c.head_dim, at::kCPU), {}, nullptr, nullptr};
  r.config = fitted_config(c, r.rope);
  const kernels::ModelDimensions dims = dimensions(c, rope_config);
  r.cpu = std::make_unique<kernels::QuantizedKVCache>(r.config, dims, options);
  options.asynchronous_append = asynchronous;
  r.cuda = std::make_unique<kernels::QuantizedKVCache>(r.config, dims, options, std::make_unique<kernels::CudaBackend>());
  return r;
}

// A pool of one outlier page per layer and kind, filled by appends of 1 to
// 64 tokens: CUDA runs out on the same append as the CPU reference and says
// so (std::length_error, the exhausted flag). With asynchronous_append the
// CUDA append itself returns, and the synchronize() after it reports the
// exhaustion, once, naming the layer and the batch.
void expect_exhaustion_as_on_the_cpu(bool asynchronous) {
  Case c = make_kernel_case("kvquant_small_pool", QuantMethod::kKvquant, 2, 64, 2);
  c.fit.outlier_fraction = 0.05;
  kernels::CacheOptions options;
  options.max_sequences = 2;
  options.max_context = 256;
  options.outlier_page_entries = 16;
  options.max_outlier_pages = 1;
  const CpuAndCuda run = cpu_and_cuda(c, 3, options, asynchronous);
  const Activations a = synthetic(1, 200, c.head_dim, 1.0, c.element, run.rope);
  int64_t position = 0;
  const int32_t id = run.cpu->add_sequence();
  ASSERT_EQ(run.cuda->add_sequence(), id);
  bool cpu_failed = false, cuda_failed = false;
  for (int64_t n : {1, 1, 1, 1, 8, 8, 32, 64}) {
    kernels::AppendBatch batch{{id}, {position}, {n}, nullptr, nullptr};
    const at::Tensor k = (run.config.settings.keys_pre_rope ? a.keys_pre : a.keys).narrow(2, position, n)[0].permute({1, 0, 2}).contiguous();
    const at::Tensor v = a.values.narrow(2, position, n)[0].permute({1, 0, 2}).contiguous();
    batch.keys = k.data_ptr<float>();
    batch.values = v.data_ptr<float>();
    try {
      run.cpu->append(0, batch);
    } catch (const std::length_error&) {
      cpu_failed = true;
    }
    try {
      if (asynchronous) {
        ASSERT_NO_THROW(run.cuda->append(0, batch)) << "an asynchronous append does not wait for its flags";
        run.cuda->synchronize();
      } else {
        run.cuda->append(0, batch);
      }
    } catch (const std::length_error& e) {
      cuda_failed = true;
      const std::string what = e.what();
      const std::string batch_named = asynchronous ? " (sequences " + std::to_string(id) : ":";
      EXPECT_NE(what.find("append to layer 0" + batch_named), std::string::npos) << what;
    }
    ASSERT_EQ(cpu_failed, cuda_failed) << "after " << position + n << " tokens";
    if (cpu_failed) break;
    position += n;
  }
  EXPECT_TRUE(cpu_failed) << "the pool of one page of 16 entries must run out";
  EXPECT_NO_THROW(run.cuda->synchronize()) << "reported once";
}

TEST(AppendCudaOutlierPool, ExhaustionIsReportedAsOnTheCpu) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  expect_exhaustion_as_on_the_cpu(false);
}

TEST(AppendCudaOutlierPool, AsynchronousExhaustionIsReportedBySynchronize) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  expect_exhaustion_as_on_the_cpu(true);
}

// Pipelined asynchronous appends (no sync between them; prefill chunks,
// then decode steps of every sequence on every layer) from one host buffer
// the test overwrites with NaN as soon as each append returns: the pools
// after one synchronize() equal the CPU reference's byte for byte, so every
// queued copy read the bytes of its own call (CudaBackend's pinned staging).
TEST(AppendCudaAsynchronous, PipelinedAppendsFromOneReusedHostBufferStoreWhatTheCpuDoes) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (const QuantMethod method : {QuantMethod::kKvquant, QuantMethod::kKivi}) {
    Case c = make_kernel_case(method == QuantMethod::kKvquant ? "kvquant_async" : "kivi_async", method, 2, 128, 8);
    kernels::CacheOptions options;
    options.max_sequences = 3;
    options.max_context = 512;
    const CpuAndCuda run = cpu_and_cuda(c, 17, options, true);
    constexpr int kSequences = 3, kPrefill = 100, kSteps = 60;
    std::vector<std::vector<Activations>> inputs(kSequences);
    std::vector<int32_t> ids;
    for (int s = 0; s < kSequences; ++s) {
      ids.push_back(run.cpu->add_sequence());
      ASSERT_EQ(run.cuda->add_sequence(), ids.back());
      for (int64_t layer = 0; layer < kLayers; ++layer) {
        inputs[s].push_back(synthetic(1, kPrefill + kSteps, c.head_dim, 1.0 + 0.5 * layer, c.element, run.rope));
      }
    }
    std::vector<float> keys, values;  // one buffer for every call
    std::vector<int64_t> lengths(kSequences, 0);
    const auto append_all = [&](int64_t n) {
      kernels::AppendBatch batch;
      for (int s = 0; s < kSequences; ++s) {
        batch.sequences.push_back(ids[s]);
        batch.positions.push_back(lengths[s]);
        batch.tokens.push_back(n);
      }
      for (int64_t layer = 0; layer < kLayers; ++layer) {
        keys.clear();
        values.clear();
        for (int s = 0; s < kSequences; ++s) {
          testing::append_token_rows(inputs[s][layer], run.config.settings.keys_pre_rope, lengths[s], n, keys, values);
        }
        batch.keys = keys.data();
        batch.values = values.data();
        run.cpu->append(layer, batch);
        run.cuda->append(layer, batch);
        std::fill(keys.begin(), keys.end(), std::numeric_limits<float>::quiet_NaN());
        std::fill(values.begin(), values.end(), std::numeric_limits<float>::quiet_NaN());
      }
      for (int s = 0; s < kSequences; ++s) lengths[s] += n;
    };
    append_all(kPrefill);
    for (int step = 0; step < kSteps; ++step) append_all(1);
    ASSERT_NO_THROW(run.cuda->synchronize());
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      ASSERT_NO_FATAL_FAILURE(expect_equal_pools(*run.cpu, *run.cuda, layer, c.name + " after the pipelined appends"));
    }
  }
}

}  // namespace
}  // namespace kvforge
