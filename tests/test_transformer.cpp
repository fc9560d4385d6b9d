// The libtorch forward pass against Hugging Face transformers (fixtures made
// by scripts/make_model_fixtures.py) and against analytic cases.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numbers>

#include "formats/hf_config.h"
#include "model/generation.h"
#include "model/kv_cache_policy.h"
#include "model/transformer.h"
#include "tests/cpu_kernel_family.h"
#include "tests/low_precision.h"
#include "tests/reference_tensors.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

using testing::fixtures_dir;
using testing::load_reference;
using testing::max_relative_error;
using testing::accumulated_error_bound;
using testing::argmax_check;
using testing::argmax_disagreements;
using testing::ArgmaxCheck;
using testing::RoundingCount;
using testing::unit_roundoff;

const ComputeTarget kCpuFp32{c10::Device(c10::kCPU), c10::kFloat};
const ComputeTarget kCpuBf16{c10::Device(c10::kCPU), c10::kBFloat16};
const ComputeTarget kCpuFp32Fused{c10::Device(c10::kCPU), c10::kFloat, AttentionBackend::kFused};

std::vector<int32_t> to_ids(const at::Tensor& row) {
  const at::Tensor ints = row.to(at::kInt).contiguous();
  return {ints.data_ptr<int32_t>(), ints.data_ptr<int32_t>() + ints.numel()};
}

// The reference decoding the issue asks for: a full forward pass over the
// growing sequence at every step, no cache.
std::vector<int32_t> greedy_without_cache(const Transformer& model, std::vector<int32_t> ids, int64_t steps) {
  std::vector<int32_t> generated;
  for (int64_t i = 0; i < steps; ++i) {
    const at::Tensor input = at::tensor(at::ArrayRef<int32_t>(ids), at::kInt).to(at::kLong).unsqueeze(0);
    const at::Tensor logits = model.forward(input);
    const auto next = static_cast<int32_t>(logits[0][-1].argmax().item<int64_t>());
    generated.push_back(next);
    ids.push_back(next);
  }
  return generated;
}

// The low-precision argmax equals the fp32 one at every position whose fp32
// top-2 margin exceeds 2 * relative_error * max |logit| (tests/low_precision.cpp),
// and those positions are at least a quarter of all: the check cannot pass by
// checking nothing.
void expect_argmax_agrees_where_checked(const at::Tensor& fp32_logits, const at::Tensor& logits,
                                        double relative_error) {
  const ArgmaxCheck check = argmax_check(fp32_logits, relative_error);
  const int64_t disagreements = argmax_disagreements(check, fp32_logits, logits);
  const double all_agree = fp32_logits.argmax(-1).eq(logits.argmax(-1)).to(at::kDouble).mean().item<double>();
  std::cout << "logit error bound " << relative_error << " * max|logit|; positions checked "
            << check.checked.sum().item<int64_t>() << "/" << check.checked.numel() << " (" << check.share()
            << "), bound on their margin: median " << check.bound.median().item<double>()
            << "; argmax agreement over all positions " << all_agree << "\n";
  EXPECT_GE(check.share(), 1.0 / 4) << "too few positions with a margin above the bound";
  EXPECT_EQ(disagreements, 0) << "argmax differs where the margin exceeds the bound";
}

class TinyModel : public ::testing::TestWithParam<std::string> {
 protected:
  std::filesystem::path model_dir() const { return fixtures_dir() / "models" / GetParam(); }
  std::map<std::string, at::Tensor> reference() const {
    return load_reference(fixtures_dir() / "reference" / (GetParam() + ".safetensors"));
  }
};

TEST_P(TinyModel, Fp32LogitsEqualTransformers) {
  c10::InferenceMode guard;
  const auto ref = reference();
  const Transformer model = Transformer::load(model_dir(), kCpuFp32);
  const at::Tensor logits = model.forward(ref.at("input_ids").to(at::kLong));
  ASSERT_EQ(logits.sizes(), ref.at("logits").sizes());
  EXPECT_LT(max_relative_error(logits, ref.at("logits")), 1e-4);
}

TEST_P(TinyModel, Fp32FusedAttentionEqualsTransformers) {
  c10::InferenceMode guard;
  const auto ref = reference();
  const Transformer model = Transformer::load(model_dir(), kCpuFp32Fused);
  const at::Tensor ids = ref.at("input_ids").to(at::kLong);
  EXPECT_LT(max_relative_error(model.forward(ids), ref.at("logits")), 1e-4);
  // Through the cache in two chunks: the fused path with an offset mask.
  KVCache cache = model.make_cache(ids.size(0), ids.size(1));
  const at::Tensor first = model.forward(ids.narrow(1, 0, 10), {.cache = &cache});
  const at::Tensor rest = model.forward(ids.narrow(1, 10, ids.size(1) - 10), {.cache = &cache});
  EXPECT_LT(max_relative_error(at::cat({first, rest}, 1), ref.at("logits")), 1e-4);
}

// bf16 against transformers' fp32 logits, at the positions where the fp32
// top-2 margin exceeds the bf16 error bound (tests/low_precision.cpp derives
// it); transformers' own bf16 argmax depends on the CPU's kernels, so it is
// no reference.
TEST_P(TinyModel, Bf16ArgmaxEqualsFp32WhereTheMarginExceedsTheBound) {
  KVFORGE_SKIP_IF_FORCED_CPU_FAMILY_UNAVAILABLE();
  c10::InferenceMode guard;
  const auto ref = reference();
  const Transformer model = Transformer::load(model_dir(), kCpuBf16);
  const at::Tensor fp32 = ref.at("logits").flatten(0, 1);
  const at::Tensor bf16 = model.forward(ref.at("input_ids").to(at::kLong)).flatten(0, 1);
  const RoundingCount roundings{model.config(), /*fp32_weights=*/true};
  const double bound = accumulated_error_bound(roundings.to_logits(), unit_roundoff(c10::kBFloat16));
  expect_argmax_agrees_where_checked(fp32, bf16, bound);
}

TEST_P(TinyModel, GreedyDecodingEqualsTransformersGenerate) {
  const auto ref = reference();
  const Transformer model = Transformer::load(model_dir(), kCpuFp32);
  const auto prompt = to_ids(ref.at("greedy_prompt")[0]);
  const auto expected = to_ids(ref.at("greedy_tokens")[0]);
  GenerationOptions options;
  options.max_new_tokens = static_cast<int64_t>(expected.size());
  EXPECT_EQ(greedy_generate(model, prompt, options).tokens, expected);
}

TEST_P(TinyModel, CachedDecodingEqualsFullForward) {
  c10::InferenceMode guard;
  const auto ref = reference();
  // Longer than the Mistral fixture's sliding window, so the window is
  // exercised both in the prompt and while decoding. With kFused, steps
  // over the cache take grouped_attention, whole windows SDPA.
  const auto prompt = to_ids(ref.at("input_ids")[0].narrow(0, 0, 11));
  for (const ComputeTarget& target : {kCpuFp32, kCpuFp32Fused}) {
    const Transformer model = Transformer::load(model_dir(), target);
    GenerationOptions options;
    options.max_new_tokens = 14;
    EXPECT_EQ(greedy_generate(model, prompt, options).tokens, greedy_without_cache(model, prompt, 14))
        << attention_label(target.attention);
  }
}

TEST_P(TinyModel, ChunkedPrefillThroughCacheEqualsOnePass) {
  c10::InferenceMode guard;
  const auto ref = reference();
  const at::Tensor ids = ref.at("input_ids").to(at::kLong);
  for (const ComputeTarget& target : {kCpuFp32, kCpuFp32Fused}) {
    const Transformer model = Transformer::load(model_dir(), target);
    KVCache cache = model.make_cache(ids.size(0), ids.size(1));
    const at::Tensor first = model.forward(ids.narrow(1, 0, 10), {.cache = &cache});
    const at::Tensor rest = model.forward(ids.narrow(1, 10, ids.size(1) - 10), {.cache = &cache});
    EXPECT_LT(max_relative_error(at::cat({first, rest}, 1), ref.at("logits")), 1e-4)
        << attention_label(target.attention);
  }
}

// Stores through a full-precision KVCache, records every block it is given,
// and returns the cache altered: keys zeroed at `zero_keys` and values
// scaled by `value_scale` at `scaled_values` (absolute positions, every
// layer), the stored cache left as it was.
class AlteringPolicy final : public KVCachePolicy {
 public:
  AlteringPolicy(KVCache inner, std::vector<int64_t> zero_keys, std::vector<int64_t> scaled_values,
                 double value_scale)
      : inner_(std::move(inner)),
        zero_keys_(std::move(zero_keys)),
        scaled_values_(std::move(scaled_values)),
        value_scale_(value_scale) {}

  int64_t length() const override { return inner_.length(); }
  CachedKeysValues append(const NewKeysValues& block) override {
    blocks.push_back({block.layer, block.position_start, block.keys_pre_rope.clone(), block.keys.clone(),
                      block.values.clone()});
    const CachedKeysValues stored = inner_.append(block);
    CachedKeysValues altered{stored.keys.clone(), stored.values.clone()};
    for (const int64_t p : zero_keys_) {
      if (p < altered.length()) altered.keys.select(2, p).zero_();
    }
    for (const int64_t p : scaled_values_) {
      if (p < altered.length()) altered.values.select(2, p).mul_(value_scale_);
    }
    return altered;
  }
  void commit(int64_t tokens) override {
    commits.push_back(tokens);
    inner_.commit(tokens);
  }
  void clear() override { inner_.clear(); }

  std::vector<NewKeysValues> blocks;
  std::vector<int64_t> commits;

 private:
  KVCache inner_;
  std::vector<int64_t> zero_keys_, scaled_values_;
  double value_scale_;
};

// Keeps keys before RoPE only (a KVCache handed the pre-RoPE keys) and
// rotates them on read-back with the model's RoPE at their absolute
// positions, as a policy quantizing pre-RoPE keys (KVQuant) must.
class PreRopePolicy final : public KVCachePolicy {
 public:
  PreRopePolicy(const Transformer& model, int64_t batch, int64_t capacity)
      : rope_(model.rope()), inner_(model.make_cache(batch, capacity)) {}

  int64_t length() const override { return inner_.length(); }
  CachedKeysValues append(const NewKeysValues& block) override {
    const CachedKeysValues stored =
        inner_.append({block.layer, block.position_start, block.keys_pre_rope, block.keys_pre_rope, block.values});
    const RopeTables tables = rope_.tables(0, stored.length(), stored.keys.scalar_type());
    return {RotaryEmbedding::apply(stored.keys, tables), stored.values};
  }
  void commit(int64_t tokens) override { inner_.commit(tokens); }
  void clear() override { inner_.clear(); }

 private:
  const RotaryEmbedding& rope_;
  KVCache inner_;
};

// Alters one layer's keys after RoPE and values [B, kv_heads, T, head_dim]
// over a whole sequence, in place.
using AlterKeysValues = std::function<void(at::Tensor& keys, at::Tensor& values)>;

// The logits of a tiny checkpoint in float64, written from the definitions
// (transformers' modeling code) and sharing nothing with Transformer but the
// RoPE inverse frequencies (Rope.InverseFrequenciesMatchFloat64Formulas):
// one pass over the whole sequence whose attention reads the keys and values
// `alter` made of the computed ones.
at::Tensor reference_logits_f64(const std::filesystem::path& model_dir, const at::Tensor& ids,
                                const AlterKeysValues& alter) {
  const ModelConfig c = load_model_config(model_dir);
  const auto weights = load_reference(model_dir / "model.safetensors");
  const auto get = [&weights](const std::string& name) { return weights.at(name).to(at::kDouble); };
  const auto norm = [&c](const at::Tensor& x, const at::Tensor& weight) {
    return weight * x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + c.rms_norm_eps);
  };
  const int64_t batch = ids.size(0), tokens = ids.size(1), d = c.head_dim;
  const at::Tensor angles = at::arange(tokens, at::kDouble).unsqueeze(1) *
                            rope_inverse_frequencies(c.rope, d).to(at::kDouble).unsqueeze(0);
  const at::Tensor cos = at::cat({angles.cos(), angles.cos()}, -1);
  const at::Tensor sin = at::cat({angles.sin(), angles.sin()}, -1);
  const auto rotate = [&](const at::Tensor& x) {
    return x * cos + at::cat({-x.narrow(-1, d / 2, d / 2), x.narrow(-1, 0, d / 2)}, -1) * sin;
  };
  const at::Tensor position = at::arange(tokens, at::kLong);
  const at::Tensor query_pos = position.unsqueeze(1), key_pos = position.unsqueeze(0);

  at::Tensor h = get("model.embed_tokens.weight").index_select(0, ids.flatten()).view({batch, tokens, -1});
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    const at::Tensor x = norm(h, get(p + "input_layernorm.weight"));
    const auto project = [&](const std::string& name, int64_t heads) {
      std::optional<at::Tensor> bias;
      if (c.attention_bias) bias = get(p + "self_attn." + name + "_proj.bias");
      at::Tensor y = at::linear(x, get(p + "self_attn." + name + "_proj.weight"), bias).view({batch, tokens, heads, d});
      if (c.qk_norm && name != "v") y = norm(y, get(p + "self_attn." + name + "_norm.weight"));
      return y.transpose(1, 2);
    };
    const at::Tensor q = rotate(project("q", c.num_heads));
    at::Tensor k = rotate(project("k", c.num_kv_heads));
    at::Tensor v = project("v", c.num_kv_heads);
    if (alter) alter(k, v);
    const int64_t group = c.num_heads / c.num_kv_heads;
    k = k.repeat_interleave(group, 1);
    v = v.repeat_interleave(group, 1);
    const int64_t window = c.layer_window.empty() ? 0 : c.layer_window[static_cast<size_t>(layer)];
    at::Tensor allowed = key_pos <= query_pos;
    if (window > 0) allowed = allowed.logical_and(query_pos - key_pos < window);
    const at::Tensor scores = (q.matmul(k.transpose(2, 3)) / std::sqrt(static_cast<double>(d)))
                                  .masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    const at::Tensor out = scores.softmax(-1).matmul(v).transpose(1, 2).reshape({batch, tokens, -1});
    h = h + at::linear(out, get(p + "self_attn.o_proj.weight"));
    const at::Tensor y = norm(h, get(p + "post_attention_layernorm.weight"));
    const at::Tensor gate = at::silu(at::linear(y, get(p + "mlp.gate_proj.weight")));
    h = h + at::linear(gate * at::linear(y, get(p + "mlp.up_proj.weight")), get(p + "mlp.down_proj.weight"));
  }
  h = norm(h, get("model.norm.weight"));
  return at::linear(h, get(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"));
}

// The model attends over what the cache policy returns: a policy returning
// an altered cache changes the logits exactly as attention over that altered
// cache, computed independently in float64, does.
TEST_P(TinyModel, AttentionReadsWhatTheCachePolicyReturns) {
  c10::InferenceMode guard;
  const auto ref = reference();
  const at::Tensor ids = ref.at("input_ids").to(at::kLong);
  const int64_t batch = ids.size(0), tokens = ids.size(1), prefill = 10;
  ASSERT_GT(tokens, 14);
  // Positions in the prefill and among the decoded tokens.
  const std::vector<int64_t> zero_keys{1, 6, 12}, scaled_values{0, 4, 11, 14};
  const double value_scale = -3.0;
  const AlterKeysValues alter = [&](at::Tensor& keys, at::Tensor& values) {
    for (const int64_t p : zero_keys) keys.select(2, p).zero_();
    for (const int64_t p : scaled_values) values.select(2, p).mul_(value_scale);
  };
  const at::Tensor plain = reference_logits_f64(model_dir(), ids, {}).to(at::kFloat);
  const at::Tensor expected = reference_logits_f64(model_dir(), ids, alter).to(at::kFloat);
  // The reference is transformers' model, and the alteration matters.
  EXPECT_LT(max_relative_error(plain, ref.at("logits")), 1e-4);
  const double change = max_relative_error(expected, plain);
  EXPECT_GT(change, 1e-2);

  for (const ComputeTarget& target : {kCpuFp32, kCpuFp32Fused}) {
    const Transformer model = Transformer::load(model_dir(), target);
    const int64_t layers = model.config().num_layers;
    AlteringPolicy policy(model.make_cache(batch, tokens), zero_keys, scaled_values, value_scale);
    // A prefill, then one token at a time (the decoding path).
    std::vector<at::Tensor> logits{model.forward(ids.narrow(1, 0, prefill), {.cache = &policy})};
    for (int64_t t = prefill; t < tokens; ++t) logits.push_back(model.forward(ids.narrow(1, t, 1), {.cache = &policy}));
    const at::Tensor altered = at::cat(logits, 1);
    EXPECT_LT(max_relative_error(altered, expected), 1e-4)
        << attention_label(target.attention) << " (the alteration moved the logits by " << change << ")";

    // What the policy was given: each pass's layers in order, at the
    // positions the pass continues from, keys before and after RoPE.
    const int64_t passes = 1 + tokens - prefill;
    ASSERT_EQ(static_cast<int64_t>(policy.blocks.size()), passes * layers);
    for (size_t i = 0; i < policy.blocks.size(); ++i) {
      const NewKeysValues& block = policy.blocks[i];
      const int64_t pass = static_cast<int64_t>(i) / layers;
      const int64_t start = pass == 0 ? 0 : prefill + pass - 1;
      const int64_t count = pass == 0 ? prefill : 1;
      EXPECT_EQ(block.layer, static_cast<int64_t>(i) % layers);
      EXPECT_EQ(block.position_start, start);
      const std::vector<int64_t> shape{batch, model.config().num_kv_heads, count, model.config().head_dim};
      EXPECT_EQ(block.keys_pre_rope.sizes(), at::IntArrayRef(shape));
      EXPECT_EQ(block.values.sizes(), at::IntArrayRef(shape));
      EXPECT_TRUE(block.keys.equal(
          RotaryEmbedding::apply(block.keys_pre_rope, model.rope().tables(start, count, at::kFloat))));
    }
    std::vector<int64_t> commits(static_cast<size_t>(passes), 1);
    commits[0] = prefill;
    EXPECT_EQ(policy.commits, commits);
  }
}

// Keys handed over before RoPE with their positions are enough to rebuild
// the cache: a policy rotating them on read-back decodes as the 16-bit one.
TEST_P(TinyModel, PolicyRotatingPreRopeKeysEqualsTheFullPrecisionCache) {
  c10::InferenceMode guard;
  const auto ref = reference();
  const at::Tensor ids = ref.at("input_ids").to(at::kLong);
  const auto prompt = to_ids(ref.at("input_ids")[0].narrow(0, 0, 11));
  for (const ComputeTarget& target : {kCpuFp32, kCpuFp32Fused}) {
    const Transformer model = Transformer::load(model_dir(), target);
    PreRopePolicy policy(model, ids.size(0), ids.size(1));
    const at::Tensor first = model.forward(ids.narrow(1, 0, 10), {.cache = &policy});
    const at::Tensor rest = model.forward(ids.narrow(1, 10, ids.size(1) - 10), {.cache = &policy});
    EXPECT_LT(max_relative_error(at::cat({first, rest}, 1), ref.at("logits")), 1e-4)
        << attention_label(target.attention);

    PreRopePolicy decoding(model, 1, 11 + 14);
    GenerationOptions options;
    options.max_new_tokens = 14;
    const auto expected = greedy_generate(model, prompt, options).tokens;
    options.cache = &decoding;
    EXPECT_EQ(greedy_generate(model, prompt, options).tokens, expected) << attention_label(target.attention);
  }
}

// A policy that attends itself (as the runtime kernels do): it stores the
// block in a full-precision KVCache and computes the block's attention in
// float64 by the definition (causal with the block's offset, the sliding
// window, grouped-query heads), independently of the model's attention code.
class AttendingPolicy final : public KVCachePolicy {
 public:
  AttendingPolicy(const Transformer& model, int64_t batch, int64_t capacity)
      : inner_(model.make_cache(batch, capacity)) {}
  int64_t length() const override { return inner_.length(); }
  CachedKeysValues append(const NewKeysValues&) override {
    throw std::logic_error("AttendingPolicy: the model should call append_and_attend");
  }
  bool attends() const override { return true; }
  at::Tensor append_and_attend(const NewKeysValues& block, const at::Tensor& queries, double scale,
                               int64_t window) override {
    ++calls;
    const CachedKeysValues cached = inner_.append(block);
    const at::Tensor k = cached.keys.to(at::kDouble), v = cached.values.to(at::kDouble);
    const at::Tensor q = queries.to(at::kDouble);
    const int64_t heads = q.size(1), group = heads / k.size(1), tokens = q.size(2), length = k.size(2);
    at::Tensor out = at::zeros(q.sizes(), q.options());
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t position = block.position_start + t;
        const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
        const at::Tensor keys = k.select(1, h / group).narrow(1, first, position + 1 - first);  // [B, n, D]
        const at::Tensor values = v.select(1, h / group).narrow(1, first, position + 1 - first);
        const at::Tensor scores = at::bmm(keys, q.select(1, h).narrow(1, t, 1).transpose(1, 2)) * scale;  // [B, n, 1]
        const at::Tensor p = at::softmax(scores, 1);
        out.select(1, h).narrow(1, t, 1).copy_(at::bmm(p.transpose(1, 2), values));
      }
    }
    EXPECT_LE(length, inner_.capacity());
    return out.to(queries.scalar_type());
  }
  void commit(int64_t tokens) override { inner_.commit(tokens); }
  void clear() override { inner_.clear(); }
  int64_t calls = 0;

 private:
  KVCache inner_;
};

TEST_P(TinyModel, APolicyThatAttendsItselfReplacesTheModelsAttention) {
  c10::InferenceMode guard;
  const auto ref = reference();
  const at::Tensor ids = ref.at("input_ids").to(at::kLong);
  const Transformer model = Transformer::load(model_dir(), kCpuFp32);
  AttendingPolicy policy(model, ids.size(0), ids.size(1));
  const at::Tensor first = model.forward(ids.narrow(1, 0, 10), {.cache = &policy});
  const at::Tensor rest = model.forward(ids.narrow(1, 10, ids.size(1) - 10), {.cache = &policy});
  EXPECT_LT(max_relative_error(at::cat({first, rest}, 1), ref.at("logits")), 1e-4);
  EXPECT_EQ(policy.calls, 2 * model.config().num_layers);
}

// A policy must return what attention can read.
TEST(KVCachePolicy, AWrongShapeIsAClearError) {
  class Short final : public KVCachePolicy {
   public:
    int64_t length() const override { return 0; }
    CachedKeysValues append(const NewKeysValues& block) override {
      return {block.keys.narrow(2, 0, 1), block.values.narrow(2, 0, 1)};
    }
    void commit(int64_t) override {}
    void clear() override {}
  } policy;
  c10::InferenceMode guard;
  const Transformer model = Transformer::load(fixtures_dir() / "models" / "llama3", kCpuFp32);
  const at::Tensor ids = at::zeros({1, 3}, at::kLong);
  EXPECT_THROW(model.forward(ids, {.cache = &policy}), std::logic_error);
}

INSTANTIATE_TEST_SUITE_P(Architectures, TinyModel,
                         ::testing::Values("llama3", "llama2_linear", "mistral", "qwen2", "qwen3"));

class PyLlama : public ::testing::Test {
 protected:
  static std::filesystem::path model_dir() { return testing::pyllama_dir(); }
};

TEST_F(PyLlama, Fp32LogitsEqualTransformers) {
  c10::InferenceMode guard;
  const auto ref = load_reference(fixtures_dir() / "reference" / "pyllama_fp32.safetensors");
  const Transformer model = Transformer::load(model_dir(), kCpuFp32);
  const at::Tensor logits = model.forward(ref.at("input_ids").to(at::kLong));
  const at::Tensor positions = ref.at("positions").to(at::kLong);
  EXPECT_LT(max_relative_error(logits.index_select(1, positions), ref.at("logits_at")), 1e-4);
  EXPECT_LT(max_relative_error(logits.logsumexp(-1), ref.at("logsumexp")), 1e-4);
  EXPECT_TRUE(logits.argmax(-1).equal(ref.at("argmax").to(at::kLong)));
}

// A whole 2048-token window of heldout.txt in bf16 and fp16 against
// kvforge's own fp32 forward of it (PyLlama.Fp32LogitsEqualTransformers
// checks that against transformers to 1e-4; here its argmax and top-2
// margins are checked against transformers' fp32 ones over the whole
// window). Bounds: tests/low_precision.cpp.
class PyLlamaLowPrecision : public PyLlama {
 protected:
  void SetUp() override { KVFORGE_SKIP_IF_FORCED_CPU_FAMILY_UNAVAILABLE(); }

  static void expect_within_bounds(c10::ScalarType dtype) {
    c10::InferenceMode guard;
    const auto ref = load_reference(fixtures_dir() / "reference" / "pyllama_bf16.safetensors");
    const at::Tensor ids = ref.at("input_ids").to(at::kLong);
    const Transformer fp32 = Transformer::load(model_dir(), kCpuFp32);
    const Transformer low = Transformer::load(model_dir(), {c10::Device(c10::kCPU), dtype});
    // The fp32 forward once per process: the bf16 and fp16 tests share it.
    static const at::Tensor hidden = fp32.hidden_states(ids)[0];
    static const at::Tensor logits = fp32.logits(hidden);
    const at::Tensor low_hidden = low.hidden_states(ids)[0].to(at::kFloat);
    // The fp32 reference against transformers': margins to the suite's fp32
    // tolerance 1e-4, and the argmax wherever the margin exceeds twice that
    // tolerance of the largest logit (elsewhere the kernels may break a tie).
    const auto top = std::get<0>(logits.topk(2, -1));
    const at::Tensor hf_margin = ref.at("top2_margin_fp32")[0];
    EXPECT_LT(max_relative_error(top.select(-1, 0) - top.select(-1, 1), hf_margin), 1e-4);
    const at::Tensor decided = hf_margin > 2 * 1e-4 * logits.abs().amax(-1);
    EXPECT_EQ(logits.argmax(-1).ne(ref.at("argmax_fp32")[0].to(at::kLong)).logical_and(decided).sum().item<int64_t>(), 0);
    EXPECT_GT(decided.to(at::kDouble).mean().item<double>(), 0.99);

    const RoundingCount roundings{fp32.config(), /*fp32_weights=*/false};  // a bf16 checkpoint
    const double u = unit_roundoff(dtype);
    // The final hidden state, position by position, relative to its norm.
    const at::Tensor hidden_error = (low_hidden - hidden).norm(2, -1) / hidden.norm(2, -1);
    const double hidden_bound = accumulated_error_bound(roundings.to_final_hidden(), u);
    std::cout << c10::toString(dtype) << ": final hidden state error " << hidden_error.max().item<double>() / u
              << " u, bound " << hidden_bound / u << " u\n";
    EXPECT_LT(hidden_error.max().item<double>(), hidden_bound);
    expect_argmax_agrees_where_checked(logits, low.logits(low_hidden.to(dtype)),
                                       accumulated_error_bound(roundings.to_logits(), u));
  }
};

TEST_F(PyLlamaLowPrecision, Bf16ArgmaxEqualsFp32OnAWholeWindowWhereTheMarginExceedsTheBound) {
  expect_within_bounds(c10::kBFloat16);
}

TEST_F(PyLlamaLowPrecision, Fp16ArgmaxEqualsFp32OnAWholeWindowWhereTheMarginExceedsTheBound) {
  expect_within_bounds(c10::kHalf);
}

TEST_F(PyLlama, GreedyGenerationEqualsTransformers) {
  const auto ref = nlohmann::json::parse(testing::read_file(fixtures_dir() / "reference" / "pyllama_greedy.json"));
  const Transformer model = Transformer::load(model_dir(), kCpuFp32);
  const auto& prompts = ref.is_array() ? ref : ref.at("prompts");
  ASSERT_FALSE(prompts.empty());
  for (const auto& case_json : prompts) {
    const auto prompt = case_json.at("prompt_ids").get<std::vector<int32_t>>();
    const auto expected = case_json.at("generated_ids").get<std::vector<int32_t>>();
    GenerationOptions options;
    options.max_new_tokens = static_cast<int64_t>(expected.size());
    EXPECT_EQ(greedy_generate(model, prompt, options).tokens, expected);
  }
}

// The same checks on a GPU; skipped where there is none.
class CudaTinyModel : public TinyModel {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaTinyModel, Fp32LogitsEqualTransformersWithBothBackends) {
  c10::InferenceMode guard;
  const auto ref = reference();
  for (const auto backend : {AttentionBackend::kEager, AttentionBackend::kFused}) {
    const Transformer model =
        Transformer::load(model_dir(), {c10::Device(c10::kCUDA), c10::kFloat, backend});
    const at::Tensor ids = ref.at("input_ids").to(at::kLong);
    EXPECT_LT(max_relative_error(model.forward(ids), ref.at("logits")), 1e-4) << attention_label(backend);
    KVCache cache = model.make_cache(ids.size(0), ids.size(1));
    const at::Tensor first = model.forward(ids.narrow(1, 0, 10), {.cache = &cache});
    const at::Tensor rest = model.forward(ids.narrow(1, 10, ids.size(1) - 10), {.cache = &cache});
    EXPECT_LT(max_relative_error(at::cat({first, rest}, 1), ref.at("logits")), 1e-4) << attention_label(backend);
  }
}

TEST_P(CudaTinyModel, CachedDecodingEqualsFullForward) {
  c10::InferenceMode guard;
  const auto ref = reference();
  const Transformer model =
      Transformer::load(model_dir(), {c10::Device(c10::kCUDA), c10::kFloat, AttentionBackend::kFused});
  const auto prompt = to_ids(ref.at("input_ids")[0].narrow(0, 0, 11));
  GenerationOptions options;
  options.max_new_tokens = 14;
  EXPECT_EQ(greedy_generate(model, prompt, options).tokens, greedy_without_cache(model, prompt, 14));
  EXPECT_EQ(greedy_generate(model, to_ids(ref.at("greedy_prompt")[0]), {.max_new_tokens = 12}).tokens,
            to_ids(ref.at("greedy_tokens")[0]));
}

INSTANTIATE_TEST_SUITE_P(Architectures, CudaTinyModel,
                         ::testing::Values("llama3", "llama2_linear", "mistral", "qwen2", "qwen3"));

// HF transformers' bf16 argmax on the same GPU (scripts/make_cuda_reference.py
// writes it on the GPU machine and points KVFORGE_HF_CUDA_REFERENCE at it).
TEST(CudaPyLlama, Bf16ArgmaxAgreesWithTransformersOnTheGpu) {
  const char* reference_path = std::getenv("KVFORGE_HF_CUDA_REFERENCE");
  if (!cuda_available() || reference_path == nullptr) {
    GTEST_SKIP() << "needs a GPU and KVFORGE_HF_CUDA_REFERENCE";
  }
  c10::InferenceMode guard;
  const auto ref = load_reference(reference_path);
  const at::Tensor ids = ref.at("input_ids").to(at::kLong);
  for (const auto backend : {AttentionBackend::kFused, AttentionBackend::kEager}) {
    const Transformer model =
        Transformer::load(testing::pyllama_dir(), {c10::Device(c10::kCUDA), c10::kBFloat16, backend});
    const at::Tensor argmax = model.forward(ids).argmax(-1).cpu();
    const auto& expected = ref.at(backend == AttentionBackend::kFused ? "argmax_sdpa" : "argmax_eager");
    const double agreement = argmax.eq(expected.to(at::kLong)).to(at::kDouble).mean().item<double>();
    std::cout << "bf16 argmax agreement with transformers (" << attention_label(backend) << ", "
              << argmax.numel() << " positions): " << agreement << "\n";
    EXPECT_GE(agreement, 0.995) << attention_label(backend);
  }
  const Transformer fp32 = Transformer::load(testing::pyllama_dir(), {c10::Device(c10::kCUDA), c10::kFloat,
                                                                     AttentionBackend::kFused});
  const at::Tensor logits = fp32.forward(ids.narrow(0, 0, 1)).cpu();
  EXPECT_LT(max_relative_error(logits.narrow(1, 0, 256), ref.at("logits_fp32_first256")), 1e-4);
}

TEST(AttentionMask, CausalWithOffsetAndWindow) {
  // Queries at positions 3 and 4 over 5 keys, window 2: each sees itself and
  // one key before it.
  const at::Tensor mask = attention_mask(3, 2, 5, 2, c10::Device(c10::kCPU));
  const at::Tensor expected = at::tensor({0, 0, 1, 1, 0, 0, 0, 0, 1, 1}).to(at::kBool).view({2, 5});
  EXPECT_TRUE(mask.equal(expected));
  const at::Tensor causal = attention_mask(0, 3, 3, 0, c10::Device(c10::kCPU));
  EXPECT_TRUE(causal.equal(at::ones({3, 3}, at::kBool).tril()));
}

TEST(Rope, InverseFrequenciesMatchFloat64Formulas) {
  RopeConfig rope;
  rope.theta = 500000.0;
  const at::Tensor plain = rope_inverse_frequencies(rope, 128).to(at::kDouble);
  for (int64_t i = 0; i < 64; ++i) {
    const double expected = 1.0 / std::pow(500000.0, 2.0 * static_cast<double>(i) / 128.0);
    EXPECT_NEAR(plain[i].item<double>() / expected, 1.0, 1e-6) << i;
  }
  // Llama 3.1 scaling (factor 8, low 1, high 4, original 8192), in float64.
  rope.type = RopeType::kLlama3;
  rope.factor = 8;
  rope.low_freq_factor = 1;
  rope.high_freq_factor = 4;
  rope.original_max_position_embeddings = 8192;
  const at::Tensor scaled = rope_inverse_frequencies(rope, 128).to(at::kDouble);
  int low = 0, medium = 0, high = 0;
  for (int64_t i = 0; i < 64; ++i) {
    const double f = 1.0 / std::pow(500000.0, 2.0 * static_cast<double>(i) / 128.0);
    const double wavelen = 2 * std::numbers::pi / f;
    double expected;
    if (wavelen < 8192.0 / 4) {
      expected = f, ++high;
    } else if (wavelen > 8192.0 / 1) {
      expected = f / 8, ++low;
    } else {
      const double smooth = (8192.0 / wavelen - 1) / (4 - 1);
      expected = (1 - smooth) * f / 8 + smooth * f, ++medium;
    }
    EXPECT_NEAR(scaled[i].item<double>() / expected, 1.0, 1e-5) << i;
  }
  EXPECT_GT(low, 0);
  EXPECT_GT(medium, 0);
  EXPECT_GT(high, 0);
}

// The CPU tables are cos and sin of the float32 angle p * inv_freq (HF's
// float32 product) rounded once to float32: within half a float32 ulp of a
// long double evaluation (plus the float64 evaluation's own ~1e-16, far below
// that). A 32 x 128 table first: the size whose upper half came back ~1e-4
// off from ATen's cos on a loaded machine; then positions past 100K, where
// the argument reduction matters.
TEST(Rope, CpuTablesAreCorrectlyRoundedAtEveryPosition) {
  RopeConfig rope;
  rope.theta = 500000.0;
  const RotaryEmbedding embedding(rope, 128, c10::Device(c10::kCPU));
  const at::Tensor inverse = rope_inverse_frequencies(rope, 128);
  for (const auto& [start, length] : {std::pair<int64_t, int64_t>{0, 32}, {131000, 72}}) {
    const RopeTables tables = embedding.tables(start, length, at::kFloat);
    ASSERT_EQ(tables.cos.sizes(), (at::IntArrayRef{length, 128}));
    int64_t checked = 0;
    for (int64_t t = 0; t < length; ++t) {
      for (int64_t j = 0; j < 128; ++j) {
        const float angle = static_cast<float>(start + t) * inverse[j % 64].item<float>();
        for (const auto& [table, reference] :
             {std::pair{tables.cos, std::cos(static_cast<long double>(angle))},
              std::pair{tables.sin, std::sin(static_cast<long double>(angle))}}) {
          const double expected = static_cast<double>(reference);
          const double half_ulp = expected == 0 ? 0 : std::ldexp(1.0, std::ilogb(expected) - 24);
          ASSERT_LE(std::fabs(table[t][j].item<float>() - expected), half_ulp + 1e-15)
              << "position " << start + t << " channel " << j;
          ++checked;
        }
      }
    }
    EXPECT_EQ(checked, 2 * length * 128);
  }
  // The model dtype is the float32 table rounded.
  const RopeTables bf16 = embedding.tables(7, 9, at::kBFloat16);
  EXPECT_TRUE(bf16.sin.equal(embedding.tables(7, 9, at::kFloat).sin.to(at::kBFloat16)));
}

TEST(Rope, InvertUndoesApply) {
  RopeConfig rope;
  const RotaryEmbedding embedding(rope, 16, c10::Device(c10::kCPU));
  const RopeTables tables = embedding.tables(5, 7, at::kDouble);
  const at::Tensor x = at::randn({2, 3, 7, 16}, at::kDouble);
  EXPECT_TRUE(at::allclose(RotaryEmbedding::invert(RotaryEmbedding::apply(x, tables), tables), x, 1e-6, 1e-6));
  // cos and sin are rounded to float32, as in transformers: the rotation is
  // orthogonal to float32 precision. Position 0 is the identity rotation.
  const RopeTables zero = embedding.tables(0, 1, at::kDouble);
  const at::Tensor y = at::randn({1, 1, 1, 16}, at::kDouble);
  EXPECT_TRUE(at::allclose(RotaryEmbedding::apply(y, zero), y));
}

}  // namespace
}  // namespace kvforge
