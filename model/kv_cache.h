#pragma once
// The incremental key/value cache of full-precision decoding: per layer,
// preallocated [batch, kv_heads, capacity, head_dim] tensors holding keys
// after RoPE and values, filled as tokens arrive.
#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

#include "formats/hf_config.h"

namespace kvforge {

class KVCache {
 public:
  KVCache(const ModelConfig& config, int64_t batch, int64_t capacity, c10::Device device,
          c10::ScalarType dtype);

  int64_t length() const { return length_; }  // tokens already committed
  int64_t capacity() const { return capacity_; }
  int64_t batch() const { return batch_; }

  // Writes `keys`/`values` [batch, kv_heads, T, head_dim] for `layer` at
  // positions [length, length + T) and returns the cache contents up to
  // length + T. Every layer appends the same T before commit(T).
  std::pair<at::Tensor, at::Tensor> append(int64_t layer, const at::Tensor& keys,
                                           const at::Tensor& values);
  void commit(int64_t tokens);
  void clear() { length_ = 0; }

 private:
  std::vector<at::Tensor> keys_;
  std::vector<at::Tensor> values_;
  int64_t batch_;
  int64_t capacity_;
  int64_t length_ = 0;
};

}  // namespace kvforge
