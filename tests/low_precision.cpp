#include "tests/low_precision.h"

#include <ATen/ATen.h>

#include <cmath>
#include <stdexcept>
#include <string>

namespace kvforge::testing {

// Derivation of the bounds.
//
// Unit roundoff. A type with p significant bits (the hidden bit included)
// rounds to nearest with relative error at most u = 2^-p: bf16 p = 8, fp16
// p = 11, fp32 p = 24. pyllama-16m is stored in bf16 and the fp32
// reference upcasts it exactly, so its weights carry no error; the tiny
// fixtures are fp32 and each weight is rounded once. Products are
// accumulated in fp32 (oneDNN, ATen's own kernels, cuBLAS alike), whose
// error (n * 2^-24 for n <= 2048 terms, below 2^-13) is small beside one
// bf16 or fp16 rounding and is not counted.
//
// Roundings. model/transformer.cpp rounds to the model dtype after every
// operation; counted on the longest path through one decoder layer:
//   attention: RMSNorm (normed cast, times weight) 2, q/k/v projection 1,
//     RoPE (cos/sin tables, x*cos, rotate_half*sin plus it) 3, scores 1,
//     times 1/sqrt(head_dim) 1, softmax cast back 1, probabilities*V 1,
//     o_proj 1, residual add 1                                       = 12
//   MLP: RMSNorm 2, gate (or up) 1, SiLU 1, times up 1, down 1, add 1 = 7
// so 19 per layer (Qwen3's q_norm and k_norm add 2); the final norm adds 2
// and the LM head 1. From an fp32 checkpoint the weights are rounded too:
// the embedding, each norm weight and one projection weight per matmul on
// the path (6 per layer, 7 with q_norm, one more for a q/k/v bias), the
// final norm's and the LM head's. The fused attention kernels round less
// often than the eager path, never more.
//
// Accumulation. Each rounding is a relative perturbation (1 + d_i) with
// |d_i| <= u. The pre-norm residual blocks renormalize their input (RMSNorm
// is scale invariant) and add a correction to the residual stream, so, to
// first order, relative perturbations of the stream add up layer after
// layer instead of multiplying. The worst case n * u (98 u = 0.38 for bf16
// logits of a 5-layer model) is far from any run and would make the bounds
// vacuous; the probabilistic model of rounding error analysis (Higham and
// Mary, SIAM J. Sci. Comput. 41(5), 2019) treats the d_i as independent,
// mean zero, so their sum has standard deviation at most sqrt(n/3) u.
// The bound is lambda * sqrt(n) * u with lambda = 2, i.e. 3.5 standard
// deviations: relative to the largest magnitude of the tensor (for the
// recorded q, k, v) or of the position (hidden state norm, logits).
//
// Argmax. At a position, with fp32 logits z and low-precision logits z~,
// |z~_j - z_j| <= e * max_k |z_k| with e the logits' bound. The computed
// argmax is the fp32 one when z_top - z_j > 2 e max_k |z_k| for every
// j != top, i.e. when the top-2 margin exceeds that: only those positions
// are checked, and the share of them is asserted large so that the check
// cannot pass by checking nothing.

double unit_roundoff(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kBFloat16: return std::ldexp(1.0, -8);
    case c10::kHalf: return std::ldexp(1.0, -11);
    case c10::kFloat: return std::ldexp(1.0, -24);
    default: throw std::invalid_argument("no unit roundoff for " + std::string(c10::toString(dtype)));
  }
}

int64_t RoundingCount::per_layer() const {
  const int64_t activations = 12 + 7 + (config.qk_norm ? 2 : 0);
  const int64_t weights = 6 + (config.qk_norm ? 1 : 0) + (config.attention_bias ? 1 : 0);
  return activations + (fp32_weights ? weights : 0);
}

int64_t RoundingCount::to_query(int64_t layer) const {
  const int64_t activations = 2 + 1 + (config.qk_norm ? 2 : 0) + 3;
  const int64_t weights = 2 + (config.qk_norm ? 1 : 0) + (config.attention_bias ? 1 : 0);
  return per_layer() * layer + (fp32_weights ? 1 : 0) + activations + (fp32_weights ? weights : 0);
}

int64_t RoundingCount::to_key_or_value(int64_t layer) const {
  return to_query(layer) - 3;  // no RoPE on k_pre or v
}

int64_t RoundingCount::to_final_hidden() const {
  // The embedding (a weight) and the final norm (2, and its weight).
  return per_layer() * config.num_layers + 2 + (fp32_weights ? 2 : 0);
}

int64_t RoundingCount::to_logits() const { return to_final_hidden() + 1 + (fp32_weights ? 1 : 0); }

double accumulated_error_bound(int64_t roundings, double u) {
  constexpr double kLambda = 2.0;
  return kLambda * std::sqrt(static_cast<double>(roundings)) * u;
}

double ArgmaxCheck::share() const { return checked.to(at::kDouble).mean().item<double>(); }

ArgmaxCheck argmax_check(const at::Tensor& reference_logits, double relative_error) {
  const at::Tensor z = reference_logits.to(at::kDouble);
  const auto [top, index] = z.topk(2, -1);
  ArgmaxCheck check;
  check.margin = top.select(-1, 0) - top.select(-1, 1);
  check.bound = 2 * relative_error * z.abs().amax(-1);
  check.checked = check.margin > check.bound;
  return check;
}

int64_t argmax_disagreements(const ArgmaxCheck& check, const at::Tensor& reference_logits, const at::Tensor& logits) {
  const at::Tensor differ = reference_logits.argmax(-1).ne(logits.argmax(-1));
  return differ.logical_and(check.checked).sum().item<int64_t>();
}

}  // namespace kvforge::testing
