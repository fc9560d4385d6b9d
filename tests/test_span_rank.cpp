// kernels/span_rank.h (the append kernel's token_top_bottom ranks) on the
// CPU, each stage of the bitonic network run in a loop as the kernel's
// threads run it between barriers, against the rule's definition counted
// pair by pair: element i is among the k largest when fewer than k elements
// are larger or equal with a lower index, likewise the smallest (the CPU
// reference's partial sorts). Ties (values from a small set), signed zeros,
// spans of any length (padded to a power of two) and several spans per row.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/span_rank.h"
#include "tests/top_bottom_definition.h"

namespace kvforge {
namespace {

namespace rank = kernels::span_rank;

using testing::top_or_bottom_by_definition;

TEST(SpanRank, TopAndBottomEqualTheDefinitionWithTiesAndSignedZeros) {
  std::mt19937 random(20261201);
  std::normal_distribution<double> normal;
  const std::vector<double> few = {0.0, -0.0, 1.0, -1.0, 0.5, 2.5, -3.0};
  int checked = 0, outliers = 0;
  for (const int n : {3, 5, 8, 12, 16, 24, 100, 128, 1024}) {
    for (const int spans : {1, 2, 3}) {
      for (int trial = 0; trial < 4; ++trial) {
        std::vector<double> row(static_cast<size_t>(n * spans));
        for (double& x : row) {
          x = trial % 2 == 0 ? few[std::uniform_int_distribution<size_t>(0, few.size() - 1)(random)] : normal(random);
        }
        rank::SpanSort sort;
        sort.n = n;
        sort.slots_per_span = rank::slots_per_span_for(n);
        sort.slots = spans * sort.slots_per_span;
        std::vector<uint64_t> keys(static_cast<size_t>(sort.slots));
        std::vector<uint32_t> tags(static_cast<size_t>(sort.slots));
        std::vector<int32_t> ranks(row.size(), -1);
        sort.keys = keys.data();
        sort.tags = tags.data();
        for (int x = 0; x < sort.slots; ++x) rank::fill_slot(sort, row.data(), x);
        for (int size = 2; size <= sort.slots_per_span; size *= 2) {
          for (int stride = size / 2; stride > 0; stride /= 2) {
            for (int x = 0; x < sort.slots; ++x) rank::compare_exchange(sort, size, stride, x);
          }
        }
        for (int x = 0; x < sort.slots; ++x) rank::record_rank(sort, ranks.data(), x);
        for (int s = 0; s < spans; ++s) {
          for (int at = 1; at < n; ++at) {
            const size_t x = static_cast<size_t>(s * sort.slots_per_span + at);
            ASSERT_TRUE(keys[x - 1] < keys[x] || (keys[x - 1] == keys[x] && tags[x - 1] < tags[x]))
                << "n " << n << " span " << s << " slot " << at << " out of order";
          }
        }
        for (const int64_t k : {int64_t{1}, int64_t{2}, static_cast<int64_t>((n - 1) / 2)}) {
          if (k < 1 || 2 * k >= n) continue;
          for (int i = 0; i < n * spans; ++i) {
            const bool want = top_or_bottom_by_definition(row, n, i, k);
            ASSERT_EQ(rank::top_or_bottom(sort, ranks.data(), row.data(), i, k), want)
                << "n " << n << " spans " << spans << " trial " << trial << " k " << k << " element " << i;
            ++checked;
            outliers += want ? 1 : 0;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 10000);
  EXPECT_GT(outliers, 1000);
}

TEST(SpanRank, OrderKeysFollowTheDoublesComparisons) {
  const std::vector<double> ascending = {-1e300, -2.5, -1.0, -1e-300, 0.0, 1e-300, 1.0, 2.5, 1e300};
  for (size_t a = 0; a < ascending.size(); ++a) {
    for (size_t b = 0; b < ascending.size(); ++b) {
      EXPECT_EQ(rank::order_key(ascending[a]) < rank::order_key(ascending[b]), a < b) << a << " " << b;
    }
  }
  EXPECT_EQ(rank::order_key(-0.0), rank::order_key(0.0));
}

}  // namespace
}  // namespace kvforge
