#pragma once
// Butterfly reductions over the 32 lanes of a warp (every lane gets the
// result).

namespace kvforge::kernels::decode_attention_device {

inline constexpr int kWarpSize = 32;

__device__ inline float warp_max(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

__device__ inline float warp_sum(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace kvforge::kernels::decode_attention_device
