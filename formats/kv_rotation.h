#pragma once
// Orthogonal rotations applied to cached keys and values before they are
// quantized (`kvforge rotate`): value types only (no torch), shared by the
// rotation fit (rotation/), the artifact that stores them, the simulation
// that applies them (calib/kv_rotation.h) and the runtime kernels.
//
// The arithmetic (docs/artifact.md, "Rotations"), per layer and KV head h,
// with x a row vector of head_dim D and R = R[h] a D x D orthogonal matrix:
//   keys, form kMatrix (post-RoPE keys only): the cached key is
//     k' = (k - c[h]) R, queries attend with q' = q R, so
//     q'.k' = q.k - q.c[h]: for each query a constant shift of every logit,
//     the same softmax. c (`centre`) may be empty (no centring).
//   keys, form kPairAngles (any key domain, the form for pre-RoPE keys):
//     a rotation within each RoPE frequency pair (j, j + D/2) (the HF
//     rotate_half pairing), angle theta[h, j]:
//       k'_j       = k_j cos(theta) - k_{j+D/2} sin(theta)
//       k'_{j+D/2} = k_j sin(theta) + k_{j+D/2} cos(theta)
//     (the same form as RoPE's own rotation, so the two commute and
//     RoPE(q R).RoPE(k R) = RoPE(q).RoPE(k)); as a matrix R with k' = k R:
//     R[j][j] = R[j+D/2][j+D/2] = cos, R[j][j+D/2] = sin, R[j+D/2][j] = -sin.
//     Foldable into W_K's and W_Q's rows at no runtime cost (models without
//     q_norm/k_norm).
//   values, form kMatrix: v' = v R; attention output o' = o R, so the head's
//     output is o = o' R^T (foldable: W_V,h <- R^T W_V,h rows,
//     W_O[:, g-block] <- W_O[:, g-block] R for the query heads g of h).
// The quantizer of a rotated configuration is fitted to, and applied to, the
// rotated keys and values k', v'.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvforge {

// The orthogonal matrix a head's rotation started from.
enum class RotationBasis {
  kIdentity,
  kHadamard,  // QuaRot: the normalized Sylvester Hadamard matrix H / sqrt(D)
  kEigen,     // OSCAR: eigenvectors of the GQA group's query (keys) or score-weighted value covariance, then Hadamard
  kRandom,    // a seeded random orthogonal matrix
};
std::string_view basis_name(RotationBasis basis);  // "identity", "hadamard", "eigen", "random"
std::optional<RotationBasis> parse_basis(std::string_view name);

enum class RotationForm {
  kNone,
  kMatrix,      // a full D x D orthogonal matrix per KV head
  kPairAngles,  // one angle per RoPE pair and KV head (keys only)
};
std::string_view rotation_form_name(RotationForm form);  // "none", "matrix", "pair_angles"
std::optional<RotationForm> parse_rotation_form(std::string_view name);

// The per-layer arrays (TensorRotation, LayerRotation) are in
// formats/quantizer_config.h beside the other fitted parameters.

// Held-out (validation) loss of one KV head's rotation, for the log, inspect
// and the bench table: the key term (KL + lambda * post-W_O error) and the
// value term (relative post-W_O error), at the base and at the learned
// rotation (equal to the base when nothing was learned).
struct HeadRotationLoss {
  double key_base = 0, key_learned = 0;
  double value_base = 0, value_learned = 0;
  bool operator==(const HeadRotationLoss&) const = default;
};

// How a configuration's rotations were made (the artifact's
// /configs/NAME/rotation attributes).
struct RotationSettings {
  RotationForm keys = RotationForm::kNone;
  RotationForm values = RotationForm::kNone;  // kNone or kMatrix
  bool key_centred = false;  // keys carry a centre c (kMatrix only)
  bool folded = false;       // folded into the model's weights (the runtime applies nothing)
  RotationBasis key_basis = RotationBasis::kHadamard;    // requested base (heads record what they kept)
  RotationBasis value_basis = RotationBasis::kHadamard;
  // The objective and the fit (provenance).
  double key_kl_weight = 1.0;
  double key_output_weight = 1.0;  // lambda: the post-W_O term of the key objective
  double value_output_weight = 1.0;
  int64_t steps = 80;
  double learning_rate = 1e-2;
  std::string gradient = "straight_through";  // or "smoothed"
  int64_t last_queries = 64;     // queries per sample the objective attends with
  int64_t fit_samples = 0;       // captured windows fitted on
  int64_t validation_samples = 0;
  bool operator==(const RotationSettings&) const = default;
};

}  // namespace kvforge
