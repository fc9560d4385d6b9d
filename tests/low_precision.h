#pragma once
// Error bounds for bf16 and fp16 runs of the forward pass, derived from the
// arithmetic (tests/low_precision.cpp says how), so that the low-precision
// tests hold for any kernels ATen and oneDNN pick on any processor.
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "formats/hf_config.h"

namespace kvforge::testing {

// u = 2^-p for a type of p significant bits: bf16 2^-8, fp16 2^-11, fp32 2^-24.
double unit_roundoff(c10::ScalarType dtype);

// Roundings to the model dtype on the longest path of the forward pass, as
// model/transformer.cpp computes it (the list is in low_precision.cpp).
// `fp32_weights`: the checkpoint is fp32, so every weight is rounded too
// (the tiny fixtures); a bf16 checkpoint (pyllama-16m) is not.
struct RoundingCount {
  const ModelConfig& config;
  bool fp32_weights;
  int64_t per_layer() const;
  int64_t to_query(int64_t layer) const;         // q after q_norm and RoPE of layer `layer` (0-based)
  int64_t to_key_or_value(int64_t layer) const;  // k_pre and v
  int64_t to_final_hidden() const;               // after the final norm
  int64_t to_logits() const;
};

// Relative error bound after `roundings` roundings of unit roundoff u:
// lambda * sqrt(roundings) * u with lambda = 2 (probabilistic model).
double accumulated_error_bound(int64_t roundings, double u);

// Positions whose argmax a low-precision run must reproduce, and why.
struct ArgmaxCheck {
  at::Tensor checked;   // bool [positions]: the fp32 top-1 beats every other token by more than the bound
  at::Tensor margin;    // fp32 top-1 minus top-2 logit
  at::Tensor bound;     // 2 * error bound * max |logit|, per position
  double share() const;  // of positions checked
};
// `reference_logits`: fp32 [positions, vocab]; `relative_error`: bound on
// |low-precision logit - fp32 logit| / max |fp32 logit| at a position.
ArgmaxCheck argmax_check(const at::Tensor& reference_logits, double relative_error);
// Positions checked whose argmax differs between the two logits.
int64_t argmax_disagreements(const ArgmaxCheck& check, const at::Tensor& reference_logits,
                             const at::Tensor& logits);

}  // namespace kvforge::testing
