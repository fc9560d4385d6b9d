#pragma once
// Removes a file on scope exit unless released: the temporary file of a
// write that failed, so no partial output is left behind.
#include <filesystem>
#include <system_error>
#include <utility>

namespace kvforge {

class RemoveOnFailure {
 public:
  explicit RemoveOnFailure(std::filesystem::path path) : path_(std::move(path)) {}
  ~RemoveOnFailure() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove(path_, ignored);
  }
  RemoveOnFailure(const RemoveOnFailure&) = delete;
  RemoveOnFailure& operator=(const RemoveOnFailure&) = delete;
  void release() { path_.clear(); }

 private:
  std::filesystem::path path_;
};

}  // namespace kvforge
