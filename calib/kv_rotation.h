#pragma once
// Applying a configuration's rotations (formats/kv_rotation.h states the
// arithmetic) to keys, queries and values as tensors: what the simulation,
// the rotation fit and eval share. Every function is differentiable in its
// tensor arguments and follows their device and dtype.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "formats/quantizer_config.h"

namespace kvforge {

// Pair-angle rotations as matrices: angles [..., D/2] -> [..., D, D] with
// x' = x R rotating channel pair (j, j + D/2) by angles[..., j].
at::Tensor pair_rotation_matrices(const at::Tensor& angles);

// One layer's rotation of keys or values as matrices [kv_heads, D, D]
// (x' = x R), in `options`' dtype and device; undefined for RotationForm::kNone.
// std::invalid_argument naming the array when its shape is not the form's.
at::Tensor rotation_matrices(const TensorRotation& rotation, RotationForm form, int64_t kv_heads, int64_t head_dim,
                             const at::TensorOptions& options);

// The keys' centre [kv_heads, 1, D] (undefined when the rotation has none).
at::Tensor rotation_centre(const TensorRotation& rotation, int64_t kv_heads, int64_t head_dim,
                           const at::TensorOptions& options);

// x [..., heads, T, D] times matrices [heads', D, D] per head: x R (rotate)
// or x R^T (unrotate). heads may be a multiple of heads' (queries of a GQA
// group share their KV head's matrix: query head g uses g / (heads / heads')).
at::Tensor rotate(const at::Tensor& x, const at::Tensor& matrices);
at::Tensor unrotate(const at::Tensor& x, const at::Tensor& matrices);

// ||R^T R - I|| (Frobenius), the largest over heads: how far from orthogonal.
double orthogonality_error(const at::Tensor& matrices);

}  // namespace kvforge
