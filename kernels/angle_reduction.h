#pragma once
// A float32 angle reduced by whole turns (multiples of 2 pi) to about
// [-pi, pi] (the turns come from a float product, so within |angle| 2^-23 of
// a half turn the result may lie that far past pi), for the
// special-function unit's sin and cos, which are accurate near that range
// only (docs/runtime-layout.md 6.3 step 2: RoPE's angle t inv_freq in the
// CUDA decode). 2 pi is taken in two float parts; the first product is
// exact inside the fma, so the result's error is the two roundings at
// |r| < 4 (2^-22 and 2^-23) plus turns * |2 pi - high - low| (7.1e-15 a
// turn): under 2^-21 absolute for |angle| < 2^21.
#include <cmath>

#include "kernels/runtime_layout.h"

namespace kvforge::kernels {

inline constexpr float kTwoPiHigh = 6.28318548202514648f;      // float(2 pi)
inline constexpr float kTwoPiLow = -1.74845553146951715e-07f;  // float(2 pi - kTwoPiHigh)
inline constexpr float kTurnsPerRadian = 0.159154943091895336f;

KVFORGE_HOST_DEVICE inline float reduced_angle(float angle) {
#if defined(__CUDA_ARCH__)
  const float turns = rintf(__fmul_rn(angle, kTurnsPerRadian));
  return __fmaf_rn(-turns, kTwoPiLow, __fmaf_rn(-turns, kTwoPiHigh, angle));
#else
  const float turns = std::nearbyint(angle * kTurnsPerRadian);
  return std::fma(-turns, kTwoPiLow, std::fma(-turns, kTwoPiHigh, angle));
#endif
}

}  // namespace kvforge::kernels
