// kernels/small_division.h against float32 division (x / d rounded once) for
// the grids' divisors 3 and 15: every exponent with 4096 sampled significands
// each (both signs), every subnormal exponent range, and the edge cases
// (powers of two, multiples of the divisor, the largest and smallest finite
// values). The exhaustive run over all 2^32 inputs is recorded in the header.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kernels/small_division.h"

namespace kvforge {
namespace {

void expect_equal_to_division(float x, float divisor) {
  const float inverse = 1.0f / divisor;
  const volatile float d = divisor;  // a division at run time, not folded by the compiler
  const float want = x / d;
  const float got = kernels::divide_by_small(x, divisor, inverse);
  ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << std::hexfloat << x << " / " << divisor << ": " << got << " against " << want;
}

TEST(SmallDivision, EqualsDivisionOnEveryExponent) {
  std::mt19937 random(7);
  for (const float divisor : {3.0f, 15.0f}) {
    for (uint32_t exponent = 0; exponent < 255; ++exponent) {  // 0: subnormals
      for (int i = 0; i < 4096; ++i) {
        const uint32_t significand = random() & 0x7fffffu;
        for (const uint32_t sign : {0u, 0x80000000u}) {
          const float x = std::bit_cast<float>(sign | (exponent << 23) | significand);
          if (x == 0.0f) continue;  // -0 is the documented exception, +0 below
          expect_equal_to_division(x, divisor);
        }
      }
    }
  }
}

TEST(SmallDivision, EqualsDivisionOnTheEdges) {
  const float big = std::numeric_limits<float>::max(), tiny = std::numeric_limits<float>::denorm_min();
  for (const float divisor : {3.0f, 15.0f}) {
    std::vector<float> edges = {0.0f, big, -big, tiny, -tiny, std::numeric_limits<float>::min(), 1.0f, -1.0f};
    for (int e = -149; e <= 127; ++e) {
      edges.push_back(std::ldexp(1.0f, e));
      edges.push_back(std::ldexp(divisor, e < 126 ? e : 126));
      edges.push_back(std::nextafter(std::ldexp(divisor, e < 126 ? e : 126), 0.0f));
    }
    for (const float x : edges) {
      if (std::isfinite(x)) expect_equal_to_division(x, divisor);
    }
  }
}

TEST(SmallDivision, MinusZeroGivesPlusZero) {
  EXPECT_EQ(std::bit_cast<uint32_t>(kernels::divide_by_small(-0.0f, 3.0f, 1.0f / 3.0f)), 0u);
}

}  // namespace
}  // namespace kvforge
