#include "tests/kernel_activations.h"

#include <ATen/ATen.h>

#include <vector>

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

Float32Array array_of(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kFloat).contiguous();
  return {std::vector<int64_t>(c.sizes().begin(), c.sizes().end()),
          std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel())};
}

}  // namespace kvforge::testing
