#pragma once
// The KV cache a configuration is evaluated through: the model's own
// full-precision cache for the 16-bit baseline (no configuration), the
// simulated quantizing cache (simulated_quantized_cache.h) for an artifact
// configuration; in the model's dtype and on its device either way.
#include <cstdint>
#include <memory>

#include "formats/quantizer_config.h"
#include "model/kv_cache_policy.h"
#include "model/transformer.h"

namespace kvforge {

// How a configuration's quantized cache is run: simulated
// (simulated_quantized_cache.h, the reference quantizer) or through the
// runtime kernels (kernel_kv_cache.h: `eval --through-kernels`).
enum class QuantizedCacheKind { kSimulated, kKernels };

// config == nullptr: the 16-bit cache (whatever `kind`). std::invalid_argument
// when the configuration does not fit the model (layer count) or the
// runtime cannot serve it.
std::unique_ptr<KVCachePolicy> make_cache_policy(const Transformer& model, const QuantizerConfig* config,
                                                 int64_t batch, int64_t capacity,
                                                 QuantizedCacheKind kind = QuantizedCacheKind::kSimulated);

}  // namespace kvforge
