#include "log/log.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <memory>
#include <stdexcept>

namespace kvforge::log {
namespace {

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::kDebug: return spdlog::level::debug;
    case Level::kInfo: return spdlog::level::info;
    case Level::kWarn: return spdlog::level::warn;
    case Level::kError: return spdlog::level::err;
    case Level::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

// %j: the message as a JSON string body (quotes, backslashes and control
// characters escaped), so that --log-json lines always parse.
class JsonEscapedMessage final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    static constexpr char kHex[] = "0123456789abcdef";
    for (char c : std::string_view(msg.payload.data(), msg.payload.size())) {
      switch (c) {
        case '"': dest.append(std::string_view("\\\"")); break;
        case '\\': dest.append(std::string_view("\\\\")); break;
        case '\n': dest.append(std::string_view("\\n")); break;
        case '\r': dest.append(std::string_view("\\r")); break;
        case '\t': dest.append(std::string_view("\\t")); break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            const char esc[] = {'\\', 'u', '0', '0', kHex[(c >> 4) & 0xf], kHex[c & 0xf]};
            dest.append(esc, esc + 6);
          } else {
            dest.push_back(c);
          }
      }
    }
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonEscapedMessage>();
  }
};

std::shared_ptr<spdlog::logger> logger() {
  auto existing = spdlog::get("kvforge");
  if (existing) return existing;
  auto created = spdlog::stderr_color_mt("kvforge");
  created->set_pattern("%^%L%$ %v");
  return created;
}

// The logger passes what its most verbose sink wants; each sink filters.
void update_logger_level() {
  auto sink_logger = logger();
  auto level = spdlog::level::off;
  for (const auto& sink : sink_logger->sinks()) level = std::min(level, sink->level());
  sink_logger->set_level(level);
}

}  // namespace

void configure(const Options& options) {
  auto sink_logger = logger();
  sink_logger->sinks().front()->set_level(to_spdlog(options.level));
  update_logger_level();
  if (options.json) {
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<JsonEscapedMessage>('j').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%e%z","level":"%l","msg":"%j"})");
    sink_logger->set_formatter(std::move(formatter));
  } else {
    sink_logger->set_pattern("%^%L%$ %v");
  }
}

struct LogFile::Sink {
  std::shared_ptr<spdlog::sinks::basic_file_sink_mt> file;
};

LogFile::LogFile(const std::string& path, Level level) : sink_(std::make_unique<Sink>()) {
  try {
    sink_->file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, false);
  } catch (const spdlog::spdlog_ex& e) {
    throw std::runtime_error(path + ": cannot open the log file (" + e.what() + ")");
  }
  sink_->file->set_level(to_spdlog(level));
  sink_->file->set_pattern("%Y-%m-%d %H:%M:%S.%e %L %v");
  auto sink_logger = logger();
  sink_logger->sinks().push_back(sink_->file);
  sink_logger->flush_on(spdlog::level::trace);
  update_logger_level();
}

LogFile::~LogFile() {
  auto sink_logger = logger();
  auto& sinks = sink_logger->sinks();
  sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_->file), sinks.end());
  update_logger_level();
}

Level level() {
  switch (logger()->sinks().front()->level()) {
    case spdlog::level::trace:
    case spdlog::level::debug: return Level::kDebug;
    case spdlog::level::info: return Level::kInfo;
    case spdlog::level::warn: return Level::kWarn;
    case spdlog::level::err:
    case spdlog::level::critical: return Level::kError;
    default: return Level::kOff;
  }
}

bool enabled(Level wanted) { return logger()->should_log(to_spdlog(wanted)); }  // some sink wants it

void write(Level level, std::string_view message) {
  logger()->log(to_spdlog(level), "{}", message);
}

}  // namespace kvforge::log
