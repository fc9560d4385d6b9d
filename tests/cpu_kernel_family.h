#pragma once
// Which CPU kernel family a test run forces ATen and oneDNN to, and whether
// this processor can run it (tests/CMakeLists.txt runs the low-precision
// tests once per family; a family above the processor's is skipped).
#include <gtest/gtest.h>

#include <optional>
#include <string>

namespace kvforge::testing {

// Why the kernel family forced by ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA
// cannot be tested on this processor, or nothing when it can (or when
// neither variable is set); throws std::invalid_argument for a value it does
// not know. ATen takes ATEN_CPU_CAPABILITY=avx512 without
// asking the processor, so its AVX-512 kernels would die of SIGILL without
// AVX-512; oneDNN takes ONEDNN_MAX_CPU_ISA as a ceiling and would silently
// run a lower family. Either way the requested family is not what runs.
std::optional<std::string> unavailable_cpu_kernel_family();

}  // namespace kvforge::testing

// In a test body or SetUp: skip when the forced family cannot run here,
// with KVFORGE_CPU_FAMILY_SKIP_MESSAGE (defined by tests/CMakeLists.txt,
// which reports a forced-family run that prints it as skipped).
#define KVFORGE_SKIP_IF_FORCED_CPU_FAMILY_UNAVAILABLE()                                   \
  do {                                                                                    \
    if (const auto why = ::kvforge::testing::unavailable_cpu_kernel_family()) {           \
      GTEST_SKIP() << KVFORGE_CPU_FAMILY_SKIP_MESSAGE ": " << *why;                     \
    }                                                                                     \
  } while (false)
