#pragma once
// The decoder of a Hugging Face Llama-family checkpoint (Llama 2/3, Mistral,
// Qwen2, Qwen3) in libtorch, computing what transformers computes: RMSNorm
// in float32, RoPE tables in float32 cast to the model dtype, softmax
// attention with grouped KV heads, causal and sliding-window masks, SiLU MLP.
#include <ATen/core/Tensor.h>

#include <filesystem>
#include <functional>
#include <string>
#include <memory>
#include <optional>
#include <vector>

#include "formats/hf_config.h"
#include "model/device.h"
#include "model/kv_cache.h"
#include "model/kv_cache_policy.h"
#include "model/rope.h"

namespace kvforge {

class Checkpoint;

// What one attention layer computed for a block of T new tokens.
// The new keys and values the cache policy is handed (layer, positions,
// keys before and after RoPE, values), and the queries that attend.
struct AttentionTensors : NewKeysValues {
  at::Tensor queries;  // [B, heads, T, head_dim], after q_norm and RoPE
};

// Sees every attention layer's tensors during a forward pass (capture,
// quantization studies). Called in layer order.
class AttentionObserver {
 public:
  virtual ~AttentionObserver() = default;
  virtual void on_attention(const AttentionTensors& tensors) = 0;
};

struct ForwardOptions {
  // Attention stores the new keys and values in it and attends over what it
  // returns (model/kv_cache_policy.h); positions continue from
  // cache->length(); committed on return. Without one, attention reads the
  // pass's own keys and values.
  KVCachePolicy* cache = nullptr;
  AttentionObserver* observer = nullptr;
  // Positions of the first token when no cache is given.
  int64_t position_start = 0;
};

struct LayerWeights {
  at::Tensor input_norm, post_attention_norm;
  at::Tensor q_proj, k_proj, v_proj, o_proj;
  std::optional<at::Tensor> q_bias, k_bias, v_bias;
  std::optional<at::Tensor> q_norm, k_norm;
  at::Tensor gate_proj, up_proj, down_proj;
};

// Supplies the weight called `name` (HF naming) with the given shape, on any
// device and dtype; the transformer moves it to its target.
using WeightLoader = std::function<at::Tensor(const std::string& name, const std::vector<int64_t>& shape)>;

class Transformer {
 public:
  // Loads config.json and the safetensors weights of `model_dir`.
  static Transformer load(const std::filesystem::path& model_dir, const ComputeTarget& target);
  // Random weights of the config's shapes (benchmarks): projections
  // N(0, 0.02), norms 1, biases 0.
  static Transformer random(ModelConfig config, const ComputeTarget& target, uint64_t seed);
  Transformer(ModelConfig config, const Checkpoint& checkpoint, const ComputeTarget& target);
  Transformer(ModelConfig config, const WeightLoader& load, const ComputeTarget& target);

  // input_ids: [B, T] int64 on any device. Returns logits [B, T, vocab] in
  // float32.
  at::Tensor forward(const at::Tensor& input_ids, const ForwardOptions& options = {}) const;
  // Final hidden states after the last norm, [B, T, hidden] in the model dtype.
  at::Tensor hidden_states(const at::Tensor& input_ids, const ForwardOptions& options = {}) const;
  at::Tensor logits(const at::Tensor& hidden) const;  // float32

  // The pieces of hidden_states(), for layer-by-layer work (capture's
  // recomputation): embed, one decoder layer at a time, final norm. With a
  // cache, position_start must be cache->length() and the caller commits.
  at::Tensor embed(const at::Tensor& input_ids) const;  // [B, T, hidden], model dtype
  at::Tensor decoder_layer(int64_t layer, const at::Tensor& hidden, int64_t position_start,
                           KVCachePolicy* cache = nullptr, AttentionObserver* observer = nullptr) const;
  at::Tensor final_norm(const at::Tensor& hidden) const;

  // The full-precision cache (model dtype, target device).
  KVCache make_cache(int64_t batch, int64_t capacity) const;

  const ModelConfig& config() const { return config_; }
  const ComputeTarget& target() const { return target_; }
  // The model's RoPE, for policies that rotate stored pre-RoPE keys.
  const RotaryEmbedding& rope() const { return rope_; }
  const LayerWeights& layer(int64_t index) const { return layers_.at(static_cast<size_t>(index)); }
  int64_t parameter_count() const;

 private:
  at::Tensor attention(int64_t layer, const at::Tensor& x, int64_t start, KVCachePolicy* cache,
                       AttentionObserver* observer) const;
  // q: [B, heads, T, D]; k, v: [B, kv_heads, S, D] holding positions [0, S).
  at::Tensor eager_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                             int64_t window, double scale) const;
  at::Tensor fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                             int64_t window, double scale) const;
  at::Tensor mlp(const LayerWeights& weights, const at::Tensor& x) const;
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const;

  ModelConfig config_;
  ComputeTarget target_;
  RotaryEmbedding rope_;
  at::Tensor embed_tokens_;
  at::Tensor final_norm_;
  at::Tensor lm_head_;  // same storage as embed_tokens_ when tied
  std::vector<LayerWeights> layers_;
};

// Boolean mask [T, S]: query i (position start + i) may attend key j when
// j <= start + i and, with a window, start + i - j < window.
at::Tensor attention_mask(int64_t start, int64_t queries, int64_t keys, int64_t window,
                          c10::Device device);

}  // namespace kvforge
