#pragma once
// Greedy decoding of a batch of equal-length prompts through a KV cache
// policy, the way a server meets a prompt: the prompt is prefilled in chunks
// of `chunk` tokens (each chunk a forward pass through the cache, so a
// quantizing cache's decode-time windows hold at every chunk boundary), then
// one token per row per step. The needle probes and the user's tasks both
// score answers with it.
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "eval/cache_policy_factory.h"
#include "formats/quantizer_config.h"
#include "model/kv_cache_policy.h"
#include "model/transformer.h"

namespace kvforge {

// Makes the cache one batch is decoded through: `batch` rows, `capacity`
// positions. Tests hand in their own policies; eval hands in
// cache_policy_maker's.
using CachePolicyMaker = std::function<std::unique_ptr<KVCachePolicy>(int64_t batch, int64_t capacity)>;

// make_cache_policy (eval/cache_policy_factory.h) of one configuration:
// config == nullptr is the 16-bit cache. `model` and `config` must outlive
// the maker.
CachePolicyMaker cache_policy_maker(const Transformer& model, const QuantizerConfig* config,
                                    QuantizedCacheKind kind = QuantizedCacheKind::kSimulated);

struct CachedGreedyOptions {
  int64_t chunk = 512;         // prompt tokens per prefill pass (>= 1)
  int64_t max_new_tokens = 16;  // per row
};

// Whether row `row` needs no more tokens, given the tokens chosen for it so
// far (never empty when called). An empty function: never finished.
using RowFinished = std::function<bool(size_t row, std::span<const int32_t> chosen)>;

// One row's greedy decoding. margins[i] is the decision margin of step i:
// the chosen token's logit minus the runner-up's (the largest logit of any
// other token), >= 0, in the logits' own arithmetic (widened to double
// after the model's dtype). A margin near 0 is a near-tie: another
// arithmetic of the same cache (the runtime kernels against the simulated
// quantizer, a GPU against the CPU) may choose the other token there.
struct GreedyDecoding {
  std::vector<int32_t> tokens;
  std::vector<double> margins;  // one per token
};

// prompts: B rows of the same length T >= 1. `cache` is cleared first and
// must hold B rows and T + max_new_tokens positions. Returns per row the
// greedy (argmax) tokens up to the step where `finished` first said yes for
// that row, or max_new_tokens, with their margins; decoding stops once every
// row is finished. std::invalid_argument for ragged or empty prompts, a
// chunk < 1 or a vocabulary of fewer than 2 tokens.
std::vector<GreedyDecoding> greedy_decode_through_cache(const Transformer& model,
                                                        const std::vector<std::vector<int32_t>>& prompts,
                                                        KVCachePolicy& cache, const CachedGreedyOptions& options,
                                                        const RowFinished& finished);

}  // namespace kvforge
