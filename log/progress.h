#pragma once
// Progress of long work: items done, tokens/s and ETA, logged at most every
// `interval` seconds (and once at the end), the way llama.cpp's tools report.
#include <chrono>
#include <cstdint>
#include <string>

namespace kvforge::log {

class ProgressMeter {
 public:
  ProgressMeter(std::string what, int64_t total_items, double interval_seconds = 2.0);

  // Records `items` more items holding `tokens` more tokens; logs when due.
  void advance(int64_t items, int64_t tokens, const std::string& detail = {});
  // Logs the final line (elapsed time and mean throughput).
  void finish(const std::string& detail = {});

  int64_t items_done() const { return items_done_; }
  int64_t tokens_done() const { return tokens_done_; }
  double elapsed_seconds() const;
  double tokens_per_second() const;

 private:
  using Clock = std::chrono::steady_clock;
  void report(const std::string& detail, bool final_line);

  std::string what_;
  int64_t total_items_;
  double interval_seconds_;
  int64_t items_done_ = 0;
  int64_t tokens_done_ = 0;
  Clock::time_point start_;
  Clock::time_point last_report_;
};

std::string format_duration(double seconds);

}  // namespace kvforge::log
