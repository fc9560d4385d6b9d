// kernels/arrival_counters.h: which of a decode workspace's arrival counters
// a planner knows to be zero. Checked against a model of the workspace's
// memory (which counters hold zero after each call) over random call
// sequences: every call that merges in its last blocks finds its counters
// zero, and on an unchanged workspace the planner zeroes only when one of
// them is not.
#include <gtest/gtest.h>

#include <cstdint>
#include <algorithm>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "kernels/arrival_counters.h"

namespace kvforge {
namespace {

using kernels::arrival_region_bytes;
using kernels::ArrivalZeros;

TEST(ArrivalCounters, TheRegionKeepsTheStatesAligned) {
  EXPECT_EQ(arrival_region_bytes(0), 0);
  EXPECT_EQ(arrival_region_bytes(1), 256);
  EXPECT_EQ(arrival_region_bytes(64), 256);
  EXPECT_EQ(arrival_region_bytes(65), 512);
  EXPECT_EQ(arrival_region_bytes(32 * 8), 1024);  // batch 32, 8 KV heads
}

TEST(ArrivalCounters, AServingLoopZeroesOncePerWorkspaceAndLargerBatch) {
  ArrivalZeros zeros;
  int a = 0, b = 0;  // two workspaces' addresses
  EXPECT_TRUE(zeros.zero_before(&a, 4096, 64, true));    // first sight
  EXPECT_FALSE(zeros.zero_before(&a, 4096, 64, true));   // every later step of the same batch
  EXPECT_FALSE(zeros.zero_before(&a, 4096, 64, true));
  EXPECT_FALSE(zeros.zero_before(&a, 4096, 8, true));    // a smaller batch: its counters are among them
  EXPECT_FALSE(zeros.zero_before(&a, 4096, 64, true));   // its states start past the 256 bytes of 64
  EXPECT_TRUE(zeros.zero_before(&a, 4096, 128, true));   // a larger batch
  EXPECT_FALSE(zeros.zero_before(&a, 4096, 8, true));
  EXPECT_TRUE(zeros.zero_before(&a, 4096, 128, true));   // batch 8's states went over counters 64 on
  EXPECT_FALSE(zeros.zero_before(&a, 4096, 128, false));  // the merge kernel's plan leaves them
  EXPECT_FALSE(zeros.zero_before(&a, 4096, 128, true));
  EXPECT_FALSE(zeros.zero_before(&a, 4096, 64, true));
  EXPECT_TRUE(zeros.zero_before(&a, 4096, 65, true));    // counters 64 on again
  EXPECT_TRUE(zeros.zero_before(&b, 4096, 65, true));    // another workspace
  EXPECT_TRUE(zeros.zero_before(&b, 8192, 65, true));    // the same address, another size: another allocation
  zeros.forget();                                        // a workspace of one call in between
  EXPECT_TRUE(zeros.zero_before(&b, 8192, 65, true));
}

// The workspace memory's counters (true: zero) per workspace, and the
// calls' effects on them, as the launcher and the kernels have them. A
// planner forgets a workspace it switches away from, so that it zeroes
// only when needed where it has seen every call on the workspace.
TEST(ArrivalCounters, EveryMergingCallFindsItsCountersZero) {
  std::mt19937 random(20261203);
  constexpr int64_t kMaxCounters = 300;
  int addresses[3];  // the model's workspaces: pointers the planner tells apart
  for (int sequence = 0; sequence < 200; ++sequence) {
    ArrivalZeros zeros;
    std::map<std::pair<int, int64_t>, std::vector<bool>> memory;  // (address, bytes) -> counters zero
    std::pair<int, int64_t> last{-1, -1};
    bool seen_whole = false;  // the planner has seen every call on the current workspace
    for (int call = 0; call < 60; ++call) {
      // Mostly the same workspace, sometimes another or a new size.
      const int address = random() % 8 == 0 ? static_cast<int>(random() % 3) : std::max(last.first, 0);
      const int64_t bytes = random() % 10 == 0 ? 1 + static_cast<int64_t>(random() % 2) : std::max<int64_t>(last.second, 1);
      const std::pair<int, int64_t> workspace{address, bytes};
      // A new allocation holds anything (another size at one address is
      // another allocation).
      const bool fresh = memory.count(workspace) == 0;
      std::vector<bool>& zero = memory.try_emplace(workspace, std::vector<bool>(kMaxCounters + 64, false)).first->second;
      if (workspace != last) seen_whole = fresh;
      const int64_t counters = 1 + static_cast<int64_t>(random() % kMaxCounters);
      const bool merging = random() % 4 != 0;
      const bool zeroed = zeros.zero_before(&addresses[address], bytes, counters, merging);
      bool all_zero = true;
      for (int64_t i = 0; i < counters; ++i) all_zero = all_zero && zero[i];
      if (seen_whole && merging) {
        EXPECT_EQ(zeroed, !all_zero) << "sequence " << sequence << " call " << call;
      }
      const int64_t region = arrival_region_bytes(counters) / 4;
      if (zeroed) {
        for (int64_t i = 0; i < region; ++i) zero[i] = true;
      }
      if (merging) {
        for (int64_t i = 0; i < counters; ++i) ASSERT_TRUE(zero[i]) << "sequence " << sequence << " call " << call;
      }
      // The call's split states start past its region.
      for (int64_t i = region; i < static_cast<int64_t>(zero.size()); ++i) zero[i] = false;
      last = workspace;
    }
  }
}

}  // namespace
}  // namespace kvforge
