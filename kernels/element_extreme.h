#pragma once
// A group's minimum or maximum as the append's reference takes it (the
// first inlier, then min = (v < min ? v : min), max = (max < v ? v : max) in
// index order, so among equal values, +0 and -0 included, the first in index
// order is kept), for groups without outliers whose values are element-type
// numbers: exact in float, so a lane exchanges one float and one index
// instead of a double. lower and higher are symmetric and associative over
// (value, index), so any reduction tree gives the sequential result
// (tests/test_element_extreme.cpp). The block-per-sequence kernel's Extreme
// (kernels/append_kernel.cuh) also skips outliers.
#include <cstdint>

#include "kernels/runtime_layout.h"

namespace kvforge::kernels {

struct ElementExtreme {
  float value;
  int32_t at;  // the element's index in the group
};

KVFORGE_HOST_DEVICE inline ElementExtreme lower(ElementExtreme a, ElementExtreme b) {
  return b.value < a.value || (!(a.value < b.value) && b.at < a.at) ? b : a;
}

KVFORGE_HOST_DEVICE inline ElementExtreme higher(ElementExtreme a, ElementExtreme b) {
  return a.value < b.value || (!(b.value < a.value) && b.at < a.at) ? b : a;
}

}  // namespace kvforge::kernels
