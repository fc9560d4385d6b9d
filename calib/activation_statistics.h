#pragma once
// Per-channel statistics of an activation store, as llama.cpp's imatrix
// --show-statistics does for weights: which channels carry outliers (mean
// magnitude far above the median channel's) and how heavy their tails are
// (kurtosis), per layer, for keys before and after RoPE and for values.
#include <cstdint>
#include <vector>

#include "formats/activation_store.h"

namespace kvforge {

struct ChannelStatistics {
  ActivationField field = ActivationField::kKeysPreRope;
  int64_t layer = 0;
  int64_t tokens = 0;              // per channel
  std::vector<double> mean_abs;    // [heads * head_dim], index = head * head_dim + dim
  std::vector<double> kurtosis;    // E[(x - mean)^4] / var^2 (3 for a Gaussian)
  double max_over_median = 0;      // of mean_abs: large means outlier channels
  std::vector<int64_t> top_channels;  // the largest mean_abs first
};

// Statistics of `field` for every layer over the first `max_samples`
// complete samples (all when <= 0). `top` channels are listed per layer.
std::vector<ChannelStatistics> channel_statistics(const ActivationStoreReader& store, ActivationField field,
                                                  int64_t max_samples = 0, int top = 4);

}  // namespace kvforge
