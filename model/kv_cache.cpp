#include "model/kv_cache.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>

namespace kvforge {

KVCache::KVCache(const ModelConfig& config, int64_t batch, int64_t capacity, c10::Device device,
                 c10::ScalarType dtype)
    : batch_(batch), capacity_(capacity) {
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  for (int64_t layer = 0; layer < config.num_layers; ++layer) {
    keys_.push_back(at::empty({batch, config.num_kv_heads, capacity, config.head_dim}, options));
    values_.push_back(at::empty({batch, config.num_kv_heads, capacity, config.head_dim}, options));
  }
}

CachedKeysValues KVCache::append(const NewKeysValues& block) {
  const int64_t tokens = block.keys.size(2);
  if (block.position_start != length_) {
    throw std::invalid_argument("KV cache: a block at position " + std::to_string(block.position_start) +
                                " appended to a cache of length " + std::to_string(length_));
  }
  if (length_ + tokens > capacity_) {
    throw std::length_error("KV cache full: " + std::to_string(length_) + " + " +
                            std::to_string(tokens) + " tokens exceed capacity " +
                            std::to_string(capacity_));
  }
  auto& layer_keys = keys_.at(static_cast<std::size_t>(block.layer));
  auto& layer_values = values_.at(static_cast<std::size_t>(block.layer));
  layer_keys.narrow(2, length_, tokens).copy_(block.keys);
  layer_values.narrow(2, length_, tokens).copy_(block.values);
  return {layer_keys.narrow(2, 0, length_ + tokens), layer_values.narrow(2, 0, length_ + tokens)};
}

void KVCache::commit(int64_t tokens) { length_ += tokens; }

}  // namespace kvforge
