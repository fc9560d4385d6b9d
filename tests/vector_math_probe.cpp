// The first vector-math call of a process, checked: a multithreaded matmul
// (which starts MKL's and OpenMP's threads), then one function over 8192
// elements, every element against a long double evaluation.
// Usage: vector_math_probe cos|sin|log|sqrt|exp64 [--prepared]
// --prepared calls prepare_cpu_vector_math() first. Exits 1 with one line
// naming the worst element when any is off by more than 2 ulps, else 0.
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "model/cpu_vector_math.h"

namespace {

long double reference(const std::string& function, long double x) {
  if (function == "cos") return std::cos(x);
  if (function == "sin") return std::sin(x);
  if (function == "log") return std::log(x);
  if (function == "sqrt") return std::sqrt(x);
  return std::exp(x);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string function = argv[1];
  if (argc > 2 && std::strcmp(argv[2], "--prepared") == 0) kvforge::prepare_cpu_vector_math();
  at::Tensor a = at::randn({32, 512}), w = at::randn({512, 512});
  for (int i = 0; i < 5; ++i) a = at::linear(a, w) / 20;
  const bool float64 = function == "exp64";
  const at::Tensor x = float64 ? at::linspace(-15, 15, 8192, at::kDouble) : at::linspace(0.5, 30, 8192, at::kFloat);
  const at::Tensor y = (function == "cos"   ? x.cos()
                        : function == "sin" ? x.sin()
                        : function == "log" ? x.log()
                        : function == "sqrt" ? x.sqrt()
                                             : x.exp())
                           .to(at::kDouble);
  const at::Tensor x64 = x.to(at::kDouble);
  const double* got = y.data_ptr<double>();
  const double* in = x64.data_ptr<double>();
  const double ulp = float64 ? 0x1p-52 : 0x1p-23;  // relative, at the top of a binade
  double worst = 0;
  int64_t worst_at = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const long double expected = reference(function, in[i]);
    // cos and sin near their zeros: against the function's scale, 1.
    const long double scale = std::fabs(expected) < 1 ? 1.0L : std::fabs(expected);
    const double error = static_cast<double>(std::fabs(got[i] - expected) / scale) / ulp;
    if (error > worst) worst = error, worst_at = i;
  }
  if (worst > 2) {
    std::printf("%s: element %lld of 8192 off by %.3g ulps\n", function.c_str(), static_cast<long long>(worst_at), worst);
    return 1;
  }
  return 0;
}
