#pragma once
// A KV cache policy that stores through the runtime kernels (kernels/:
// QuantizedKVCache with the CUDA kernels on a GPU model, their CPU reference
// on a CPU model) and attends with their fused dequantizing decode attention:
// what `kvforge eval --through-kernels` runs, to check the runtime against
// the simulated cache on the same probes.
//
// The kernels decode one query per sequence, so a block of T tokens is fed
// as T decoding steps (append one token, attend with its query): the
// decode-time semantics of SimulatedQuantizedCache at chunk 1. Inputs and
// outputs stay on the model's device (the kernels' zero-copy path). The cache's
// exact elements are in the model's dtype (fp32 models use the fp32
// reference layout). Sliding-window layers are refused.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "formats/quantizer_config.h"
#include "kernels/quantized_kv_cache.h"
#include "model/kv_cache_policy.h"
#include "model/transformer.h"

namespace kvforge {

class KernelKVCache final : public KVCachePolicy {
 public:
  // std::invalid_argument when the runtime cannot serve the configuration
  // for this model (QuantizedKVCache's one-line reasons) or the model is on
  // a CUDA device and kvforge was built without the CUDA kernels.
  KernelKVCache(const Transformer& model, const QuantizerConfig& config, int64_t batch, int64_t capacity);

  int64_t length() const override { return length_; }
  CachedKeysValues append(const NewKeysValues& block) override;  // not used: this policy attends
  bool attends() const override { return true; }
  at::Tensor append_and_attend(const NewKeysValues& block, const at::Tensor& queries, double scale,
                               int64_t window) override;
  void commit(int64_t tokens) override { length_ += tokens; }
  void clear() override;

 private:
  kernels::QuantizedKVCache cache_;
  bool keys_pre_rope_;
  float softmax_scale_;
  std::vector<int32_t> sequences_;
  int64_t length_ = 0;
};

}  // namespace kvforge
