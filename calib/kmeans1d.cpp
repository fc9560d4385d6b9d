#include "calib/kmeans1d.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace kvforge {
namespace {

// Sufficient statistics of the points of one bin, values centred on the
// weighted mean of all points (keeps the second moments well conditioned).
struct Bin {
  double weight = 0, sum = 0, sum_squares = 0;
};

void check_inputs(std::span<const float> values, std::span<const float> weights, int k) {
  if (k < 1) throw std::invalid_argument("weighted_kmeans_1d: k must be >= 1, got " + std::to_string(k));
  if (!weights.empty() && weights.size() != values.size()) {
    throw std::invalid_argument("weighted_kmeans_1d: " + std::to_string(weights.size()) + " weights for " +
                                std::to_string(values.size()) + " values");
  }
  for (const float x : values) {
    if (!std::isfinite(x)) throw std::invalid_argument("weighted_kmeans_1d: values must be finite");
  }
  for (const float w : weights) {
    if (!(w >= 0) || !std::isfinite(w)) {
      throw std::invalid_argument("weighted_kmeans_1d: weights must be finite and >= 0");
    }
  }
}

// Adds centroids until there are k: the midpoint of the widest gap each time.
void spread(std::vector<double>& centroids, int k) {
  if (centroids.empty()) {
    for (int i = 0; i < k; ++i) centroids.push_back(k == 1 ? 0.0 : -1.0 + 2.0 * i / (k - 1));
    return;
  }
  if (static_cast<int>(centroids.size()) < k && centroids.size() == 1) {
    centroids.push_back(centroids[0] + std::max(std::abs(centroids[0]), 1.0) / 1024);
  }
  while (static_cast<int>(centroids.size()) < k) {
    size_t widest = 0;
    for (size_t i = 1; i + 1 < centroids.size(); ++i) {
      if (centroids[i + 1] - centroids[i] > centroids[widest + 1] - centroids[widest]) widest = i;
    }
    centroids.insert(centroids.begin() + static_cast<std::ptrdiff_t>(widest) + 1,
                     0.5 * (centroids[widest] + centroids[widest + 1]));
  }
}

// Optimal partition of the bins (ascending, each of positive weight) into k
// contiguous runs; returns each run's weighted mean (still centred).
std::vector<double> partition_bins(const std::vector<Bin>& bins, int k) {
  const size_t m = bins.size();
  std::vector<double> w(m + 1, 0), s(m + 1, 0), q(m + 1, 0);
  {
    long double cw = 0, cs = 0, cq = 0;
    for (size_t i = 0; i < m; ++i) {
      cw += bins[i].weight;
      cs += bins[i].sum;
      cq += bins[i].sum_squares;
      w[i + 1] = static_cast<double>(cw);
      s[i + 1] = static_cast<double>(cs);
      q[i + 1] = static_cast<double>(cq);
    }
  }
  // Squared error of bins [a, b) around their weighted mean.
  const auto cost = [&](size_t a, size_t b) {
    const double weight = w[b] - w[a], sum = s[b] - s[a];
    return std::max(0.0, (q[b] - q[a]) - sum * sum / weight);
  };
  const size_t kk = static_cast<size_t>(k);
  // best[j][i]: the least cost of the first i bins in j + 1 runs; split[j][i]
  // the start of the last run.
  std::vector<std::vector<double>> best(kk, std::vector<double>(m + 1, std::numeric_limits<double>::infinity()));
  std::vector<std::vector<uint32_t>> split(kk, std::vector<uint32_t>(m + 1, 0));
  for (size_t i = 1; i <= m; ++i) best[0][i] = cost(0, i);
  for (size_t j = 1; j < kk; ++j) {
    // j + 1 runs need at least j + 1 bins; the rest must be left for the
    // runs still to come (k - 1 - j of them).
    for (size_t i = j + 1; i + (kk - 1 - j) <= m; ++i) {
      double least = std::numeric_limits<double>::infinity();
      uint32_t where = 0;
      for (size_t t = j; t < i; ++t) {
        const double c = best[j - 1][t] + cost(t, i);
        if (c < least) {
          least = c;
          where = static_cast<uint32_t>(t);
        }
      }
      best[j][i] = least;
      split[j][i] = where;
    }
  }
  std::vector<double> means(kk);
  size_t end = m;
  for (size_t j = kk; j-- > 0;) {
    const size_t start = j == 0 ? 0 : split[j][end];
    means[j] = (s[end] - s[start]) / (w[end] - w[start]);
    end = start;
  }
  return means;
}

}  // namespace

std::vector<double> weighted_kmeans_1d(std::span<const float> values, std::span<const float> weights, int k,
                                       const KMeans1dOptions& options) {
  check_inputs(values, weights, k);
  if (options.bins < 1) throw std::invalid_argument("weighted_kmeans_1d: bins must be >= 1");
  double total = 0;
  for (const float x : weights) total += x;
  const bool weighted = !weights.empty() && total > 0;
  const auto weight_of = [&](size_t i) { return weighted ? static_cast<double>(weights[i]) : 1.0; };

  // Weighted mean and range of the points that count.
  double weight_sum = 0, mean = 0;
  float lo = std::numeric_limits<float>::infinity(), hi = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < values.size(); ++i) {
    const double wi = weight_of(i);
    if (wi <= 0) continue;
    weight_sum += wi;
    mean += wi * values[i];
    lo = std::min(lo, values[i]);
    hi = std::max(hi, values[i]);
  }
  std::vector<double> centroids;
  if (weight_sum <= 0) {
    spread(centroids, k);
    return centroids;
  }
  mean /= weight_sum;

  // Distinct values, up to B of them.
  const size_t max_bins = static_cast<size_t>(options.bins);
  std::unordered_set<float> distinct;
  for (size_t i = 0; i < values.size() && distinct.size() <= max_bins; ++i) {
    if (weight_of(i) > 0) distinct.insert(values[i] == 0.0f ? 0.0f : values[i]);
  }
  std::vector<Bin> bins;
  const auto add = [](Bin& bin, double x, double wi) {
    bin.weight += wi;
    bin.sum += wi * x;
    bin.sum_squares += wi * x * x;
  };
  if (distinct.size() <= max_bins) {
    std::vector<float> sorted(distinct.begin(), distinct.end());
    std::sort(sorted.begin(), sorted.end());
    bins.resize(sorted.size());
    for (size_t i = 0; i < values.size(); ++i) {
      const double wi = weight_of(i);
      if (wi <= 0) continue;
      const auto at = std::lower_bound(sorted.begin(), sorted.end(), values[i]) - sorted.begin();
      add(bins[static_cast<size_t>(at)], values[i] - mean, wi);
    }
  } else {
    std::vector<Bin> all(max_bins);
    const double width = (static_cast<double>(hi) - lo) / static_cast<double>(max_bins);
    for (size_t i = 0; i < values.size(); ++i) {
      const double wi = weight_of(i);
      if (wi <= 0) continue;
      const double at = std::floor((static_cast<double>(values[i]) - lo) / width);
      const size_t index = std::min(max_bins - 1, static_cast<size_t>(std::max(0.0, at)));
      add(all[index], values[i] - mean, wi);
    }
    for (const Bin& bin : all) {
      if (bin.weight > 0) bins.push_back(bin);
    }
  }

  if (bins.size() <= static_cast<size_t>(k)) {
    for (const Bin& bin : bins) centroids.push_back(bin.sum / bin.weight + mean);
  } else {
    centroids = partition_bins(bins, k);
    for (double& c : centroids) c += mean;
  }
  // Means of disjoint ascending runs ascend; rounding could tie two.
  for (size_t i = 1; i < centroids.size(); ++i) {
    if (!(centroids[i] > centroids[i - 1])) {
      centroids[i] = std::nextafter(centroids[i - 1], std::numeric_limits<double>::infinity());
    }
  }
  spread(centroids, k);
  return centroids;
}

double kmeans_1d_cost(std::span<const float> values, std::span<const float> weights,
                      std::span<const double> centroids) {
  if (centroids.empty()) throw std::invalid_argument("kmeans_1d_cost: no centroids");
  if (!weights.empty() && weights.size() != values.size()) {
    throw std::invalid_argument("kmeans_1d_cost: weights and values differ in length");
  }
  double total = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const double x = values[i];
    const auto upper = std::lower_bound(centroids.begin(), centroids.end(), x);
    double d = std::numeric_limits<double>::infinity();
    if (upper != centroids.end()) d = *upper - x;
    if (upper != centroids.begin()) d = std::min(d, x - *(upper - 1));
    total += (weights.empty() ? 1.0 : static_cast<double>(weights[i])) * d * d;
  }
  return total;
}

}  // namespace kvforge
