#pragma once
// A KV cache policy that stores nothing useful: every cached key and value
// reads back as zero (attention then averages zero vectors), the cache a
// quantizer that destroyed everything would be. Needle and task scores must
// collapse through it.
#include <ATen/ATen.h>

#include "model/kv_cache_policy.h"

namespace kvforge::testing {

class ZeroedCachePolicy final : public KVCachePolicy {
 public:
  int64_t length() const override { return length_; }
  CachedKeysValues append(const NewKeysValues& block) override {
    const int64_t positions = block.position_start + block.keys.size(2);
    auto shape = block.keys.sizes().vec();
    shape[2] = positions;
    return {at::zeros(shape, block.keys.options()), at::zeros(shape, block.values.options())};
  }
  void commit(int64_t tokens) override { length_ += tokens; }
  void clear() override { length_ = 0; }

 private:
  int64_t length_ = 0;
};

}  // namespace kvforge::testing
