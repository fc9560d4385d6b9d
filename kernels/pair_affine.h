#pragma once
// The dequantization affine of a runtime group from its stored (min, max)
// (docs/runtime-layout.md 6.2), in float32: x^ = fma(b, L[code], a). One
// definition for the CPU reference and every decode kernel, so that they
// dequantize the same bits to the same numbers.
#include "kernels/runtime_layout.h"
#include "kernels/small_division.h"

namespace kvforge::kernels {

struct Affine {
  float a = 0, b = 0;
};

// min == max: the group is kept as it is (a = min, b = 0). Otherwise
// lo = clip * min, hi = clip * max (float32 products) and
//   uniform:     a = lo,              b = (hi - lo) / top, rounded once;
//   non-uniform: a = (lo + hi) * 0.5, b = (hi - lo) * 0.5.
// top = 2^bits - 1; for 3 and 15 (2 and 4 bits) the division is
// small_division.h's three operations, which round as the division does
// (hi - lo is never -0 here). Branch-free but for non_uniform, which the
// kernels know at compile time or per launch.
KVFORGE_HOST_DEVICE inline Affine pair_affine(float min, float max, float clip_ratio, bool non_uniform, int top) {
#if defined(__CUDA_ARCH__)
  const float lo = __fmul_rn(clip_ratio, min), hi = __fmul_rn(clip_ratio, max);
  const float width = __fsub_rn(hi, lo);
  const float middle = __fmul_rn(__fadd_rn(lo, hi), 0.5f), half_width = __fmul_rn(width, 0.5f);
#else
  const float lo = clip_ratio * min, hi = clip_ratio * max;
  const float width = hi - lo;
  const float middle = (lo + hi) * 0.5f, half_width = width * 0.5f;
#endif
  Affine affine;
  if (non_uniform) {
    affine = {middle, half_width};
  } else if (top == 3 || top == 15) {
    affine = {lo, divide_by_small(width, static_cast<float>(top), 1.0f / static_cast<float>(top))};
  } else {
#if defined(__CUDA_ARCH__)
    affine = {lo, __fdiv_rn(width, static_cast<float>(top))};
#else
    affine = {lo, width / static_cast<float>(top)};
#endif
  }
  return min == max ? Affine{min, 0.0f} : affine;
}

}  // namespace kvforge::kernels
