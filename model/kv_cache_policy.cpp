#include "model/kv_cache_policy.h"

#include <stdexcept>

namespace kvforge {

at::Tensor KVCachePolicy::append_and_attend(const NewKeysValues&, const at::Tensor&, double, int64_t) {
  // Only reached when a policy says attends() without implementing it.
  throw std::logic_error("KVCachePolicy::append_and_attend: this policy does not attend (attends() is false)");
}

}  // namespace kvforge
