#include "bench/decode_bench_config.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <mutex>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "calib/float32_array.h"
#include "calib/quantizer_fit.h"
#include "formats/hf_config.h"
#include "formats/kv_rotation.h"
#include "model/rope.h"

namespace kvforge {
namespace {

// int2-rot's rotations (rotation/rotation_fit's forms for post-RoPE keys),
// random orthogonal per KV head; the activations are rotated before the fit,
// as rotate refits the quantizers in the rotated basis. Sets the
// configuration's rotation settings and returns the layer's rotation.
LayerRotation int2rot_rotations(QuantizerConfig& config, LayerActivations& a, int64_t kv_heads, int64_t head_dim) {
  const auto orthogonal = [&] {
    return std::get<0>(at::linalg_qr(at::randn({kv_heads, head_dim, head_dim}, at::kDouble))).to(at::kFloat);
  };
  const at::Tensor keys = orthogonal(), values = orthogonal();
  const at::Tensor centre = at::randn({kv_heads, head_dim}) * 0.3;
  RotationSettings settings;
  settings.keys = RotationForm::kMatrix;
  settings.values = RotationForm::kMatrix;
  settings.key_centred = true;
  settings.steps = 0;
  config.rotation = settings;
  // [batch, kv_heads, T, D] x [kv_heads, D, D]: x' = x R per head.
  a.keys = at::matmul(a.keys - centre.unsqueeze(1), keys);
  a.values = at::matmul(a.values, values);
  LayerRotation rotation;
  rotation.keys.matrix = float32_array(keys);
  rotation.keys.centre = float32_array(centre);
  rotation.values.matrix = float32_array(values);
  return rotation;
}

// torch's CPU generator seeded for one (method, bits) while it lives, its
// state put back after: a configuration then depends on its method and
// bits alone, not on which ones the benchmark fitted before it (the grid
// fits eight, a targeted run one or two).
class SeededCpuGenerator {
 public:
  explicit SeededCpuGenerator(const std::string& name) : generator_(at::detail::getDefaultCPUGenerator()) {
    const std::lock_guard<std::mutex> lock(generator_.mutex());
    saved_ = generator_.get_state();
    uint64_t seed = 14695981039346656037ull;  // FNV-1a of the name: the same on every platform
    for (const unsigned char c : name) seed = (seed ^ c) * 1099511628211ull;
    generator_.set_current_seed(seed);
  }
  ~SeededCpuGenerator() {
    const std::lock_guard<std::mutex> lock(generator_.mutex());
    generator_.set_state(saved_);
  }
  SeededCpuGenerator(const SeededCpuGenerator&) = delete;
  SeededCpuGenerator& operator=(const SeededCpuGenerator&) = delete;

 private:
  at::Generator generator_;
  at::Tensor saved_;
};

}  // namespace

kernels::ModelDimensions decode_bench_dimensions() {
  kernels::ModelDimensions dims{1, kDecodeBenchHeads, kDecodeBenchKvHeads, kDecodeBenchHeadDim, {}};
  const RopeConfig llama3{RopeType::kLlama3, 500000.0, 8.0, 1.0, 4.0, 8192};
  dims.rope_inverse_frequencies = float32_array(rope_inverse_frequencies(llama3, kDecodeBenchHeadDim)).values;
  return dims;
}

QuantizerConfig decode_bench_config(const std::string& method, int bits) {
  constexpr int64_t kv_heads = kDecodeBenchKvHeads, head_dim = kDecodeBenchHeadDim;
  FitOptions fit;
  const std::optional<QuantMethod> parsed = parse_method(method);
  if (!parsed) throw std::invalid_argument("--methods " + method + ": expected kvquant, kivi, int2-rot or rtn");
  fit.method = *parsed;
  fit.bits = bits;
  QuantizerConfig config;
  config.name = method + "-" + std::to_string(bits) + "bit";
  const SeededCpuGenerator seeded(config.name);
  config.settings = resolve_settings(fit, head_dim);
  const at::Tensor channel = at::arange(head_dim, at::kFloat);
  const at::Tensor scale = 1 + 3 * (channel.remainder(11) == 0).to(at::kFloat);
  LayerActivations a;
  a.keys = at::randn({2, kv_heads, 512, head_dim}) * scale;
  a.values = at::randn({2, kv_heads, 512, head_dim});
  if (config.settings.fisher_weighted) {
    a.fisher_keys = at::ones_like(a.keys);
    a.fisher_values = at::ones_like(a.values);
  }
  std::optional<LayerRotation> rotation;
  if (fit.method == QuantMethod::kInt2Rot) rotation = int2rot_rotations(config, a, kv_heads, head_dim);
  config.layers.push_back(fit_layer(config.settings, a, fit));
  if (rotation) config.layers.back().rotation = *rotation;
  return config;
}

}  // namespace kvforge
