#include "eval/cache_perplexity.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "eval/cache_policy_factory.h"
#include "log/log.h"
#include "log/progress.h"
#include "model/cpu_vector_math.h"

namespace kvforge {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A batch of windows as the forward pass takes them, and per row the first
// position whose prediction is scored (position t predicts token t + 1).
struct WindowBatch {
  at::Tensor ids;                    // [B, T] int64 on the model's device
  std::vector<int64_t> first_scored;  // per row
};

WindowBatch make_batch(const at::Tensor& all_tokens, std::span<const PerplexityWindow> windows,
                       const PerplexityOptions& options, c10::Device device) {
  const int64_t bos = options.bos ? 1 : 0;
  WindowBatch batch;
  std::vector<at::Tensor> rows;
  for (const PerplexityWindow& window : windows) {
    at::Tensor row = all_tokens.narrow(0, window.stream_begin, window.stream_length);
    if (bos) row = at::cat({at::full({1}, *options.bos, row.options()), row});
    rows.push_back(row);
    // The predicted token at position t is stream index begin + t + 1 - bos.
    batch.first_scored.push_back(window.score_from - window.stream_begin + bos - 1);
  }
  batch.ids = at::stack(rows).to(device);
  return batch;
}

// Feeds the batch to a fresh cache `chunk` positions at a time; on_chunk
// gets each chunk's first position and its logits [B, C, V] (float32).
void prefill_in_chunks(const Transformer& model, KVCachePolicy& cache, const at::Tensor& ids, int64_t chunk,
                       const std::function<void(int64_t, const at::Tensor&)>& on_chunk) {
  ForwardOptions forward;
  forward.cache = &cache;
  const int64_t length = ids.size(1);
  for (int64_t begin = 0; begin < length; begin += chunk) {
    const int64_t count = std::min(chunk, length - begin);
    on_chunk(begin, model.forward(ids.narrow(1, begin, count), forward));
  }
}

// Scores the chunk at `begin` (logits [B, C, V]) against the 16-bit cache's
// logits of the whole batch ([B, T, V]): the positions of each row that the
// protocol scores.
void score_chunk(const WindowBatch& batch, int64_t begin, const at::Tensor& logits, const at::Tensor& reference,
                 CachePerplexityAccumulator& accumulator) {
  const int64_t length = batch.ids.size(1);
  for (int64_t row = 0; row < batch.ids.size(0); ++row) {
    const int64_t from = std::max(begin, batch.first_scored[static_cast<size_t>(row)]);
    const int64_t to = std::min(begin + logits.size(1), length - 1);  // the last position predicts nothing
    if (to <= from) continue;
    const at::Tensor rows = logits[row].narrow(0, from - begin, to - from);
    const at::Tensor targets = batch.ids[row].narrow(0, from + 1, to - from);
    const at::Tensor nll = -at::log_softmax(rows, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1);
    accumulator.add(nll, compare_next_token(reference[row].narrow(0, from, to - from), rows));
  }
}

std::string running_perplexities(std::span<const CachePerplexityAccumulator> accumulators,
                                 std::span<const QuantizerConfig* const> configurations) {
  std::string text = log::concat("ppl ", kFullPrecisionName, " ", accumulators[0].running_perplexity());
  for (size_t i = 0; i < configurations.size(); ++i) {
    text += log::concat(", ", configurations[i]->name, " ", accumulators[i + 1].running_perplexity());
  }
  return text;
}

}  // namespace

NextTokenComparison compare_next_token(const at::Tensor& reference_logits, const at::Tensor& logits,
                                       int64_t slice_elements) {
  if (reference_logits.dim() != 2 || reference_logits.sizes() != logits.sizes()) {
    throw std::invalid_argument("compare_next_token: expected two logit matrices [N, V] of one shape");
  }
  const int64_t positions = logits.size(0);
  const int64_t slice = std::max<int64_t>(1, slice_elements / std::max<int64_t>(1, logits.size(1)));
  std::vector<at::Tensor> kl, same;
  prepare_cpu_vector_math();  // exp below
  for (int64_t begin = 0; begin < positions; begin += slice) {
    const int64_t count = std::min(slice, positions - begin);
    const at::Tensor p_logits = reference_logits.narrow(0, begin, count);
    const at::Tensor q_logits = logits.narrow(0, begin, count);
    const at::Tensor log_p = at::log_softmax(p_logits.to(at::kDouble), -1);
    const at::Tensor log_q = at::log_softmax(q_logits.to(at::kDouble), -1);
    kl.push_back((log_p.exp() * (log_p - log_q)).sum(-1));
    same.push_back(p_logits.argmax(-1) == q_logits.argmax(-1));
  }
  if (kl.empty()) {
    const auto options = logits.options();
    return {at::empty({0}, options.dtype(at::kDouble)), at::empty({0}, options.dtype(at::kBool))};
  }
  return {at::cat(kl), at::cat(same)};
}

double sorted_percentile(std::span<const double> sorted, double fraction) {
  if (sorted.empty()) return 0;
  if (fraction <= 0) return sorted.front();
  if (fraction >= 1) return sorted.back();
  const double position = fraction * static_cast<double>(sorted.size() - 1);
  const auto lower = static_cast<size_t>(position);
  const double weight = position - static_cast<double>(lower);
  const size_t upper = std::min(lower + 1, sorted.size() - 1);
  return (1 - weight) * sorted[lower] + weight * sorted[upper];
}

void CachePerplexityAccumulator::add(const at::Tensor& nll, const NextTokenComparison& comparison) {
  if (nll.numel() != comparison.kl.numel() || nll.numel() != comparison.same_top1.numel()) {
    throw std::invalid_argument("cache perplexity: NLL, KL and top-1 of different position counts");
  }
  const at::Tensor nll_cpu = nll.to(at::kCPU, at::kDouble).contiguous();
  nll_sum_ += nll_cpu.sum().item<double>();
  nll_squared_sum_ += nll_cpu.pow(2).sum().item<double>();
  const at::Tensor kl_cpu = comparison.kl.to(at::kCPU, at::kDouble).contiguous();
  kl_.insert(kl_.end(), kl_cpu.data_ptr<double>(), kl_cpu.data_ptr<double>() + kl_cpu.numel());
  same_top1_ += comparison.same_top1.sum().item<int64_t>();
  positions_ += nll.numel();
}

double CachePerplexityAccumulator::running_perplexity() const {
  return positions_ > 0 ? std::exp(nll_sum_ / static_cast<double>(positions_)) : 1.0;
}

CachePerplexity CachePerplexityAccumulator::result() const {
  CachePerplexity result;
  result.windows = windows_;
  result.tokens_scored = positions_;
  if (positions_ == 0) return result;
  const double n = static_cast<double>(positions_);
  result.mean_nll = nll_sum_ / n;
  const double variance = std::max(0.0, nll_squared_sum_ / n - result.mean_nll * result.mean_nll);
  result.nll_stderr = positions_ > 1 ? std::sqrt(variance / (n - 1)) : 0.0;
  result.perplexity = std::exp(result.mean_nll);
  double kl_sum = 0;
  for (const double kl : kl_) kl_sum += kl;
  result.kl_mean = kl_sum / n;
  std::vector<double> sorted = kl_;
  std::sort(sorted.begin(), sorted.end());
  result.kl_p99 = sorted_percentile(sorted, 0.99);
  result.kl_p999 = sorted_percentile(sorted, 0.999);
  result.top1_agreement = static_cast<double>(same_top1_) / n;
  return result;
}

CachePerplexityResult evaluate_cache_perplexity(const Transformer& model, std::span<const int32_t> stream,
                                                std::span<const QuantizerConfig* const> configurations,
                                                const CachePerplexityOptions& options) {
  if (options.chunk < 1) {
    throw std::invalid_argument("--chunk " + std::to_string(options.chunk) + ": expected a prefill chunk >= 1");
  }
  if (options.windows.batch < 1) {
    throw std::invalid_argument("--batch " + std::to_string(options.windows.batch) + ": expected >= 1");
  }
  const PerplexityOptions& protocol = options.windows;
  const auto windows = plan_perplexity_windows(static_cast<int64_t>(stream.size()), protocol);
  if (windows.empty()) {
    throw std::invalid_argument("the text has " + std::to_string(stream.size()) +
                                " tokens, fewer than one window of --ctx " + std::to_string(protocol.context));
  }
  for (const QuantizerConfig* config : configurations) {
    if (config == nullptr) throw std::invalid_argument("cache perplexity: a null configuration");
  }
  const at::Tensor all_tokens =
      at::from_blob(const_cast<int32_t*>(stream.data()), {static_cast<int64_t>(stream.size())},
                    at::TensorOptions().dtype(at::kInt))
          .to(at::kLong);
  const size_t caches = configurations.size() + 1;
  std::vector<CachePerplexityAccumulator> accumulators(caches);
  std::vector<double> seconds(caches, 0.0);
  log::ProgressMeter progress("cache perplexity", static_cast<int64_t>(windows.size()));
  const auto batch_size = static_cast<size_t>(protocol.batch);
  for (size_t first = 0; first < windows.size(); first += batch_size) {
    const size_t count = std::min(batch_size, windows.size() - first);
    const WindowBatch batch = make_batch(all_tokens, std::span(windows).subspan(first, count), protocol,
                                         model.target().device);
    const int64_t rows = batch.ids.size(0), length = batch.ids.size(1);
    c10::InferenceMode inference;
    // The 16-bit cache first: its logits of every position are the
    // reference the configurations are compared with.
    at::Tensor reference;
    {
      const auto started = Clock::now();
      const std::unique_ptr<KVCachePolicy> cache = make_cache_policy(model, nullptr, rows, length);
      prefill_in_chunks(model, *cache, batch.ids, options.chunk, [&](int64_t begin, const at::Tensor& logits) {
        if (!reference.defined()) reference = at::empty({rows, length, logits.size(2)}, logits.options());
        reference.narrow(1, begin, logits.size(1)).copy_(logits);
        score_chunk(batch, begin, logits, reference, accumulators[0]);
      });
      seconds[0] += seconds_since(started);
    }
    for (size_t i = 0; i < configurations.size(); ++i) {
      const auto started = Clock::now();
      const std::unique_ptr<KVCachePolicy> cache = make_cache_policy(model, configurations[i], rows, length, options.cache);
      prefill_in_chunks(model, *cache, batch.ids, options.chunk, [&](int64_t begin, const at::Tensor& logits) {
        score_chunk(batch, begin, logits, reference, accumulators[i + 1]);
      });
      seconds[i + 1] += seconds_since(started);
    }
    for (CachePerplexityAccumulator& accumulator : accumulators) {
      for (size_t w = 0; w < count; ++w) accumulator.add_window();
    }
    progress.advance(static_cast<int64_t>(count), static_cast<int64_t>(count * caches) * length,
                     running_perplexities(accumulators, configurations));
  }
  progress.finish(running_perplexities(accumulators, configurations));
  CachePerplexityResult result;
  for (const CachePerplexityAccumulator& accumulator : accumulators) result.perplexity.push_back(accumulator.result());
  result.seconds = std::move(seconds);
  return result;
}

}  // namespace kvforge
