// kernels/fixed_divisor.h (the decode kernels' page and outlier-page
// arithmetic) against / and %: powers of two by shifts, other page sizes by
// division, over small values, the edges of every page and random 32-bit
// values.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "kernels/fixed_divisor.h"

namespace kvforge {
namespace {

TEST(FixedDivisor, ShiftsArePowersOfTwoOnly) {
  EXPECT_EQ(kernels::power_of_two_shift(1), 0);
  EXPECT_EQ(kernels::power_of_two_shift(16), 4);
  EXPECT_EQ(kernels::power_of_two_shift(256), 8);
  EXPECT_EQ(kernels::power_of_two_shift(1u << 31), 31);
  for (const uint32_t d : {0u, 3u, 12u, 24u, 255u, 257u, 1000u, 0xffffffffu}) {
    EXPECT_EQ(kernels::power_of_two_shift(d), -1) << d;
  }
}

TEST(FixedDivisor, QuotientAndRemainderEqualDivision) {
  std::mt19937 random(3);
  std::uniform_int_distribution<uint32_t> any;
  for (const uint32_t d : {1u, 2u, 3u, 12u, 16u, 64u, 100u, 256u, 4096u, 1000003u, 1u << 31, 0xffffffffu}) {
    const kernels::FixedDivisor divisor(d);
    auto check = [&](uint32_t x) {
      ASSERT_EQ(divisor.quotient(x), x / d) << x << " / " << d;
      ASSERT_EQ(divisor.remainder(x), x % d) << x << " % " << d;
    };
    for (uint32_t x = 0; x < 5000; ++x) check(x);
    for (uint32_t page = 1; page < 64; ++page) {  // either side of page boundaries
      const uint64_t edge = static_cast<uint64_t>(page) * d;
      if (edge <= 0xffffffffu) check(static_cast<uint32_t>(edge));
      if (edge - 1 <= 0xffffffffu) check(static_cast<uint32_t>(edge - 1));
    }
    for (int trial = 0; trial < 20000; ++trial) check(any(random));
    check(0xffffffffu);
  }
}

}  // namespace
}  // namespace kvforge
