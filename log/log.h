#pragma once
// Logging for every kvforge library and the CLI.
//
// spdlog stays behind this header: torch ships its own fmt headers, which
// shadow the system fmt that Debian's spdlog is built against, so no file
// that includes torch may include spdlog. Callers pass plain values; they are
// streamed with operator<< into one message.
#include <sstream>
#include <string>
#include <string_view>

namespace kvforge::log {

enum class Level { kDebug, kInfo, kWarn, kError, kOff };

struct Options {
  Level level = Level::kInfo;
  bool json = false;  // one JSON object per line on stderr
};

// Configures the process-wide sink (stderr). Safe to call more than once.
void configure(const Options& options);
Level level();
bool enabled(Level level);
void write(Level level, std::string_view message);

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

template <typename... Args>
void debug(const Args&... args) {
  if (enabled(Level::kDebug)) write(Level::kDebug, concat(args...));
}
template <typename... Args>
void info(const Args&... args) {
  if (enabled(Level::kInfo)) write(Level::kInfo, concat(args...));
}
template <typename... Args>
void warn(const Args&... args) {
  if (enabled(Level::kWarn)) write(Level::kWarn, concat(args...));
}
template <typename... Args>
void error(const Args&... args) {
  if (enabled(Level::kError)) write(Level::kError, concat(args...));
}

}  // namespace kvforge::log
