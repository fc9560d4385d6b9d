#pragma once
// Logging for every kvforge library and the CLI.
//
// spdlog stays behind this header: torch ships its own fmt headers, which
// shadow the system fmt that Debian's spdlog is built against, so no file
// that includes torch may include spdlog. Callers pass plain values; they are
// streamed with operator<< into one message.
#include <memory>
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

// While alive, every message at `level` or above also goes to `path`
// (appended, one timestamped line each, flushed per line), whatever the
// stderr sink's level: the log a long job leaves beside its outputs.
// std::runtime_error naming the path when it cannot be opened.
class LogFile {
 public:
  explicit LogFile(const std::string& path, Level level = Level::kDebug);
  ~LogFile();
  LogFile(const LogFile&) = delete;
  LogFile& operator=(const LogFile&) = delete;

 private:
  struct Sink;
  std::unique_ptr<Sink> sink_;
};
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
