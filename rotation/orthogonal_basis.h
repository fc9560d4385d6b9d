#pragma once
// The fixed orthogonal matrices a learned rotation starts from
// (formats/kv_rotation.h's RotationBasis), as tensors. Convention of the
// whole library: row vectors, x' = x R, matrices [heads, D, D]; a matrix whose
// columns are eigenvectors therefore maps x to its coordinates in that
// eigenbasis.
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvforge {

// The normalized Sylvester Hadamard matrix H / sqrt(D), [D, D] (QuaRot):
// every entry +-1/sqrt(D), symmetric, orthogonal. std::invalid_argument
// naming head_dim when D is not a power of 2.
at::Tensor hadamard_matrix(int64_t dim, const at::TensorOptions& options);

// `count` seeded random orthogonal matrices [count, D, D]: Q of the QR
// decomposition of a standard normal matrix with Q's columns signed so that
// diag(R) > 0 (Haar-distributed). The same seed gives the same matrices on
// every device (drawn on the CPU in float64).
at::Tensor random_orthogonal(int64_t count, int64_t dim, uint64_t seed, const at::TensorOptions& options);

// Eigenvectors of symmetric matrices [heads, D, D] as columns, ordered by
// descending eigenvalue, each signed so that its entry of largest magnitude
// is positive (deterministic across devices). Computed in float64, returned
// in the input's dtype.
at::Tensor covariance_eigenvectors(const at::Tensor& covariance);

// OSCAR's key basis: per KV head, the eigenvectors of the GQA group's query
// covariance sum_g Q_g^T Q_g (queries [N, H, T, D] post-RoPE, the H / Hkv
// query heads of KV head h being h * H / Hkv ...). Returns [Hkv, D, D].
at::Tensor key_eigenbasis(const at::Tensor& queries, int64_t kv_heads);

// OSCAR's value basis: per KV head, the eigenvectors of the score-weighted
// value covariance sum_{n,t} w[n,h,t] v[n,h,t]^T v[n,h,t] (values
// [N, Hkv, T, D], token_weights [N, Hkv, T]: the attention mass each token
// receives). Returns [Hkv, D, D].
at::Tensor value_eigenbasis(const at::Tensor& values, const at::Tensor& token_weights);

}  // namespace kvforge
