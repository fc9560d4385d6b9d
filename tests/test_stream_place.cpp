// The 32-bit stream positions the int8 decode copies KIVI's channel pairs
// from (kernels/runtime_layout.h: stream_place, stream_advance,
// step_slot_in_page) against the layout's 64-bit definition
// (channel_pair_stream_index over pairs_per_page) and a search over the
// step's slots, on page sizes that divide the groups, straddle them and
// hold several.
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/runtime_layout.h"

namespace kvforge {
namespace {

using kernels::StreamPlace;

TEST(StreamPlace, SplitsAndAdvancesAsTheLayoutsStreamIndex) {
  for (const int32_t page_size : {1, 5, 12, 16, 64}) {
    for (const int32_t group : {32, 64, 128}) {
      for (const int32_t kv_heads : {1, 2, 8}) {
        for (const int32_t dim : {64, 128}) {
          kernels::TensorPageLayout l;
          l.spec.page_size = page_size;
          l.spec.group = group;
          l.pairs_per_slot = (kv_heads * dim + group - 1) / group;
          const auto per_slot = static_cast<int32_t>(l.pairs_per_slot);
          const auto per_page = static_cast<int32_t>(kernels::pairs_per_page(l));
          for (int32_t g = 0; g < 40; ++g) {
            for (int32_t head = 0; head < kv_heads; ++head) {
              for (int32_t lane = 0; lane < 32; ++lane) {
                const StreamPlace first = kernels::stream_place(g * group, per_slot, per_page, head * dim + lane);
                for (int32_t i = 0; i < dim / 32; ++i) {
                  const StreamPlace at = kernels::stream_advance(first, 32 * i, per_page);
                  const int64_t sigma = kernels::channel_pair_stream_index(l, g, head * dim + lane + 32 * i);
                  ASSERT_EQ(at.entry, sigma / per_page) << page_size << " " << group << " " << g << " " << lane;
                  ASSERT_EQ(at.offset, sigma % per_page) << page_size << " " << group << " " << g << " " << lane;
                  // The layout's promise: a page of one of the group's own slots.
                  ASSERT_LT(static_cast<int64_t>(at.entry) * page_size, static_cast<int64_t>(g + 1) * group);
                  ASSERT_GT(static_cast<int64_t>(at.entry + 1) * page_size, static_cast<int64_t>(g) * group);
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(StreamPlace, FindsTheStepsSlotInAPage) {
  for (const int32_t page_size : {1, 5, 12, 16, 64}) {
    for (int32_t step_first = 0; step_first < 256; step_first += 32) {
      for (const int32_t tokens : {1, 7, 32}) {
        for (int32_t entry = 0; entry < 300 / page_size + 2; ++entry) {
          int32_t want = -1;
          for (int32_t j = 0; j < tokens; ++j) {
            if ((step_first + j) / page_size == entry) {
              want = j;
              break;
            }
          }
          ASSERT_EQ(kernels::step_slot_in_page(entry, page_size, step_first, tokens), want)
              << "page " << page_size << " step " << step_first << " tokens " << tokens << " entry " << entry;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvforge
