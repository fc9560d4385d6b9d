#pragma once
// Error measures of a quantizer on calibration activations (float64 sums),
// for LayerCalibrationStats.
#include <ATen/core/Tensor.h>

namespace kvforge {

struct ErrorSums {
  double squared_error = 0;      // sum (x - x^)^2
  double squared_reference = 0;  // sum x^2
  double relative() const { return squared_reference > 0 ? squared_error / squared_reference : 0.0; }
  ErrorSums& operator+=(const ErrorSums& other) {
    squared_error += other.squared_error;
    squared_reference += other.squared_reference;
    return *this;
  }
};

// Over all elements; same shapes.
ErrorSums tensor_error(const at::Tensor& reference, const at::Tensor& approximation);

// Attention logits s_ij = q_i . k_j / sqrt(D) over causal pairs j <= i of
// every window and query head, with exact and with dequantized keys.
// queries: [N, H, T, D]; keys, keys_hat: [N, Hkv, T, D], post-RoPE; query
// head h reads kv head h / (H / Hkv). All in float64; cost O(T D^2) per
// head (a running Gram matrix of earlier keys), not O(T^2 D).
ErrorSums logit_error(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& keys_hat);

}  // namespace kvforge
