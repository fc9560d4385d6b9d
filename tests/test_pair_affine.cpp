// kernels/pair_affine.h (the affine every decode path dequantizes a group
// with) against docs/runtime-layout.md 6.2 written out in plain float32
// operations, the division as a division: uniform grids of 2, 3 and 4 bits,
// non-uniform grids, kept groups, over pairs of many magnitudes.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>

#include "kernels/pair_affine.h"

namespace kvforge {
namespace {

uint32_t bits_of(float x) { return std::bit_cast<uint32_t>(x); }

kernels::Affine documented(float min, float max, float clip, bool non_uniform, int top) {
  if (min == max) return {min, 0.0f};
  const volatile float lo = clip * min, hi = clip * max;  // each product rounded once
  if (non_uniform) return {(lo + hi) * 0.5f, (hi - lo) * 0.5f};
  const volatile float width = hi - lo, divisor = static_cast<float>(top);
  return {lo, width / divisor};
}

TEST(PairAffine, IsTheDocumentedArithmetic) {
  std::mt19937 random(31);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  for (int trial = 0; trial < 200000; ++trial) {
    const float scale = std::ldexp(1.0f, exponent(random));
    float min = unit(random) * scale, max = unit(random) * scale;
    if (max < min) std::swap(min, max);
    if (trial % 97 == 0) max = min;  // a kept group
    const float clip = trial % 3 == 0 ? 1.0f : 0.5f + 0.5f * std::fabs(unit(random));
    for (const int top : {3, 7, 15}) {
      for (const bool non_uniform : {false, true}) {
        const kernels::Affine got = kernels::pair_affine(min, max, clip, non_uniform, top);
        const kernels::Affine want = documented(min, max, clip, non_uniform, top);
        ASSERT_EQ(bits_of(got.a), bits_of(want.a)) << min << " " << max << " clip " << clip << " top " << top;
        ASSERT_EQ(bits_of(got.b), bits_of(want.b)) << min << " " << max << " clip " << clip << " top " << top;
      }
    }
  }
}

TEST(PairAffine, KeepsAGroupOfOneValueAsItIs) {
  for (const float v : {0.0f, -0.0f, 1.5f, -3.25e-20f, 6.0e30f}) {
    const kernels::Affine affine = kernels::pair_affine(v, v, 0.9f, false, 3);
    EXPECT_EQ(bits_of(affine.a), bits_of(v));
    EXPECT_EQ(affine.b, 0.0f);
  }
}

}  // namespace
}  // namespace kvforge
