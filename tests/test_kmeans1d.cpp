// Exact weighted 1-D k-means against brute force over every contiguous
// partition of the sorted points, analytic cases and the degenerate inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "calib/kmeans1d.h"

namespace kvforge {
namespace {

// sum w (x - nearest)^2 in float64, written here independently.
double reference_cost(const std::vector<float>& x, const std::vector<float>& w, const std::vector<double>& c) {
  double total = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    double best = std::numeric_limits<double>::infinity();
    for (const double level : c) best = std::min(best, (x[i] - level) * (x[i] - level));
    total += (w.empty() ? 1.0 : w[i]) * best;
  }
  return total;
}

// The least cost over all partitions of the sorted points into k non-empty
// contiguous runs, each at its weighted mean: recursion over the first cut.
double brute_force(const std::vector<std::pair<double, double>>& points, size_t begin, int k) {
  const auto run_cost = [&](size_t a, size_t b) {
    double weight = 0, sum = 0;
    for (size_t i = a; i < b; ++i) {
      weight += points[i].second;
      sum += points[i].first * points[i].second;
    }
    if (weight == 0) return 0.0;
    const double mean = sum / weight;
    double cost = 0;
    for (size_t i = a; i < b; ++i) cost += points[i].second * (points[i].first - mean) * (points[i].first - mean);
    return cost;
  };
  if (k == 1) return run_cost(begin, points.size());
  double best = std::numeric_limits<double>::infinity();
  for (size_t cut = begin + 1; cut + static_cast<size_t>(k - 1) <= points.size(); ++cut) {
    best = std::min(best, run_cost(begin, cut) + brute_force(points, cut, k - 1));
  }
  return best;
}

void expect_strictly_ascending(const std::vector<double>& c) {
  for (size_t i = 1; i < c.size(); ++i) EXPECT_LT(c[i - 1], c[i]) << "at " << i;
}

TEST(KMeans1d, EqualsBruteForceOnRandomWeightedCases) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> value(-3.0f, 5.0f);
  std::uniform_real_distribution<float> weight(0.0f, 2.0f);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 2 + static_cast<int>(rng() % 9);
    const int k = 1 + static_cast<int>(rng() % std::min(n, 5));
    std::vector<float> x(n), w(n);
    for (int i = 0; i < n; ++i) {
      x[i] = value(rng);
      w[i] = trial % 3 == 0 ? 1.0f : weight(rng);
    }
    std::vector<std::pair<double, double>> points;
    for (int i = 0; i < n; ++i) points.emplace_back(x[i], w[i]);
    std::sort(points.begin(), points.end());
    const double best = brute_force(points, 0, k);
    const auto centroids = weighted_kmeans_1d(x, w, k);
    ASSERT_EQ(centroids.size(), static_cast<size_t>(k));
    expect_strictly_ascending(centroids);
    EXPECT_NEAR(reference_cost(x, w, centroids), best, 1e-9 * (1 + best)) << "trial " << trial;
    EXPECT_NEAR(kmeans_1d_cost(x, w, centroids), reference_cost(x, w, centroids), 1e-9 * (1 + best));
  }
}

TEST(KMeans1d, AnalyticCases) {
  {
    const std::vector<float> x = {1, 2, 3, 10, 11, 12};
    const auto c = weighted_kmeans_1d(x, {}, 2);
    EXPECT_DOUBLE_EQ(c[0], 2.0);
    EXPECT_DOUBLE_EQ(c[1], 11.0);
  }
  {
    // One cluster: the weighted mean.
    const std::vector<float> x = {0, 1}, w = {3, 1};
    EXPECT_DOUBLE_EQ(weighted_kmeans_1d(x, w, 1)[0], 0.25);
  }
  {
    // Weights move the split: {0, 1, 2} with the middle point pulled to 2.
    const std::vector<float> x = {0, 1, 2}, w = {1, 1, 100};
    const auto c = weighted_kmeans_1d(x, w, 2);
    EXPECT_DOUBLE_EQ(c[0], 0.5);
    EXPECT_DOUBLE_EQ(c[1], 2.0);
  }
  {
    // Uniform on [0, 1], more distinct values than bins: quartile midpoints.
    std::vector<float> x(40000);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) / static_cast<float>(x.size() - 1);
    const auto c = weighted_kmeans_1d(x, {}, 4);
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(c[i], (2 * i + 1) / 8.0, 1e-3);
  }
}

TEST(KMeans1d, HistogramIsNearOptimalWithFewBins) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(3000), w(3000);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = normal(rng);
    w[i] = std::abs(normal(rng));
  }
  const auto exact = weighted_kmeans_1d(x, w, 4);  // 3000 distinct values <= 4096 bins: exact
  const auto binned = weighted_kmeans_1d(x, w, 4, {.bins = 64});
  const double exact_cost = reference_cost(x, w, exact);
  EXPECT_LE(exact_cost, reference_cost(x, w, binned) * (1 + 1e-12));
  EXPECT_LT(reference_cost(x, w, binned), 1.02 * exact_cost);
}

TEST(KMeans1d, DegenerateInputs) {
  {
    const std::vector<float> x = {5, 5, 5};
    const auto c = weighted_kmeans_1d(x, {}, 4);
    ASSERT_EQ(c.size(), 4u);
    expect_strictly_ascending(c);
    EXPECT_NE(std::find(c.begin(), c.end(), 5.0), c.end());
    EXPECT_EQ(reference_cost(x, {}, c), 0.0);
  }
  {
    const std::vector<float> x = {1, 3, 3, 1};
    const auto c = weighted_kmeans_1d(x, {}, 4);
    ASSERT_EQ(c.size(), 4u);
    expect_strictly_ascending(c);
    EXPECT_EQ(c.front(), 1.0);
    EXPECT_EQ(c.back(), 3.0);
  }
  {
    // Zero total weight: unweighted.
    const std::vector<float> x = {0, 1, 2, 10}, zero = {0, 0, 0, 0};
    EXPECT_EQ(weighted_kmeans_1d(x, zero, 2), weighted_kmeans_1d(x, {}, 2));
  }
  {
    // Points of zero weight take no part.
    const std::vector<float> x = {0, 1, 100, 2, 3}, w = {1, 1, 0, 1, 1};
    const auto c = weighted_kmeans_1d(x, w, 2);
    EXPECT_DOUBLE_EQ(c[0], 0.5);
    EXPECT_DOUBLE_EQ(c[1], 2.5);
  }
  {
    const auto c = weighted_kmeans_1d({}, {}, 4);
    ASSERT_EQ(c.size(), 4u);
    EXPECT_DOUBLE_EQ(c[0], -1.0);
    EXPECT_DOUBLE_EQ(c[3], 1.0);
  }
  const std::vector<float> x = {1, 2};
  const std::vector<float> negative = {1, -1};
  EXPECT_THROW(weighted_kmeans_1d(x, negative, 1), std::invalid_argument);
  EXPECT_THROW(weighted_kmeans_1d(x, {}, 0), std::invalid_argument);
  const std::vector<float> short_weights = {1};
  EXPECT_THROW(weighted_kmeans_1d(x, short_weights, 1), std::invalid_argument);
}

}  // namespace
}  // namespace kvforge
