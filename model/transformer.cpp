#include "model/transformer.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "formats/safetensors.h"
#include "model/grouped_attention.h"

namespace kvforge {
namespace {

c10::ScalarType to_scalar_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return c10::kFloat;
    case DType::kF16: return c10::kHalf;
    case DType::kBF16: return c10::kBFloat16;
  }
  return c10::kFloat;
}

// A view of a mapped checkpoint tensor (no copy; valid while the mapping lives).
at::Tensor mapped_tensor(const Checkpoint& checkpoint, const std::string& name, const std::vector<int64_t>& shape) {
  const TensorView& view = checkpoint.tensor(name, shape);
  return at::from_blob(const_cast<std::byte*>(view.bytes.data()), view.shape,
                       at::TensorOptions().dtype(to_scalar_type(view.dtype)));
}

std::string layer_prefix(int64_t layer) { return "model.layers." + std::to_string(layer) + "."; }

// What a KV cache policy returned must be what attention can read: keys and
// values for positions [0, expected_length), shaped and typed as `keys`.
void check_cached(const CachedKeysValues& cached, const at::Tensor& keys, int64_t layer,
                  int64_t expected_length) {
  auto shape_of = [](const at::Tensor& t) { return t.defined() ? c10::str(t.sizes()) : std::string("undefined"); };
  std::vector<int64_t> expected(keys.sizes().begin(), keys.sizes().end());
  expected[2] = expected_length;
  for (const at::Tensor* t : {&cached.keys, &cached.values}) {
    if (!t->defined() || t->sizes() != at::IntArrayRef(expected) || t->scalar_type() != keys.scalar_type() ||
        t->device() != keys.device()) {
      throw std::logic_error("KV cache policy at layer " + std::to_string(layer) + " returned " + shape_of(*t) +
                             " where attention reads " + c10::str(at::IntArrayRef(expected)) + " of " +
                             c10::toString(keys.scalar_type()) + " on " + keys.device().str());
    }
  }
}

}  // namespace

at::Tensor attention_mask(int64_t start, int64_t queries, int64_t keys, int64_t window,
                          c10::Device device) {
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor query_pos = at::arange(start, start + queries, options).unsqueeze(1);
  const at::Tensor key_pos = at::arange(0, keys, options).unsqueeze(0);
  at::Tensor mask = key_pos <= query_pos;
  if (window > 0) mask = mask.logical_and(query_pos - key_pos < window);
  return mask;
}

at::Tensor Transformer::eager_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        int64_t start, int64_t window, double scale) const {
  // transformers' eager_attention_forward: repeat KV heads, scores in the
  // model dtype, softmax in float32 cast back, then the weighted sum.
  const int64_t groups = config_.q_per_kv();
  auto repeat = [groups](const at::Tensor& x) {
    if (groups == 1) return x;
    const auto s = x.sizes();
    return x.unsqueeze(2).expand({s[0], s[1], groups, s[2], s[3]}).reshape({s[0], s[1] * groups, s[2], s[3]});
  };
  at::Tensor scores = at::matmul(q, repeat(k).transpose(2, 3)) * scale;
  if (q.size(2) > 1 || window > 0) {
    const at::Tensor mask = attention_mask(start, q.size(2), k.size(2), window, q.device());
    scores = scores.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  }
  const at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
  return at::matmul(probs, repeat(v));
}

at::Tensor Transformer::fused_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        int64_t start, int64_t window, double scale) const {
  const int64_t tokens = q.size(2);
  const int64_t keys = k.size(2);
  if (keys != tokens) {
    // Over a cache the key length changes every step, and SDPA's cuDNN
    // backend would compile a plan for each (model/grouped_attention.h).
    std::optional<at::Tensor> mask;
    if (tokens > 1 || window > 0) mask = attention_mask(start, tokens, keys, window, q.device());
    return grouped_attention(q, k, v, mask, scale);
  }
  // A whole window (no cache, or the first pass into an empty one).
  std::optional<at::Tensor> mask;
  bool is_causal = false;
  const bool window_bites = window > 0 && start + tokens > window;
  if (!window_bites && start == 0 && tokens > 1) {
    is_causal = true;  // the fused kernels' own causal mask
  } else if (window_bites || tokens > 1) {
    mask = attention_mask(start, tokens, keys, window, q.device());
  }
  return at::scaled_dot_product_attention(q, k, v, mask, /*dropout_p=*/0.0, is_causal, scale,
                                          /*enable_gqa=*/config_.num_heads != config_.num_kv_heads);
}

Transformer Transformer::load(const std::filesystem::path& model_dir, const ComputeTarget& target) {
  ModelConfig config = load_model_config(model_dir);
  const Checkpoint checkpoint(model_dir);
  return Transformer(std::move(config), checkpoint, target);
}

Transformer Transformer::random(ModelConfig config, const ComputeTarget& target, uint64_t seed) {
  // Drawn on the target device: an 8B model's weights drawn on the CPU
  // would take minutes. Seeds torch's default generators.
  at::manual_seed(seed);
  const auto options = at::TensorOptions().dtype(target.dtype).device(target.device);
  const WeightLoader loader = [options](const std::string& name, const std::vector<int64_t>& shape) {
    if (name.find("norm") != std::string::npos) return at::ones(shape, options);
    if (name.ends_with(".bias")) return at::zeros(shape, options);
    return at::empty(shape, options).normal_(0.0, 0.02);
  };
  return Transformer(std::move(config), loader, target);
}

Transformer::Transformer(ModelConfig config, const Checkpoint& checkpoint, const ComputeTarget& target)
    : Transformer(std::move(config),
                  [&checkpoint](const std::string& name, const std::vector<int64_t>& shape) {
                    return mapped_tensor(checkpoint, name, shape);
                  },
                  target) {}

Transformer::Transformer(ModelConfig config, const WeightLoader& load, const ComputeTarget& target)
    : config_(std::move(config)), target_(target), rope_(config_.rope, config_.head_dim, target.device) {
  // The copy detaches weights from their source (a mapping, a generator).
  const auto load_tensor = [&load, &target](const std::string& name, const std::vector<int64_t>& shape) {
    return load(name, shape).to(target.device, target.dtype, /*non_blocking=*/false, /*copy=*/true);
  };
  const int64_t hidden = config_.hidden_size;
  const int64_t q_dim = config_.num_heads * config_.head_dim;
  const int64_t kv_dim = config_.num_kv_heads * config_.head_dim;
  const int64_t inter = config_.intermediate_size;
  embed_tokens_ = load_tensor("model.embed_tokens.weight", {config_.vocab_size, hidden});
  final_norm_ = load_tensor("model.norm.weight", {hidden});
  // Some tied checkpoints still store lm_head.weight; the tie wins, as in HF.
  lm_head_ = config_.tie_word_embeddings
                 ? embed_tokens_
                 : load_tensor("lm_head.weight", {config_.vocab_size, hidden});
  for (int64_t i = 0; i < config_.num_layers; ++i) {
    const std::string p = layer_prefix(i);
    LayerWeights w;
    w.input_norm = load_tensor(p + "input_layernorm.weight", {hidden});
    w.post_attention_norm = load_tensor(p + "post_attention_layernorm.weight", {hidden});
    w.q_proj = load_tensor(p + "self_attn.q_proj.weight", {q_dim, hidden});
    w.k_proj = load_tensor(p + "self_attn.k_proj.weight", {kv_dim, hidden});
    w.v_proj = load_tensor(p + "self_attn.v_proj.weight", {kv_dim, hidden});
    w.o_proj = load_tensor(p + "self_attn.o_proj.weight", {hidden, q_dim});
    if (config_.attention_bias) {
      w.q_bias = load_tensor(p + "self_attn.q_proj.bias", {q_dim});
      w.k_bias = load_tensor(p + "self_attn.k_proj.bias", {kv_dim});
      w.v_bias = load_tensor(p + "self_attn.v_proj.bias", {kv_dim});
    }
    if (config_.qk_norm) {
      w.q_norm = load_tensor(p + "self_attn.q_norm.weight", {config_.head_dim});
      w.k_norm = load_tensor(p + "self_attn.k_norm.weight", {config_.head_dim});
    }
    w.gate_proj = load_tensor(p + "mlp.gate_proj.weight", {inter, hidden});
    w.up_proj = load_tensor(p + "mlp.up_proj.weight", {inter, hidden});
    w.down_proj = load_tensor(p + "mlp.down_proj.weight", {hidden, inter});
    layers_.push_back(std::move(w));
  }
}

int64_t Transformer::parameter_count() const {
  int64_t count = embed_tokens_.numel() + final_norm_.numel();
  if (!config_.tie_word_embeddings) count += lm_head_.numel();
  for (const auto& w : layers_) {
    for (const at::Tensor* t : {&w.input_norm, &w.post_attention_norm, &w.q_proj, &w.k_proj,
                                &w.v_proj, &w.o_proj, &w.gate_proj, &w.up_proj, &w.down_proj}) {
      count += t->numel();
    }
    for (const auto* t : {&w.q_bias, &w.k_bias, &w.v_bias, &w.q_norm, &w.k_norm}) {
      if (t->has_value()) count += (*t)->numel();
    }
  }
  return count;
}

KVCache Transformer::make_cache(int64_t batch, int64_t capacity) const {
  return KVCache(config_, batch, capacity, target_.device, target_.dtype);
}

at::Tensor Transformer::rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
  // HF LlamaRMSNorm: statistics in float32, cast back before the weight.
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor normed = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + config_.rms_norm_eps);
  return weight * normed.to(x.scalar_type());
}

at::Tensor Transformer::mlp(const LayerWeights& w, const at::Tensor& x) const {
  return at::linear(at::silu(at::linear(x, w.gate_proj)) * at::linear(x, w.up_proj), w.down_proj);
}

at::Tensor Transformer::attention(int64_t layer, const at::Tensor& x, int64_t start, KVCachePolicy* cache,
                                  AttentionObserver* observer) const {
  const LayerWeights& w = layers_[static_cast<size_t>(layer)];
  const int64_t batch = x.size(0);
  const int64_t tokens = x.size(1);
  const int64_t head_dim = config_.head_dim;
  auto project = [&](const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t heads,
                     const std::optional<at::Tensor>& norm) {
    at::Tensor y = at::linear(x, weight, bias).view({batch, tokens, heads, head_dim});
    if (norm) y = rms_norm(y, *norm);
    return y.transpose(1, 2);  // [B, heads, T, head_dim]
  };
  at::Tensor q = project(w.q_proj, w.q_bias, config_.num_heads, w.q_norm);
  const at::Tensor k_pre = project(w.k_proj, w.k_bias, config_.num_kv_heads, w.k_norm);
  at::Tensor v = project(w.v_proj, w.v_bias, config_.num_kv_heads, std::nullopt);

  const RopeTables tables = rope_.tables(start, tokens, x.scalar_type());
  q = RotaryEmbedding::apply(q, tables);
  at::Tensor k = RotaryEmbedding::apply(k_pre, tables);
  const NewKeysValues block{layer, start, k_pre, k, v};
  if (observer != nullptr) {
    observer->on_attention({block, q});
  }
  const int64_t window = config_.layer_window.empty() ? 0 : config_.layer_window[static_cast<size_t>(layer)];
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const auto output = [&](const at::Tensor& out) {
    return at::linear(out.transpose(1, 2).reshape({batch, tokens, config_.num_heads * head_dim}), w.o_proj);
  };
  if (cache != nullptr && cache->attends()) {
    const at::Tensor out = cache->append_and_attend(block, q, scale, window);
    TORCH_CHECK(out.sizes() == q.sizes(), "layer ", layer, ": the cache policy's attention output has shape ",
                out.sizes(), ", expected the queries' ", q.sizes());
    return output(out.to(q.scalar_type()));
  }
  if (cache != nullptr) {
    // From here on attention reads only what the policy returns.
    CachedKeysValues cached = cache->append(block);
    check_cached(cached, k, layer, start + tokens);
    k = std::move(cached.keys);
    v = std::move(cached.values);
  }

  return output(target_.attention == AttentionBackend::kEager ? eager_attention(q, k, v, start, window, scale)
                                                              : fused_attention(q, k, v, start, window, scale));
}

at::Tensor Transformer::embed(const at::Tensor& input_ids) const {
  return at::embedding(embed_tokens_, input_ids.to(target_.device, at::kLong));
}

at::Tensor Transformer::decoder_layer(int64_t layer, const at::Tensor& hidden, int64_t position_start,
                                      KVCachePolicy* cache, AttentionObserver* observer) const {
  const LayerWeights& w = layers_.at(static_cast<size_t>(layer));
  const at::Tensor h = hidden + attention(layer, rms_norm(hidden, w.input_norm), position_start, cache, observer);
  return h + mlp(w, rms_norm(h, w.post_attention_norm));
}

at::Tensor Transformer::final_norm(const at::Tensor& hidden) const { return rms_norm(hidden, final_norm_); }

at::Tensor Transformer::hidden_states(const at::Tensor& input_ids, const ForwardOptions& options) const {
  const int64_t start = options.cache != nullptr ? options.cache->length() : options.position_start;
  at::Tensor h = embed(input_ids);
  for (int64_t layer = 0; layer < config_.num_layers; ++layer) {
    h = decoder_layer(layer, h, start, options.cache, options.observer);
  }
  if (options.cache != nullptr) options.cache->commit(input_ids.size(1));
  return final_norm(h);
}

at::Tensor Transformer::logits(const at::Tensor& hidden) const {
  return at::linear(hidden, lm_head_).to(at::kFloat);
}

at::Tensor Transformer::forward(const at::Tensor& input_ids, const ForwardOptions& options) const {
  return logits(hidden_states(input_ids, options));
}

}  // namespace kvforge
