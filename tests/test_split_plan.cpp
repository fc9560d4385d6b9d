// kernels/split_plan.h: the decode kernels' context splits. The H200's
// cases worked by hand from the model (528 resident blocks: 132
// multiprocessors, 4 blocks each; 8 KV heads; 32K tokens), then every
// choice against a brute-force search of the model over its range.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "kernels/split_plan.h"

namespace kvforge {
namespace {

using kernels::split_time;
using kernels::splits_for_whole_waves;

constexpr int64_t kResident = 528;
constexpr int64_t kTokens = 32768;

// Llama-3's 32 query heads on the H200's 132 multiprocessors, a one-group
// merge block loading 8 states a round.
TEST(SplitPlan, FourGroupMergeAtBatchOneWithManySplitsOnly) {
  EXPECT_TRUE(kernels::wide_merge(64, 32, 132, 8));        // batch 1, 32K: 64 splits
  EXPECT_TRUE(kernels::wide_merge(9, 4 * 32, 132, 8));     // batch 4, one state past a round
  EXPECT_FALSE(kernels::wide_merge(8, 32, 132, 8));        // one round holds them all
  EXPECT_FALSE(kernels::wide_merge(13, 8 * 32, 132, 8));   // batch 8 (int2-rot: 8 splits + 5 exact): 256 blocks
  EXPECT_FALSE(kernels::wide_merge(2, 32 * 32, 132, 8));   // batch 32
  EXPECT_TRUE(kernels::wide_merge(64, 132, 132, 8));       // exactly one block per multiprocessor
  EXPECT_FALSE(kernels::wide_merge(64, 133, 132, 8));
}

// Four query heads a merge block only where the output is rotated back, in
// one-group blocks, and the GQA group is a multiple of four.
TEST(SplitPlan, MergeBlocksShareTheValueRotationAcrossFourHeads) {
  EXPECT_EQ(kernels::merge_heads(true, false, 4, 4), 4);   // int2-rot, Llama-3-8B's GQA 4
  EXPECT_EQ(kernels::merge_heads(true, false, 8, 4), 4);   // GQA 8: two blocks per KV head
  EXPECT_EQ(kernels::merge_heads(true, false, 1, 4), 1);   // multi-head attention
  EXPECT_EQ(kernels::merge_heads(true, false, 2, 4), 1);
  EXPECT_EQ(kernels::merge_heads(true, true, 4, 4), 1);    // batch 1's four-group blocks
  EXPECT_EQ(kernels::merge_heads(false, false, 4, 4), 1);  // nothing to rotate back
}

// The int8 kernel's splits merge in a thread-block cluster only where it
// writes every state, nothing is rotated back and the splits fit a
// portable cluster: Llama-3-8B's rtn at batch 8 (8 splits) and 32 (2), not
// batch 1's 64; and only where clustering holds as many blocks at once.
TEST(SplitPlan, ClusterMergeWhereTheInt8KernelWritesEveryState) {
  EXPECT_TRUE(kernels::cluster_merge_applies(true, 0, false, 8, 8));    // batch 8
  EXPECT_TRUE(kernels::cluster_merge_applies(true, 0, false, 2, 8));    // batch 32
  EXPECT_TRUE(kernels::cluster_merge_applies(true, 0, false, 1, 8));    // one split: no merge at all
  EXPECT_FALSE(kernels::cluster_merge_applies(true, 0, false, 64, 8));  // batch 1: 64 splits
  EXPECT_FALSE(kernels::cluster_merge_applies(true, 0, false, 9, 8));   // past the portable size
  EXPECT_FALSE(kernels::cluster_merge_applies(false, 0, false, 8, 8));  // not the int8 kernel
  EXPECT_FALSE(kernels::cluster_merge_applies(true, 3, false, 8, 8));   // int2-rot's exact blocks
  EXPECT_FALSE(kernels::cluster_merge_applies(true, 0, true, 8, 8));    // a rotation
}

TEST(SplitPlan, ClustersOnlyWhereTheyAddNoWave) {
  EXPECT_TRUE(kernels::clusters_add_no_wave(512, kResident, 8 * 66));    // batch 8: 66 clusters of 8 hold 528
  EXPECT_FALSE(kernels::clusters_add_no_wave(512, kResident, 8 * 63));   // 504 at once: a second wave
  EXPECT_TRUE(kernels::clusters_add_no_wave(64, kResident, 8 * 8));      // a launch smaller than the device
  EXPECT_TRUE(kernels::clusters_add_no_wave(2048, kResident, kResident)); // many waves either way
  EXPECT_FALSE(kernels::clusters_add_no_wave(2048, kResident, kResident - 2));
}

TEST(SplitPlan, Batch32FillsOneWaveWithTwoSplits) {
  // 256 blocks per split: one split, 1 wave of 32768 + 512; two, 1 wave of
  // 16384 + 512; three, 2 waves (768 blocks) of 10923 + 512.
  EXPECT_EQ(split_time(kTokens, 256, kResident, 1), 33280.0);
  EXPECT_EQ(split_time(kTokens, 256, kResident, 2), 16896.0);
  EXPECT_EQ(split_time(kTokens, 256, kResident, 3), 22870.0);
  EXPECT_EQ(splits_for_whole_waves(kTokens, 256, kResident, 128), 2);
}

TEST(SplitPlan, Batch8TakesOneWaveNotFourOfShortSplits) {
  // 64 blocks per split: 8 splits, 1 wave of 4096 + 512 = 4608; 33 splits,
  // 4 waves (2112 blocks) of 993 + 512 = 6020 (without the fixed cost, 3972
  // against 4096: the rule that chose 33).
  EXPECT_EQ(split_time(kTokens, 64, kResident, 8), 4608.0);
  EXPECT_EQ(split_time(kTokens, 64, kResident, 33), 6020.0);
  EXPECT_EQ(splits_for_whole_waves(kTokens, 64, kResident, 128), 8);
}

TEST(SplitPlan, Batch1SpreadsOneSequenceOverTheWave) {
  // 8 blocks per split: 66 splits fill the 528 slots (1 wave of 497 + 512);
  // 64 leave 16 idle (512 + 512).
  EXPECT_EQ(split_time(kTokens, 8, kResident, 66), 1009.0);
  EXPECT_EQ(split_time(kTokens, 8, kResident, 64), 1024.0);
  EXPECT_EQ(splits_for_whole_waves(kTokens, 8, kResident, 128), 66);
}

TEST(SplitPlan, TheChoiceIsTheModelsLeastWithTiesToFewerSplits) {
  for (const int64_t longest : {1, 255, 256, 4096, 5000, 32768, 131072}) {
    for (const int64_t per_split : {1, 8, 64, 100, 256, 512, 2048}) {
      for (const int64_t resident : {132, 396, 528}) {
        for (const int64_t max_splits : {1, 2, 16, 128, 512}) {
          const int64_t chosen = splits_for_whole_waves(longest, per_split, resident, max_splits);
          ASSERT_GE(chosen, 1);
          ASSERT_LE(chosen, std::max<int64_t>(1, max_splits));
          const double least = split_time(longest, per_split, resident, chosen);
          for (int64_t s = 1; s <= max_splits; ++s) {
            const double time = split_time(longest, per_split, resident, s);
            ASSERT_GE(time, least) << longest << " " << per_split << " " << resident << " " << s;
            if (s < chosen) ASSERT_GT(time, least) << "a tie goes to fewer splits";
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvforge
