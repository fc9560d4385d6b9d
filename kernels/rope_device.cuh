#pragma once
// RoPE on the device for keys stored before RoPE (docs/runtime-layout.md
// 6.3 step 2): the float32 angle t inv_freq reduced by whole turns, then the
// special-function unit's sin and cos.
#include <cstdint>

#include "kernels/angle_reduction.h"

namespace kvforge::kernels::decode_attention_device {

// sin and cos of a float32 angle: reduced_angle (kernels/angle_reduction.h,
// under 2^-21 for |angle| < 2^21), then the special-function unit's (2^-21.4
// on [-pi, pi]): within ~1e-6 absolute. sincosf costs ~40 instructions a
// call up to |angle| = 105615 and takes a slow path beyond it, which
// 128K-token contexts reach. RoPE's angle t inv_freq is the one argument.
__device__ inline void reduced_sin_cos(float angle, float& sin_angle, float& cos_angle) {
  __sincosf(reduced_angle(angle), &sin_angle, &cos_angle);
}

// One RoPE pair (a, b) = (x_i, x_{i + D/2}) at `position`: angle =
// float(t) * inv_freq[i] (float32, as the reference), then x cos +
// rotate_half(x) sin with reduced_sin_cos.
__device__ inline void rope_pair(float position, float inverse_frequency, float& a, float& b) {
  const float angle = __fmul_rn(position, inverse_frequency);
  float sin_angle, cos_angle;
  reduced_sin_cos(angle, sin_angle, cos_angle);
  const float x = a, y = b;
  a = x * cos_angle + (-y) * sin_angle;
  b = y * cos_angle + x * sin_angle;
}

// RoPE at each token's position over a tile of keys. A thread takes four
// pairs of a token (16-byte loads and stores of both halves; the
// frequencies in shared memory, 16-byte aligned): one pair per thread had
// spent as much on its indices, loads and stores as on the rotation.
template <int D>
__device__ void rope_tile(const float* inverse_frequencies, int64_t first, int count, float* tile, int stride) {
  constexpr int kHalf = D / 2, kQuads = kHalf / 4;
  for (int unit = threadIdx.x; unit < count * kQuads; unit += blockDim.x) {
    const int j = unit / kQuads, i = unit % kQuads * 4;
    const float position = static_cast<float>(first + j);
    float* row = tile + j * stride;
    const float4 f = *reinterpret_cast<const float4*>(inverse_frequencies + i);
    float4 a = *reinterpret_cast<const float4*>(row + i), b = *reinterpret_cast<const float4*>(row + i + kHalf);
    rope_pair(position, f.x, a.x, b.x);
    rope_pair(position, f.y, a.y, b.y);
    rope_pair(position, f.z, a.z, b.z);
    rope_pair(position, f.w, a.w, b.w);
    *reinterpret_cast<float4*>(row + i) = a;
    *reinterpret_cast<float4*>(row + i + kHalf) = b;
  }
}

}  // namespace kvforge::kernels::decode_attention_device
