#pragma once
// What a configuration costs in cache memory, for the comparison table and
// the frontier chart: effective bits per cached element at the evaluated
// context (calib/effective_bits.h, keys and values averaged) and cache bytes
// per token over all layers, keys and values:
//   bytes/token = effective_bits / 8 x 2 (keys, values) x layers x kv_heads x head_dim
// (ModelConfig::kv_bytes_per_token). What the bits count: the b-bit codes,
// the 16-bit scale and offset of every group, the sparse outliers (value,
// index and per-token row pointer) and the 16-bit sink and residual windows
// of each tensor's residual rule, amortized over the context; offline
// per-channel scales (KVQuant keys) amortized over the context too. Not
// counted: rotation matrices and the fitted grids, which are per-layer
// model parameters, not per-token cache.
// The 16-bit cache is 16 bits: 2 bytes x 2 x layers x kv_heads x head_dim
// per token, whatever dtype the model runs in.
#include <cstdint>
#include <optional>

#include "calib/effective_bits.h"
#include "eval/evaluation.h"
#include "formats/hf_config.h"
#include "formats/quantizer_config.h"

namespace kvforge {

// A ConfigurationEvaluation with name, method, bits, rotated,
// effective_bits and cache_bytes_per_token set and nothing measured yet.
// config == nullptr: the 16-bit cache (kFullPrecisionName, method "fp16",
// 16 bits). measured: outlier shares measured on activations instead of the
// configured ones (effective_bits.h). std::invalid_argument for a context
// < 1 or a configuration whose layer count is not the model's.
ConfigurationEvaluation describe_configuration(const QuantizerConfig* config, const ModelConfig& model,
                                               int64_t context,
                                               const std::optional<OutlierFractions>& measured = std::nullopt);

}  // namespace kvforge
