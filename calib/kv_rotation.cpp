#include "calib/kv_rotation.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <string>

#include "model/cpu_vector_math.h"

namespace kvforge {
namespace {

void check_shape(const Float32Array& array, const std::vector<int64_t>& expected, const char* what) {
  if (array.shape != expected) {
    std::string text = "rotation ";
    text += what;
    text += ": expected shape [";
    for (size_t i = 0; i < expected.size(); ++i) text += (i ? ", " : "") + std::to_string(expected[i]);
    text += "]";
    throw std::invalid_argument(text);
  }
}

at::Tensor tensor_of(const Float32Array& array, const at::TensorOptions& options) {
  std::vector<float> copy = array.values;
  return at::from_blob(copy.data(), array.shape, at::TensorOptions().dtype(at::kFloat)).to(options).clone();
}

}  // namespace

at::Tensor pair_rotation_matrices(const at::Tensor& angles) {
  prepare_cpu_vector_math();
  const at::Tensor cos = at::cos(angles), sin = at::sin(angles);
  // Blocks of the matrix, each diagonal [..., pairs, pairs]: R = [[C, S], [-S, C]]
  // with x' = x R: x'_j = x_j cos - x_{j+P} sin, x'_{j+P} = x_j sin + x_{j+P} cos.
  const at::Tensor c = at::diag_embed(cos), s = at::diag_embed(sin);
  const at::Tensor top = at::cat({c, s}, -1), bottom = at::cat({-s, c}, -1);
  return at::cat({top, bottom}, -2);
}

at::Tensor rotation_matrices(const TensorRotation& rotation, RotationForm form, int64_t kv_heads, int64_t head_dim,
                             const at::TensorOptions& options) {
  switch (form) {
    case RotationForm::kNone:
      return {};
    case RotationForm::kMatrix:
      check_shape(rotation.matrix, {kv_heads, head_dim, head_dim}, "matrix");
      return tensor_of(rotation.matrix, options);
    case RotationForm::kPairAngles:
      if (head_dim % 2 != 0) throw std::invalid_argument("rotation angles: head_dim must be even");
      check_shape(rotation.angles, {kv_heads, head_dim / 2}, "angles");
      // Built in float64 whatever the target, so a float64 simulation is exact.
      return pair_rotation_matrices(tensor_of(rotation.angles, options.dtype(at::kDouble))).to(options);
  }
  throw std::invalid_argument("rotation_matrices: unknown form");
}

at::Tensor rotation_centre(const TensorRotation& rotation, int64_t kv_heads, int64_t head_dim,
                           const at::TensorOptions& options) {
  if (rotation.centre.empty()) return {};
  check_shape(rotation.centre, {kv_heads, head_dim}, "centre");
  return tensor_of(rotation.centre, options).unsqueeze(1);
}

namespace {
at::Tensor per_head(const at::Tensor& x, const at::Tensor& matrices) {
  if (x.dim() < 3 || matrices.dim() != 3) throw std::invalid_argument("rotate: expected x [..., heads, T, D] and [heads, D, D]");
  const int64_t heads = x.size(-3), kv_heads = matrices.size(0);
  if (heads % kv_heads != 0 || matrices.size(1) != x.size(-1) || matrices.size(2) != x.size(-1)) {
    throw std::invalid_argument("rotate: x has " + std::to_string(heads) + " heads of " + std::to_string(x.size(-1)) +
                                " channels, the matrices are [" + std::to_string(kv_heads) + ", " +
                                std::to_string(matrices.size(1)) + ", " + std::to_string(matrices.size(2)) + "]");
  }
  return heads == kv_heads ? matrices : matrices.repeat_interleave(heads / kv_heads, 0);
}
}  // namespace

at::Tensor rotate(const at::Tensor& x, const at::Tensor& matrices) {
  return at::matmul(x, per_head(x, matrices).to(x.scalar_type()));
}

at::Tensor unrotate(const at::Tensor& x, const at::Tensor& matrices) {
  return at::matmul(x, per_head(x, matrices).to(x.scalar_type()).transpose(-1, -2));
}

double orthogonality_error(const at::Tensor& matrices) {
  const at::Tensor r = matrices.to(at::kDouble);
  const at::Tensor eye = at::eye(r.size(-1), r.options());
  return at::linalg_matrix_norm(at::matmul(r.transpose(-1, -2), r) - eye).max().item<double>();
}

}  // namespace kvforge
