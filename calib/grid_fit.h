#pragma once
// Non-uniform quantization grids (KVQuant's per-layer datatypes): 2^bits
// levels in a quantizer's normalized domain (inliers span [-1, 1]), fitted
// by weighted k-means (kmeans1d.h) to the normalized calibration inliers,
// optionally corrected by Q-Norm.
//
// Q-Norm keeps the mean and the (population) standard deviation of the
// normalized data in its dequantized values, in one of two ways
// (formats/quantizer_config.h's QNorm):
//
// affine (KVQuant's): the k-means levels c stay the encode grid (codes are
// the nearest c_k, the k-means boundaries unchanged); with m, s the
// weighted mean and standard deviation of the data and m^, s^ those of the
// dequantized values c[code] (weighted alike), the grid the codes
// dequantize to is a c + b, a = s / s^, b = m - a m^, so that the
// dequantized values' mean and std are m and s exactly (up to float levels).
// Unchanged (grid = c) when s^ = 0.
//
// iterated (kvforge's variant): with m^, s^ of the data replaced by its
// nearest level, the levels themselves are mapped,
//   grid' = (grid - m^) * (s / s^) + m,
// which keeps them ascending. Moving the levels moves the rounding
// boundaries, so the map is repeated with the new assignment until m^ and s^
// match m and s (|m^ - m| + |s^ - s| < 1e-6 s; float levels allow no
// better), at most 256 rounds and 8 without improvement; the best round is
// kept. (Each round shrinks the mismatch by about half on KV data.) Levels
// may end up slightly outside [-1, 1]. Skipped (grid unchanged) when s^ = 0.
// Unweighted (as it always was).
#include <ATen/core/Tensor.h>

#include <vector>

#include "calib/kmeans1d.h"

namespace kvforge {

// values: float32 [n]; weights: float32 [n] or undefined (unweighted).
// Returns 2^bits strictly ascending float levels.
std::vector<float> fit_grid(const at::Tensor& values, const at::Tensor& weights, int bits,
                            const KMeans1dOptions& options = {});

// values: the normalized data (float32 or float64 [n]); weights: [n] or
// undefined (unweighted). Returns the dequantization grid a c + b.
std::vector<float> q_norm_affine_grid(const std::vector<float>& levels, const at::Tensor& values,
                                      const at::Tensor& weights);

// values: the normalized data (float32 or float64 [n]).
std::vector<float> q_norm_iterated_grid(const std::vector<float>& grid, const at::Tensor& values);

// Strictly ascending float levels from ascending doubles (ties nudged up).
std::vector<float> to_float_grid(const std::vector<double>& levels);

}  // namespace kvforge
