// kernels/warp_run.h and step_append_warps (kernels/step_append.h): the
// int8 decode kernel's partition of a block's tokens among its warps, and
// the two warps that store a decoding step's token there. Against a
// brute-force assignment token by token (token t of [first, last) is in
// step (t - first) / step_tokens, which goes to warp step / ceil(steps /
// warps)): every run is the set of tokens its warp is assigned, the keys'
// warp is the one assigned the token at length - 1 (the one that reads it:
// it must store it before), the values' warp is another warp of the block,
// and a block whose split does not end at the token stores nothing. Host
// code only: runs without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/step_append.h"
#include "kernels/warp_run.h"

namespace kvforge {
namespace {

using kernels::step_append_warps;
using kernels::warp_run;

struct Assigned {
  int64_t first = -1, last = -1;  // [first, last) of the tokens assigned, -1: none
};

std::vector<Assigned> assign_token_by_token(int64_t first, int64_t last, int warps, int step_tokens) {
  const int64_t steps = (last - first + step_tokens - 1) / step_tokens;
  const int64_t per_warp = (steps + warps - 1) / warps;
  std::vector<Assigned> runs(static_cast<size_t>(warps));
  for (int64_t t = first; t < last; ++t) {
    const auto w = static_cast<size_t>((t - first) / step_tokens / per_warp);
    if (runs[w].first < 0) runs[w].first = t;
    EXPECT_TRUE(runs[w].last < 0 || runs[w].last == t) << "warp " << w << " assigned tokens out of order";
    runs[w].last = t + 1;
  }
  return runs;
}

TEST(StepAppendWarps, RunsAreTheTokensEachWarpIsAssigned) {
  int checked = 0;
  for (const int step_tokens : {32, 64}) {
    for (const int64_t first : {int64_t{0}, int64_t{5}, int64_t{512}, int64_t{131072 - 700}}) {
      for (int64_t size = 1; size <= 1100; size += (size < 300 ? 1 : 37)) {
        const int64_t last = first + size;
        const std::vector<Assigned> expected = assign_token_by_token(first, last, 4, step_tokens);
        for (int w = 0; w < 4; ++w) {
          const kernels::WarpRun run = warp_run(first, last, w, 4, step_tokens);
          const Assigned& e = expected[static_cast<size_t>(w)];
          if (e.first < 0) {
            EXPECT_EQ(run.tokens, 0) << "first " << first << " last " << last << " warp " << w;
            EXPECT_EQ(run.steps, 0);
          } else {
            ASSERT_EQ(run.first, e.first) << "first " << first << " last " << last << " warp " << w;
            ASSERT_EQ(run.tokens, e.last - e.first) << "first " << first << " last " << last << " warp " << w;
            ASSERT_EQ(run.steps, (run.tokens + step_tokens - 1) / step_tokens);
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 8000);
}

TEST(StepAppendWarps, KeysByTheWarpThatReadsTheTokenValuesByAnotherOfTheBlock) {
  int appending = 0;
  for (const int step_tokens : {32, 64}) {
    for (const int64_t first : {int64_t{0}, int64_t{3}, int64_t{4096}, int64_t{65536 + 11}}) {
      for (int64_t size = 1; size <= 1100; size += (size < 300 ? 1 : 29)) {
        const int64_t last = first + size;
        const std::vector<Assigned> runs = assign_token_by_token(first, last, 4, step_tokens);
        // A length the block ends at, one past it (the token is another
        // block's) and one inside it (a later split holds the token).
        for (const int64_t length : {last, last + 1, last - 1}) {
          const kernels::StepAppendWarps warps = step_append_warps(first, last, length, 4, step_tokens);
          int reader = -1;
          for (int w = 0; w < 4; ++w) {
            const Assigned& r = runs[static_cast<size_t>(w)];
            if (length == last && r.first >= 0 && r.first <= length - 1 && length - 1 < r.last) reader = w;
          }
          ASSERT_EQ(warps.keys, reader) << "first " << first << " last " << last << " length " << length;
          if (reader < 0) {
            EXPECT_EQ(warps.values, -1);
            continue;
          }
          EXPECT_NE(warps.values, warps.keys);
          EXPECT_GE(warps.values, 0);
          EXPECT_LT(warps.values, 4);
          // The kernel's own condition for the keys' warp: its run ends at the token.
          const kernels::WarpRun run = warp_run(first, last, warps.keys, 4, step_tokens);
          EXPECT_EQ(run.first + run.tokens, length);
          ++appending;
        }
      }
    }
  }
  EXPECT_GT(appending, 2000);
}

TEST(StepAppendWarps, AnEmptyBlockStoresNothing) {
  const kernels::StepAppendWarps warps = step_append_warps(64, 64, 64, 4, 64);
  EXPECT_EQ(warps.keys, -1);
  EXPECT_EQ(warps.values, -1);
}

}  // namespace
}  // namespace kvforge
