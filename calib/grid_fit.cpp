#include "calib/grid_fit.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include "calib/group_quantizer.h"


namespace kvforge {

std::vector<float> to_float_grid(const std::vector<double>& levels) {
  std::vector<float> grid;
  grid.reserve(levels.size());
  for (const double level : levels) {
    float value = static_cast<float>(level);
    if (!grid.empty() && !(value > grid.back())) value = std::nextafter(grid.back(), std::numeric_limits<float>::infinity());
    grid.push_back(value);
  }
  return grid;
}

std::vector<float> fit_grid(const at::Tensor& values, const at::Tensor& weights, int bits,
                            const KMeans1dOptions& options) {
  if (bits < 1 || bits > 8) throw std::invalid_argument("fit_grid: bits must be in 1..8, got " + std::to_string(bits));
  // The k-means runs on the host.
  const at::Tensor x = values.to(at::kCPU, at::kFloat).contiguous().reshape({-1});
  const std::span<const float> xs(x.data_ptr<float>(), static_cast<size_t>(x.numel()));
  std::span<const float> ws;
  at::Tensor w;
  if (weights.defined()) {
    w = weights.to(at::kCPU, at::kFloat).contiguous().reshape({-1});
    if (w.numel() != x.numel()) throw std::invalid_argument("fit_grid: weights and values differ in length");
    ws = std::span<const float>(w.data_ptr<float>(), static_cast<size_t>(w.numel()));
  }
  return to_float_grid(weighted_kmeans_1d(xs, ws, 1 << bits, options));
}

std::vector<float> q_norm_affine_grid(const std::vector<float>& levels, const at::Tensor& values,
                                      const at::Tensor& weights) {
  if (levels.empty()) throw std::invalid_argument("q_norm_affine_grid: empty grid");
  const at::Tensor x = values.to(at::kDouble).reshape({-1});
  const at::Tensor w = weights.defined() ? weights.to(at::kDouble).reshape({-1}) : at::ones_like(x);
  if (w.numel() != x.numel()) throw std::invalid_argument("q_norm_affine_grid: weights and values differ in length");
  const double total = w.sum().item<double>();
  if (x.numel() == 0 || !(total > 0)) return levels;
  const at::Tensor dequantized = nearest_level(x, levels);
  const auto moments = [&](const at::Tensor& v) {
    const double mean = (w * v).sum().item<double>() / total;
    const double std = std::sqrt((w * (v - mean).square()).sum().item<double>() / total);
    return std::pair{mean, std};
  };
  const auto [mean, std] = moments(x);
  const auto [mean_hat, std_hat] = moments(dequantized);
  if (!(std_hat > 0)) return levels;
  const double a = std / std_hat, b = mean - a * mean_hat;
  std::vector<double> grid;
  for (const float c : levels) grid.push_back(a * static_cast<double>(c) + b);
  return to_float_grid(grid);
}

std::vector<float> q_norm_iterated_grid(const std::vector<float>& grid, const at::Tensor& values) {
  if (grid.empty()) throw std::invalid_argument("q_norm_iterated_grid: empty grid");
  const at::Tensor x = values.to(at::kDouble).reshape({-1});
  const int64_t n = x.numel();
  if (n == 0) return grid;
  const double mean = x.mean().item<double>();
  const double std = (x - mean).square().mean().sqrt().item<double>();
  // Dequantized values are levels, so their mean and spread need only how
  // many values each level takes: counts between the midpoints, found in a
  // sorted copy (a value on a midpoint goes to the lower level, as
  // nearest_level rounds). Sorted once, each round costs O(levels log n).
  std::vector<double> sorted(static_cast<size_t>(n));
  if (values.scalar_type() == at::kFloat) {  // sorting float32 is cheaper; the order is the same
    const at::Tensor v = values.reshape({-1}).to(at::kCPU).contiguous();
    std::vector<float> f(v.data_ptr<float>(), v.data_ptr<float>() + n);
    std::sort(f.begin(), f.end());
    std::copy(f.begin(), f.end(), sorted.begin());
  } else {
    const at::Tensor v = x.to(at::kCPU).contiguous();
    std::copy(v.data_ptr<double>(), v.data_ptr<double>() + n, sorted.begin());
    std::sort(sorted.begin(), sorted.end());
  }
  const auto dequantized_moments = [&](const std::vector<float>& levels) {
    double sum = 0, sum_squares = 0;
    int64_t before = 0;
    for (size_t i = 0; i < levels.size(); ++i) {
      int64_t through = n;
      if (i + 1 < levels.size()) {
        const double midpoint = (static_cast<double>(levels[i]) + static_cast<double>(levels[i + 1])) / 2;
        through = std::upper_bound(sorted.begin(), sorted.end(), midpoint) - sorted.begin();
      }
      const double count = static_cast<double>(through - before);
      sum += count * levels[i];
      sum_squares += count * static_cast<double>(levels[i]) * levels[i];
      before = through;
    }
    const double m = sum / static_cast<double>(n);
    return std::pair{m, std::sqrt(std::max(0.0, sum_squares / static_cast<double>(n) - m * m))};
  };
  std::vector<float> current = grid, best = grid;
  double best_error = std::numeric_limits<double>::infinity();
  int stale = 0;  // rounds since the best one
  for (int round = 0; round < 256 && stale < 8; ++round) {
    const auto [mean_hat, std_hat] = dequantized_moments(current);
    if (!(std_hat > 0)) break;
    const double scale = std::max(std, 1e-300);
    const double error = std::abs(mean_hat - mean) / scale + std::abs(std_hat - std) / scale;
    if (error < best_error) {
      best_error = error;
      best = current;
      stale = 0;
    } else {
      ++stale;
    }
    if (error < 1e-6) break;
    std::vector<double> next(current.size());
    for (size_t i = 0; i < current.size(); ++i) next[i] = (current[i] - mean_hat) * (std / std_hat) + mean;
    current = to_float_grid(next);
  }
  return best;
}

}  // namespace kvforge
