#pragma once
// The incremental key/value cache of full-precision decoding, the KV cache
// policy (model/kv_cache_policy.h) the model uses unless given another: per
// layer, preallocated [batch, kv_heads, capacity, head_dim] tensors in the
// model dtype holding keys after RoPE and values, filled as tokens arrive;
// append() returns views of them, unchanged.
#include <ATen/core/Tensor.h>

#include <vector>

#include "formats/hf_config.h"
#include "model/kv_cache_policy.h"

namespace kvforge {

class KVCache final : public KVCachePolicy {
 public:
  KVCache(const ModelConfig& config, int64_t batch, int64_t capacity, c10::Device device,
          c10::ScalarType dtype);

  int64_t length() const override { return length_; }  // tokens already committed
  int64_t capacity() const { return capacity_; }
  int64_t batch() const { return batch_; }

  // Writes the block's keys (after RoPE) and values for its layer at
  // positions [length, length + T) and returns the cache contents up to
  // length + T. Every layer appends the same T before commit(T).
  CachedKeysValues append(const NewKeysValues& block) override;
  void commit(int64_t tokens) override;
  void clear() override { length_ = 0; }

 private:
  std::vector<at::Tensor> keys_;
  std::vector<at::Tensor> values_;
  int64_t batch_;
  int64_t capacity_;
  int64_t length_ = 0;
};

}  // namespace kvforge
