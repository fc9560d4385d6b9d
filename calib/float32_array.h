#pragma once
// A tensor as a configuration's Float32Array (formats/quantizer_config.h):
// its values as float32 on the host, row-major, its shape kept. What calib,
// rotate and the benchmarks store fitted tensors through.
#include <ATen/core/Tensor.h>

#include "formats/quantizer_config.h"

namespace kvforge {

Float32Array float32_array(const at::Tensor& t);

}  // namespace kvforge
