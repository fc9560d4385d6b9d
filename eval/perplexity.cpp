#include "eval/perplexity.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>

#include "log/log.h"
#include "log/progress.h"

namespace kvforge {

std::vector<PerplexityWindow> plan_perplexity_windows(int64_t stream_tokens,
                                                      const PerplexityOptions& options) {
  const int64_t bos = options.bos ? 1 : 0;
  const int64_t length = options.context - bos;
  if (length < (bos ? 1 : 2)) {
    throw std::invalid_argument("--ctx " + std::to_string(options.context) +
                                ": too short to predict any token");
  }
  const int64_t stride = options.stride.value_or(length);
  if (stride < 1 || stride > length) {
    throw std::invalid_argument("--stride " + std::to_string(stride) + ": expected 1.." +
                                std::to_string(length) + " (the window's stream tokens)");
  }
  std::vector<PerplexityWindow> windows;
  int64_t scored_until = 0;
  for (int64_t begin = 0; begin + length <= stream_tokens; begin += stride) {
    if (options.max_windows && static_cast<int64_t>(windows.size()) >= *options.max_windows) break;
    // Without BOS the first stream token of window 0 has no prediction.
    const int64_t first_predictable = bos ? begin : begin + 1;
    windows.push_back({begin, length, std::max(scored_until, first_predictable)});
    scored_until = begin + length;
  }
  return windows;
}

PerplexityResult evaluate_perplexity(const Transformer& model, std::span<const int32_t> stream,
                                     const PerplexityOptions& options) {
  const auto windows = plan_perplexity_windows(static_cast<int64_t>(stream.size()), options);
  if (windows.empty()) {
    throw std::invalid_argument("the text has " + std::to_string(stream.size()) +
                                " tokens, fewer than one window of --ctx " +
                                std::to_string(options.context));
  }
  const int64_t bos = options.bos ? 1 : 0;
  const auto device = model.target().device;
  const at::Tensor all_tokens =
      at::from_blob(const_cast<int32_t*>(stream.data()), {static_cast<int64_t>(stream.size())},
                    at::TensorOptions().dtype(at::kInt))
          .to(at::kLong);

  PerplexityResult result;
  double nll_sum = 0;
  double nll_sq_sum = 0;
  log::ProgressMeter progress("perplexity", static_cast<int64_t>(windows.size()));
  const auto started = std::chrono::steady_clock::now();
  for (size_t first = 0; first < windows.size(); first += static_cast<size_t>(options.batch)) {
    const size_t count = std::min(static_cast<size_t>(options.batch), windows.size() - first);
    std::vector<at::Tensor> rows;
    for (size_t i = first; i < first + count; ++i) {
      at::Tensor row = all_tokens.narrow(0, windows[i].stream_begin, windows[i].stream_length);
      if (bos) row = at::cat({at::full({1}, *options.bos, row.options()), row});
      rows.push_back(row);
    }
    const at::Tensor ids = at::stack(rows).to(device);
    at::Tensor nll;
    {
      c10::InferenceMode inference;
      const at::Tensor logits = model.forward(ids);  // [B, T, V] float32
      // Position t predicts token t + 1.
      const at::Tensor log_probs = at::log_softmax(logits.narrow(1, 0, ids.size(1) - 1), -1);
      nll = -log_probs.gather(-1, ids.narrow(1, 1, ids.size(1) - 1).unsqueeze(-1)).squeeze(-1);
    }
    const at::Tensor nll_cpu = nll.to(at::kCPU, at::kDouble).contiguous();
    for (size_t i = 0; i < count; ++i) {
      const auto& window = windows[first + i];
      // Predicted token at position t (t >= 1) is stream index begin + t - bos.
      const int64_t first_pos = window.score_from - window.stream_begin + bos - 1;
      const at::Tensor scored = nll_cpu[static_cast<int64_t>(i)].narrow(0, first_pos, nll_cpu.size(1) - first_pos);
      const double sum = scored.sum().item<double>();
      nll_sum += sum;
      nll_sq_sum += scored.pow(2).sum().item<double>();
      result.tokens_scored += scored.numel();
      result.window_mean_nll.push_back(sum / static_cast<double>(scored.numel()));
    }
    result.windows += static_cast<int64_t>(count);
    const double running = std::exp(nll_sum / static_cast<double>(result.tokens_scored));
    progress.advance(static_cast<int64_t>(count), static_cast<int64_t>(count) * ids.size(1),
                     log::concat("ppl ", running));
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const double n = static_cast<double>(result.tokens_scored);
  result.mean_nll = nll_sum / n;
  const double variance = std::max(0.0, nll_sq_sum / n - result.mean_nll * result.mean_nll);
  result.nll_stderr = n > 1 ? std::sqrt(variance / (n - 1)) : 0.0;
  result.perplexity = std::exp(result.mean_nll);
  result.tokens_per_second =
      result.seconds > 0 ? static_cast<double>(result.windows * options.context) / result.seconds : 0;
  progress.finish(log::concat("perplexity ", result.perplexity));
  return result;
}

}  // namespace kvforge
