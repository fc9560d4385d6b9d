#pragma once
// x / d and x % d for a divisor fixed per launch (the runtime cache's tokens
// per page and entries per outlier page): a shift and a mask where d is a
// power of two (the defaults, 16 and 256), else the division. The decode
// kernels divide slots and entry numbers by these once per unit or entry;
// a 32-bit division is ~20 instructions, a 64-bit one a subroutine call.
//
// Host-device, so that the CPU tests check it against / and %.
#include <cstdint>

#include "kernels/runtime_layout.h"

namespace kvforge::kernels {

// log2(d) for a power of two d > 0, else -1.
KVFORGE_HOST_DEVICE inline int power_of_two_shift(uint32_t d) {
  if (d == 0 || (d & (d - 1)) != 0) return -1;
#if defined(__CUDA_ARCH__)
  return __ffs(static_cast<int>(d)) - 1;
#else
  return __builtin_ctz(d);
#endif
}

struct FixedDivisor {
  uint32_t divisor = 1;
  int shift = 0;

  KVFORGE_HOST_DEVICE explicit FixedDivisor(uint32_t d) : divisor(d), shift(power_of_two_shift(d)) {}
  KVFORGE_HOST_DEVICE uint32_t quotient(uint32_t x) const { return shift >= 0 ? x >> shift : x / divisor; }
  KVFORGE_HOST_DEVICE uint32_t remainder(uint32_t x) const { return shift >= 0 ? x & (divisor - 1) : x % divisor; }
};

}  // namespace kvforge::kernels
