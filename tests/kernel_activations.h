#pragma once
// Synthetic activations for the runtime-kernel tests (CPU reference, CUDA
// append, CUDA decode): keys before and after RoPE and values of one layer,
// every value an element-type number, with the features the layouts must
// handle: channels of different scales and offsets for keys (an outlier
// channel every 11) and occasional spikes in values.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "calib/quantizer_fit.h"
#include "formats/quantizer_config.h"
#include "kernels/quantized_kv_cache.h"
#include "kernels/runtime_layout.h"
#include "model/rope.h"

namespace kvforge::testing {

// x rounded to the element type (through float32 for fp16 and bf16, as the
// tests' inputs are), returned as float32.
at::Tensor to_element(const at::Tensor& x, kernels::ElementType element);

struct KernelActivations {
  at::Tensor keys_pre, keys, values;  // [windows, kv_heads, tokens, dim] float32
};

KernelActivations synthetic_activations(int64_t windows, int64_t kv_heads, int64_t tokens, int64_t dim,
                                        double layer_scale, kernels::ElementType element,
                                        const RotaryEmbedding& rope);

// Tokens [from, from + n) of window 0 as AppendBatch reads them (rows
// [n][kv_heads][dim] float32), appended to `keys` and `values`; the keys
// before RoPE when `keys_pre_rope` (the configuration's domain).
void append_token_rows(const KernelActivations& a, bool keys_pre_rope, int64_t from, int64_t n,
                       std::vector<float>& keys, std::vector<float>& values);

// A batch's sequence lengths: `count` of them spread log-uniformly over
// 1..longest, 1 and `longest` included when count > 1 (one uniform draw for
// count 1), in an order shuffled by a std::mt19937 seeded with `seed`.
std::vector<int64_t> mixed_lengths(int64_t count, int64_t longest, uint32_t seed);

// One layer's quantizers fitted by calib to `calibration` (keys in the
// settings' domain) under a random rotation of the given forms (drawn in this
// order: key matrix, key centre, key angles, value matrix), the rotation
// recorded in the result.
LayerQuantizers fit_randomly_rotated_layer(const QuantizerSettings& settings, const FitOptions& fit,
                                           const KernelActivations& calibration, int64_t kv_heads, int64_t head_dim,
                                           RotationForm key_rotation, RotationForm value_rotation, bool key_centre);

// The fit options of a runtime-kernel test case: no Fisher weights, every
// calibration token used.
FitOptions kernel_test_fit(QuantMethod method, int bits);

// A runtime-kernel test case's configuration: settings resolved from `fit`,
// the rotation forms recorded (no learning steps), and `layers` layers each
// fitted by fit_randomly_rotated_layer to 2 synthetic windows of 96 tokens at
// scale 1 + 0.5 layer (drawn in layer order).
QuantizerConfig fitted_kernel_config(const std::string& name, const FitOptions& fit, int64_t layers, int64_t kv_heads,
                                     int64_t head_dim, kernels::ElementType element, RotationForm key_rotation,
                                     RotationForm value_rotation, bool key_centre, const RotaryEmbedding& rope);

// The model dimensions a test cache needs, with the RoPE inverse frequencies of `rope`.
kernels::ModelDimensions kernel_model_dimensions(int64_t layers, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                                 const RopeConfig& rope);

}  // namespace kvforge::testing
