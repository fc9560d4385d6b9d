#include "tests/kernel_activations.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <tuple>
#include <vector>

#include "calib/float32_array.h"
#include "calib/kv_rotation.h"

namespace kvforge::testing {

at::Tensor to_element(const at::Tensor& x, kernels::ElementType element) {
  switch (element) {
    case kernels::ElementType::kFloat16: return x.to(at::kHalf).to(at::kFloat);
    case kernels::ElementType::kBFloat16: return x.to(at::kBFloat16).to(at::kFloat);
    case kernels::ElementType::kFloat32: return x.to(at::kFloat);
  }
  return x;
}

KernelActivations synthetic_activations(int64_t windows, int64_t kv_heads, int64_t tokens, int64_t dim,
                                        double layer_scale, kernels::ElementType element,
                                        const RotaryEmbedding& rope) {
  const at::Tensor channel = at::arange(dim, at::kDouble);
  const at::Tensor scale = 1 + 3 * (channel.remainder(11) == 0).to(at::kDouble);
  const at::Tensor offset = 0.5 * at::sin(channel);
  KernelActivations a;
  const at::Tensor pre = (at::randn({windows, kv_heads, tokens, dim}, at::kDouble) * scale + offset) * layer_scale;
  a.keys_pre = to_element(pre, element);
  a.keys = to_element(RotaryEmbedding::apply(a.keys_pre.to(at::kFloat), rope.tables(0, tokens, at::kFloat)), element);
  at::Tensor values = at::randn({windows, kv_heads, tokens, dim}, at::kDouble);
  values = values + (at::rand(values.sizes(), at::kDouble) < 0.01).to(at::kDouble) *
                        at::randn(values.sizes(), at::kDouble) * 6;
  a.values = to_element(values * layer_scale, element);
  return a;
}

void append_token_rows(const KernelActivations& a, bool keys_pre_rope, int64_t from, int64_t n,
                       std::vector<float>& keys, std::vector<float>& values) {
  // [1, kv_heads, n, dim] -> [n][kv_heads][dim]
  const at::Tensor k = (keys_pre_rope ? a.keys_pre : a.keys).narrow(2, from, n)[0].permute({1, 0, 2}).contiguous();
  const at::Tensor v = a.values.narrow(2, from, n)[0].permute({1, 0, 2}).contiguous();
  keys.insert(keys.end(), k.data_ptr<float>(), k.data_ptr<float>() + k.numel());
  values.insert(values.end(), v.data_ptr<float>(), v.data_ptr<float>() + v.numel());
}

std::vector<int64_t> mixed_lengths(int64_t count, int64_t longest, uint32_t seed) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<double> exponent(0.0, std::log(static_cast<double>(longest)));
  std::vector<int64_t> lengths;
  if (count == 1) return {1 + static_cast<int64_t>(generator() % static_cast<uint64_t>(longest))};
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = i == 0 ? 1 : i == 1 ? longest : std::llround(std::exp(exponent(generator)));
    lengths.push_back(std::clamp<int64_t>(n, 1, longest));
  }
  std::shuffle(lengths.begin(), lengths.end(), generator);
  return lengths;
}

LayerQuantizers fit_randomly_rotated_layer(const QuantizerSettings& settings, const FitOptions& fit,
                                           const KernelActivations& calibration, int64_t kv_heads, int64_t head_dim,
                                           RotationForm key_rotation, RotationForm value_rotation, bool key_centre) {
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const auto orthogonal = [&] { return std::get<0>(at::linalg_qr(at::randn({kv_heads, head_dim, head_dim}, at::kDouble))); };
  LayerRotation rotation;
  if (key_rotation == RotationForm::kMatrix) {
    rotation.keys.matrix = float32_array(orthogonal());
    if (key_centre) rotation.keys.centre = float32_array(at::randn({kv_heads, head_dim}, at::kDouble) * 0.3);
  } else if (key_rotation == RotationForm::kPairAngles) {
    rotation.keys.angles = float32_array((at::rand({kv_heads, head_dim / 2}, at::kDouble) * 2 - 1) * std::numbers::pi);
  }
  if (value_rotation == RotationForm::kMatrix) rotation.values.matrix = float32_array(orthogonal());
  LayerActivations a;
  a.keys = (settings.keys_pre_rope ? calibration.keys_pre : calibration.keys).to(at::kDouble);
  a.values = calibration.values.to(at::kDouble);
  if (key_rotation != RotationForm::kNone) {
    const at::Tensor m = rotation_matrices(rotation.keys, key_rotation, kv_heads, head_dim, options);
    const at::Tensor centre = rotation_centre(rotation.keys, kv_heads, head_dim, options);
    a.keys = rotate(centre.defined() ? a.keys - centre : a.keys, m);
  }
  if (value_rotation != RotationForm::kNone) {
    a.values = rotate(a.values, rotation_matrices(rotation.values, value_rotation, kv_heads, head_dim, options));
  }
  a.keys = a.keys.to(at::kFloat);
  a.values = a.values.to(at::kFloat);
  LayerQuantizers fitted = fit_layer(settings, a, fit);
  fitted.rotation = rotation;
  return fitted;
}

FitOptions kernel_test_fit(QuantMethod method, int bits) {
  FitOptions fit;
  fit.method = method;
  fit.bits = bits;
  fit.fisher = false;
  fit.max_calibration_tokens = 0;
  return fit;
}

QuantizerConfig fitted_kernel_config(const std::string& name, const FitOptions& fit, int64_t layers, int64_t kv_heads,
                                     int64_t head_dim, kernels::ElementType element, RotationForm key_rotation,
                                     RotationForm value_rotation, bool key_centre, const RotaryEmbedding& rope) {
  QuantizerConfig config;
  config.name = name;
  config.settings = resolve_settings(fit, head_dim);
  if (key_rotation != RotationForm::kNone || value_rotation != RotationForm::kNone) {
    RotationSettings r;
    r.keys = key_rotation;
    r.values = value_rotation;
    r.key_centred = key_centre;
    r.steps = 0;
    config.rotation = r;
  }
  for (int64_t layer = 0; layer < layers; ++layer) {
    const KernelActivations calibration =
        synthetic_activations(2, kv_heads, 96, head_dim, 1.0 + 0.5 * static_cast<double>(layer), element, rope);
    config.layers.push_back(fit_randomly_rotated_layer(config.settings, fit, calibration, kv_heads, head_dim,
                                                       key_rotation, value_rotation, key_centre));
  }
  return config;
}

kernels::ModelDimensions kernel_model_dimensions(int64_t layers, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                                 const RopeConfig& rope) {
  kernels::ModelDimensions d;
  d.num_layers = layers;
  d.num_heads = heads;
  d.num_kv_heads = kv_heads;
  d.head_dim = head_dim;
  const at::Tensor inv = rope_inverse_frequencies(rope, head_dim).contiguous();
  d.rope_inverse_frequencies.assign(inv.data_ptr<float>(), inv.data_ptr<float>() + inv.numel());
  return d;
}

}  // namespace kvforge::testing
