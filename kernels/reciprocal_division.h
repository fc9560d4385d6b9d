#pragma once
// a / b rounded once (IEEE float64 division) from y = 1 / b rounded to
// nearest, in three operations instead of a division's two dozen: q = a y,
// the remainder r = a - b q exactly (one fma), then q + r y rounded once.
// Markstein's theorem (Markstein 1990; Muller et al., Handbook of
// Floating-Point Arithmetic): with y within half an ulp of 1/b and q within
// one ulp of a/b, that last rounding is the correctly rounded a/b, as long
// as nothing under- or overflows. So a group of the append that divides all
// its elements by one step takes the reciprocal once (its grid) and gets the
// reference's quotients bit for bit. A zero quotient may carry the other
// sign (a = -0 gives +0), which no code depends on. The caller keeps b and
// a / b well inside the normal range (divides_by_reciprocal) and divides
// outright otherwise. tests/test_reciprocal_division.cpp checks it against
// division.
#include <cmath>

#include "kernels/runtime_layout.h"

namespace kvforge::kernels {

// Whether divide_by_reciprocal is exact for divisor b: |b| and 1 / |b| well
// inside the normal range, with room for the quotients of the append's
// element-type numbers (|a| < 2^129).
KVFORGE_HOST_DEVICE inline bool divides_by_reciprocal(double b) {
  const double magnitude = b < 0 ? -b : b;
  return magnitude >= 0x1p-700 && magnitude <= 0x1p700;
}

// `inverse` is 1 / b rounded to nearest (the caller's, once per divisor).
// float64 here; kernels/small_division.h's float32 division by the grids'
// small divisors is the same three operations.
template <class T>
KVFORGE_HOST_DEVICE inline T divide_by_reciprocal(T a, T b, T inverse) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) {
    const float q = __fmul_rn(a, inverse);
    const float remainder = __fmaf_rn(-q, b, a);  // exact: a - q b
    return __fmaf_rn(remainder, inverse, q);
  } else {
    const double q = __dmul_rn(a, inverse);
    const double remainder = __fma_rn(-q, b, a);  // exact: a - q b
    return __fma_rn(remainder, inverse, q);
  }
#else
  const T q = a * inverse;
  const T remainder = std::fma(-q, b, a);
  return std::fma(remainder, inverse, q);
#endif
}

}  // namespace kvforge::kernels
