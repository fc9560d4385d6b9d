// The CUDA decode_attention over issue 10's whole Must-show matrix, with the
// check of test_decode_attention_cuda (tests/decode_attention_check.h) plus
// the issue's own tolerance against float64 attention (1e-3 of max ||v'||,
// and half an io ulp for a 16-bit io type):
//   - a covering design of head_dim {64, 128} x GQA {1, 4, 8} x bits {2, 4}
//     x method {kvquant with outliers and pre-RoPE keys, kivi with windows
//     and a sink, int2-rot with rotations, rtn}: every pair of values of any
//     two of these axes appears in some case (12 cases: the method x GQA
//     product, head_dim and bits assigned so that the other pairs appear);
//   - each case a batch of 1, 8 or 64 sequences, the 8 and 64 of mixed
//     lengths spread log-uniformly over 1..8192 (1 and 8192 included), each
//     method at every batch size;
//   - within a method's cases the variants: kvquant unrotated, tau outliers
//     in bf16, rotated (pair angles on the keys, a matrix on the values);
//     kivi block flush and sliding keys with a sink; int2-rot with and
//     without a key centre (without: bf16 rows); rtn plain and with grouped outliers; pages of 12,
//     16 and 64 tokens, one split and splits of 64 to 2048 tokens;
//   - long contexts: 131072 and 65536 tokens for kvquant and int2-rot at
//     2 bits (batch 1 and 2; int2-rot's 128K in bf16 rows).
// The CPU side (the reference cache, its decode and float64 attention over
// every token) runs in parallel where it can; each case prints its worst
// ratios and its CPU and GPU seconds. MatrixDesign runs without a GPU: the
// design covers what it claims and every case is served by the runtime.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cuda_runtime_check.h"
#include "kernels/quantized_kv_cache.h"
#include "tests/decode_attention_check.h"
#include "tests/kernel_activations.h"

namespace kvforge {
namespace {

using kernels::ElementType;
using kernels::TensorKind;
using Case = testing::DecodeCase;

constexpr int64_t kLongestMixed = 8192;  // the batches' lengths spread over 1..kLongestMixed

const char* case_method_name(QuantMethod m) {
  switch (m) {
    case QuantMethod::kKvquant: return "kvquant";
    case QuantMethod::kKivi: return "kivi";
    case QuantMethod::kInt2Rot: return "int2rot";
    default: return "rtn";
  }
}

// One row of the covering design.
struct DesignRow {
  QuantMethod method;
  int64_t gqa;
  int64_t head_dim;
  int bits;
};

// The method x GQA product, head_dim and bits assigned so that every pair of
// (head_dim, GQA, bits, method) values appears (MatrixDesign checks it).
const std::vector<DesignRow>& covering_design() {
  static const std::vector<DesignRow> rows{
      {QuantMethod::kKvquant, 1, 64, 2},  {QuantMethod::kKvquant, 4, 64, 2},  {QuantMethod::kKvquant, 8, 128, 4},
      {QuantMethod::kKivi, 1, 64, 2},     {QuantMethod::kKivi, 4, 64, 4},     {QuantMethod::kKivi, 8, 128, 2},
      {QuantMethod::kInt2Rot, 1, 64, 4},  {QuantMethod::kInt2Rot, 4, 128, 2}, {QuantMethod::kInt2Rot, 8, 128, 4},
      {QuantMethod::kRtn, 1, 128, 2},     {QuantMethod::kRtn, 4, 128, 4},     {QuantMethod::kRtn, 8, 64, 4},
  };
  return rows;
}

// The row's case: the method's variant for its position among the method's
// rows (0, 1, 2 for GQA 1, 4, 8), `batch` sequences.
Case design_case(const DesignRow& row, int variant, int64_t batch, uint32_t seed) {
  const std::string shape = std::to_string(row.bits) + "bit_d" + std::to_string(row.head_dim) + "_gqa" +
                            std::to_string(row.gqa) + "_batch" + std::to_string(batch);
  Case c = testing::make_decode_case("", row.method, row.bits, row.head_dim, row.gqa * testing::kDecodeKvHeads);
  c.lengths = testing::mixed_lengths(batch, kLongestMixed, seed);
  std::string variant_name;
  switch (row.method) {
    case QuantMethod::kKvquant:
      c.fit.outlier_fraction = 0.04;
      if (variant == 1) {  // per-head values with token_tau outliers, bf16 elements and io, splits of 64
        variant_name = "tau_bf16";
        c.fit.value_outlier_rule = OutlierRule::kTokenTau;
        c.fit.outlier_fraction = 0.03;
        c.element = c.io = ElementType::kBFloat16;
        c.tokens_per_split = 64;
      } else if (variant == 2) {  // pair angles on the pre-RoPE keys, a matrix on the values, page 12, fp16 io
        variant_name = "rotated_page12_fp16io";
        c.key_rotation = RotationForm::kPairAngles;
        c.value_rotation = RotationForm::kMatrix;
        c.page_size = 12;
        c.io = ElementType::kFloat16;
      }
      break;
    case QuantMethod::kKivi:
      c.fit.residual_tokens = 32;
      c.fit.sink_tokens = 2;
      if (variant == 0) {  // sliding keys, a page (12) dividing no group of 32, splits of 32
        variant_name = "sliding_sink_page12";
        c.fit.key_residual_rule = ResidualRule::kSliding;
        c.page_size = 12;
        c.tokens_per_split = 32;
      } else if (variant == 1) {  // block flush with a sink, splits of 512
        variant_name = "sink";
        c.tokens_per_split = 512;
      } else {  // a page of 64 holding two key groups, fp32 elements, one split
        variant_name = "sink_page64_fp32_one_split";
        c.fit.residual_tokens = 64;
        c.fit.key_group = 32;
        c.page_size = 64;
        c.element = ElementType::kFloat32;
        c.tokens_per_split = 0;
      }
      break;
    case QuantMethod::kInt2Rot:
      c.fit.sink_tokens = 4;
      c.fit.residual_tokens = 16;
      c.key_rotation = c.value_rotation = RotationForm::kMatrix;
      if (variant == 0) {  // no centre, page 12, bf16 rows (the exact kernel's tensor-core passes)
        variant_name = "rotated_page12_bf16";
        c.page_size = 12;
        c.element = ElementType::kBFloat16;
      } else {  // a key centre; splits of 128 at GQA 8
        variant_name = "rotated_centred";
        c.key_centre = true;
        if (variant == 2) c.tokens_per_split = 128;
      }
      break;
    default:
      if (variant == 1) {  // groups of 32 channels with top/bottom outliers per head
        variant_name = "groups32_outliers";
        c.fit.key_group = 32;
        c.fit.value_group = 32;
        c.fit.outlier_fraction = 0.05;
        c.tokens_per_split = 128;
      } else if (variant == 2) {
        variant_name = "bf16";
        c.element = ElementType::kBFloat16;
      }
      break;
  }
  c.name = std::string(case_method_name(row.method)) + (variant_name.empty() ? "" : "_" + variant_name) + "_" + shape;
  return c;
}

std::vector<Case> design_cases() {
  // Method m's variant v has batch kBatches[(m + v) % 3]: every method and
  // every GQA ratio at every batch size.
  static const int64_t kBatches[] = {1, 8, 64};
  std::vector<Case> all;
  for (size_t i = 0; i < covering_design().size(); ++i) {
    const int method = static_cast<int>(i / 3), variant = static_cast<int>(i % 3);
    all.push_back(design_case(covering_design()[i], variant, kBatches[(method + variant) % 3],
                              static_cast<uint32_t>(i + 1)));
  }
  return all;
}

// 64K and 128K contexts at 2 bits (batch 1 and 2): kvquant and int2-rot.
std::vector<Case> long_context_cases() {
  std::vector<Case> all;
  {
    Case c = testing::make_decode_case("long_kvquant_2bit_d128_gqa4_128k_64k", QuantMethod::kKvquant, 2, 128, 8);
    c.fit.outlier_fraction = 0.02;
    c.tokens_per_split = 1024;
    c.lengths = {131072, 65536};
    all.push_back(c);
  }
  {
    Case c = testing::make_decode_case("long_int2rot_rotated_bf16_2bit_d128_gqa8_128k", QuantMethod::kInt2Rot, 2, 128,
                                       16);
    c.element = ElementType::kBFloat16;  // the exact kernel's tensor-core passes
    c.fit.sink_tokens = 4;
    c.fit.residual_tokens = 64;
    c.key_rotation = c.value_rotation = RotationForm::kMatrix;
    c.key_centre = true;
    c.tokens_per_split = 512;
    c.lengths = {131072};
    all.push_back(c);
  }
  {
    Case c = testing::make_decode_case("long_int2rot_rotated_2bit_d64_gqa1_64k", QuantMethod::kInt2Rot, 2, 64, 2);
    c.fit.sink_tokens = 4;
    c.fit.residual_tokens = 16;
    c.key_rotation = c.value_rotation = RotationForm::kMatrix;
    c.tokens_per_split = 2048;
    c.lengths = {65536, 3};
    all.push_back(c);
  }
  return all;
}

// The long int2-rot contexts are the 8-bit integer kernel's by default (2
// bits, one group per row); the bf16 tensor-core kernel on them too,
// against float64 within 1e-3.
std::vector<Case> bf16_tensor_core_cases() {
  std::vector<Case> all;
  for (Case c : long_context_cases()) {
    if (c.fit.method != QuantMethod::kInt2Rot) continue;
    c.name = "bf16tc_" + c.name;
    c.kernel = kernels::DecodeKernel::kBf16TensorCores;
    all.push_back(c);
  }
  return all;
}

std::vector<Case> all_cases() {
  std::vector<Case> all = design_cases();
  for (Case& c : long_context_cases()) all.push_back(std::move(c));
  for (Case& c : bf16_tensor_core_cases()) all.push_back(std::move(c));
  return all;
}

class DecodeAttentionCudaMatrix : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeAttentionCudaMatrix, EqualsTheCpuReferenceAndFloat64Attention) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  testing::DecodeCheckOptions options;
  options.float64_within_1e3 = true;
  options.print_timing = true;
  const testing::DecodeCaseSummary summary = testing::check_decode_case(GetParam(), options);
  EXPECT_EQ(summary.heads_checked, static_cast<int64_t>(GetParam().lengths.size()) * GetParam().heads);
}

INSTANTIATE_TEST_SUITE_P(Matrix, DecodeAttentionCudaMatrix, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// ------------------------------------------------------------ the design (no GPU)

// What a case's cache stores, read from the runtime's layouts.
struct Features {
  bool rotated = false, outliers = false, sink = false, window = false, pre_rope = false;
};

Features features_of(const Case& c) {
  const RotaryEmbedding rope(RopeConfig{}, c.head_dim, at::kCPU);
  const QuantizerConfig config = testing::fitted_decode_config(c, rope);
  kernels::CacheOptions options;
  options.page_size = c.page_size;
  options.element = c.element;
  options.max_sequences = 1;
  options.max_context = 64;
  const kernels::QuantizedKVCache cache(config, testing::decode_dimensions(c), options);
  Features f;
  f.rotated = c.key_rotation != RotationForm::kNone || c.value_rotation != RotationForm::kNone;
  f.pre_rope = config.settings.keys_pre_rope;
  for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
    const kernels::TensorLayoutSpec& spec = cache.layout(kind).spec;
    f.outliers = f.outliers || cache.layout(kind).outlier_spans > 0;
    f.sink = f.sink || spec.sink_tokens > 0;
    f.window = f.window || spec.residual_tokens > 0 || cache.layout(kind).ring_capacity > 0;
  }
  return f;
}

int64_t gqa_of(const Case& c) { return c.heads / testing::kDecodeKvHeads; }

TEST(MatrixDesign, EveryPairOfAxisValuesAppears) {
  using Point = std::tuple<int64_t, int64_t, int64_t, int64_t>;  // head_dim, gqa, bits, method
  std::vector<Point> points;
  for (const Case& c : design_cases()) {
    points.emplace_back(c.head_dim, gqa_of(c), c.fit.bits, static_cast<int64_t>(c.fit.method));
  }
  const std::vector<std::vector<int64_t>> values{{64, 128},
                                                 {1, 4, 8},
                                                 {2, 4},
                                                 {static_cast<int64_t>(QuantMethod::kKvquant),
                                                  static_cast<int64_t>(QuantMethod::kKivi),
                                                  static_cast<int64_t>(QuantMethod::kInt2Rot),
                                                  static_cast<int64_t>(QuantMethod::kRtn)}};
  const auto axis = [](const Point& p, int a) {
    return a == 0 ? std::get<0>(p) : a == 1 ? std::get<1>(p) : a == 2 ? std::get<2>(p) : std::get<3>(p);
  };
  for (int a = 0; a < 4; ++a) {
    for (int b = a + 1; b < 4; ++b) {
      std::set<std::pair<int64_t, int64_t>> seen;
      for (const Point& p : points) seen.emplace(axis(p, a), axis(p, b));
      for (int64_t x : values[a]) {
        for (int64_t y : values[b]) {
          EXPECT_TRUE(seen.count({x, y})) << "axes " << a << " and " << b << ": (" << x << ", " << y << ") missing";
        }
      }
    }
  }
}

TEST(MatrixDesign, BatchesLengthsAndLongContextsAreCovered) {
  std::set<std::pair<int64_t, int64_t>> method_batch;  // (method, batch size)
  int64_t shortest = kLongestMixed, longest_mixed = 0;
  for (const Case& c : design_cases()) {
    method_batch.emplace(static_cast<int64_t>(c.fit.method), static_cast<int64_t>(c.lengths.size()));
    if (c.lengths.size() > 1) {
      shortest = std::min(shortest, *std::min_element(c.lengths.begin(), c.lengths.end()));
      longest_mixed = std::max(longest_mixed, *std::max_element(c.lengths.begin(), c.lengths.end()));
      EXPECT_GT(std::set<int64_t>(c.lengths.begin(), c.lengths.end()).size(), c.lengths.size() / 2)
          << c.name << ": the batch's lengths must be mixed";
    }
  }
  for (QuantMethod m : {QuantMethod::kKvquant, QuantMethod::kKivi, QuantMethod::kInt2Rot, QuantMethod::kRtn}) {
    for (int64_t batch : {1, 8, 64}) {
      EXPECT_TRUE(method_batch.count({static_cast<int64_t>(m), batch})) << case_method_name(m) << " at batch " << batch;
    }
  }
  EXPECT_EQ(shortest, 1);
  EXPECT_EQ(longest_mixed, kLongestMixed);
  std::set<std::pair<int64_t, int64_t>> long_contexts;  // (method, context) at 2 bits
  for (const Case& c : long_context_cases()) {
    EXPECT_LE(c.lengths.size(), 2u) << c.name;
    for (int64_t n : c.lengths) {
      if (c.fit.bits == 2) long_contexts.emplace(static_cast<int64_t>(c.fit.method), n);
    }
  }
  for (QuantMethod m : {QuantMethod::kKvquant, QuantMethod::kInt2Rot}) {
    for (int64_t n : {65536, 131072}) {
      EXPECT_TRUE(long_contexts.count({static_cast<int64_t>(m), n})) << case_method_name(m) << " at " << n << " tokens";
    }
  }
}

// Runs without a GPU: every case is a configuration the runtime serves (a
// GPU run compares kernels, not refusals), and each of rotation, outliers,
// sink, window and pre-RoPE keys appears with and without.
TEST(MatrixDesign, EveryCaseIsServedAndEveryFeatureAppearsWithAndWithout) {
  at::manual_seed(4321);
  std::set<std::pair<std::string, bool>> seen;
  for (const Case& c : all_cases()) {
    Features f;
    EXPECT_NO_THROW(f = features_of(c)) << c.name;
    seen.insert({"rotation", f.rotated});
    seen.insert({"outliers", f.outliers});
    seen.insert({"sink", f.sink});
    seen.insert({"window", f.window});
    seen.insert({"pre-RoPE keys", f.pre_rope});
    if (c.fit.method == QuantMethod::kKvquant) {
      EXPECT_TRUE(f.outliers && f.pre_rope) << c.name << ": kvquant with outliers and pre-RoPE keys";
    }
    if (c.fit.method == QuantMethod::kKivi) EXPECT_TRUE(f.sink && f.window) << c.name << ": kivi with a sink and a window";
    if (c.fit.method == QuantMethod::kInt2Rot) EXPECT_TRUE(f.rotated) << c.name << ": int2-rot with its rotation";
  }
  for (const char* feature : {"rotation", "outliers", "sink", "window", "pre-RoPE keys"}) {
    EXPECT_TRUE(seen.count({feature, true})) << feature << " never appears";
    EXPECT_TRUE(seen.count({feature, false})) << feature << " is never absent";
  }
}

}  // namespace
}  // namespace kvforge
