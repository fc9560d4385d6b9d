#pragma once
// Perplexity of a model over a token stream, with the protocol of
// llama.cpp's perplexity tool and of the pyllama-16m README:
//   - the stream is cut into windows of `context` positions; with add_bos,
//     position 0 of every window holds BOS and the rest holds
//     context - 1 stream tokens;
//   - window k starts at stream offset k * stride; only whole windows are
//     evaluated (the remainder is dropped);
//   - each stream token is scored once, in the first window that predicts
//     it: all predicted tokens of window 0, then the tokens past the end of
//     the previous window. With the default stride (the window's stream
//     length) windows do not overlap and every predicted token is scored.
// perplexity = exp(mean NLL over all scored tokens).
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "model/transformer.h"

namespace kvforge {

struct PerplexityOptions {
  int64_t context = 2048;
  std::optional<int64_t> stride;  // stream tokens between window starts
  std::optional<int32_t> bos;     // prepended to every window when set
  int64_t batch = 1;              // windows per forward pass
  std::optional<int64_t> max_windows;
};

struct PerplexityWindow {
  int64_t stream_begin = 0;  // first stream token in the window
  int64_t stream_length = 0; // stream tokens in the window
  int64_t score_from = 0;    // first stream index this window scores
};

struct PerplexityResult {
  int64_t windows = 0;
  int64_t tokens_scored = 0;
  double mean_nll = 0;
  double nll_stderr = 0;  // standard error of the mean NLL over tokens
  double perplexity = 0;
  std::vector<double> window_mean_nll;
  double seconds = 0;
  double tokens_per_second = 0;  // positions evaluated per second
};

// Pure: which windows the protocol evaluates. Throws std::invalid_argument
// for a context or stride that cannot work.
std::vector<PerplexityWindow> plan_perplexity_windows(int64_t stream_tokens,
                                                      const PerplexityOptions& options);

PerplexityResult evaluate_perplexity(const Transformer& model, std::span<const int32_t> stream,
                                     const PerplexityOptions& options);

}  // namespace kvforge
