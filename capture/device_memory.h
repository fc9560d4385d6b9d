#pragma once
// How much memory a device has free for a new job: CUDA's free memory as the
// runtime reports it, or the machine's MemAvailable for the CPU.
#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>

namespace kvforge {

// Bytes of `MemAvailable:` in the text of /proc/meminfo (given in kB);
// nullopt when the line is missing or malformed.
std::optional<int64_t> parse_meminfo_available(const std::string& meminfo_text);

// Free bytes on `device`; nullopt when it cannot be told (no /proc/meminfo).
std::optional<int64_t> available_device_memory(c10::Device device);

}  // namespace kvforge
