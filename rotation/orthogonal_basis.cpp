#include "rotation/orthogonal_basis.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <stdexcept>
#include <string>

namespace kvforge {

at::Tensor hadamard_matrix(int64_t dim, const at::TensorOptions& options) {
  if (dim < 1 || (dim & (dim - 1)) != 0) {
    throw std::invalid_argument("hadamard basis: head_dim must be a power of 2, got " + std::to_string(dim));
  }
  // Sylvester: H_{2n} = [[H_n, H_n], [H_n, -H_n]], built exactly in float64.
  at::Tensor h = at::ones({1, 1}, at::kDouble);
  while (h.size(0) < dim) h = at::cat({at::cat({h, h}, 1), at::cat({h, -h}, 1)}, 0);
  return (h / std::sqrt(static_cast<double>(dim))).to(options);
}

at::Tensor random_orthogonal(int64_t count, int64_t dim, uint64_t seed, const at::TensorOptions& options) {
  if (count < 0 || dim < 1) throw std::invalid_argument("random basis: expected count >= 0 and head_dim >= 1");
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor gaussian = at::randn({count, dim, dim}, generator, at::TensorOptions().dtype(at::kDouble));
  const auto [q, r] = at::linalg_qr(gaussian);
  // Sign fix: Q diag(sign(diag(R))), so the factorization is unique and Q Haar.
  const at::Tensor signs = at::where(at::diagonal(r, 0, -2, -1) < 0, -1.0, 1.0);
  return (q * signs.unsqueeze(-2)).to(options);
}

at::Tensor covariance_eigenvectors(const at::Tensor& covariance) {
  const at::Tensor symmetric = covariance.to(at::kDouble);
  const auto [eigenvalues, vectors] = at::linalg_eigh((symmetric + symmetric.transpose(-1, -2)) / 2);
  // eigh sorts ascending: flip to descending.
  const at::Tensor descending = vectors.flip(-1);
  const at::Tensor largest = descending.abs().argmax(-2, true);
  const at::Tensor signs = at::where(descending.gather(-2, largest) < 0, -1.0, 1.0);
  return (descending * signs).to(covariance.scalar_type());
}

at::Tensor key_eigenbasis(const at::Tensor& queries, int64_t kv_heads) {
  if (queries.dim() != 4 || kv_heads < 1 || queries.size(1) % kv_heads != 0) {
    throw std::invalid_argument("key eigenbasis: expected queries [N, H, T, D] with H a multiple of " +
                                std::to_string(kv_heads));
  }
  const int64_t n = queries.size(0), group = queries.size(1) / kv_heads, tokens = queries.size(2),
                dim = queries.size(3);
  // [Hkv, N * G * T, D]: the rows of every query head of the group.
  const at::Tensor rows =
      queries.reshape({n, kv_heads, group, tokens, dim}).permute({1, 0, 2, 3, 4}).reshape({kv_heads, -1, dim});
  return covariance_eigenvectors(at::matmul(rows.transpose(-1, -2), rows));
}

at::Tensor value_eigenbasis(const at::Tensor& values, const at::Tensor& token_weights) {
  if (values.dim() != 4 || token_weights.dim() != 3 || token_weights.sizes() != values.sizes().slice(0, 3)) {
    throw std::invalid_argument("value eigenbasis: expected values [N, Hkv, T, D] and token weights [N, Hkv, T]");
  }
  const int64_t heads = values.size(1), dim = values.size(3);
  const at::Tensor rows = values.transpose(0, 1).reshape({heads, -1, dim});
  const at::Tensor weights = token_weights.to(values.scalar_type()).transpose(0, 1).reshape({heads, -1, 1});
  return covariance_eigenvectors(at::matmul(rows.transpose(-1, -2), rows * weights));
}

}  // namespace kvforge
