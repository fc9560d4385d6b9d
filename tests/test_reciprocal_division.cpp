// kernels/reciprocal_division.h against float64 division (a / b rounded
// once): random pairs over the exponents the append meets, the append's own
// quotients (element-type numbers minus a group's lower end, over its step
// (hi - lo) / (2^bits - 1) or (hi - lo) / 2, for bf16, fp16 and fp32
// elements), and significands at the edges (1, 2 - ulp, 1 + ulp and their
// neighbours) against each other, where a quotient's rounding is closest to
// a tie. Quotients are compared bit for bit, a zero's sign aside.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/element_conversion.h"
#include "kernels/reciprocal_division.h"

namespace kvforge {
namespace {

// Whether the reciprocal path gives a / b (the grid's check first, as the
// kernel does); counts the pairs it took.
void expect_equal_to_division(double a, double b, int64_t& taken) {
  if (!kernels::divides_by_reciprocal(b)) return;
  ++taken;
  const volatile double divisor = b;  // divided at run time, not folded by the compiler
  const double want = a / divisor;
  const double inverse = 1.0 / divisor;
  const double got = kernels::divide_by_reciprocal(a, b, inverse);
  if (want == 0.0 && got == 0.0) return;  // either sign
  ASSERT_EQ(std::bit_cast<uint64_t>(got), std::bit_cast<uint64_t>(want)) << std::hexfloat << a << " / " << b << ": " << got << " against " << want;
}

TEST(ReciprocalDivision, EqualsDivisionForRandomPairsOverTheExponents) {
  std::mt19937_64 random(20261202);
  std::uniform_int_distribution<uint64_t> significand(0, (uint64_t{1} << 52) - 1);
  std::uniform_int_distribution<int> a_exponent(-300, 300), b_exponent(-300, 300);
  int64_t taken = 0;
  for (int i = 0; i < 2'000'000; ++i) {
    const double a = std::ldexp(1.0 + std::ldexp(static_cast<double>(significand(random)), -52), a_exponent(random));
    const double b = std::ldexp(1.0 + std::ldexp(static_cast<double>(significand(random)), -52), b_exponent(random));
    ASSERT_NO_FATAL_FAILURE(expect_equal_to_division(i % 2 ? a : -a, i % 3 ? b : -b, taken));
  }
  EXPECT_EQ(taken, 2'000'000);
}

// The append's quotients: (x - lo) / step with x, lo, hi element-type
// numbers of a group and step its grid's (kernels/append_kernel.cuh).
TEST(ReciprocalDivision, EqualsDivisionForTheAppendsGridQuotients) {
  std::mt19937_64 random(7);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> scale(-12.0f, 12.0f);
  int64_t taken = 0;
  for (const kernels::ElementType element :
       {kernels::ElementType::kBFloat16, kernels::ElementType::kFloat16, kernels::ElementType::kFloat32}) {
    for (int group = 0; group < 20'000; ++group) {
      const float magnitude = std::exp2(scale(random));
      double values[32];
      double lo = 0, hi = 0;
      for (int i = 0; i < 32; ++i) {
        values[i] = kernels::round_to_element(element, static_cast<double>(normal(random) * magnitude));
        lo = i == 0 || values[i] < lo ? values[i] : lo;
        hi = i == 0 || hi < values[i] ? values[i] : hi;
      }
      if (!(hi > lo)) continue;
      for (const double divisor : {3.0, 15.0}) {  // uniform: (x - lo) / ((hi - lo) / top)
        const double step = (hi - lo) / divisor;
        for (const double x : values) ASSERT_NO_FATAL_FAILURE(expect_equal_to_division(x - lo, step, taken));
      }
      const double centre = (lo + hi) / 2, half = (hi - lo) / 2;  // non-uniform
      for (const double x : values) ASSERT_NO_FATAL_FAILURE(expect_equal_to_division(x - centre, half, taken));
    }
  }
  EXPECT_GT(taken, 5'000'000);
}

// Significands next to 1 and 2 on both sides, in every combination, at a
// few exponents: the quotients whose exact value lies closest to a tie.
TEST(ReciprocalDivision, EqualsDivisionForEdgeSignificands) {
  std::vector<double> significands;
  for (int k = 0; k < 64; ++k) {
    significands.push_back(1.0 + std::ldexp(static_cast<double>(k), -52));
    significands.push_back(2.0 - std::ldexp(static_cast<double>(k + 1), -52));
    significands.push_back(1.5 + std::ldexp(static_cast<double>(k) - 32, -52));
    significands.push_back(4.0 / 3.0 + std::ldexp(static_cast<double>(k) - 32, -52));
  }
  int64_t taken = 0;
  for (const int exponent : {-600, -40, 0, 1, 77, 600}) {
    for (const double sa : significands) {
      for (const double sb : significands) {
        ASSERT_NO_FATAL_FAILURE(expect_equal_to_division(std::ldexp(sa, exponent), sb, taken));
        ASSERT_NO_FATAL_FAILURE(expect_equal_to_division(-sa, std::ldexp(sb, -exponent), taken));
      }
    }
  }
  EXPECT_EQ(taken, 6 * 2 * static_cast<int64_t>(significands.size() * significands.size()));
}

TEST(ReciprocalDivision, TakesOnlyDivisorsWellInsideTheNormalRange) {
  EXPECT_TRUE(kernels::divides_by_reciprocal(1.0));
  EXPECT_TRUE(kernels::divides_by_reciprocal(-0x1p700));
  EXPECT_TRUE(kernels::divides_by_reciprocal(0x1p-700));
  EXPECT_FALSE(kernels::divides_by_reciprocal(0x1p701));
  EXPECT_FALSE(kernels::divides_by_reciprocal(0x1p-701));
  EXPECT_FALSE(kernels::divides_by_reciprocal(0.0));
  EXPECT_FALSE(kernels::divides_by_reciprocal(INFINITY));
  EXPECT_FALSE(kernels::divides_by_reciprocal(NAN));
}

}  // namespace
}  // namespace kvforge
