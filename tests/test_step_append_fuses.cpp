// step_append_host (kernels/decode_attention_launch.h): which decoding
// steps the CUDA launcher runs with the append inside the decode's launch
// (the int8 kernel's for rtn's layout, the query rotation's for int2-rot's),
// and which it leaves to the append kernel. A wrong answer stores a token the kernel cannot store or attends
// over rows nobody appended yet, so every condition is taken away one at a
// time from a step that fuses. The params are the ones
// QuantizedKVCache::decode_step hands its backend (captured on the CPU
// reference); the plan is set by hand. Host code only: runs without a GPU.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "formats/quantizer_config.h"
#include "kernels/append_launch.h"
#include "kernels/cpu_reference.h"
#include "kernels/decode_attention_launch.h"
#include "kernels/quantized_kv_cache.h"
#include "tests/hooked_cpu_backend.h"

namespace kvforge {
namespace {

using kernels::AppendParams;
using kernels::DecodeParams;
using kernels::DecodePlan;
using kernels::StepAppendHost;

QuantizerConfig rtn(int64_t sink, int64_t window) {
  QuantizerConfig c;
  c.name = "rtn";
  c.settings.method = QuantMethod::kRtn;
  c.settings.keys = {Grouping::kPerToken, 64};
  c.settings.values = {Grouping::kPerToken, 64};
  c.settings.sink_tokens = sink;
  c.settings.residual_tokens = window;
  c.layers.resize(1);
  return c;
}

// The params of one decoding step of `sequences` sequences (after a
// prefill of 20 tokens each), as decode_step passes them to its backend;
// `check` runs while the cache (and so every pointer) is alive.
void with_step_params(const QuantizerConfig& config, int sequences,
                      const std::function<void(const AppendParams&, const DecodeParams&)>& check) {
  kernels::ModelDimensions dims;
  dims.num_layers = 1;
  dims.num_heads = 8;
  dims.num_kv_heads = 2;
  dims.head_dim = 64;
  kernels::CacheOptions options;
  options.max_sequences = sequences;
  options.max_context = 64;
  auto hooked = std::make_unique<testing::HookedCpuBackend>();
  testing::HookedCpuBackend& backend = *hooked;
  kernels::QuantizedKVCache cache(config, dims, options, std::move(hooked));
  std::optional<AppendParams> append;
  std::optional<DecodeParams> decode;
  backend.before_step = [&](const AppendParams& a, const DecodeParams& d) {
    append = a;
    decode = d;
  };
  kernels::AppendBatch batch;
  for (int s = 0; s < sequences; ++s) {
    batch.sequences.push_back(cache.add_sequence());
    batch.positions.push_back(0);
    batch.tokens.push_back(20);
  }
  std::vector<float> rows(static_cast<size_t>(20 * sequences * 2 * 64));
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i % 17) * 0.25f - 2.0f;
  batch.keys = batch.values = rows.data();
  cache.append(0, batch);
  for (int s = 0; s < sequences; ++s) {
    batch.positions[static_cast<size_t>(s)] = 20;
    batch.tokens[static_cast<size_t>(s)] = 1;
  }
  const std::vector<float> queries(static_cast<size_t>(sequences * 8 * 64), 0.5f);
  std::vector<float> output(queries.size());
  cache.decode_step(0, batch, queries.data(), output.data());
  ASSERT_TRUE(append.has_value() && decode.has_value()) << "decode_step did not hand its backend one step";
  check(*append, *decode);
}

// The int8 kernel's 64-token steps over every token (one split of 256:
// the steps' 21 tokens and more): what fusing needs without a window.
DecodePlan int8_wide_plan() {
  DecodePlan plan;
  plan.tensor_cores = plan.int8 = true;
  plan.int8_steps = kernels::Int8Steps::kSteps64Stages4;
  plan.splits = 1;
  plan.tokens_per_split = 256;
  plan.states = 1;
  return plan;
}

// The same with the exact kernel's blocks over the sink and window.
DecodePlan with_exact_kernel(DecodePlan plan) {
  plan.exact_splits = 2;
  plan.exact_kernel = true;
  plan.states = plan.splits + plan.exact_splits;
  return plan;
}

TEST(StepAppendFuses, RtnStepsOnTheInt8WideStepsFuse) {
  for (const int sequences : {3, 40}) {  // inline arrays, and uploaded ones
    with_step_params(rtn(0, 0), sequences, [&](const AppendParams& a, const DecodeParams& d) {
      EXPECT_EQ(a.inline_arrays.count, sequences <= kernels::kInlineBatchEntries ? sequences : 0);
      EXPECT_EQ(kernels::step_append_host(a, d, int8_wide_plan()), StepAppendHost::kInt8Kernel) << sequences;
      DecodePlan three_stages = int8_wide_plan();
      three_stages.int8_steps = kernels::Int8Steps::kSteps64Stages3;
      EXPECT_NE(kernels::step_append_host(a, d, three_stages), StepAppendHost::kNone) << sequences << " sequences";
      // Splits that just reach the new tokens (the 21st of each sequence).
      DecodePlan just_enough = int8_wide_plan();
      just_enough.splits = 3;
      just_enough.tokens_per_split = 7;
      EXPECT_EQ(kernels::step_append_host(a, d, just_enough), StepAppendHost::kInt8Kernel) << sequences;
    });
  }
}

TEST(StepAppendFuses, EveryMissingConditionRunsTheAppendOnItsOwn) {
  with_step_params(rtn(0, 0), 3, [&](const AppendParams& a, const DecodeParams& d) {
    ASSERT_NE(kernels::step_append_host(a, d, int8_wide_plan()), StepAppendHost::kNone);
    using Change = std::function<void(AppendParams&, DecodeParams&, DecodePlan&)>;
    const auto refused = [&](const std::string& what, const Change& change) {
      AppendParams append = a;
      DecodeParams decode = d;
      DecodePlan plan = int8_wide_plan();
      change(append, decode, plan);
      EXPECT_EQ(kernels::step_append_host(append, decode, plan), StepAppendHost::kNone) << what;
    };
    // The plan: another kernel, the 32-token steps, exact ranges beside.
    refused("bf16 tensor cores", [](AppendParams&, DecodeParams&, DecodePlan& p) { p.int8 = false; });
    refused("lookup kernel", [](AppendParams&, DecodeParams&, DecodePlan& p) {
      p.int8 = p.tensor_cores = false;
      p.lookup = true;
    });
    refused("32-token steps",
            [](AppendParams&, DecodeParams&, DecodePlan& p) { p.int8_steps = kernels::Int8Steps::kSteps32; });
    refused("exact ranges", [](AppendParams&, DecodeParams&, DecodePlan& p) { p.exact_splits = 1; });
    refused("no tensor-core kernel", [](AppendParams&, DecodeParams&, DecodePlan& p) { p.tensor_cores = false; });
    refused("the lookup kernel's flag", [](AppendParams&, DecodeParams&, DecodePlan& p) { p.lookup = true; });
    // A plan whose splits end before the new tokens (one kept from shorter
    // contexts): no warp's run would end at them.
    refused("splits short of the tokens", [](AppendParams&, DecodeParams&, DecodePlan& p) { p.tokens_per_split = 20; });
    refused("two splits short of the tokens", [](AppendParams&, DecodeParams&, DecodePlan& p) {
      p.splits = 2;
      p.tokens_per_split = 10;
    });
    refused("the append's page table another", [](AppendParams& a, DecodeParams&, DecodePlan&) { a.page_table += 1; });
    // The decode's layouts not the append's (the appending kernels take the
    // decode's).
    refused("the decode's key bits", [](AppendParams&, DecodeParams& d, DecodePlan&) { d.key_cache.layout.spec.bits = 4; });
    refused("the decode's value element", [](AppendParams&, DecodeParams& d, DecodePlan&) {
      d.value_cache.layout.spec.element = kernels::ElementType::kBFloat16;
    });
    // The append: not the token-parallel kernel's, rotated, outliers.
    refused("per-sequence append kernel",
            [](AppendParams& a, DecodeParams&, DecodePlan&) { a.kernel = kernels::AppendKernel::kPerSequence; });
    alignas(16) static const float matrix[2 * 64 * 64] = {};
    refused("key rotation", [](AppendParams& a, DecodeParams&, DecodePlan&) {
      a.key_rotation.kind = kernels::RotationKind::kMatrix;
      a.key_rotation.matrix = matrix;
    });
    refused("value rotation", [](AppendParams& a, DecodeParams&, DecodePlan&) {
      a.value_rotation.kind = kernels::RotationKind::kMatrix;
      a.value_rotation.matrix = matrix;
    });
    refused("key outliers", [](AppendParams& a, DecodeParams&, DecodePlan&) {
      a.key_quantization.outliers = kernels::OutlierSelection::kTokenTau;
    });
    // Other pools or page table than the decode's.
    refused("other key pages", [](AppendParams& a, DecodeParams&, DecodePlan&) { a.key_cache.pages += 1; });
    refused("other value pages", [](AppendParams& a, DecodeParams&, DecodePlan&) { a.value_cache.pages += 1; });
    refused("other page table", [](AppendParams& a, DecodeParams&, DecodePlan&) { a.batch.page_table += 1; });
    // Not one token per entry, in the decode's order, at its lengths.
    refused("a token more", [](AppendParams& a, DecodeParams&, DecodePlan&) {
      a.rows += 1;
      a.inline_arrays.token_offsets[a.inline_arrays.count] += 1;
    });
    refused("two tokens and none",
            [](AppendParams& a, DecodeParams&, DecodePlan&) { a.inline_arrays.token_offsets[1] = 2; });
    refused("an entry fewer", [](AppendParams& a, DecodeParams&, DecodePlan&) {
      a.batch.count -= 1;
      a.inline_arrays.count -= 1;
      a.rows -= 1;
    });
    refused("slots swapped", [](AppendParams& a, DecodeParams&, DecodePlan&) {
      std::swap(a.inline_arrays.slots[0], a.inline_arrays.slots[1]);
    });
    refused("a length off", [](AppendParams&, DecodeParams& d, DecodePlan&) { d.inline_arrays.lengths[2] += 1; });
    refused("inline arrays on one side",
            [](AppendParams&, DecodeParams& d, DecodePlan&) { d.inline_arrays.count = 0; });
  });
}

// Unrotated, a sink or a window in either kind: the token is read from
// exact rows (by the exact ranges' kernels), never from the int8 kernel's
// codes, and no query rotation runs first: the append runs on its own,
// whatever the plan (the exact kernel's blocks hosting it were measured
// slower than two launches, bench/README.md).
TEST(StepAppendFuses, ASinkOrWindowLeavesTheAppendOnItsOwn) {
  for (const int64_t sink : {0, 4}) {
    with_step_params(rtn(sink, 8), 3, [&](const AppendParams& a, const DecodeParams& d) {
      EXPECT_EQ(kernels::step_append_host(a, d, with_exact_kernel(int8_wide_plan())), StepAppendHost::kNone)
          << "sink " << sink;
      DecodePlan steps32 = with_exact_kernel(int8_wide_plan());
      steps32.int8_steps = kernels::Int8Steps::kSteps32;
      EXPECT_EQ(kernels::step_append_host(a, d, steps32), StepAppendHost::kNone) << "sink " << sink;
      DecodePlan lookup = with_exact_kernel(DecodePlan{});
      lookup.lookup = true;
      EXPECT_EQ(kernels::step_append_host(a, d, lookup), StepAppendHost::kNone) << "sink " << sink;
      EXPECT_EQ(kernels::step_append_host(a, d, int8_wide_plan()), StepAppendHost::kNone) << "sink " << sink;
      DecodePlan rotation_first = with_exact_kernel(int8_wide_plan());  // no rotation: nothing to host it
      rotation_first.rotate_queries_first = true;
      EXPECT_EQ(kernels::step_append_host(a, d, rotation_first), StepAppendHost::kNone) << "sink " << sink;
    });
  }
  with_step_params(rtn(4, 0), 3, [&](const AppendParams& a, const DecodeParams& d) {
    EXPECT_EQ(kernels::step_append_host(a, d, int8_wide_plan()), StepAppendHost::kNone) << "sink alone";
    EXPECT_EQ(kernels::step_append_host(a, d, with_exact_kernel(int8_wide_plan())), StepAppendHost::kNone)
        << "sink alone";
  });
}

// int2-rot's steps (matrix rotations, the decode's own; a sink and a
// sliding window in both kinds): where the plan rotates the queries first,
// the query rotation's kernel appends the token (kRotateQueries), with the
// values' rotation a matrix or none. Every other rotated step runs the
// append on its own: a decode rotation that is not the append's (the rows
// would be stored in another basis than the one attended in), the token read
// from codes in this call (no window, or one flushed in blocks), or no
// query rotation launched first (the exact blocks first at batch 1, other
// kernels), or a rotation whose step blocks would take more than one wave
// (DecodePlan::rotation_step_in_one_wave).
TEST(StepAppendFuses, RotatedStepsWithAWindowFuseIntoTheQueryRotation) {
  alignas(16) static const float key_matrix[2 * 64 * 64] = {}, value_matrix[2 * 64 * 64] = {},
                                 other_matrix[2 * 64 * 64] = {};
  static const float centre[2 * 64] = {}, other_centre[2 * 64] = {};
  const auto rotated = [&](AppendParams& a, DecodeParams& d) {
    for (kernels::Rotation* r : {&a.key_rotation, &d.key_rotation}) {
      r->kind = kernels::RotationKind::kMatrix;
      r->matrix = key_matrix;
      r->centre = centre;
    }
    for (kernels::Rotation* r : {&a.value_rotation, &d.value_rotation}) {
      r->kind = kernels::RotationKind::kMatrix;
      r->matrix = value_matrix;
    }
  };
  DecodePlan rotation_first = with_exact_kernel(int8_wide_plan());
  rotation_first.rotate_queries_first = true;
  rotation_first.rotation_step_in_one_wave = true;
  for (const int sequences : {3, 40}) {  // inline arrays, and uploaded ones
    with_step_params(rtn(4, 16), sequences, [&](const AppendParams& a, const DecodeParams& d) {
      AppendParams append = a;
      DecodeParams decode = d;
      rotated(append, decode);
      EXPECT_EQ(kernels::step_append_host(append, decode, rotation_first), StepAppendHost::kRotateQueries)
          << sequences << " sequences";
      DecodePlan bf16 = rotation_first;  // the bf16 tensor-core kernel behind the rotation
      bf16.int8 = false;
      EXPECT_EQ(kernels::step_append_host(append, decode, bf16), StepAppendHost::kRotateQueries) << sequences;
      AppendParams keys_only = append;
      DecodeParams decode_keys_only = decode;
      keys_only.value_rotation = decode_keys_only.value_rotation = kernels::Rotation{};
      EXPECT_EQ(kernels::step_append_host(keys_only, decode_keys_only, rotation_first), StepAppendHost::kRotateQueries)
          << sequences << " sequences, values unrotated";
    });
  }
  with_step_params(rtn(4, 16), 3, [&](const AppendParams& a, const DecodeParams& d) {
    using Change = std::function<void(AppendParams&, DecodeParams&, DecodePlan&)>;
    const auto refused = [&](const std::string& what, const Change& change) {
      AppendParams append = a;
      DecodeParams decode = d;
      rotated(append, decode);
      DecodePlan plan = rotation_first;
      change(append, decode, plan);
      EXPECT_EQ(kernels::step_append_host(append, decode, plan), StepAppendHost::kNone) << what;
    };
    refused("no query rotation first (the exact blocks first)", [](AppendParams&, DecodeParams&, DecodePlan& p) {
      p.rotate_queries_first = false;
      p.exact_first = true;
    });
    refused("the rotation with the step's blocks past one wave",
            [](AppendParams&, DecodeParams&, DecodePlan& p) { p.rotation_step_in_one_wave = false; });
    refused("the lookup kernel", [](AppendParams&, DecodeParams&, DecodePlan& p) { p.lookup = true; });
    refused("no tensor-core kernel", [](AppendParams&, DecodeParams&, DecodePlan& p) { p.tensor_cores = false; });
    refused("the decode's key matrix another",
            [](AppendParams&, DecodeParams& d, DecodePlan&) { d.key_rotation.matrix = other_matrix; });
    refused("the decode's key centre another",
            [](AppendParams&, DecodeParams& d, DecodePlan&) { d.key_rotation.centre = other_centre; });
    refused("the decode's values unrotated",
            [](AppendParams&, DecodeParams& d, DecodePlan&) { d.value_rotation = kernels::Rotation{}; });
    refused("the append's values unrotated",
            [](AppendParams& a, DecodeParams&, DecodePlan&) { a.value_rotation = kernels::Rotation{}; });
    refused("the values rotated alone", [](AppendParams& a, DecodeParams& d, DecodePlan&) {
      a.key_rotation = d.key_rotation = kernels::Rotation{};
    });
    refused("the keys' window flushed in blocks", [](AppendParams& a, DecodeParams&, DecodePlan&) {
      a.key_cache.layout.spec.window_rule = kernels::WindowRule::kBlockFlush;
    });
    refused("the values' window flushed in blocks", [](AppendParams& a, DecodeParams&, DecodePlan&) {
      a.value_cache.layout.spec.window_rule = kernels::WindowRule::kBlockFlush;
    });
    refused("a token more", [](AppendParams& a, DecodeParams&, DecodePlan&) {
      a.rows += 1;
      a.inline_arrays.token_offsets[a.inline_arrays.count] += 1;
    });
    refused("other value pages", [](AppendParams& a, DecodeParams&, DecodePlan&) { a.value_cache.pages += 1; });
    refused("a length off", [](AppendParams&, DecodeParams& d, DecodePlan&) { d.inline_arrays.lengths[1] += 1; });
    // The decode's layouts without the window the append's have: its
    // kernels would read the token's codes in this call.
    refused("the decode's keys without a window",
            [](AppendParams&, DecodeParams& d, DecodePlan&) { d.key_cache.layout.spec.residual_tokens = 0; });
    refused("the decode's values' window another",
            [](AppendParams&, DecodeParams& d, DecodePlan&) { d.value_cache.layout.spec.residual_tokens = 8; });
  });
  // A sink without a window: the token is read from codes in this call.
  with_step_params(rtn(4, 0), 3, [&](const AppendParams& a, const DecodeParams& d) {
    AppendParams append = a;
    DecodeParams decode = d;
    rotated(append, decode);
    EXPECT_EQ(kernels::step_append_host(append, decode, rotation_first), StepAppendHost::kNone) << "no window";
  });
}

// Inline arrays whose count is not the batch's, or past the arrays'
// kInlineBatchEntries, are refused by every reader before it reads them:
// the CUDA append's and decode's checks (host code: no GPU needed), the CPU
// reference's, and the fused step's choice (none).
TEST(StepAppendFuses, InlineCountsPastTheArraysOrTheBatchAreRefused) {
  with_step_params(rtn(0, 0), 3, [&](const AppendParams& a, const DecodeParams& d) {
    const auto expect_inline_refusal = [](const std::function<void()>& call, const std::string& what) {
      try {
        call();
        ADD_FAILURE() << what << ": accepted";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("inline"), std::string::npos) << what << ": " << e.what();
      }
    };
    for (const int32_t batch : {kernels::kInlineBatchEntries + 1, 3}) {
      const int32_t count = batch == 3 ? 2 : batch;  // past the arrays; not the batch's
      AppendParams append = a;
      append.batch.count = batch;
      append.rows = batch;
      append.inline_arrays.count = count;
      DecodeParams decode = d;
      decode.batch.count = batch;
      decode.inline_arrays.count = count;
      const std::string what = std::to_string(count) + " inline entries, a batch of " + std::to_string(batch);
      expect_inline_refusal([&] { kernels::check_append_params(append); }, "CUDA append " + what);
      expect_inline_refusal([&] { kernels::append_reference(append); }, "CPU append " + what);
      expect_inline_refusal([&] { kernels::launch_decode_attention(decode, nullptr); }, "CUDA decode " + what);
      expect_inline_refusal([&] { kernels::decode_attention_reference(decode); }, "CPU decode " + what);
      EXPECT_EQ(kernels::step_append_host(append, decode, int8_wide_plan()), StepAppendHost::kNone) << what;
    }
  });
}

}  // namespace
}  // namespace kvforge
