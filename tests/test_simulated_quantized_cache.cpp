// The simulated quantizing KV cache (eval/simulated_quantized_cache.h):
// streaming a window in chunks reads back, after every chunk, exactly what
// the float64 oracle (quantize_dequantize_keys/values over the whole prefix)
// gives, for every grouping, window rule, pre-RoPE keys and rotations; and
// the transformer runs through it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "calib/kv_rotation.h"
#include "calib/quantize_simulation.h"
#include "eval/simulated_quantized_cache.h"
#include "model/transformer.h"

namespace kvforge {
namespace {

constexpr int64_t kLayers = 2, kKvHeads = 2, kHeadDim = 16;

ModelConfig small_model() {
  ModelConfig model;
  model.vocab_size = 64;
  model.hidden_size = 64;
  model.intermediate_size = 96;
  model.num_layers = kLayers;
  model.num_heads = 4;
  model.num_kv_heads = kKvHeads;
  model.head_dim = kHeadDim;
  model.max_position_embeddings = 256;
  model.layer_window = std::vector<int64_t>(kLayers, 0);
  return model;
}

Float32Array filled(std::vector<int64_t> shape, float value) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return {shape, std::vector<float>(static_cast<size_t>(n), value)};
}

// Configurations covering every grouping and window rule.
QuantizerConfig kivi_like() {  // per-channel token groups, KIVI's block flush, sink
  QuantizerConfig c;
  c.name = "kivi-like";
  c.settings.method = QuantMethod::kKivi;
  c.settings.keys = {Grouping::kPerChannelTokens, 4};
  c.settings.keys.residual_rule = ResidualRule::kBlockFlush;
  c.settings.values = {Grouping::kPerToken, 8};
  c.settings.sink_tokens = 2;
  c.settings.residual_tokens = 8;
  c.layers.resize(kLayers);
  return c;
}

QuantizerConfig int2_rot_like() {  // per token, sliding windows, a grid, outliers, a rotation with a centre
  QuantizerConfig c;
  c.name = "rotated";
  c.settings.method = QuantMethod::kInt2Rot;
  c.settings.keys = {Grouping::kPerToken, kHeadDim, true, 0.125, OutlierRule::kTokenTopBottom};
  c.settings.values = {Grouping::kPerTokenAllHeads, 0};
  c.settings.sink_tokens = 1;
  c.settings.residual_tokens = 5;
  c.layers.resize(kLayers);
  RotationSettings rotation;
  rotation.keys = RotationForm::kMatrix;
  rotation.values = RotationForm::kMatrix;
  rotation.key_centred = true;
  c.rotation = rotation;
  // Sign-flipped, column-permuted Sylvester Hadamard matrices / 4: entries
  // +-1/4, exact in float32 and exactly orthogonal, so x R R^T == x up to
  // float64 rounding and the exact tokens of both paths agree.
  at::manual_seed(7);
  at::Tensor h = at::ones({1, 1}, at::kDouble);
  while (h.size(0) < kHeadDim) h = at::cat({at::cat({h, h}, 1), at::cat({h, -h}, 1)}, 0);
  for (LayerQuantizers& layer : c.layers) {
    for (TensorRotation* r : {&layer.rotation.keys, &layer.rotation.values}) {
      std::vector<at::Tensor> heads;
      for (int64_t head = 0; head < kKvHeads; ++head) {
        const at::Tensor signs = at::randint(0, 2, {kHeadDim, 1}, at::kDouble) * 2 - 1;
        heads.push_back((h * signs / 4).index_select(1, at::randperm(kHeadDim, at::kLong)));
      }
      const at::Tensor q = at::stack(heads).to(at::kFloat).contiguous();
      r->matrix = {{kKvHeads, kHeadDim, kHeadDim}, std::vector<float>(q.data_ptr<float>(), q.data_ptr<float>() + q.numel())};
    }
    layer.rotation.keys.centre = filled({kKvHeads, kHeadDim}, 0.25f);
  }
  return c;
}

QuantizerConfig kvquant_like() {  // offline per-channel pre-RoPE keys with thresholds, pair-angle rotation
  QuantizerConfig c;
  c.name = "kvquant-like";
  c.settings.method = QuantMethod::kKvquant;
  c.settings.keys_pre_rope = true;
  c.settings.keys = {Grouping::kPerChannelOffline, 0, true, 0.01, OutlierRule::kChannelThresholds};
  c.settings.values = {Grouping::kPerToken, kHeadDim};
  c.settings.sink_tokens = 1;
  RotationSettings rotation;
  rotation.keys = RotationForm::kPairAngles;
  c.rotation = rotation;
  c.layers.resize(kLayers);
  for (LayerQuantizers& layer : c.layers) {
    layer.keys.grid = {-0.8f, -0.2f, 0.25f, 0.7f};
    layer.keys.channel_scale = filled({kKvHeads, kHeadDim}, 1.5f);
    layer.keys.channel_offset = filled({kKvHeads, kHeadDim}, 0.1f);
    layer.keys.outlier_low = filled({kKvHeads, kHeadDim}, -1.4f);
    layer.keys.outlier_high = filled({kKvHeads, kHeadDim}, 1.6f);
    layer.rotation.keys.angles = filled({kKvHeads, kHeadDim / 2}, 0.3f);
  }
  return c;
}

struct Stream {
  at::Tensor keys_pre, keys, values;  // [1, kv_heads, T, D] float64
};

Stream random_stream(const RotaryEmbedding& rope, int64_t tokens) {
  at::manual_seed(11);
  Stream s;
  s.keys_pre = at::randn({1, kKvHeads, tokens, kHeadDim}, at::kDouble);
  s.keys_pre.select(3, 3).mul_(6.0);  // an outlier channel
  s.keys = RotaryEmbedding::apply(s.keys_pre, rope.tables(0, tokens, at::kDouble));
  s.values = at::randn({1, kKvHeads, tokens, kHeadDim}, at::kDouble);
  return s;
}

// What attention must read over the prefix of `end` tokens: the oracle over
// the whole prefix at once (pre-RoPE keys rotated after dequantization).
CachedKeysValues oracle(const QuantizerConfig& config, const RotaryEmbedding& rope, const Stream& s, int64_t layer,
                        int64_t end) {
  CachedKeysValues expected;
  if (config.settings.keys_pre_rope) {
    const at::Tensor k = quantize_dequantize_keys(config, layer, s.keys_pre.narrow(2, 0, end)).dequantized;
    expected.keys = RotaryEmbedding::apply(k, rope.tables(0, end, at::kDouble));
  } else {
    expected.keys = quantize_dequantize_keys(config, layer, s.keys.narrow(2, 0, end)).dequantized;
  }
  expected.values = quantize_dequantize_values(config, layer, s.values.narrow(2, 0, end)).dequantized;
  return expected;
}

void expect_streaming_equals_oracle(const QuantizerConfig& config, double tolerance) {
  const ModelConfig model = small_model();
  const RotaryEmbedding rope(model.rope, kHeadDim, at::kCPU);
  const int64_t total = 42;
  const Stream s = random_stream(rope, total);
  SimulatedQuantizedCache cache(model, config, rope, 1, total, at::kCPU, at::kDouble);
  // A prefill chunk, single decoding steps, another chunk, more steps.
  const std::vector<int64_t> chunks{7, 1, 1, 1, 12, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  int64_t at_position = 0, quantized_seen = 0;
  for (int64_t chunk : chunks) {
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      NewKeysValues block;
      block.layer = layer;
      block.position_start = at_position;
      block.keys_pre_rope = s.keys_pre.narrow(2, at_position, chunk);
      block.keys = s.keys.narrow(2, at_position, chunk);
      block.values = s.values.narrow(2, at_position, chunk);
      const CachedKeysValues got = cache.append(block);
      const CachedKeysValues want = oracle(config, rope, s, layer, at_position + chunk);
      ASSERT_EQ(got.length(), at_position + chunk);
      const double key_error = (got.keys - want.keys).abs().max().item<double>();
      const double value_error = (got.values - want.values).abs().max().item<double>();
      EXPECT_LE(key_error, tolerance) << config.name << " layer " << layer << " after " << at_position + chunk;
      EXPECT_LE(value_error, tolerance) << config.name << " layer " << layer << " after " << at_position + chunk;
      if (!at::equal(want.keys, s.keys.narrow(2, 0, at_position + chunk))) ++quantized_seen;
    }
    cache.commit(chunk);
    at_position += chunk;
  }
  ASSERT_EQ(at_position, total);
  EXPECT_GT(quantized_seen, 10) << "the configuration must actually quantize";
}

TEST(SimulatedQuantizedCache, StreamingKiviEqualsTheOracleAfterEveryChunk) {
  // Same float64 operations on the same groups: bit for bit.
  expect_streaming_equals_oracle(kivi_like(), 0.0);
}

TEST(SimulatedQuantizedCache, StreamingRotatedPerTokenEqualsTheOracleAfterEveryChunk) {
  // The rotation's float64 matmul may sum in another order for another
  // number of rows: values agree to float64 rounding of D-term dot products
  // (|x| < 30 here: 30 * D * 2^-52 ~ 1e-13); a flipped code would be ~0.1
  // or more.
  expect_streaming_equals_oracle(int2_rot_like(), 1e-11);
}

TEST(SimulatedQuantizedCache, StreamingPreRopeKeysEqualTheOracleAfterEveryChunk) {
  expect_streaming_equals_oracle(kvquant_like(), 1e-11);
}

TEST(SimulatedQuantizedCache, RefusesOutOfOrderBlocksAndOverflow) {
  const ModelConfig model = small_model();
  const RotaryEmbedding rope(model.rope, kHeadDim, at::kCPU);
  SimulatedQuantizedCache cache(model, kivi_like(), rope, 1, 4, at::kCPU, at::kDouble);
  NewKeysValues block;
  block.keys = block.keys_pre_rope = block.values = at::zeros({1, kKvHeads, 3, kHeadDim}, at::kDouble);
  block.position_start = 1;
  EXPECT_THROW(cache.append(block), std::invalid_argument);
  block.position_start = 0;
  cache.append(block);
  cache.commit(3);
  block.position_start = 3;
  EXPECT_THROW(cache.append(block), std::length_error);
  QuantizerConfig short_config = kivi_like();
  short_config.layers.pop_back();
  EXPECT_THROW(SimulatedQuantizedCache(model, short_config, rope, 1, 4, at::kCPU, at::kDouble), std::invalid_argument);
}

TEST(SimulatedQuantizedCache, TransformerThroughItMatchesTheFullPrecisionCacheWhenNothingIsQuantized) {
  ModelConfig model = small_model();
  const Transformer transformer = Transformer::random(model, ComputeTarget{}, 3);
  const at::Tensor ids = at::randint(0, model.vocab_size, {1, 20}, at::kLong);
  QuantizerConfig everything_exact = int2_rot_like();
  everything_exact.settings.sink_tokens = 20;  // the sink covers the whole window
  SimulatedQuantizedCache exact_cache(transformer.config(), everything_exact, transformer.rope(), 1, 20, at::kCPU,
                                      at::kFloat);
  KVCache reference = transformer.make_cache(1, 20);
  ForwardOptions with_exact, with_reference;
  with_exact.cache = &exact_cache;
  with_reference.cache = &reference;
  const at::Tensor a = transformer.forward(ids.narrow(1, 0, 12), with_exact);
  const at::Tensor b = transformer.forward(ids.narrow(1, 0, 12), with_reference);
  EXPECT_TRUE(at::equal(a, b));
  const at::Tensor c = transformer.forward(ids.narrow(1, 12, 1), with_exact);
  const at::Tensor d = transformer.forward(ids.narrow(1, 12, 1), with_reference);
  EXPECT_TRUE(at::equal(c, d));

  // A configuration that quantizes changes what the next token sees.
  SimulatedQuantizedCache quantizing(transformer.config(), kivi_like(), transformer.rope(), 1, 20, at::kCPU,
                                     at::kFloat);
  ForwardOptions with_quantizing;
  with_quantizing.cache = &quantizing;
  transformer.forward(ids.narrow(1, 0, 12), with_quantizing);
  const at::Tensor e = transformer.forward(ids.narrow(1, 12, 1), with_quantizing);
  EXPECT_GT((e - d).abs().max().item<double>(), 1e-4);
}

}  // namespace
}  // namespace kvforge
