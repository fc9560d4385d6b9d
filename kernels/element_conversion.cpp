#include "kernels/element_conversion.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvforge::kernels {
namespace {

// A binary floating-point format with `mantissa` stored fraction bits,
// smallest normal exponent `min_exponent` (value = 1.m * 2^e) and largest
// exponent `max_exponent`, rounded from double in one step: |x| is rounded to
// a multiple of its quantum 2^(max(e, min_exponent) - mantissa), which is
// exact in double (both formats have far fewer bits), ties to even by rint.
struct SmallFloat {
  int mantissa, min_exponent, max_exponent, exponent_bias;
};
constexpr SmallFloat kHalf{10, -14, 15, 15};
constexpr SmallFloat kBfloat16{7, -126, 127, 127};

uint16_t encode(const SmallFloat& f, double value) {
  const uint16_t sign = std::signbit(value) ? uint16_t(0x8000) : uint16_t(0);
  const int exponent_bits = 15 - f.mantissa;  // both formats are 16 bits: 1 + exponent + mantissa
  const uint16_t infinity = static_cast<uint16_t>(((1u << exponent_bits) - 1) << f.mantissa);
  if (std::isnan(value)) return static_cast<uint16_t>(sign | infinity | (1u << (f.mantissa - 1)));
  const double magnitude = std::fabs(value);
  if (std::isinf(value)) return sign | infinity;
  if (magnitude == 0) return sign;
  int e = 0;
  std::frexp(magnitude, &e);  // magnitude = m * 2^e, m in [0.5, 1): the leading bit is 2^(e - 1)
  const int exponent = std::max(e - 1, f.min_exponent);
  const double quantum = std::ldexp(1.0, exponent - f.mantissa);
  const double rounded = std::rint(magnitude / quantum) * quantum;
  if (rounded == 0) return sign;  // below half the smallest subnormal
  std::frexp(rounded, &e);
  const int rounded_exponent = e - 1;
  if (rounded_exponent > f.max_exponent) return sign | infinity;
  if (rounded_exponent < f.min_exponent) {  // subnormal: exponent field 0, fraction in quanta of 2^(min - mantissa)
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(rounded / std::ldexp(1.0, f.min_exponent - f.mantissa)));
  }
  const double fraction = rounded / std::ldexp(1.0, rounded_exponent) - 1.0;  // [0, 1), exact
  const auto field = static_cast<uint16_t>(rounded_exponent + f.exponent_bias);
  return static_cast<uint16_t>(sign | (field << f.mantissa) |
                               static_cast<uint16_t>(std::ldexp(fraction, f.mantissa)));
}

}  // namespace

uint16_t half_bits(double value) { return encode(kHalf, value); }
uint16_t bfloat16_bits(double value) { return encode(kBfloat16, value); }

float half_value(uint16_t bits) {
  const bool negative = (bits & 0x8000) != 0;
  const int field = (bits >> 10) & 0x1f;
  const int fraction = bits & 0x3ff;
  float magnitude;
  if (field == 0x1f) {
    magnitude = fraction == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  } else if (field == 0) {
    magnitude = std::ldexp(static_cast<float>(fraction), -24);
  } else {
    magnitude = std::ldexp(static_cast<float>(fraction + 1024), field - 25);
  }
  return negative ? -magnitude : magnitude;
}

float bfloat16_value(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

void store_element(ElementType element, double value, void* out) {
  switch (element) {
    case ElementType::kFloat16: {
      const uint16_t bits = half_bits(value);
      std::memcpy(out, &bits, 2);
      return;
    }
    case ElementType::kBFloat16: {
      const uint16_t bits = bfloat16_bits(value);
      std::memcpy(out, &bits, 2);
      return;
    }
    case ElementType::kFloat32: {
      const auto single = static_cast<float>(value);
      std::memcpy(out, &single, 4);
      return;
    }
  }
}

float load_element(ElementType element, const void* in) {
  switch (element) {
    case ElementType::kFloat16: {
      uint16_t bits;
      std::memcpy(&bits, in, 2);
      return half_value(bits);
    }
    case ElementType::kBFloat16: {
      uint16_t bits;
      std::memcpy(&bits, in, 2);
      return bfloat16_value(bits);
    }
    case ElementType::kFloat32: {
      float value;
      std::memcpy(&value, in, 4);
      return value;
    }
  }
  return 0.0f;
}

double round_to_element(ElementType element, double value) {
  unsigned char bytes[4];
  store_element(element, value, bytes);
  return load_element(element, bytes);
}

}  // namespace kvforge::kernels
