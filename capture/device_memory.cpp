#include "capture/device_memory.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include <fstream>
#include <sstream>

namespace kvforge {

std::optional<int64_t> parse_meminfo_available(const std::string& meminfo_text) {
  std::istringstream lines(meminfo_text);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::string name, unit;
    int64_t kilobytes = -1;
    words >> name;
    if (name != "MemAvailable:") continue;
    if (!(words >> kilobytes >> unit) || kilobytes < 0 || unit != "kB") return std::nullopt;
    return kilobytes * 1024;
  }
  return std::nullopt;
}

std::optional<int64_t> available_device_memory(c10::Device device) {
  if (device.is_cuda()) {
    // cudaMemGetInfo on the device, through the caching allocator; memory the
    // allocator caches for this process is not counted as free, and this
    // runs before the model is loaded.
    const auto [free, total] =
        c10::cuda::CUDACachingAllocator::get()->getMemoryInfo(device.has_index() ? device.index() : 0);
    (void)total;
    return static_cast<int64_t>(free);
  }
  std::ifstream file("/proc/meminfo");
  if (!file) return std::nullopt;
  std::stringstream text;
  text << file.rdbuf();
  return parse_meminfo_available(text.str());
}

}  // namespace kvforge
