#include "model/generation.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <chrono>
#include <optional>
#include <stdexcept>

namespace kvforge {

GenerationResult greedy_generate(const Transformer& model, std::span<const int32_t> prompt,
                                 const GenerationOptions& options) {
  if (prompt.empty()) throw std::invalid_argument("greedy_generate: the prompt has no tokens");
  c10::InferenceMode inference;
  const int64_t prompt_length = static_cast<int64_t>(prompt.size());
  std::optional<KVCache> own_cache;
  KVCachePolicy* cache = options.cache;
  if (cache == nullptr) {
    cache = &own_cache.emplace(model.make_cache(1, prompt_length + options.max_new_tokens));
  } else {
    cache->clear();
  }
  GenerationResult result;
  using Clock = std::chrono::steady_clock;

  auto started = Clock::now();
  const at::Tensor prompt_ids =
      at::from_blob(const_cast<int32_t*>(prompt.data()), {1, prompt_length}, at::TensorOptions().dtype(at::kInt))
          .to(at::kLong);
  // Only the last position's logits are needed after the prompt.
  at::Tensor hidden = model.hidden_states(prompt_ids, {.cache = cache});
  at::Tensor next_logits = model.logits(hidden.narrow(1, prompt_length - 1, 1));
  result.prefill_seconds = std::chrono::duration<double>(Clock::now() - started).count();

  started = Clock::now();
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    const auto token = static_cast<int32_t>(next_logits.view({-1}).argmax().item<int64_t>());
    result.tokens.push_back(token);
    if (options.on_token) options.on_token(token);
    if ((options.stop_token && token == *options.stop_token) || step + 1 == options.max_new_tokens) break;
    const at::Tensor ids = at::full({1, 1}, static_cast<int64_t>(token), at::TensorOptions().dtype(at::kLong));
    next_logits = model.forward(ids, {.cache = cache});
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return result;
}

}  // namespace kvforge
