#include "calib/activation_statistics.h"

#include <algorithm>
#include <numeric>

namespace kvforge {
namespace {

struct Moments {
  double count = 0, sum = 0, sum_abs = 0, sum2 = 0, sum3 = 0, sum4 = 0;
  void add(double x) {
    const double x2 = x * x;
    count += 1;
    sum += x;
    sum_abs += std::abs(x);
    sum2 += x2;
    sum3 += x2 * x;
    sum4 += x2 * x2;
  }
  double kurtosis() const {
    // Central moments from raw sums (float64 keeps this well conditioned for
    // activations of magnitude ~1-100).
    const double m = sum / count;
    const double var = sum2 / count - m * m;
    if (var <= 0) return 0;
    const double m4 = sum4 / count - 4 * m * sum3 / count + 6 * m * m * sum2 / count - 3 * m * m * m * m;
    return m4 / (var * var);
  }
};

double median(std::vector<double> values) {
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  const double upper = values[mid];
  if (values.size() % 2 == 1) return upper;
  return (upper + *std::max_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid))) / 2;
}

}  // namespace

std::vector<ChannelStatistics> channel_statistics(const ActivationStoreReader& store, ActivationField field,
                                                  int64_t max_samples, int top) {
  const auto& model = store.layout().model;
  const int64_t heads = uses_query_heads(field) ? model.num_heads : model.num_kv_heads;
  const int64_t dims = model.head_dim;
  const int64_t samples = max_samples > 0 ? std::min(max_samples, store.samples_complete()) : store.samples_complete();
  std::vector<ChannelStatistics> result;
  for (int64_t layer = 0; layer < model.num_layers; ++layer) {
    std::vector<Moments> moments(static_cast<size_t>(heads * dims));
    for (int64_t head = 0; head < heads; ++head) {
      const std::vector<float> slab = store.read_head(field, layer, head, 0, samples);  // [samples, L, D]
      for (size_t i = 0; i < slab.size(); ++i) {
        moments[static_cast<size_t>(head * dims) + i % static_cast<size_t>(dims)].add(slab[i]);
      }
    }
    ChannelStatistics stats;
    stats.field = field;
    stats.layer = layer;
    stats.tokens = static_cast<int64_t>(moments.front().count);
    for (const auto& m : moments) {
      stats.mean_abs.push_back(m.sum_abs / m.count);
      stats.kurtosis.push_back(m.kurtosis());
    }
    const double middle = median(stats.mean_abs);
    stats.max_over_median = middle > 0 ? *std::max_element(stats.mean_abs.begin(), stats.mean_abs.end()) / middle : 0;
    std::vector<int64_t> order(stats.mean_abs.size());
    std::iota(order.begin(), order.end(), 0);
    const auto count = std::min<size_t>(static_cast<size_t>(top), order.size());
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(count), order.end(),
                      [&](int64_t a, int64_t b) { return stats.mean_abs[static_cast<size_t>(a)] > stats.mean_abs[static_cast<size_t>(b)]; });
    stats.top_channels.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(count));
    result.push_back(std::move(stats));
  }
  return result;
}

}  // namespace kvforge
