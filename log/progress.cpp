#include "log/progress.h"

#include <cmath>
#include <cstdio>

#include "log/log.h"

namespace kvforge::log {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto total = static_cast<int64_t>(std::llround(seconds));
  char buffer[32];
  if (total >= 3600) {
    std::snprintf(buffer, sizeof buffer, "%lldh%02lldm", static_cast<long long>(total / 3600),
                  static_cast<long long>((total % 3600) / 60));
  } else if (total >= 60) {
    std::snprintf(buffer, sizeof buffer, "%lldm%02llds", static_cast<long long>(total / 60),
                  static_cast<long long>(total % 60));
  } else {
    std::snprintf(buffer, sizeof buffer, "%.1fs", seconds);
  }
  return buffer;
}

ProgressMeter::ProgressMeter(std::string what, int64_t total_items, double interval_seconds)
    : what_(std::move(what)),
      total_items_(total_items),
      interval_seconds_(interval_seconds),
      start_(Clock::now()),
      last_report_(start_) {}

double ProgressMeter::elapsed_seconds() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

double ProgressMeter::tokens_per_second() const {
  const double elapsed = elapsed_seconds();
  return elapsed > 0 ? static_cast<double>(tokens_done_) / elapsed : 0.0;
}

void ProgressMeter::advance(int64_t items, int64_t tokens, const std::string& detail) {
  items_done_ += items;
  tokens_done_ += tokens;
  const auto now = Clock::now();
  if (std::chrono::duration<double>(now - last_report_).count() >= interval_seconds_ ||
      items_done_ == total_items_) {
    last_report_ = now;
    report(detail, false);
  }
}

void ProgressMeter::finish(const std::string& detail) { report(detail, true); }

void ProgressMeter::report(const std::string& detail, bool final_line) {
  const double elapsed = elapsed_seconds();
  const double rate = tokens_per_second();
  std::string line = concat(what_, ": ", items_done_, "/", total_items_);
  char numbers[96];
  if (final_line) {
    std::snprintf(numbers, sizeof numbers, " done in %s, %.1f tokens/s",
                  format_duration(elapsed).c_str(), rate);
  } else {
    const double remaining =
        items_done_ > 0 ? elapsed * static_cast<double>(total_items_ - items_done_) / items_done_
                        : NAN;
    std::snprintf(numbers, sizeof numbers, " (%.1f%%), %.1f tokens/s, ETA %s",
                  total_items_ > 0 ? 100.0 * items_done_ / total_items_ : 100.0, rate,
                  format_duration(remaining).c_str());
  }
  line += numbers;
  if (!detail.empty()) line += concat(", ", detail);
  info(line);
}

}  // namespace kvforge::log
