#include "eval/cache_policy_factory.h"

#include "eval/simulated_quantized_cache.h"
#include "model/kv_cache.h"

namespace kvforge {

std::unique_ptr<KVCachePolicy> make_cache_policy(const Transformer& model, const QuantizerConfig* config,
                                                 int64_t batch, int64_t capacity) {
  const ComputeTarget& target = model.target();
  if (config == nullptr) {
    return std::make_unique<KVCache>(model.config(), batch, capacity, target.device, target.dtype);
  }
  return std::make_unique<SimulatedQuantizedCache>(model.config(), *config, model.rope(), batch, capacity,
                                                   target.device, target.dtype);
}

}  // namespace kvforge
