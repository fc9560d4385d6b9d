// rotation/orthogonal_basis.h: orthogonality of every base, Hadamard's
// entries, the eigenbases against covariances with known eigenvectors, and
// the value eigenbasis' score weights deciding its first direction.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>

#include "calib/kv_rotation.h"
#include "rotation/attention_objective.h"
#include "rotation/orthogonal_basis.h"
#include "rotation/rotation_fit.h"

namespace kvforge {
namespace {

const at::TensorOptions kFloat = at::TensorOptions().dtype(at::kFloat);
const at::TensorOptions kDouble = at::TensorOptions().dtype(at::kDouble);

TEST(RotationBasis, HadamardIsOrthogonalWithEntriesOneOverRootD) {
  for (const int64_t dim : {1, 2, 8, 128}) {
    const at::Tensor h = hadamard_matrix(dim, kFloat);
    EXPECT_LT(orthogonality_error(h.unsqueeze(0)), 1e-5) << dim;
    // Entries are exactly +-2^-k/2 rounded once to float32.
    const double entry = 1 / std::sqrt(static_cast<double>(dim));
    EXPECT_LT((h.abs().to(at::kDouble) - entry).abs().max().item<double>(), entry * 0x1p-23) << dim;
    EXPECT_TRUE(at::equal(h, h.transpose(0, 1)));
  }
  // Sylvester's H_2 = [[1, 1], [1, -1]] / sqrt 2.
  const at::Tensor h2 = hadamard_matrix(2, kDouble) * std::sqrt(2.0);
  EXPECT_TRUE(at::allclose(h2, at::tensor({1.0, 1.0, 1.0, -1.0}, kDouble).view({2, 2})));
  EXPECT_THROW(hadamard_matrix(96, kFloat), std::invalid_argument);
}

TEST(RotationBasis, RandomOrthogonalIsOrthogonalAndSeeded) {
  const at::Tensor a = random_orthogonal(3, 64, 7, kFloat);
  EXPECT_LT(orthogonality_error(a), 1e-5);
  EXPECT_TRUE(at::equal(a, random_orthogonal(3, 64, 7, kFloat)));
  EXPECT_FALSE(at::allclose(a, random_orthogonal(3, 64, 8, kFloat)));
  EXPECT_FALSE(at::allclose(a[0], a[1]));
}

// Q^T Q = U diag(s) U^T exactly when the rows of Q are sqrt(s_i) u_i^T: the
// eigenvectors are U's columns, by descending s.
TEST(RotationBasis, KeyEigenbasisRecoversKnownEigenvectors) {
  const int64_t dim = 16, kv_heads = 2, group = 2;
  const at::Tensor u = random_orthogonal(kv_heads, dim, 3, kDouble);
  const at::Tensor s = at::linspace(40.0, 1.0, dim, kDouble);  // distinct, descending
  // Rows sqrt(s_i) u_i^T of head h, split over the group's 2 query heads and 2 windows.
  at::Tensor rows = (u.transpose(1, 2) * s.sqrt().unsqueeze(-1));  // [Hkv, D, D]
  rows = rows.reshape({kv_heads, group, 2, dim / 4, dim});          // split D rows into 2 heads x 2 windows x D/4
  const at::Tensor queries = rows.permute({2, 0, 1, 3, 4}).reshape({2, kv_heads * group, dim / 4, dim});
  const at::Tensor e = key_eigenbasis(queries, kv_heads);
  // E^T U is diagonal +-1.
  const at::Tensor product = at::matmul(e.transpose(1, 2), u);
  EXPECT_LT((product.abs() - at::eye(dim, kDouble)).abs().max().item<double>(), 1e-10);
}

// Tokens along e0 (large, rarely attended) and along e1 (small, attended):
// unweighted, e0 has the largest variance; weighted by attention mass, e1.
TEST(RotationBasis, ValueEigenbasisFollowsTheScoreWeights) {
  const int64_t dim = 8, tokens = 20;
  at::Tensor values = at::zeros({1, 1, tokens, dim}, kDouble);
  at::Tensor weights = at::zeros({1, 1, tokens}, kDouble);
  for (int64_t t = 0; t < tokens; ++t) {
    const bool rare = t % 2 == 0;
    values[0][0][t][rare ? 0 : 1] = rare ? 3.0 : 1.0;
    weights[0][0][t] = rare ? 0.01 : 1.0;
  }
  const at::Tensor uniform = value_eigenbasis(values, at::ones_like(weights));
  const at::Tensor weighted = value_eigenbasis(values, weights);
  EXPECT_NEAR(uniform[0].select(1, 0)[0].item<double>(), 1.0, 1e-12);   // first column e0
  EXPECT_NEAR(weighted[0].select(1, 0)[1].item<double>(), 1.0, 1e-12);  // first column e1
}

// Every base of base_matrices (the eigen ones composed with Hadamard) is
// orthogonal in float32.
TEST(RotationBasis, EveryBaseIsOrthogonalInFloat32) {
  at::manual_seed(5);
  const int64_t n = 2, heads = 4, kv_heads = 2, tokens = 24, dim = 32;
  RotationLayerData data;
  data.queries = at::randn({n, heads, tokens, dim}, kFloat);
  data.keys = at::randn({n, kv_heads, tokens, dim}, kFloat);
  data.values = at::randn({n, kv_heads, tokens, dim}, kFloat) * at::linspace(0.1, 5.0, dim, kFloat);
  data.o_proj = at::randn({48, heads * dim}, kFloat);
  const AttentionObjective objective(data, 8);
  for (const RotationBasis basis :
       {RotationBasis::kIdentity, RotationBasis::kHadamard, RotationBasis::kEigen, RotationBasis::kRandom}) {
    for (const bool keys : {true, false}) {
      const at::Tensor r = base_matrices(basis, keys, data, objective.token_mass(), 1);
      ASSERT_EQ(r.sizes(), (at::IntArrayRef{kv_heads, dim, dim}));
      EXPECT_EQ(r.scalar_type(), at::kFloat);
      EXPECT_LT(orthogonality_error(r), 1e-5) << basis_name(basis) << (keys ? " keys" : " values");
    }
  }
}

}  // namespace
}  // namespace kvforge
