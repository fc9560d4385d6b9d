#pragma once
// The objective a rotation is learned by (`kvforge rotate`, OptR): how much
// quantized keys or values change one layer's attention output after o_proj,
// per KV head, batched over the KV heads of a layer.
//
// Per KV head h, over the query heads g of its GQA group (g = h * G ...
// h * G + G - 1, G = H / Hkv), over the last `last_queries` positions of
// every window (causal: the query at position t sees keys 0..t), with
// P_g = softmax(q_g k^T * scale) (scale 1/sqrt(D)), o_g = P_g V, and
// W_O,g = o_proj.weight[:, g*D : (g+1)*D] so that the head group's share of
// the layer output is y = sum_g o_g W_O,g^T:
//   key term   KL(P_fp || P_q), the mean over windows, query heads and
//              queries of sum_t P_fp log(P_fp / P_q) (keys quantized,
//              values exact), and the relative post-W_O output error
//              ||sum_g (o~_g - o_g) W_O,g^T||^2 / ||sum_g o_g W_O,g^T||^2;
//   value term ||sum_g P_g (V~ - V) W_O,g^T||^2 / ||sum_g P_g V W_O,g^T||^2,
//              with P_g the caller's probabilities: exact ones (the reported
//              decomposition: key- and value-induced error separately) or
//              those of quantized keys (what a value rotation is learned
//              with, the learned key rotation in place).
// Norms run over windows, queries and the hidden dimension. Keys are given
// in the quantizer's domain: pre-RoPE keys (RotationLayerData::rope set) are
// rotated by RoPE (model/rope.h) before the logits, exactly as the exact keys.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "formats/hf_config.h"

namespace kvforge {

// One layer's captured activations as the objective needs them, all on one
// device, float32 or float64.
struct RotationLayerData {
  at::Tensor queries;  // post-RoPE [N, H, T, D]
  at::Tensor keys;     // the quantizer's domain [N, Hkv, T, D]: pre-RoPE when `rope` is set, else post-RoPE
  at::Tensor values;   // [N, Hkv, T, D]
  at::Tensor o_proj;   // the layer's o_proj weight [hidden, H * D]
  std::optional<RopeConfig> rope;         // keys are pre-RoPE: the model's RoPE
  at::Tensor fisher_keys, fisher_values;  // [N, Hkv, T, D] Fisher sensitivities; undefined unless Fisher-weighted

  int64_t windows() const { return keys.size(0); }
  // Windows [first, first + count) of every tensor (o_proj and rope shared).
  RotationLayerData windows_slice(int64_t first, int64_t count) const;
  // Every tensor moved to `device` and `dtype` (the Fisher weights too).
  RotationLayerData to(const at::Device& device, at::ScalarType dtype) const;
};

// Per-KV-head terms, each [Hkv] in the data's dtype.
struct KeyTerms {
  at::Tensor kl;      // KL(P_fp || P_q)
  at::Tensor output;  // relative post-W_O output error
  at::Tensor total(double kl_weight, double output_weight) const;  // kl_weight * kl + output_weight * output
};

// The exact attention of a layer's data, computed once, against which
// dequantized keys and values are measured. Holds the exact probabilities
// [N, Hkv, G, Lq, T] and outputs; every method is differentiable in its
// tensor argument.
class AttentionObjective {
 public:
  // last_queries <= 0 or > T: every position. std::invalid_argument naming
  // the tensor for inconsistent shapes.
  AttentionObjective(const RotationLayerData& data, int64_t last_queries);

  // Dequantized keys [N, Hkv, T, D] in the quantizer's domain.
  KeyTerms key_terms(const at::Tensor& keys) const;
  // Attention probabilities [N, Hkv, G, Lq, T] with these keys.
  at::Tensor probabilities(const at::Tensor& keys) const;
  const at::Tensor& exact_probabilities() const { return exact_probabilities_; }
  // Dequantized values [N, Hkv, T, D] under `probabilities` [N, Hkv, G, Lq, T].
  at::Tensor value_term(const at::Tensor& values, const at::Tensor& probabilities) const;
  // [N, Hkv, T]: the exact attention mass each token receives, summed over
  // the group's query heads and the objective's queries (the value
  // eigenbasis' weights).
  at::Tensor token_mass() const;

  int64_t query_count() const { return query_count_; }

 private:
  at::Tensor log_probabilities(const at::Tensor& keys) const;
  at::Tensor post_rope(const at::Tensor& keys) const;
  // sum over windows, queries and hidden of (sum_g o_g W_O,g^T)^2: [Hkv].
  at::Tensor output_energy(const at::Tensor& outputs) const;

  at::Tensor queries_;  // [N, Hkv, G, Lq, D], pre-scaled by 1/sqrt(D)
  at::Tensor values_;   // [N, Hkv, 1, T, D]
  at::Tensor o_proj_;   // [Hkv, G * D, hidden]
  at::Tensor causal_;   // bool [Lq, T]: query i sees key t
  at::Tensor rope_cos_, rope_sin_;  // [T, D] when keys are pre-RoPE
  at::Tensor exact_log_probabilities_, exact_probabilities_, exact_outputs_, exact_energy_;
  int64_t query_count_ = 0;
};

}  // namespace kvforge
