// The CUDA decode_attention (kernels/decode_attention.cu) on the caches the
// CPU reference builds, on hand-picked layouts: kvquant with outliers and
// pre-RoPE keys, kivi block flush and sliding, int2-rot with rotations, rtn;
// head_dim 64 and 128, GQA 1/4/8, 2 and 4 bits, a batch of mixed lengths (1
// to ~4K) and one 32K context. tests/decode_attention_check.h states the
// comparison (with the CPU reference within 1e-3 of the values' magnitude
// and twice the float32 bound, with float64 attention within the bound);
// test_decode_attention_cuda_matrix runs it over the whole matrix.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda_runtime_check.h"
#include "kernels/decode_attention_launch.h"
#include "kernels/rotate_queries_launch.h"
#include "kernels/split_plan.h"
#include "model/rope.h"
#include "tests/decode_attention_check.h"

namespace kvforge {
namespace {

using kernels::ElementType;
using Case = testing::DecodeCase;

class DecodeAttentionCuda : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeAttentionCuda, EqualsTheCpuReferenceAndFloat64Attention) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  testing::check_decode_case(GetParam());
}

Case make_case(std::string name, QuantMethod method, int bits, int64_t head_dim, int64_t heads) {
  return testing::make_decode_case(std::move(name), method, bits, head_dim, heads);
}

// Case c renamed, with every token from the 40th on a repeat of the 40th:
// every lane of a step then holds the same value outlier channels, which
// the kernels sum into one lane (add_at_channels).
Case repeating_tokens(Case c, std::string name, std::vector<int64_t> lengths) {
  c.name = std::move(name);
  c.repeat_from = 40;
  c.lengths = std::move(lengths);
  return c;
}

// tests/kernel_cases.h's layouts, at other GQA ratios, io types and kernels
// than the CPU tests' list, and the CUDA kernels' own cases.
std::vector<Case> cases() {
  using testing::decode_case;
  constexpr auto kBf16 = kernels::DecodeKernel::kBf16TensorCores;
  constexpr auto kInt8 = kernels::DecodeKernel::kInt8TensorCores;
  // `kernel` (kAuto: the default's choice) and `io` over a layout's case.
  const auto with = [](Case c, kernels::DecodeKernel kernel, ElementType io = ElementType::kFloat32) {
    c.kernel = kernel;
    c.io = io;
    return c;
  };
  constexpr auto kAuto = kernels::DecodeKernel::kAuto;
  std::vector<Case> all;
  all.push_back(decode_case(testing::kvquant_layout("kvquant_2bit_d128_gqa4", 2, 128, 8)));
  all.push_back(with(decode_case(testing::kvquant_rotated_layout("kvquant_rotated_4bit_d64_gqa1_page12_fp16io", 4, 64, 2)),
                     kAuto, ElementType::kFloat16));
  {  // GQA 8, bf16 elements and io, splits of 64.
    Case c = with(decode_case(testing::kvquant_tau_layout("kvquant_tau_2bit_d64_gqa8_bf16", 2, 64, 16)), kAuto,
                  ElementType::kBFloat16);
    c.tokens_per_split = 64;
    all.push_back(c);
  }
  // The bf16 kernel's versions of cases the int8 kernel takes below (int8_*).
  all.push_back(with(decode_case(testing::kivi_layout("kivi_2bit_d128_gqa4", 2, 128, 8)), kBf16));
  all.push_back(decode_case(testing::kivi_sliding_sink_layout("kivi_sliding_sink_4bit_d64_gqa1_page12", 4, 64, 2)));
  all.push_back(decode_case(testing::kivi_page64_layout("kivi_4bit_d128_gqa8_page64_fp32", 4, 128, 16)));
  all.push_back(with(decode_case(testing::int2rot_rotated_layout("int2rot_rotated_2bit_d128_gqa8", 2, 128, 16)), kBf16));
  all.push_back(decode_case(testing::int2rot_page12_layout("int2rot_4bit_d64_gqa4_page12", 4, 64, 8)));
  all.push_back(with(make_case("rtn_2bit_d128_gqa1", QuantMethod::kRtn, 2, 128, 2), kBf16));
  {
    Case c = decode_case(testing::rtn_groups32_outliers_layout("rtn_groups32_outliers_4bit_d128_gqa8", 4, 128, 16));
    c.tokens_per_split = 128;
    all.push_back(c);
    all.push_back(repeating_tokens(c, "rtn_groups32_outliers_repeated_4bit_d128_gqa8", {41, 100, 1031}));
  }
  {  // The 8-bit integer tensor-core kernel (DecodeKernel::kInt8TensorCores):
     // rtn at head_dim 128 and 64 with value outliers, int2-rot rotated with a
     // sink and a window (GQA 8), per-channel keys of 32 tokens with KIVI's
     // value groups of 32 channels (head_dim 128, and 64 with a sink, sliding
     // keys and page 12), rtn at 4 bits, a 16K context (the default also
     // takes the 4-bit kivi and int2-rot layouts above to it). Per-channel
     // keys of 32 tokens with all-heads values (bf16 io) are not the int8
     // kernel's: the default takes them to the bf16 tensor cores.
    all.push_back(with(make_case("int8_rtn_2bit_d128_gqa1", QuantMethod::kRtn, 2, 128, 2), kInt8));
    Case outliers = with(make_case("int8_rtn_outliers_2bit_d64_gqa4_page12", QuantMethod::kRtn, 2, 64, 8), kInt8);
    outliers.fit.outlier_fraction = 0.05;
    outliers.page_size = 12;
    all.push_back(outliers);
    all.push_back(repeating_tokens(outliers, "int8_rtn_outliers_repeated_2bit_d64_gqa4_page12", {41, 100, 1031}));
    all.push_back(with(decode_case(testing::int2rot_rotated_layout("int8_int2rot_rotated_2bit_d128_gqa8", 2, 128, 16)), kInt8));
    Case channels = with(decode_case(testing::kivi_layout("auto_kivi_keys_all_heads_values_2bit_d128_gqa4_bf16", 2, 128, 8)),
                         kAuto, ElementType::kBFloat16);
    channels.fit.value_grouping = Grouping::kPerTokenAllHeads;
    channels.element = ElementType::kBFloat16;
    all.push_back(channels);
    all.push_back(with(decode_case(testing::kivi_layout("int8_kivi_2bit_d128_gqa4", 2, 128, 8)), kInt8));
    Case kivi_small =
        with(decode_case(testing::kivi_sliding_sink_layout("int8_kivi_sliding_sink_2bit_d64_gqa1_page12", 2, 64, 2)), kInt8);
    kivi_small.tokens_per_split = 256;
    all.push_back(kivi_small);
    all.push_back(with(make_case("int8_rtn_4bit_d128_gqa4", QuantMethod::kRtn, 4, 128, 8), kInt8));  // 64-byte rows
    Case long_context = with(make_case("int8_rtn_16k_2bit_d128_gqa4", QuantMethod::kRtn, 2, 128, 8), kInt8);
    long_context.lengths = {16411, 33};
    all.push_back(long_context);
  }
  {  // The int8 kernel's 64-token steps (kernels::Int8Steps), with one and
     // two stages in flight: rtn and int2-rot rotated (a sink and a window)
     // at 2 and 4 bits, head_dim 128 and 64, GQA 4 and 1, page 12, bf16 io;
     // lengths around the stages' and steps' edges (a step of one stage, of
     // one token past it, a warp's run ending mid-step), splits of 256 and
     // of 512 tokens, and a 16K context.
    const auto steps = [](Case c, kernels::Int8Steps s) {
      c.kernel = kInt8;
      c.int8_steps = s;
      return c;
    };
    constexpr auto k3 = kernels::Int8Steps::kSteps64Stages3;
    constexpr auto k4 = kernels::Int8Steps::kSteps64Stages4;
    all.push_back(steps(make_case("int8_steps64x3_rtn_2bit_d128_gqa4", QuantMethod::kRtn, 2, 128, 8), k3));
    all.push_back(
        steps(decode_case(testing::int2rot_rotated_layout("int8_steps64x4_int2rot_rotated_2bit_d128_gqa4", 2, 128, 8)), k4));
    Case edges = steps(make_case("int8_steps64x4_rtn_4bit_d64_gqa1_page12_bf16io", QuantMethod::kRtn, 4, 64, 2), k4);
    edges.page_size = 12;
    edges.io = ElementType::kBFloat16;
    edges.lengths = {1, 31, 32, 33, 63, 64, 65, 96, 127, 129, 255, 257, 320, 1000};
    all.push_back(edges);
    Case split512 =
        steps(decode_case(testing::int2rot_rotated_layout("int8_steps64x3_int2rot_rotated_4bit_d128_gqa4", 4, 128, 8)), k3);
    split512.tokens_per_split = 512;
    split512.lengths = {65, 700, 2049, 3001};
    all.push_back(split512);
    // Queries off a 16-byte boundary: load_rows's element-wise loads, in
    // the int8 kernel straight into the queries (keys without a rotation),
    // in the exact kernel beside kvquant's lookup kernel into the raw rows
    // rotated after.
    Case shifted = make_case("int8_steps64_rtn_2bit_d128_gqa4_bf16io_misaligned_queries", QuantMethod::kRtn, 2, 128, 8);
    shifted.io = ElementType::kBFloat16;
    shifted.misaligned_queries = true;
    all.push_back(shifted);
    Case shifted_f32 = make_case("int8_rtn_4bit_d64_gqa8_misaligned_queries", QuantMethod::kRtn, 4, 64, 16);
    shifted_f32.misaligned_queries = true;
    all.push_back(shifted_f32);
    Case shifted_rotated =
        decode_case(testing::kvquant_rotated_layout("kvquant_rotated_2bit_d128_gqa4_fp16io_misaligned_queries", 2, 128, 8));
    shifted_rotated.io = ElementType::kFloat16;
    shifted_rotated.misaligned_queries = true;
    all.push_back(shifted_rotated);
    // Few states (at most a round of 8; 5 on the H200: the splits and the
    // exact ranges'), so that the merge takes one thread group a head and,
    // the output rotated back, four query heads a block
    // (DecodePlan::merge_heads).
    Case merge_heads =
        steps(decode_case(testing::int2rot_rotated_layout("int8_steps64x4_int2rot_rotated_merge_heads_2bit_d128_gqa4", 2,
                                                          128, 8)),
              k4);
    merge_heads.lengths = {700, 65, 300};
    all.push_back(merge_heads);
    // The exact blocks first where they are few (DecodeParams::
    // rotate_before_exact_blocks off: each of them, and each int8 block,
    // rotating its own queries), where the int2-rot cases at these lengths
    // rotate the queries first and run them behind the int8 kernel in their
    // kept slots: the 64-token steps at GQA 4, and below the 32-token steps
    // at GQA 8 beside bf16 rows of exact chunks that reach all four warps.
    Case exact_first = steps(
        decode_case(testing::int2rot_rotated_layout("int8_steps64x4_int2rot_exact_blocks_first_2bit_d128_gqa4", 2,
                                                    128, 8)),
        k4);
    exact_first.exact_blocks_first = true;
    all.push_back(exact_first);
    // decode_exact_kernel over chunks that reach all four of its warps (the
    // other cases' sink of 4 and window of 16 fill one warp's 16 tokens):
    // a sink of 40 and a window of 100 in one-pass chunks (of 40, 64 and
    // 36; the ring's rows wrap) in bf16 rows at GQA 1 (head_dim 64, its
    // heads padded to 4), int2-rot's own sink of 64 and window of 256 in
    // the default chunks of 128 in float32 rows at GQA 8 (head_dim 128, with
    // the bf16 tensor cores).
    const auto exact_rows = [](Case c, ElementType element, int64_t sink, int64_t residual,
                               std::vector<int64_t> lengths) {
      c.element = element;
      c.fit.sink_tokens = sink;
      c.fit.residual_tokens = residual;
      c.lengths = std::move(lengths);
      return c;
    };
    Case one_pass = exact_rows(
        steps(decode_case(testing::int2rot_rotated_layout("int8_steps64x4_int2rot_rotated_bf16_rows_2bit_d64_gqa1", 2, 64, 2)),
              k4),
        ElementType::kBFloat16, 40, 100, {1, 17, 39, 40, 41, 139, 140, 141, 203, 1000});
    one_pass.exact_chunk_tokens = 64;
    all.push_back(one_pass);
    all.push_back(exact_rows(
        with(decode_case(testing::int2rot_window_layout("int2rot_window_fp32_rows_4bit_d128_gqa8", 4, 128, 16)), kBf16),
        ElementType::kFloat32, 64, 256, {1, 64, 65, 320, 321, 700, 4099}));
    // bf16 rows take the exact kernel's tensor-core passes: at GQA 8 (all
    // eight columns of the mma's N live) at head_dim 128 beside the bf16
    // tensor cores and at head_dim 64 beside the int8 kernel (four k steps
    // and value tiles; lengths inside a warp's 16, on a pass's edge and
    // mid-window).
    all.push_back(exact_rows(
        with(decode_case(testing::int2rot_window_layout("int2rot_window_bf16_rows_4bit_d128_gqa8", 4, 128, 16)), kBf16),
        ElementType::kBFloat16, 64, 256, {1, 9, 64, 65, 200, 320, 321, 700, 4099}));
    all.push_back(exact_rows(
        with(decode_case(testing::int2rot_rotated_layout("int8_int2rot_rotated_bf16_rows_2bit_d64_gqa8", 2, 64, 16)),
             kInt8),
        ElementType::kBFloat16, 40, 100, {1, 17, 39, 40, 41, 139, 140, 141, 203, 1000}));
    Case exact_first_rows = exact_rows(
        with(decode_case(testing::int2rot_rotated_layout("int8_int2rot_exact_blocks_first_bf16_rows_2bit_d64_gqa8", 2,
                                                         64, 16)),
             kInt8),
        ElementType::kBFloat16, 40, 100, {1, 17, 39, 40, 41, 139, 140, 141, 203, 1000});
    exact_first_rows.exact_blocks_first = true;
    all.push_back(exact_first_rows);
    // Longer exact chunks (DecodeParams::exact_chunk_tokens): blocks of
    // several 64-token passes whose warps carry their softmax states from
    // pass to pass. int2-rot's sink of 64 and window of 256 in blocks of 256
    // (the window one block; lengths ending inside a pass, on a pass's
    // edge and mid-window) in bf16 rows at GQA 4; the sink of 40 and window
    // of 100 above in blocks of 128; and KIVI's exact ranges through the
    // general kernel in blocks of 192.
    Case chunk256 = exact_rows(
        steps(decode_case(testing::int2rot_rotated_layout("int8_steps64x4_int2rot_rotated_chunk256_2bit_d128_gqa4", 2,
                                                          128, 8)),
              k4),
        ElementType::kBFloat16, 64, 256, {1, 63, 64, 65, 129, 200, 320, 321, 385, 1000});
    chunk256.exact_chunk_tokens = 256;
    all.push_back(chunk256);
    Case chunk128 = exact_rows(
        steps(decode_case(testing::int2rot_rotated_layout("int8_steps64x4_int2rot_rotated_chunk128_2bit_d64_gqa1", 2, 64,
                                                          2)),
              k4),
        ElementType::kBFloat16, 40, 100, {1, 17, 39, 40, 41, 139, 140, 141, 203, 1000});
    chunk128.exact_chunk_tokens = 128;
    all.push_back(chunk128);
    Case kivi_chunk = with(
        decode_case(testing::kivi_sliding_sink_layout("int8_kivi_sliding_sink_chunk192_2bit_d64_gqa1_page12", 2, 64, 2)),
        kInt8);
    kivi_chunk.tokens_per_split = 256;
    kivi_chunk.exact_chunk_tokens = 192;
    all.push_back(kivi_chunk);
    Case long_context = steps(make_case("int8_steps64x4_rtn_16k_2bit_d128_gqa4", QuantMethod::kRtn, 2, 128, 8), k4);
    long_context.lengths = {16411, 97};
    all.push_back(long_context);
  }
  {  // The general kernel forced (DecodeKernel::kGeneral) on layouts the
     // tensor-core kernels take by default, so that its quantized tokens'
     // every grouping runs on the GPU (by default it takes only kvquant's and
     // the tensor-core kernels' exact ranges): KIVI's per-channel keys in
     // groups of 32 tokens with per-token values, rtn's groups of 32 channels
     // with outliers, at 2 bits (the batched loads of a tile's units).
    constexpr auto kGeneral = kernels::DecodeKernel::kGeneral;
    Case kivi = with(decode_case(testing::kivi_layout("general_kivi_2bit_d128_gqa4", 2, 128, 8)), kGeneral);
    kivi.tokens_per_split = 128;
    all.push_back(kivi);
    Case rtn = with(decode_case(testing::rtn_groups32_outliers_layout("general_rtn_groups32_outliers_2bit_d128_gqa4", 2,
                                                                      128, 8)),
                    kGeneral);
    rtn.tokens_per_split = 96;
    all.push_back(rtn);
  }
  {  // The lookup kernel (DecodeKernel::kLookup; the default's for kvquant,
     // whose cases above take it too): 4 bits at GQA 8 (its 8-head
     // instantiation) on head_dim 128; head_dim 64 at 2 bits, bf16 io, lengths
     // around its 32-token steps and a warp's run (the sink's token first);
     // and the general kernel forced on kvquant's layout, which the default
     // no longer takes to it.
    constexpr auto kLookup = kernels::DecodeKernel::kLookup;
    all.push_back(with(decode_case(testing::kvquant_layout("lookup_kvquant_4bit_d128_gqa8", 4, 128, 16)), kLookup));
    Case edges = with(decode_case(testing::kvquant_layout("lookup_kvquant_2bit_d64_gqa4_bf16io", 2, 64, 8)), kLookup,
                      ElementType::kBFloat16);
    edges.lengths = {1, 2, 32, 33, 34, 128, 129, 130, 131, 161, 1000};
    all.push_back(edges);
    all.push_back(
        with(decode_case(testing::kvquant_layout("general_kvquant_2bit_d128_gqa4", 2, 128, 8)), kernels::DecodeKernel::kGeneral));
    // A sink of 5 pre-RoPE keys (tokens past position 0, where RoPE is no
    // identity): the exact ranges beside the lookup kernel go to the
    // general kernel, which rotates them (the exact kernel does not).
    Case sink = decode_case(testing::kvquant_layout("lookup_kvquant_sink5_2bit_d128_gqa4", 2, 128, 8));
    sink.fit.sink_tokens = 5;
    sink.lengths = {1, 3, 5, 6, 40, 1031};
    all.push_back(sink);
    // Repeated tokens (the lookup kernel takes further passes where a head
    // holds more than 4 of a row's 12 entries; the general kernel puts the
    // outliers back into its dequantized tile).
    for (const auto kernel : {kLookup, kernels::DecodeKernel::kGeneral}) {
      const std::string name = std::string(kernel == kLookup ? "lookup" : "general") + "_kvquant_repeated_2bit_d128_gqa4";
      all.push_back(repeating_tokens(with(decode_case(testing::kvquant_layout(name, 2, 128, 8)), kernel), name,
                                     {41, 100, 1031, 4099}));
    }
  }
  {  // One 32K context (and a short sequence beside it): KVQuant, splits of 512.
    Case c = make_case("kvquant_32k_2bit_d128_gqa4", QuantMethod::kKvquant, 2, 128, 8);
    c.fit.outlier_fraction = 0.02;
    c.tokens_per_split = 512;
    c.lengths = {32771, 9};
    all.push_back(c);
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(Layouts, DecodeAttentionCuda, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Calls f with the DecodeParams of a small CPU cache of the case's layout
// (what the launcher decides from; nothing is launched).
template <typename F>
void with_layout_params(const Case& c, F&& f) {
  const RotaryEmbedding case_rope(RopeConfig{}, c.head_dim, at::kCPU);
  kernels::CacheOptions options;
  options.page_size = c.page_size;
  options.max_sequences = 1;
  options.max_context = 64;
  options.element = c.element;
  const kernels::QuantizedKVCache cache(testing::fitted_decode_config(c, case_rope), testing::decode_dimensions(c),
                                        options);
  f(cache.decode_params(0));
}

// with_layout_params with the case's batch: its sequences and longest
// length (what the plan's splits and waves follow).
template <typename F>
void with_case_batch_params(const Case& c, F&& f) {
  with_layout_params(c, [&](kernels::DecodeParams params) {
    params.batch.count = static_cast<int32_t>(c.lengths.size());
    params.batch.max_length = *std::max_element(c.lengths.begin(), c.lengths.end());
    f(params);
  });
}

// On any machine (no GPU needed): the int8 cases are layouts the 8-bit
// integer kernel reads, the default takes it wherever it reads a layout (at
// 2 and 4 bits), and the layouts it does not read (kvquant's non-uniform
// pre-RoPE keys, rtn's per-token groups of 32 key channels, KIVI's keys with
// all-heads values) are refused by its test, so that they run the bf16 or
// the general kernel.
TEST(DecodeAttentionCudaInt8Layouts, TheInt8CasesAndOnlyThoseTheKernelReads) {
  int int8_cases = 0;
  for (const Case& c : cases()) {
    with_layout_params(c, [&](const kernels::DecodeParams& params) {
      const bool reads = kernels::int8_decode_supported(params);
      if (c.kernel == kernels::DecodeKernel::kInt8TensorCores) {
        EXPECT_TRUE(reads) << c.name;
        ++int8_cases;
      }
      const bool expected = c.name.rfind("int8_", 0) == 0 || c.name == "int2rot_rotated_2bit_d128_gqa8" ||
                            c.name == "rtn_2bit_d128_gqa1" || c.name == "kivi_2bit_d128_gqa4" ||
                            c.name == "kivi_sliding_sink_4bit_d64_gqa1_page12" ||
                            c.name == "kivi_4bit_d128_gqa8_page64_fp32" || c.name == "int2rot_4bit_d64_gqa4_page12" ||
                            c.name == "general_kivi_2bit_d128_gqa4" || c.name == "int2rot_window_fp32_rows_4bit_d128_gqa8" ||
                            c.name == "int2rot_window_bf16_rows_4bit_d128_gqa8";
      EXPECT_EQ(reads, expected) << c.name;
    });
  }
  EXPECT_EQ(int8_cases, 21);
}

// On any machine: the lookup kernel reads kvquant's layouts (keys per
// channel offline, pre-RoPE on a grid, values of one group per row: all
// heads, or per-head with tau outliers) and none of the others (per-token
// or per-channel-token keys).
TEST(DecodeAttentionCudaLookupLayouts, TheLookupKernelReadsKvquantsLayouts) {
  int lookup_cases = 0;
  for (const Case& c : cases()) {
    with_layout_params(c, [&](const kernels::DecodeParams& params) {
      const bool reads = kernels::lookup_decode_supported(params);
      EXPECT_EQ(reads, c.fit.method == QuantMethod::kKvquant) << c.name;
      if (c.kernel == kernels::DecodeKernel::kLookup) {
        EXPECT_TRUE(reads) << c.name;
        ++lookup_cases;
      }
    });
  }
  EXPECT_EQ(lookup_cases, 3);
}

// On any machine: the 64-token steps read the int8 layouts of one scale
// group per key and value row, without outliers, of at most 4 query heads
// per KV head, and nothing else; a request for them elsewhere is refused
// before anything reaches the device, in one line.
TEST(DecodeAttentionCudaInt8Layouts, WideStepsReadOneGroupPerRowWithoutOutliersAndRefuseTheRest) {
  int wide_cases = 0;
  for (const Case& c : cases()) {
    with_layout_params(c, [&](kernels::DecodeParams params) {
      const bool reads = kernels::int8_wide_steps_supported(params);
      // GQA 8 (16 heads on 2) needs the unpacked kernel, KIVI's values and
      // rtn's groups of 32 channels more than one group per row, kvquant
      // non-uniform pre-RoPE keys; the int2-rot window layouts and rtn's one
      // group per row are read unless they carry outliers.
      const bool expected = c.name.rfind("int8_steps64", 0) == 0 || c.name == "int8_rtn_2bit_d128_gqa1" ||
                            c.name == "int8_rtn_4bit_d128_gqa4" || c.name == "int8_rtn_16k_2bit_d128_gqa4" ||
                            c.name == "rtn_2bit_d128_gqa1" || c.name == "int2rot_4bit_d64_gqa4_page12";
      EXPECT_EQ(reads, expected) << c.name;
      if (c.int8_steps != kernels::Int8Steps::kAuto) {
        EXPECT_TRUE(reads) << c.name;
        ++wide_cases;
      }
      if (reads) return;
      params.int8_steps = kernels::Int8Steps::kSteps64Stages4;
      try {
        kernels::launch_decode_attention(params, nullptr);
        ADD_FAILURE() << c.name << ": 64-token steps were accepted";
      } catch (const std::invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("int8_steps of 64 tokens"), std::string::npos) << e.what();
      }
    });
  }
  EXPECT_EQ(wide_cases, 10);
}

// The default's plan of the case's layout (params from with_layout_params)
// with the case's kernel and int8 steps, on the H200's 132 multiprocessors
// (the residency questions ask the device).
kernels::DecodePlan case_plan(const Case& c, kernels::DecodeParams& params) {
  params.kernel = c.kernel;
  params.int8_steps = c.int8_steps;
  return kernels::plan_decode_attention(params, 132);
}

// On the GPU: the merge takes four query heads a block where the output is
// rotated back (int2-rot's GQA 4 and 8) and its blocks are one-group, one
// head elsewhere (split_plan.h's merge_heads, tested on the CPU, wired into
// the plan), so that the int2-rot cases above check both merges.
TEST(DecodeAttentionCudaPlan, TheRotatedMergeTakesFourHeadsABlock) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  int grouped = 0;
  for (const Case& c : cases()) {
    with_layout_params(c, [&](kernels::DecodeParams params) {
      const kernels::DecodePlan plan = case_plan(c, params);
      const bool rotated = params.value_rotation.kind == kernels::RotationKind::kMatrix;
      const int64_t group = params.num_heads / params.key_cache.layout.spec.kv_heads;
      EXPECT_EQ(plan.merge_heads, rotated && !plan.wide_merge && group % 4 == 0 ? 4 : 1) << c.name;
      if (plan.merge_heads == 4) ++grouped;
    });
  }
  EXPECT_GE(grouped, 1);
}

// On the GPU: the int8 kernel's splits merge in thread-block clusters
// (kernels/cluster_merge.cuh) exactly where split_plan.h's rule allows it
// (no exact ranges, no rotation, at most 8 splits, no added wave), so that
// the cases above check both merges: among the clustered, the 64-token
// steps' edges case, whose length-1 sequences leave splits empty inside
// a cluster; the 16K context's merge kernel.
TEST(DecodeAttentionCudaPlan, TheInt8SplitsMergeInClustersWithoutExactRangesOrRotations) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  int clustered = 0, merged = 0;
  for (const Case& c : cases()) {
    with_case_batch_params(c, [&](kernels::DecodeParams params) {
      const kernels::DecodePlan plan = case_plan(c, params);
      const bool rotated = params.key_rotation.kind == kernels::RotationKind::kMatrix ||
                           params.value_rotation.kind == kernels::RotationKind::kMatrix;
      if (!kernels::cluster_merge_applies(plan.int8, plan.exact_splits, rotated, plan.splits, 8)) {
        EXPECT_FALSE(plan.cluster_merge) << c.name;
      }
      if (c.name == "int8_steps64x4_rtn_4bit_d64_gqa1_page12_bf16io") EXPECT_TRUE(plan.cluster_merge) << c.name;
      if (c.name == "int8_steps64x4_rtn_16k_2bit_d128_gqa4") EXPECT_FALSE(plan.cluster_merge) << c.name;
      if (plan.int8) ++(plan.cluster_merge ? clustered : merged);
    });
  }
  EXPECT_GE(clustered, 1);
  EXPECT_GE(merged, 1);
}

// On the GPU: DecodeParams::rotate_before_exact_blocks changes where the
// exact blocks launch, never the splits: where they are few (their slots
// kept) and the keys have a matrix rotation, the queries are rotated first
// and the exact blocks launch behind the int8 kernel, with the same splits
// and states as when they launch first; elsewhere the plan is the same.
TEST(DecodeAttentionCudaPlan, TheRotationBeforeTheExactBlocksKeepsTheirSlotsAndSplits) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  int moved = 0, unchanged = 0;
  for (const Case& c : cases()) {
    with_case_batch_params(c, [&](kernels::DecodeParams params) {
      params.rotate_before_exact_blocks = false;
      const kernels::DecodePlan first = case_plan(c, params);
      params.rotate_before_exact_blocks = true;
      const kernels::DecodePlan behind = case_plan(c, params);
      EXPECT_EQ(behind.splits, first.splits) << c.name;
      EXPECT_EQ(behind.tokens_per_split, first.tokens_per_split) << c.name;
      EXPECT_EQ(behind.exact_splits, first.exact_splits) << c.name;
      EXPECT_EQ(behind.states, first.states) << c.name;
      EXPECT_EQ(behind.exact_slots_reserved, first.exact_slots_reserved) << c.name;
      EXPECT_EQ(first.exact_first, first.exact_slots_reserved) << c.name;
      if (first.exact_first && params.key_rotation.kind == kernels::RotationKind::kMatrix) {
        EXPECT_FALSE(behind.exact_first) << c.name;
        EXPECT_TRUE(behind.rotate_queries_first) << c.name;
        ++moved;
      } else {
        EXPECT_EQ(behind.exact_first, first.exact_first) << c.name;
        EXPECT_EQ(behind.rotate_queries_first, first.rotate_queries_first) << c.name;
        ++unchanged;
      }
    });
  }
  EXPECT_GE(moved, 2);
  EXPECT_GE(unchanged, 1);
}

// On the GPU: a decoding step's append joins the query rotation's kernel
// (StepAppendHost::kRotateQueries) only where that kernel, with its second
// block per (KV head, sequence), runs every block at once: two blocks per
// (KV head, sequence) against the device's multiprocessors times the blocks
// the step variant's occupancy allows each. The same plan on one
// multiprocessor fewer than it needs says no.
TEST(DecodeAttentionCudaPlan, TheRotationTakesTheStepOnlyInOneWave) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  int checked = 0;
  for (const Case& c : cases()) {
    with_case_batch_params(c, [&](kernels::DecodeParams params) {
      const kernels::DecodePlan plan = case_plan(c, params);
      if (!plan.rotate_queries_first) EXPECT_FALSE(plan.rotation_step_in_one_wave) << c.name;
      kernels::DecodeParams exact_first = params;  // the exact blocks first where they are few
      exact_first.rotate_before_exact_blocks = false;
      const kernels::DecodePlan first = case_plan(c, exact_first);
      if (!first.rotate_queries_first) EXPECT_FALSE(first.rotation_step_in_one_wave) << c.name;
      if (params.key_rotation.kind != kernels::RotationKind::kMatrix || !plan.tensor_cores) return;
      const int per_multiprocessor = kernels::rotate_queries_step_blocks_per_multiprocessor(params);
      ASSERT_GE(per_multiprocessor, 1) << c.name;
      const int64_t blocks = int64_t{2} * params.key_cache.layout.spec.kv_heads * params.batch.count;
      const auto needed = static_cast<int>((blocks + per_multiprocessor - 1) / per_multiprocessor);
      // (So few multiprocessors leave the exact blocks' slots unreserved,
      // so the queries are rotated first whatever rotate_before_exact_blocks
      // says.)
      const kernels::DecodePlan fits = kernels::plan_decode_attention(params, needed);
      ASSERT_TRUE(fits.rotate_queries_first) << c.name << " on " << needed;
      EXPECT_TRUE(fits.rotation_step_in_one_wave) << c.name << " on " << needed;
      if (needed > 1) {
        const kernels::DecodePlan short_of_one = kernels::plan_decode_attention(params, needed - 1);
        ASSERT_TRUE(short_of_one.rotate_queries_first) << c.name << " on " << needed - 1;
        EXPECT_FALSE(short_of_one.rotation_step_in_one_wave) << c.name << " on " << needed - 1;
        ++checked;
      }
    });
  }
  EXPECT_GE(checked, 3);
}

TEST(DecodeAttentionCudaPlan, TheExactKernelTakesRangesExactInBothTensors) {
  // decode_exact_kernel takes the exact ranges where keys and values
  // quantize the same tokens (int2-rot's sink and window); KIVI's
  // block-flushed keys with sliding values leave tokens quantized in one
  // tensor only, which the general kernel reads.
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  int exact_kernel = 0, general = 0;
  for (const Case& c : cases()) {
    with_layout_params(c, [&](kernels::DecodeParams params) {
      const kernels::DecodePlan plan = case_plan(c, params);
      // The queries of a matrix key rotation are rotated once for the call
      // wherever tensor cores read the layout and the exact blocks do not
      // launch first.
      EXPECT_EQ(plan.rotate_queries_first, plan.tensor_cores && !plan.exact_first &&
                                               params.key_rotation.kind == kernels::RotationKind::kMatrix)
          << c.name;
      if (!(plan.tensor_cores || plan.lookup) || plan.exact_splits == 0) {
        EXPECT_FALSE(plan.exact_kernel) << c.name;
        return;
      }
      const kernels::TensorPageLayout& keys = params.key_cache.layout;
      const bool same = kernels::same_quantized_ranges(keys.spec, params.value_cache.layout.spec);
      const bool rotated_by_rope = params.keys_pre_rope && (keys.spec.sink_tokens > 1 || keys.ring_capacity > 0);
      EXPECT_EQ(plan.exact_kernel, same && !rotated_by_rope) << c.name;
      if (c.name == "lookup_kvquant_sink5_2bit_d128_gqa4") {
        EXPECT_TRUE(plan.lookup && plan.exact_splits > 0 && !plan.exact_kernel) << c.name;
      }
      if (plan.int8 && c.name.find("int2rot") != std::string::npos) EXPECT_TRUE(plan.exact_kernel) << c.name;
      if (c.name.rfind("int8_kivi_sliding_sink", 0) == 0) EXPECT_FALSE(plan.exact_kernel) << c.name;
      ++(plan.exact_kernel ? exact_kernel : general);
    });
  }
  EXPECT_GE(exact_kernel, 3);
  EXPECT_GE(general, 1);
}

// On the GPU (the plan asks the device for its residency): the exact
// blocks per (sequence, KV head) follow exact_chunk_tokens: int2-rot's sink
// of 64 and window of 256 take 5 blocks of 64, 3 of 128 (the default), 2 of
// 256 or of 320.
TEST(DecodeAttentionCudaPlan, ExactChunksSetTheExactBlocks) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  for (const Case& c : cases()) {
    if (c.name != "int8_steps64x4_int2rot_rotated_chunk256_2bit_d128_gqa4") continue;
    with_layout_params(c, [&](kernels::DecodeParams params) {
      params.batch.count = 8;
      params.batch.max_length = 32768;
      ASSERT_EQ(params.key_cache.layout.spec.sink_tokens, 64);
      ASSERT_EQ(params.key_cache.layout.ring_capacity, 256);
      for (const auto& [chunk, blocks] : {std::pair{0, 3}, std::pair{64, 5}, std::pair{128, 3}, std::pair{256, 2},
                                          std::pair{320, 2}}) {
        params.exact_chunk_tokens = chunk;
        const kernels::DecodePlan plan = kernels::plan_decode_attention(params, 132);
        EXPECT_EQ(plan.exact_chunk, chunk == 0 ? 128 : chunk);
        EXPECT_EQ(plan.exact_splits, blocks) << chunk;
        EXPECT_EQ(plan.states, plan.splits + blocks) << chunk;
      }
    });
    return;
  }
  ADD_FAILURE() << "the chunk256 case is gone";
}

// exact_chunk_tokens other than 0 or a positive multiple of 64 is refused
// in one line naming the field, before anything reaches the device.
TEST(DecodeAttentionCudaRefusals, ExactChunksAreMultiplesOf64) {
  const Case c = cases().front();
  with_layout_params(c, [&](kernels::DecodeParams params) {
    for (const int32_t chunk : {-64, 100}) {
      params.exact_chunk_tokens = chunk;
      try {
        kernels::launch_decode_attention(params, nullptr);
        ADD_FAILURE() << "exact_chunk_tokens " << chunk << " was accepted";
      } catch (const std::invalid_argument& e) {
        EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("exact_chunk_tokens " + std::to_string(chunk)), std::string::npos)
            << e.what();
      }
    }
  });
}

// A matrix rotation whose matrix is null or not 16-byte aligned (the merge
// stages R_v by 16-byte copies) is refused in one line, before anything
// reaches the device.
TEST(DecodeAttentionCudaRefusals, MatrixRotationsAreNonNullAndAligned) {
  for (const Case& c : cases()) {
    if (c.name != "int2rot_rotated_2bit_d128_gqa8") continue;
    with_layout_params(c, [&](kernels::DecodeParams params) {
      const float* aligned = params.value_rotation.matrix;
      for (const float* matrix : {static_cast<const float*>(nullptr), aligned + 1}) {
        for (const bool keys : {true, false}) {
          ASSERT_EQ((keys ? params.key_rotation : params.value_rotation).kind, kernels::RotationKind::kMatrix);
          kernels::DecodeParams bad = params;
          (keys ? bad.key_rotation : bad.value_rotation).matrix = matrix;
          try {
            kernels::launch_decode_attention(bad, nullptr);
            ADD_FAILURE() << (keys ? "a key" : "a value") << " matrix at " << matrix << " was accepted";
          } catch (const std::invalid_argument& e) {
            EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("16-byte aligned"), std::string::npos) << e.what();
          }
        }
      }
    });
    return;
  }
  ADD_FAILURE() << "the int2rot_rotated case is gone";
}

TEST(DecodeAttentionCudaRefusals, BadParamsAreOneLine) {
  kernels::DecodeParams p;
  p.key_cache.layout.spec.head_dim = p.value_cache.layout.spec.head_dim = 96;
  try {
    kernels::launch_decode_attention(p, nullptr);
    ADD_FAILURE() << "head_dim 96 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("head_dim 96"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvforge
