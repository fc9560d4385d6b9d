#pragma once
// A KV cache policy (model/kv_cache_policy.h) that stores keys and values as
// a quantizer configuration from an artifact would, in simulation: what
// `kvforge eval` runs the model through to measure a configuration with
// decode-time semantics, and the oracle the runtime kernels must agree with.
//
// Semantics (docs/artifact.md's windows, applied as tokens arrive): after a
// block of T tokens is appended to a cache of length L, the cache holds
// S = L + T tokens; the tokens the configuration quantizes in a window of S
// tokens (quantized_tokens(): not the sink, not the residual window) are
// read back dequantized, the others exactly, and the block's queries attend
// over all S, the block's own tokens included, exactly as stored. A token,
// once quantized, keeps its dequantized value: every grouping's groups are
// fixed when they are formed (per token, or G-token blocks tiled from the
// sink), so streaming a window in any chunks reads back what
// quantize_dequantize_keys/values give for the whole window at once (the
// test says so for every prefix).
//
// Keys quantized before RoPE (kvquant) are stored pre-RoPE and rotated to
// their positions on read-back; rotations (formats/kv_rotation.h) are
// applied and undone by the simulation, so what attention reads is in the
// model's own domain.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "formats/hf_config.h"
#include "formats/quantizer_config.h"
#include "model/kv_cache_policy.h"
#include "model/rope.h"

namespace kvforge {

class SimulatedQuantizedCache final : public KVCachePolicy {
 public:
  // std::invalid_argument when the configuration does not fit the model
  // (layer count, and the first quantization of a layer checks the shapes).
  SimulatedQuantizedCache(const ModelConfig& model, QuantizerConfig config, const RotaryEmbedding& rope,
                          int64_t batch, int64_t capacity, c10::Device device, c10::ScalarType dtype);

  int64_t length() const override { return length_; }
  CachedKeysValues append(const NewKeysValues& block) override;
  void commit(int64_t tokens) override;
  void clear() override;

  const QuantizerConfig& config() const { return config_; }

 private:
  struct Layer {
    at::Tensor keys;           // exact, after RoPE [B, kv_heads, capacity, D]
    at::Tensor keys_pre_rope;  // exact, before RoPE (pre-RoPE configurations only)
    at::Tensor values;         // exact
    at::Tensor read_keys;      // what attention reads: dequantized where quantized
    at::Tensor read_values;
    int64_t keys_quantized_end = 0;    // positions [sink, end) are quantized
    int64_t values_quantized_end = 0;
  };
  void quantize_new_keys(int64_t layer, Layer& state, int64_t end);
  void quantize_new_values(int64_t layer, Layer& state, int64_t end);

  QuantizerConfig config_;
  // config_ with no windows (sink 0, residual 0, sliding): quantizes every
  // token of a sub-range [a, b) of whole groups, as the window would.
  QuantizerConfig stream_config_;
  const RotaryEmbedding& rope_;
  int64_t batch_, capacity_;
  int64_t length_ = 0;
  std::vector<Layer> layers_;
};

}  // namespace kvforge
