#include "calib/calibration_stats.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kvforge {

ErrorSums tensor_error(const at::Tensor& reference, const at::Tensor& approximation) {
  if (reference.sizes() != approximation.sizes()) throw std::invalid_argument("tensor_error: shapes differ");
  const at::Tensor x = reference.to(at::kDouble);
  return {(x - approximation.to(at::kDouble)).square().sum().item<double>(), x.square().sum().item<double>()};
}

ErrorSums logit_error(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& keys_hat) {
  if (queries.dim() != 4 || keys.dim() != 4 || keys.sizes() != keys_hat.sizes() || queries.size(0) != keys.size(0) ||
      queries.size(2) != keys.size(2) || queries.size(3) != keys.size(3) || keys.size(1) == 0 ||
      queries.size(1) % keys.size(1) != 0) {
    throw std::invalid_argument("logit_error: expected queries [N, H, T, D] and keys [N, Hkv, T, D], Hkv | H");
  }
  const int64_t windows = queries.size(0), heads = queries.size(1), tokens = queries.size(2);
  const int64_t dim = queries.size(3), per_kv = heads / keys.size(1);
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(dim));
  constexpr int64_t kBlock = 128;
  const at::Tensor above_diagonal = at::ones({kBlock, kBlock}, keys.options().dtype(at::kBool)).triu(1);
  // sum over i, j <= i of (q_i . x_j)^2 for queries q [P, T, D], keys x [T, D]:
  // by query blocks, the keys of earlier blocks through the quadratic form
  // q^T (sum_j x_j x_j^T) q, the block's own causal triangle directly.
  const auto causal_squared_sum = [&](const at::Tensor& q, const at::Tensor& x) {
    at::Tensor gram = at::zeros({dim, dim}, x.options());
    // Summed on x's device: one host synchronization per layer, not per block.
    at::Tensor total = at::zeros({}, x.options());
    for (int64_t start = 0; start < tokens; start += kBlock) {
      const int64_t length = std::min(kBlock, tokens - start);
      const at::Tensor qb = q.narrow(1, start, length);
      const at::Tensor xb = x.narrow(0, start, length);
      total += (at::matmul(qb, gram) * qb).sum();
      const at::Tensor mask = above_diagonal.narrow(0, 0, length).narrow(1, 0, length);
      total += at::matmul(qb, xb.t()).masked_fill_(mask, 0.0).square_().sum();
      gram += at::matmul(xb.t(), xb);
    }
    return total;
  };
  at::Tensor squared_error = at::zeros({}, keys.options().dtype(at::kDouble));
  at::Tensor squared_reference = at::zeros({}, keys.options().dtype(at::kDouble));
  for (int64_t n = 0; n < windows; ++n) {
    for (int64_t kv = 0; kv < keys.size(1); ++kv) {
      const at::Tensor q = queries[n].narrow(0, kv * per_kv, per_kv).to(at::kDouble) * inv_sqrt_d;
      const at::Tensor k = keys[n][kv].to(at::kDouble);
      squared_error += causal_squared_sum(q, k - keys_hat[n][kv].to(at::kDouble));
      squared_reference += causal_squared_sum(q, k);
    }
  }
  return {squared_error.item<double>(), squared_reference.item<double>()};
}

}  // namespace kvforge
