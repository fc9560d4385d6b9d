// eval/configuration_cost.h: effective bits and cache bytes per token of the
// 16-bit cache and of configurations, against cases computed by hand from
// docs/artifact.md's bit accounting (pyllama-16m's shapes: 5 layers, 2 KV
// heads, head_dim 128, so 2 x 5 x 2 x 128 = 2560 cached elements per token).
#include <gtest/gtest.h>

#include <stdexcept>

#include "eval/configuration_cost.h"

namespace kvforge {
namespace {

ModelConfig pyllama_shapes() {
  ModelConfig model;
  model.num_layers = 5;
  model.num_heads = 4;
  model.num_kv_heads = 2;
  model.head_dim = 128;
  model.hidden_size = 512;
  return model;
}

QuantizerConfig config_of(QuantMethod method, int bits, TensorQuantizerSettings keys, TensorQuantizerSettings values,
                          int64_t sink, int64_t residual) {
  QuantizerConfig c;
  c.name = "hand";
  c.settings.method = method;
  c.settings.bits = bits;
  c.settings.keys = keys;
  c.settings.values = values;
  c.settings.sink_tokens = sink;
  c.settings.residual_tokens = residual;
  c.layers.resize(5);
  return c;
}

TEST(ConfigurationCost, FullPrecisionIsTwoBytesPerElement) {
  const ConfigurationEvaluation fp16 = describe_configuration(nullptr, pyllama_shapes(), 4096);
  EXPECT_EQ(fp16.name, kFullPrecisionName);
  EXPECT_EQ(fp16.method, "fp16");
  EXPECT_EQ(fp16.bits, 16);
  EXPECT_FALSE(fp16.rotated);
  EXPECT_EQ(fp16.effective_bits, 16.0);
  EXPECT_EQ(fp16.cache_bytes_per_token, 2.0 * 2 * 5 * 2 * 128);  // 5120
  EXPECT_FALSE(fp16.perplexity.has_value());
}

TEST(ConfigurationCost, PerTokenGroupsWithoutWindowsCostCodesAndScales) {
  // 2-bit codes + a 16-bit scale and offset per 128 channels: 2 + 32/128.
  const QuantizerConfig rtn =
      config_of(QuantMethod::kRtn, 2, {Grouping::kPerToken, 128}, {Grouping::kPerToken, 128}, 0, 0);
  const ConfigurationEvaluation c = describe_configuration(&rtn, pyllama_shapes(), 1000);
  EXPECT_EQ(c.name, "hand");
  EXPECT_EQ(c.method, "rtn");
  EXPECT_EQ(c.bits, 2);
  EXPECT_FALSE(c.rotated);
  EXPECT_DOUBLE_EQ(c.effective_bits, 2.25);
  EXPECT_DOUBLE_EQ(c.cache_bytes_per_token, 2.25 / 8 * 2560);  // 720
}

TEST(ConfigurationCost, WindowsAreAmortizedAtTheEvaluatedContext) {
  // Sink 64 + residual 256 of 1024 tokens exact (0.3125), the rest at
  // 2 + 32/64 bits: 16 x 0.3125 + 0.6875 x 2.5 = 6.71875 bits.
  QuantizerConfig rot =
      config_of(QuantMethod::kInt2Rot, 2, {Grouping::kPerToken, 64}, {Grouping::kPerToken, 64}, 64, 256);
  rot.rotation = RotationSettings{};
  const ConfigurationEvaluation c = describe_configuration(&rot, pyllama_shapes(), 1024);
  EXPECT_EQ(c.method, "int2-rot");
  EXPECT_TRUE(c.rotated);
  EXPECT_DOUBLE_EQ(c.effective_bits, 6.71875);
  EXPECT_DOUBLE_EQ(c.cache_bytes_per_token, 6.71875 / 8 * 2560);  // 2150
  // A context inside the windows is all 16-bit.
  EXPECT_DOUBLE_EQ(describe_configuration(&rot, pyllama_shapes(), 300).effective_bits, 16.0);

  // KIVI at 3 bits, context 1000: keys per channel in 32-token groups
  // (3 + 32/32 = 4 bits) flushed every 128 tokens, 1000 mod 128 = 104
  // exact; values per token (3 + 32/128) with the newest 128 exact:
  // keys 16 x 0.104 + 0.896 x 4 = 5.248, values 16 x 0.128 + 0.872 x 3.25
  // = 4.882, mean 5.065 bits.
  TensorQuantizerSettings keys{Grouping::kPerChannelTokens, 32};
  keys.residual_rule = ResidualRule::kBlockFlush;
  const QuantizerConfig kivi = config_of(QuantMethod::kKivi, 3, keys, {Grouping::kPerToken, 128}, 0, 128);
  const ConfigurationEvaluation k = describe_configuration(&kivi, pyllama_shapes(), 1000);
  EXPECT_EQ(k.method, "kivi");
  EXPECT_EQ(k.bits, 3);
  EXPECT_NEAR(k.effective_bits, 5.065, 1e-12);
  EXPECT_NEAR(k.cache_bytes_per_token, 5.065 / 8 * 2560, 1e-9);  // 1620.8
}

TEST(ConfigurationCost, OutliersAndOfflineScalesAreCounted) {
  // Keys per channel offline at 4 bits with 1% channel-threshold outliers,
  // context 2048, no windows: 4 + 0.01 (16 + 16) + 32/128 (row pointer)
  // + 32/2048 (the per-channel scale and offset) = 4.585625; values per
  // token at 4 + 32/128 = 4.25; mean 4.4178125.
  const QuantizerConfig kvquant =
      config_of(QuantMethod::kKvquant, 4,
                {Grouping::kPerChannelOffline, 0, true, 0.01, OutlierRule::kChannelThresholds},
                {Grouping::kPerToken, 128}, 0, 0);
  EXPECT_NEAR(describe_configuration(&kvquant, pyllama_shapes(), 2048).effective_bits, 4.4178125, 1e-12);
  // Measured shares replace the configured ones: keys 0.02 -> 4 + 0.64 +
  // 0.25 + 0.015625 = 4.905625, values (no outlier rule) unchanged.
  EXPECT_NEAR(describe_configuration(&kvquant, pyllama_shapes(), 2048, OutlierFractions{0.02, 0.5}).effective_bits,
              (4.905625 + 4.25) / 2, 1e-12);
}

TEST(ConfigurationCost, RefusesAContextBelowOneAndAnotherModelsConfiguration) {
  const QuantizerConfig rtn =
      config_of(QuantMethod::kRtn, 2, {Grouping::kPerToken, 128}, {Grouping::kPerToken, 128}, 0, 0);
  EXPECT_THROW(describe_configuration(&rtn, pyllama_shapes(), 0), std::invalid_argument);
  ModelConfig six_layers = pyllama_shapes();
  six_layers.num_layers = 6;
  EXPECT_THROW(describe_configuration(&rtn, six_layers, 100), std::invalid_argument);
}

}  // namespace
}  // namespace kvforge
