#pragma once
// What the forward pass stores keys and values in and reads them back from:
// the model's KV cache as a policy (llama.cpp's llama_memory_i). Every
// attention layer hands its block of new tokens to the policy and attends
// over exactly what the policy returns, so a quantizing cache stands in for
// the full-precision one without the model knowing. Implementations:
// KVCache (model/kv_cache.h) keeps keys and values in the model dtype.
//
// Semantics the forward pass relies on (Transformer::hidden_states):
// - a pass of T tokens starts at position length(); every layer, in layer
//   order, calls append() once with those T tokens; then commit(T);
// - append() returns the keys after RoPE and the values the new tokens'
//   queries attend over: positions [0, position_start + T), position j at
//   index j (the causal and sliding-window masks are built on that), in the
//   model dtype and on its device. What a policy returns for the earlier
//   positions (dequantized, altered, the new tokens at full precision) is
//   its choice: decode-time semantics (which tokens stay at full precision
//   at each step) live in the policy.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvforge {

// One layer's new tokens as the attention computed them: T tokens at the
// absolute positions [position_start, position_start + T).
struct NewKeysValues {
  int64_t layer = 0;
  int64_t position_start = 0;
  at::Tensor keys_pre_rope;  // [B, kv_heads, T, head_dim], after k_norm
  at::Tensor keys;           // [B, kv_heads, T, head_dim], after RoPE
  at::Tensor values;         // [B, kv_heads, T, head_dim]
};

// What attention reads: S = position_start + T positions.
struct CachedKeysValues {
  at::Tensor keys;    // [B, kv_heads, S, head_dim], after RoPE
  at::Tensor values;  // [B, kv_heads, S, head_dim]
  int64_t length() const { return keys.size(2); }
};

class KVCachePolicy {
 public:
  virtual ~KVCachePolicy() = default;
  // Tokens already committed; the next pass starts at this position.
  virtual int64_t length() const = 0;
  // Stores `block` and returns what the block's queries attend over.
  // A policy that keeps keys before RoPE (KVQuant) rotates them again on
  // read-back: RotaryEmbedding (model/rope.h, Transformer::rope()) gives the
  // tables of any positions.
  virtual CachedKeysValues append(const NewKeysValues& block) = 0;
  // A policy that attends itself (the runtime kernels' fused dequantizing
  // attention, kernels/) says so here; the forward pass then calls
  // append_and_attend() instead of append() and attending over its result.
  virtual bool attends() const { return false; }
  // Stores `block` (as append() would) and returns the attention output of
  // its queries [B, heads, T, D] (after RoPE, the model dtype) over the
  // cache, causal within the block, softmax scale `scale`, grouped-query
  // heads sharing KV heads in order; `window` > 0 is a sliding window (a
  // policy that cannot do it throws std::invalid_argument naming it).
  virtual at::Tensor append_and_attend(const NewKeysValues& block, const at::Tensor& queries, double scale,
                                       int64_t window);
  // Ends a pass: the T tokens every layer appended are now part of the cache.
  virtual void commit(int64_t tokens) = 0;
  virtual void clear() = 0;
};

}  // namespace kvforge
