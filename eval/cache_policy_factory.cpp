#include "eval/cache_policy_factory.h"

#include "eval/kernel_kv_cache.h"
#include "eval/simulated_quantized_cache.h"
#include "model/kv_cache.h"

namespace kvforge {

std::unique_ptr<KVCachePolicy> make_cache_policy(const Transformer& model, const QuantizerConfig* config,
                                                 int64_t batch, int64_t capacity, QuantizedCacheKind kind) {
  const ComputeTarget& target = model.target();
  if (config == nullptr) {
    return std::make_unique<KVCache>(model.config(), batch, capacity, target.device, target.dtype);
  }
  if (kind == QuantizedCacheKind::kKernels) return std::make_unique<KernelKVCache>(model, *config, batch, capacity);
  return std::make_unique<SimulatedQuantizedCache>(model.config(), *config, model.rope(), batch, capacity,
                                                   target.device, target.dtype);
}

}  // namespace kvforge
