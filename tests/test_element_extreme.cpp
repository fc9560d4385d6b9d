// kernels/element_extreme.h: a butterfly over 32 lanes of 2, 4 or 8
// elements each (the token-parallel append's reduction) against the
// reference's sequential minimum and maximum (cpu_reference.cpp's
// GroupRange: std::min and std::max in index order), on groups with many
// ties and both signs of zero; the results' bits and indices compared.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/element_extreme.h"

namespace kvforge {
namespace {

using kernels::ElementExtreme;

// The lanes' extremes combined as the kernel's shuffles do (lane l with
// l ^ offset for offsets lanes / 2 .. 1); lane 0's result.
template <class Combine>
ElementExtreme butterfly(std::vector<ElementExtreme> lanes, Combine combine) {
  for (size_t offset = lanes.size() / 2; offset > 0; offset /= 2) {
    std::vector<ElementExtreme> next(lanes.size());
    for (size_t l = 0; l < lanes.size(); ++l) next[l] = combine(lanes[l], lanes[l ^ offset]);
    lanes = next;
  }
  return lanes[0];
}

TEST(ElementExtreme, ButterflyEqualsTheReferencesSequentialMinimumAndMaximum) {
  std::mt19937 random(12);
  std::uniform_int_distribution<int> pick(0, 6);
  const float choices[] = {0.0f, -0.0f, 1.5f, -1.5f, 0.25f, -3.0f, 3.0f};
  int64_t groups = 0, zero_extremes = 0;
  for (const int per_lane : {2, 4, 8}) {
    for (const int lanes_per_group : {1, 2, 4, 8, 16, 32}) {
      for (int trial = 0; trial < 500; ++trial) {
        const int size = per_lane * lanes_per_group;
        std::vector<float> values(static_cast<size_t>(size));
        for (float& v : values) v = choices[pick(random)];
        // The reference: the first value, then std::min / std::max in index order.
        float min = values[0], max = values[0];
        int min_at = 0, max_at = 0;
        for (int i = 1; i < size; ++i) {
          if (values[i] < min) min = values[i], min_at = i;
          if (max < values[i]) max = values[i], max_at = i;
        }
        // Each lane's elements in index order, then the butterfly.
        std::vector<ElementExtreme> low(static_cast<size_t>(lanes_per_group)), high(low.size());
        for (int l = 0; l < lanes_per_group; ++l) {
          low[l] = high[l] = {values[l * per_lane], l * per_lane};
          for (int e = 1; e < per_lane; ++e) {
            const ElementExtreme here{values[l * per_lane + e], l * per_lane + e};
            low[l] = kernels::lower(low[l], here);
            high[l] = kernels::higher(high[l], here);
          }
        }
        const ElementExtreme got_min = butterfly(low, [](ElementExtreme a, ElementExtreme b) { return kernels::lower(a, b); });
        const ElementExtreme got_max = butterfly(high, [](ElementExtreme a, ElementExtreme b) { return kernels::higher(a, b); });
        ASSERT_EQ(std::bit_cast<uint32_t>(got_min.value), std::bit_cast<uint32_t>(min)) << "group of " << size;
        ASSERT_EQ(got_min.at, min_at);
        ASSERT_EQ(std::bit_cast<uint32_t>(got_max.value), std::bit_cast<uint32_t>(max)) << "group of " << size;
        ASSERT_EQ(got_max.at, max_at);
        zero_extremes += (min == 0.0f) + (max == 0.0f);
        ++groups;
      }
    }
  }
  EXPECT_EQ(groups, 3 * 6 * 500);
  EXPECT_GT(zero_extremes, 100) << "the groups must exercise +0 against -0";
}

}  // namespace
}  // namespace kvforge
