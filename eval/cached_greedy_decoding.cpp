#include "eval/cached_greedy_decoding.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "eval/cache_policy_factory.h"

namespace kvforge {
namespace {

at::Tensor prompt_matrix(const std::vector<std::vector<int32_t>>& prompts) {
  if (prompts.empty()) throw std::invalid_argument("greedy decoding: no prompts");
  const int64_t length = static_cast<int64_t>(prompts.front().size());
  if (length < 1) throw std::invalid_argument("greedy decoding: an empty prompt");
  at::Tensor ids = at::empty({static_cast<int64_t>(prompts.size()), length}, at::kLong);
  auto rows = ids.accessor<int64_t, 2>();
  for (size_t row = 0; row < prompts.size(); ++row) {
    if (static_cast<int64_t>(prompts[row].size()) != length) {
      throw std::invalid_argument("greedy decoding: prompt " + std::to_string(row) + " has " +
                                  std::to_string(prompts[row].size()) + " tokens, prompt 0 has " +
                                  std::to_string(length) + " (a batch needs equal lengths)");
    }
    for (int64_t t = 0; t < length; ++t) rows[static_cast<int64_t>(row)][t] = prompts[row][static_cast<size_t>(t)];
  }
  return ids;
}

}  // namespace

CachePolicyMaker cache_policy_maker(const Transformer& model, const QuantizerConfig* config, QuantizedCacheKind kind) {
  return [&model, config, kind](int64_t batch, int64_t capacity) {
    return make_cache_policy(model, config, batch, capacity, kind);
  };
}

std::vector<GreedyDecoding> greedy_decode_through_cache(const Transformer& model,
                                                        const std::vector<std::vector<int32_t>>& prompts,
                                                        KVCachePolicy& cache, const CachedGreedyOptions& options,
                                                        const RowFinished& finished) {
  if (model.config().vocab_size < 2) {
    throw std::invalid_argument("greedy decoding: a vocabulary of " + std::to_string(model.config().vocab_size) +
                                " tokens has no runner-up to measure a margin against");
  }
  if (options.chunk < 1) {
    throw std::invalid_argument("greedy decoding: prefill chunk " + std::to_string(options.chunk) +
                                ", expected >= 1");
  }
  c10::InferenceMode inference;
  const at::Tensor ids = prompt_matrix(prompts).to(model.target().device);
  const int64_t rows = ids.size(0), length = ids.size(1);
  cache.clear();

  // Only the last prompt position's logits matter: keep hidden states, not
  // [B, chunk, vocab] logits.
  at::Tensor last_hidden;
  for (int64_t start = 0; start < length; start += options.chunk) {
    const int64_t count = std::min(options.chunk, length - start);
    const at::Tensor hidden = model.hidden_states(ids.narrow(1, start, count), {.cache = &cache});
    if (start + count == length) last_hidden = hidden.narrow(1, count - 1, 1);
  }
  at::Tensor logits = model.logits(last_hidden);  // [B, 1, V]

  std::vector<GreedyDecoding> chosen(static_cast<size_t>(rows));
  std::vector<bool> done(static_cast<size_t>(rows), false);
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    const at::Tensor step_logits = logits.select(1, 0);  // [B, V]
    const at::Tensor next = step_logits.argmax(-1);      // [B]
    // The two largest logits (in the model's dtype): their gap is the margin
    // (argmax picks one of them; equal values give margin 0 either way).
    const at::Tensor top2 = std::get<0>(step_logits.topk(2, -1)).to(at::kCPU, at::kDouble).contiguous();
    const at::Tensor next_cpu = next.to(at::kCPU).contiguous();
    const int64_t* tokens = next_cpu.data_ptr<int64_t>();
    const double* top = top2.data_ptr<double>();
    bool all_done = true;
    for (size_t row = 0; row < chosen.size(); ++row) {
      if (done[row]) continue;
      chosen[row].tokens.push_back(static_cast<int32_t>(tokens[row]));
      chosen[row].margins.push_back(top[2 * row] - top[2 * row + 1]);
      done[row] = finished && finished(row, chosen[row].tokens);
      all_done = all_done && done[row];
    }
    if (all_done || step + 1 == options.max_new_tokens) break;
    // Finished rows keep decoding in the batch (a cache cannot drop rows);
    // their tokens are no longer recorded.
    logits = model.forward(next.view({rows, 1}), {.cache = &cache});
  }
  return chosen;
}

}  // namespace kvforge
