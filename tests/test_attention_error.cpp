// eval/attention_error.h: per-layer post-W_O attention error of a
// configuration on held-out captures of pyllama-16m (a small store captured
// here: 2 windows of 128 positions of heldout.txt): the mean over KV heads
// of measure_attention_terms, 0 for a configuration that quantizes nothing
// and for the 16-bit cache, > 0 at 2 bits.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <vector>

#include "capture/capture.h"
#include "eval/attention_error.h"
#include "formats/model_fingerprint.h"
#include "formats/safetensors.h"
#include "formats/sha256.h"
#include "model/tokenizer.h"
#include "model/transformer.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

constexpr int64_t kSamples = 2, kSeqLen = 128;

// Captured once per test binary with the capture library (what `kvforge
// capture` runs): q, k_pre, k_post and v of every layer.
const std::filesystem::path& heldout_store() {
  static const std::filesystem::path store = [] {
    const std::filesystem::path path = testing::scratch_dir("attention_error") / "heldout.h5";
    const std::filesystem::path model_dir = testing::pyllama_dir();
    const ModelConfig config = load_model_config(model_dir);
    const Tokenizer tokenizer = Tokenizer::from_file(model_dir / "tokenizer.json");
    const std::string text = testing::read_file(testing::shared_dir() / "data" / "heldout.txt");
    const std::vector<int32_t> tokens = tokenizer.encode(text);
    ActivationStoreLayout layout;
    layout.model = fingerprint_model(config, Checkpoint(model_dir), tokenizer.sha256());
    CaptureSettings settings;
    settings.samples = kSamples;
    settings.seq_len = kSeqLen;
    settings.seed = 3;
    settings.bos = static_cast<int32_t>(config.bos_token_id.value());
    settings.recorder.fields = {ActivationField::kQueries, ActivationField::kKeysPreRope,
                                ActivationField::kKeysPostRope, ActivationField::kValues};
    CaptureProvenance& provenance = layout.provenance;
    provenance.data_file = "heldout.txt";
    provenance.data_sha256 = sha256_hex(text);
    provenance.data_tokens = static_cast<int64_t>(tokens.size());
    provenance.samples = kSamples;
    provenance.seq_len = kSeqLen;
    provenance.seed = settings.seed;
    provenance.bos = true;
    provenance.compute_dtype = "fp32";
    provenance.device = "cpu";
    provenance.tool_version = "test";
    provenance.command_line = "test_attention_error";
    layout.fields = settings.recorder.fields;
    ActivationStoreWriter writer = ActivationStoreWriter::create(path, layout);
    const Transformer model = Transformer::load(model_dir, {c10::Device(c10::kCPU), c10::kFloat});
    run_capture(model, tokens, settings, writer);
    writer.close();
    return path;
  }();
  return store;
}

QuantizerConfig per_token_config(int64_t sink) {
  QuantizerConfig c;
  c.name = "rtn-test";
  c.settings.method = QuantMethod::kRtn;
  c.settings.bits = 2;
  c.settings.keys = {Grouping::kPerToken, 128};
  c.settings.values = {Grouping::kPerToken, 128};
  c.settings.sink_tokens = sink;
  c.layers.resize(5);
  return c;
}

TEST(AttentionError, MeanOverKvHeadsOfAnAnalyticCase) {
  LayerAttentionTerms layer0{{0.1, 0.3}, {1.0, 2.0}, {1.1, 2.3}, {0.5, 0.25}};
  LayerAttentionTerms layer1{{0.0, 0.0}, {4.0, 0.0}, {4.0, 0.0}, {0.0, 1.0}};
  const std::vector<LayerAttentionError> errors = mean_over_kv_heads({layer0, layer1});
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_EQ(errors[0].layer, 0);
  EXPECT_DOUBLE_EQ(errors[0].key_kl, 0.2);
  EXPECT_DOUBLE_EQ(errors[0].key_output, 1.5);
  EXPECT_DOUBLE_EQ(errors[0].value_output, 0.375);
  EXPECT_EQ(errors[1].layer, 1);
  EXPECT_DOUBLE_EQ(errors[1].key_output, 2.0);
  EXPECT_DOUBLE_EQ(errors[1].value_output, 0.5);
  layer1.value.pop_back();
  EXPECT_THROW(mean_over_kv_heads({layer0, layer1}), std::invalid_argument);
  EXPECT_THROW(mean_over_kv_heads({LayerAttentionTerms{}}), std::invalid_argument);
}

TEST(AttentionError, NothingQuantizedAndTheFullPrecisionCacheGiveZero) {
  const ActivationStoreReader store(heldout_store());
  const QuantizerConfig exact = per_token_config(kSeqLen);  // the sink holds every captured position
  const std::vector<LayerAttentionError> errors =
      measure_attention_error(store, testing::pyllama_dir(), &exact, AttentionTermOptions{});
  ASSERT_EQ(errors.size(), 5u);
  for (const LayerAttentionError& e : errors) {
    // The same keys and values as the exact reference, through the same
    // float32 operations: exactly 0.
    EXPECT_EQ(e.key_kl, 0.0) << "layer " << e.layer;
    EXPECT_EQ(e.key_output, 0.0) << "layer " << e.layer;
    EXPECT_EQ(e.value_output, 0.0) << "layer " << e.layer;
  }
  const std::vector<LayerAttentionError> fp16 =
      measure_attention_error(store, testing::pyllama_dir(), nullptr, AttentionTermOptions{});
  ASSERT_EQ(fp16.size(), 5u);
  for (size_t layer = 0; layer < fp16.size(); ++layer) {
    EXPECT_EQ(fp16[layer].layer, static_cast<int64_t>(layer));
    EXPECT_EQ(fp16[layer].key_output + fp16[layer].value_output + fp16[layer].key_kl, 0.0);
  }
  AttentionTermOptions two_layers;
  two_layers.max_layers = 2;
  EXPECT_EQ(measure_attention_error(store, testing::pyllama_dir(), nullptr, two_layers).size(), 2u);
}

TEST(AttentionError, TwoBitsGiveErrorInEveryLayerAndTheMeanOfTheHeadTerms) {
  const ActivationStoreReader store(heldout_store());
  const QuantizerConfig two_bits = per_token_config(0);
  AttentionTermOptions options;
  options.last_queries = 32;
  const std::vector<LayerAttentionError> errors =
      measure_attention_error(store, testing::pyllama_dir(), &two_bits, options);
  const std::vector<LayerAttentionTerms> terms =
      measure_attention_terms(store, testing::pyllama_dir(), two_bits, options);
  ASSERT_EQ(errors.size(), 5u);
  ASSERT_EQ(terms.size(), 5u);
  for (size_t layer = 0; layer < errors.size(); ++layer) {
    const LayerAttentionError& e = errors[layer];
    const LayerAttentionTerms& t = terms[layer];
    EXPECT_EQ(e.layer, static_cast<int64_t>(layer));
    EXPECT_GT(e.key_kl, 0.0);
    EXPECT_GT(e.key_output, 0.0);
    EXPECT_GT(e.value_output, 0.0);
    ASSERT_EQ(t.key_kl.size(), 2u);  // pyllama-16m's KV heads
    // The same deterministic computation twice, averaged over two heads in
    // float64: equal to the last bit of (a + b) / 2.
    EXPECT_DOUBLE_EQ(e.key_kl, (t.key_kl[0] + t.key_kl[1]) / 2);
    EXPECT_DOUBLE_EQ(e.key_output, (t.key_output[0] + t.key_output[1]) / 2);
    EXPECT_DOUBLE_EQ(e.value_output, (t.value[0] + t.value[1]) / 2);
    std::printf("layer %zu: key KL %.4g, key output %.4g, value output %.4g\n", layer, e.key_kl, e.key_output,
                e.value_output);
  }
}

}  // namespace
}  // namespace kvforge
