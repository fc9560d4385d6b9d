#pragma once
// Perplexity through a KV cache, for the 16-bit cache and any number of
// artifact configurations side by side, and each configuration's next-token
// distributions against the 16-bit cache's on the same positions (llama.cpp's
// `perplexity --kl-divergence`).
//
// Protocol: the windows, BOS handling and scored tokens of
// evaluate_perplexity (eval/perplexity.h, plan_perplexity_windows); the NLL
// is -log_softmax(logits in float32)[target] as there, so the 16-bit cache
// gives `kvforge perplexity`'s numbers. Every window is fed to a fresh cache
// (make_cache_policy) as chunked prefill: Transformer::forward on `chunk`
// positions, then the next `chunk`... (chunk >= the window: one pass). The
// 16-bit cache runs first; each configuration then runs the same tokens.
//
// What a chunk sees: a quantizing cache (eval/simulated_quantized_cache.h)
// quantizes, after each chunk, what a cache of that many tokens quantizes,
// and the chunk's queries attend over that. With chunk 1 that is exactly
// decoding (every query sees what its decoding step sees). With a larger
// chunk, a query early in the chunk also sees quantized the tokens that
// leave the 16-bit windows (sink, residual, block flush, token groups)
// later in the same chunk: a superset of what decoding quantizes, so the
// chunk size is a speed/fidelity trade-off for windowed configurations. For
// configurations whose quantized tokens of a prefix do not depend on later
// tokens (per-token groupings, no residual window) every chunk size gives
// decoding's numbers.
//
// Against the 16-bit cache, per scored position: KL(P_fp16 || P_config) =
// sum_v p_v (log p_v - log q_v) with both log-softmaxes in float64, and
// whether the argmax of the logits is the same token (ties: the lowest
// token id). Percentiles of the per-position KL are llama.cpp's: sorted
// values x_0..x_{n-1}, position f (n - 1), linear interpolation between the
// two neighbouring ranks (numpy's default "linear").
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <span>
#include <vector>

#include "eval/cache_policy_factory.h"
#include "eval/evaluation.h"
#include "eval/perplexity.h"
#include "formats/quantizer_config.h"
#include "model/transformer.h"

namespace kvforge {

struct CachePerplexityOptions {
  // context, stride, bos, batch (windows per forward pass) and max_windows,
  // as for evaluate_perplexity.
  PerplexityOptions windows;
  int64_t chunk = 512;  // prefill chunk in positions (>= context: one pass)
  QuantizedCacheKind cache = QuantizedCacheKind::kSimulated;  // how the configurations run
};

struct CachePerplexityResult {
  std::vector<CachePerplexity> perplexity;  // [0]: the 16-bit cache, then the configurations in order
  std::vector<double> seconds;              // forward and scoring time, same order
};

// configurations: each must fit the model (make_cache_policy's
// std::invalid_argument otherwise). std::invalid_argument for a chunk < 1
// or a text shorter than one window (evaluate_perplexity's message).
CachePerplexityResult evaluate_cache_perplexity(const Transformer& model, std::span<const int32_t> stream,
                                                std::span<const QuantizerConfig* const> configurations,
                                                const CachePerplexityOptions& options);

// Pure: per row of two logit matrices [N, V] (any float dtype, one device),
// KL(softmax(reference) || softmax(logits)) in float64 [N] and whether the
// argmax agrees (bool [N]). Rows are processed in slices of at most
// slice_elements logits so that the float64 copies stay small for large
// vocabularies (the default: 2^24, 128 MiB per copy).
struct NextTokenComparison {
  at::Tensor kl;         // float64 [N]
  at::Tensor same_top1;  // bool [N]
};
inline constexpr int64_t kComparisonSliceElements = int64_t{1} << 24;
NextTokenComparison compare_next_token(const at::Tensor& reference_logits, const at::Tensor& logits,
                                       int64_t slice_elements = kComparisonSliceElements);

// llama.cpp's percentile of sorted (ascending) values: see the header
// comment. fraction in [0, 1]; 0 for no values.
double sorted_percentile(std::span<const double> sorted, double fraction);

// Sums what one configuration scored, position by position, into
// CachePerplexity. Keeps the per-position KL values (for the percentiles)
// and running sums of everything else.
class CachePerplexityAccumulator {
 public:
  // One span of scored positions: NLL [N] (any float dtype), and the
  // comparison against the 16-bit cache of the same positions. Any device.
  void add(const at::Tensor& nll, const NextTokenComparison& comparison);
  void add_window() { ++windows_; }

  // mean NLL, its standard error (sqrt of the population variance over
  // n - 1, as evaluate_perplexity), perplexity = exp(mean NLL), KL mean and
  // p99 / p99.9, top-1 agreement. All 0 (top-1 1) before any position.
  CachePerplexity result() const;
  int64_t positions() const { return positions_; }
  // exp(mean NLL) so far (1 before any position), without result()'s sort.
  double running_perplexity() const;

 private:
  int64_t windows_ = 0;
  int64_t positions_ = 0;
  double nll_sum_ = 0, nll_squared_sum_ = 0;
  int64_t same_top1_ = 0;
  std::vector<double> kl_;
};

}  // namespace kvforge
