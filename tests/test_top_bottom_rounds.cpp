// kernels/top_bottom_rounds.h (token_top_bottom by rounds, the append
// kernel's path for small k) on the CPU: a block of threads emulated in a
// loop, each thread's firsts folded in a shuffled order (the kernel folds
// them by warp reductions, then over the warps), against the rule's
// definition counted pair by pair (as test_span_rank.cpp): element i is
// among the k largest when fewer than k elements are larger or equal with a
// lower index, likewise the smallest. Ties (values from a small set), signed
// zeros, several spans per row, threads holding up to kMaxSlots elements.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/span_rank.h"
#include "kernels/top_bottom_rounds.h"
#include "tests/top_bottom_definition.h"

namespace kvforge {
namespace {

namespace rounds = kernels::top_bottom_rounds;
constexpr int kSlots = rounds::kMaxSlots;

using testing::top_or_bottom_by_definition;

// The kernel's rounds over `threads` emulated threads: the taken elements.
std::vector<bool> select_by_rounds(const std::vector<double>& row, int n, int spans, int k, int threads,
                                   std::mt19937& random) {
  std::vector<bool> taken(row.size(), false);
  std::vector<int> order(static_cast<size_t>(threads));
  for (int span = 0; span < spans; ++span) {
    const int base = span * n;
    std::vector<std::array<uint64_t, kSlots>> keys(static_cast<size_t>(threads));
    std::vector<uint32_t> top_taken(static_cast<size_t>(threads), 0), bottom_taken(static_cast<size_t>(threads), 0);
    for (int t = 0; t < threads; ++t) {
      for (int j = 0; j < kSlots; ++j) {
        const int at = t + j * threads;
        keys[t][j] = at < n ? kernels::span_rank::order_key(row[base + at]) : 0;
      }
    }
    for (int round = 0; round < k; ++round) {
      for (int t = 0; t < threads; ++t) order[t] = t;
      std::shuffle(order.begin(), order.end(), random);
      rounds::Candidate top = rounds::no_top(), bottom = rounds::no_bottom();
      for (const int t : order) {
        uint64_t key[kSlots];
        std::copy(keys[t].begin(), keys[t].end(), key);
        rounds::Candidate thread_top, thread_bottom;
        rounds::thread_firsts(key, n, base, t, threads, top_taken[t], bottom_taken[t], thread_top, thread_bottom);
        if (rounds::before_in_top(thread_top, top)) top = thread_top;
        if (rounds::before_in_bottom(thread_bottom, bottom)) bottom = thread_bottom;
      }
      EXPECT_NE(top.index, rounds::kNone);
      EXPECT_NE(bottom.index, rounds::kNone);
      for (int t = 0; t < threads; ++t) {
        top_taken[t] |= rounds::taken_bit(top.index, base, t, threads);
        bottom_taken[t] |= rounds::taken_bit(bottom.index, base, t, threads);
      }
    }
    for (int t = 0; t < threads; ++t) {
      for (int j = 0; j < kSlots; ++j) {
        if ((((top_taken[t] | bottom_taken[t]) >> j) & 1u) != 0) taken[static_cast<size_t>(base + t + j * threads)] = true;
      }
    }
  }
  return taken;
}

TEST(TopBottomRounds, TakeTheDefinitionsLargestAndSmallestWithTiesAndSignedZeros) {
  std::mt19937 random(20261204);
  std::normal_distribution<double> normal;
  const std::vector<double> few = {0.0, -0.0, 1.0, -1.0, 0.5, 2.5, -3.0};
  int checked = 0, outliers = 0;
  for (const int threads : {256, 32, 7}) {
    for (const int n : {3, 8, 24, 128, 256, 1024, 2048}) {
      for (const int spans : {1, 2, 3}) {
        for (const int64_t k : {int64_t{1}, int64_t{2}, int64_t{6}, int64_t{11}}) {
          if (!rounds::applies(n, spans, k, threads)) continue;
          for (int trial = 0; trial < 2; ++trial) {
            std::vector<double> row(static_cast<size_t>(n * spans));
            for (double& x : row) {
              x = trial == 0 ? few[std::uniform_int_distribution<size_t>(0, few.size() - 1)(random)] : normal(random);
            }
            const std::vector<bool> taken = select_by_rounds(row, n, spans, static_cast<int>(k), threads, random);
            for (int i = 0; i < n * spans; ++i) {
              const bool want = top_or_bottom_by_definition(row, n, i, k);
              ASSERT_EQ(taken[static_cast<size_t>(i)], want)
                  << "threads " << threads << " n " << n << " spans " << spans << " k " << k << " trial " << trial
                  << " element " << i;
              ++checked;
              outliers += want ? 1 : 0;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 20000);
  EXPECT_GT(outliers, 500);
}

TEST(TopBottomRounds, ApplyOnlyWhereTheRoundsAreFewAndTheSlotsHoldTheSpan) {
  EXPECT_TRUE(rounds::applies(1024, 1, 6, 256));    // kvquant's values: 8 x 128 all-heads channels, 1%
  EXPECT_FALSE(rounds::applies(1024, 1, 33, 256));  // more rounds than kMaxRounds: the sort
  EXPECT_TRUE(rounds::applies(128, 8, 4, 256));     // per-head spans: 8 x 4 rounds
  EXPECT_FALSE(rounds::applies(128, 8, 5, 256));
  EXPECT_FALSE(rounds::applies(4096, 1, 6, 256));   // 16 elements a thread
  EXPECT_TRUE(rounds::applies(2048, 1, 6, 256));
  EXPECT_FALSE(rounds::applies(12, 1, 6, 256));     // 2k >= n: every element, no selection
  EXPECT_FALSE(rounds::applies(12, 1, 0, 256));
}

}  // namespace
}  // namespace kvforge
