#pragma once
// Exact weighted k-means in one dimension: the k ascending centroids that
// minimize sum_i w_i (x_i - c(x_i))^2, c(x) the nearest centroid. Optimal
// 1-D clusters are contiguous in sorted order, so a dynamic program over the
// sorted points finds the global optimum (no random restarts). Large inputs
// are first reduced to a weighted histogram: B bins over [min, max], each
// keeping the total weight and the weighted first and second moments of the
// points that fell in it (so a bin's centroid is the exact weighted mean of
// its points, not the bin centre); the DP then partitions contiguous bins in
// O(k B^2) with prefix sums. When the input has at most B distinct values the
// bins are the distinct values themselves and the result is exact.
//
// The non-uniform grids of KVQuant-style quantizers (quantizer_fit.h) are
// fitted with it, weighted by Fisher sensitivity.
#include <cstdint>
#include <span>
#include <vector>

namespace kvforge {

struct KMeans1dOptions {
  int64_t bins = 4096;  // B; the histogram resolution when there are more distinct values
};

// Returns exactly k centroids, strictly ascending. `weights` is empty (all
// ones) or as long as `values`, each >= 0 and finite; values must be finite
// (std::invalid_argument otherwise, and for k < 1).
// Degenerate inputs:
//   - zero total weight: the weights are ignored (unweighted k-means);
//   - fewer distinct (positively weighted) values m than k: the m values are
//     centroids (cost 0) and the k - m others are spread: each new one is the
//     midpoint of the widest gap between neighbouring centroids (with one
//     value v, the second is v + max(|v|, 1) / 1024);
//   - no values at all: k levels evenly spaced over [-1, 1].
std::vector<double> weighted_kmeans_1d(std::span<const float> values, std::span<const float> weights, int k,
                                       const KMeans1dOptions& options = {});

// sum_i w_i (x_i - nearest centroid)^2 in float64 (weights empty: all ones);
// centroids ascending.
double kmeans_1d_cost(std::span<const float> values, std::span<const float> weights,
                      std::span<const double> centroids);

}  // namespace kvforge
