#pragma once
// Conversions between the cache's element types (runtime_layout.h) and
// float/double on the host: round to nearest, ties to even, in one step from
// double (no double rounding through float), overflow to infinity,
// subnormals kept; what CUDA's __double2half_rn / __double2bfloat16 and
// __half2float / __bfloat162float do on the device.
#include <cstdint>
#include <cstring>

#include "kernels/runtime_layout.h"

namespace kvforge::kernels {

uint16_t half_bits(double value);      // IEEE binary16
uint16_t bfloat16_bits(double value);  // the upper half of a binary32
float half_value(uint16_t bits);
float bfloat16_value(uint16_t bits);

// `value` rounded to `element` and stored at `out` (little-endian bytes).
void store_element(ElementType element, double value, void* out);
// The element at `in`, exactly, as a float.
float load_element(ElementType element, const void* in);
// `value` rounded to `element` and widened back (what store/load give).
double round_to_element(ElementType element, double value);

}  // namespace kvforge::kernels
