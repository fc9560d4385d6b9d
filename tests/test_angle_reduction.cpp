// kernels/angle_reduction.h (RoPE's angle reduced by whole turns before the
// CUDA decode's special-function sin and cos) against float64 sin and cos of
// the same float32 angle: within its header's bound, 2^-21 absolute, for
// the angles t * inv_freq of Llama-3's RoPE (theta 500000, head_dim 128) up
// to 2^20 tokens, and for angles at every power of two below 2^21.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>

#include "kernels/angle_reduction.h"

namespace kvforge {
namespace {

// |sin r - sin a| and |cos r - cos a| in float64 (a the float32 angle, r
// its reduction).
double reduction_error(float angle) {
  const double r = kernels::reduced_angle(angle), a = angle;
  return std::max(std::fabs(std::sin(r) - std::sin(a)), std::fabs(std::cos(r) - std::cos(a)));
}

TEST(AngleReduction, RopeAnglesLoseUnderTwoToTheMinus21) {
  constexpr int kHalf = 64;
  float inverse_frequencies[kHalf];
  for (int i = 0; i < kHalf; ++i) {
    inverse_frequencies[i] = static_cast<float>(1.0 / std::pow(500000.0, 2.0 * i / (2.0 * kHalf)));
  }
  std::mt19937 random(7);
  std::uniform_int_distribution<int64_t> position(0, (int64_t{1} << 20) - 1);
  double worst = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int64_t t = trial < 2048 ? trial : position(random);
    for (const float f : inverse_frequencies) {
      const float angle = static_cast<float>(t) * f;  // float32, as the model's RoPE
      worst = std::max(worst, reduction_error(angle));
      // The turns come from a float product (relative error under 2^-23),
      // so near a half turn the nearest whole one may be missed by one:
      // |r| <= pi + |angle| 2^-23 (twice that here), plus the roundings.
      const double r = kernels::reduced_angle(angle);
      ASSERT_LE(std::fabs(r), M_PI + std::fabs(angle) * std::ldexp(1.0, -22) + std::ldexp(1.0, -20))
          << "t " << t << " angle " << angle;
    }
  }
  EXPECT_LE(worst, std::ldexp(1.0, -21));
  std::printf("worst |sin, cos of the reduced angle - of the angle|: %.3g\n", worst);
}

TEST(AngleReduction, EveryBinadeBelowTwoToThe21) {
  std::mt19937 random(11);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  for (int e = -10; e < 21; ++e) {
    for (int trial = 0; trial < 2000; ++trial) {
      const float angle = (trial % 2 ? -1.0f : 1.0f) * std::ldexp(mantissa(random), e);
      ASSERT_LE(reduction_error(angle), std::ldexp(1.0, -21)) << "angle " << angle;
    }
  }
  EXPECT_EQ(kernels::reduced_angle(0.0f), 0.0f);
  EXPECT_EQ(kernels::reduced_angle(1.0f), 1.0f);  // no turn: the angle itself
}

}  // namespace
}  // namespace kvforge
