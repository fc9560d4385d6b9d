#include "tests/cpu_kernel_family.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace kvforge::testing {
namespace {

// The feature flags of the first processor in /proc/cpuinfo (Linux names).
std::set<std::string> cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string flag; words >> flag;) flags.insert(flag);
    return flags;
  }
  return {};
}

// What each family needs, as ATen's cpuinfo checks and oneDNN's ISA
// definitions state it (/proc/cpuinfo names).
const std::map<std::string, std::vector<std::string>>& aten_requirements() {
  static const std::map<std::string, std::vector<std::string>> table = {
      {"default", {}},
      {"avx2", {"avx2", "fma"}},
      {"avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}},
  };
  return table;
}

const std::map<std::string, std::vector<std::string>>& onednn_requirements() {
  static const std::vector<std::string> avx512_core = {"avx512f", "avx512bw", "avx512vl", "avx512dq"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), avx512_core.begin(), avx512_core.end());
    return more;
  };
  static const std::map<std::string, std::vector<std::string>> table = {
      {"SSE41", {"sse4_1"}},
      {"AVX", {"avx"}},
      {"AVX2", {"avx2"}},
      {"AVX2_VNNI", {"avx2", "avx_vnni"}},
      {"AVX512_CORE", avx512_core},
      {"AVX512_CORE_VNNI", with({"avx512_vnni"})},
      {"AVX512_CORE_BF16", with({"avx512_vnni", "avx512_bf16"})},
      {"AVX512_CORE_AMX", with({"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"})},
  };
  return table;
}

std::string upper(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::toupper(c); });
  return text;
}

// Why `name` (a value of `variable`) cannot run here, or nothing.
std::optional<std::string> missing_for(const char* variable, const std::string& name,
                                       const std::map<std::string, std::vector<std::string>>& table,
                                       const std::set<std::string>& flags) {
  const auto found = table.find(name);
  if (found == table.end()) {
    throw std::invalid_argument(std::string(variable) + "=" + name + ": not a kernel family these tests know");
  }
  std::string missing;
  for (const auto& flag : found->second) {
    if (!flags.count(flag)) missing += (missing.empty() ? "" : ", ") + flag;
  }
  if (missing.empty()) return std::nullopt;
  return std::string(variable) + "=" + name + " needs " + missing + ", which this CPU lacks";
}

}  // namespace

std::optional<std::string> unavailable_cpu_kernel_family() {
  const std::set<std::string> flags = cpu_flags();
  if (const char* aten = std::getenv("ATEN_CPU_CAPABILITY"); aten != nullptr && *aten != '\0') {
    if (auto why = missing_for("ATEN_CPU_CAPABILITY", aten, aten_requirements(), flags)) return why;
  }
  if (const char* onednn = std::getenv("ONEDNN_MAX_CPU_ISA"); onednn != nullptr && *onednn != '\0') {
    if (auto why = missing_for("ONEDNN_MAX_CPU_ISA", upper(onednn), onednn_requirements(), flags)) return why;
  }
  return std::nullopt;
}

}  // namespace kvforge::testing
