#pragma once
// Greedy decoding through the incremental KV cache: one forward pass over
// the prompt, then one token at a time.
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include "model/transformer.h"

namespace kvforge {

struct GenerationOptions {
  int64_t max_new_tokens = 64;
  std::optional<int32_t> stop_token;  // generation ends after emitting it
  // Called with each new token as soon as it is chosen (streaming output).
  std::function<void(int32_t)> on_token;
  // The KV cache policy decoding goes through (cleared first); by default a
  // full-precision KVCache of the prompt plus max_new_tokens positions.
  KVCachePolicy* cache = nullptr;
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // new tokens only
  double prefill_seconds = 0;
  double decode_seconds = 0;
};

GenerationResult greedy_generate(const Transformer& model, std::span<const int32_t> prompt,
                                 const GenerationOptions& options);

}  // namespace kvforge
