#pragma once
// x / d rounded once (IEEE float32 division) for the small divisors of the
// uniform grids (d = 2^bits - 1: 3 and 15), in three operations instead of
// a division's dozen: q = x * (1/d), then one fma correction of q by its
// remainder. Checked against division over every finite float32 x for both
// divisors (2^32 inputs each, 2026-12-01): equal bit for bit except x = -0,
// which gives +0 (a grid step x = hi - lo is never -0: hi == lo gives +0,
// and min == max takes the kept-as-is path before it); an infinite x gives
// NaN (a grid step overflows only for pairs beyond +-1.7e38). tests/
// test_small_division.cpp repeats the check on every exponent with sampled
// significands and the edge cases.
#include <cmath>

#include "kernels/reciprocal_division.h"
#include "kernels/runtime_layout.h"

namespace kvforge::kernels {

// `inverse` is 1 / divisor rounded to float32 (the caller's constant).
KVFORGE_HOST_DEVICE inline float divide_by_small(float x, float divisor, float inverse) {
  return divide_by_reciprocal(x, divisor, inverse);
}

}  // namespace kvforge::kernels
