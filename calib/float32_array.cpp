#include "calib/float32_array.h"

namespace kvforge {

Float32Array float32_array(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
  Float32Array array;
  array.shape.assign(c.sizes().begin(), c.sizes().end());
  array.values.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  return array;
}

}  // namespace kvforge
