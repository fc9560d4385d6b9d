// prepare_cpu_vector_math (model/cpu_vector_math.h). The call it guards
// against is a process's first, so each check is a fresh process
// (tests/vector_math_probe.cpp), four at a time so that they load the
// machine as the suite does. Unprepared, 1-7% of such processes got a
// chunk wrong on a 2-core machine, the more the busier it was (so a run of
// these 40 would often see one); prepared, none in 1,200.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace kvforge {
namespace {

// What the probes print (nothing when every element is right), from
// `rounds` rounds of four concurrent probes of `function`.
std::string run_probes(const std::string& function, int rounds) {
  const std::string probe = std::string("'") + KVFORGE_VECTOR_MATH_PROBE + "' " + function + " --prepared";
  std::string script = "for round in $(seq " + std::to_string(rounds) + "); do ";
  for (int i = 0; i < 4; ++i) script += "(" + probe + " || echo 'probe exited non-zero') & ";
  script += "wait; done";
  FILE* pipe = ::popen(("{ " + script + "; } 2>&1").c_str(), "r");
  if (pipe == nullptr) return "cannot start sh";
  std::string out;
  char buffer[512];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) out += buffer;
  const int status = ::pclose(pipe);
  if (status != 0) out += "the shell exited with status " + std::to_string(status) + "\n";
  return out;
}

TEST(CpuVectorMath, EveryFirstCallOfAPreparedProcessIsAccurate) {
  for (const std::string function : {"cos", "sin", "log", "sqrt", "exp64"}) {
    EXPECT_EQ(run_probes(function, 2), "") << function;
  }
}

}  // namespace
}  // namespace kvforge
