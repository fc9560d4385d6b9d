#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

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

TEST(Log, LogFileTakesEveryLevelWhileAliveAndLeavesStderrsLevel) {
  const std::string path = ::testing::TempDir() + "kvforge_log_file_test.log";
  std::remove(path.c_str());
  configure({.level = Level::kWarn});
  {
    LogFile file(path);
    EXPECT_TRUE(enabled(Level::kDebug));  // the file wants debug lines
    EXPECT_EQ(level(), Level::kWarn);     // stderr's level is unchanged
    debug("debug line ", 1);
    warn("warn line");
  }
  EXPECT_FALSE(enabled(Level::kInfo));
  info("after the file closed");
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find(" D debug line 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find(" W warn line\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("after the file closed"), std::string::npos) << text;
  EXPECT_THROW(LogFile(::testing::TempDir()), std::runtime_error);  // a directory
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
