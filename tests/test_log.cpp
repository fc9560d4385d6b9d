#include <gtest/gtest.h>

#include "log/log.h"
#include "log/progress.h"

namespace kvforge::log {
namespace {

TEST(Log, ConcatStreamsEveryArgument) {
  EXPECT_EQ(concat("a", 1, ' ', 2.5, "b"), "a1 2.5b");
}

TEST(Log, LevelFiltersMessages) {
  configure({.level = Level::kWarn});
  EXPECT_FALSE(enabled(Level::kInfo));
  EXPECT_TRUE(enabled(Level::kError));
  configure({.level = Level::kDebug});
  EXPECT_TRUE(enabled(Level::kDebug));
  EXPECT_EQ(level(), Level::kDebug);
  configure({});
}

TEST(Progress, CountsItemsAndTokens) {
  configure({.level = Level::kOff});
  ProgressMeter meter("test", 4, 0.0);
  meter.advance(1, 100);
  meter.advance(3, 300);
  EXPECT_EQ(meter.items_done(), 4);
  EXPECT_EQ(meter.tokens_done(), 400);
  EXPECT_GE(meter.tokens_per_second(), 0.0);
  configure({});
}

TEST(Progress, FormatsDurations) {
  EXPECT_EQ(format_duration(5.0), "5.0s");
  EXPECT_EQ(format_duration(125.0), "2m05s");
  EXPECT_EQ(format_duration(3725.0), "1h02m");
  EXPECT_EQ(format_duration(-1.0), "?");
}

}  // namespace
}  // namespace kvforge::log
