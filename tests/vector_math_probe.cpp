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

#include "model/cpu_vector_math.h"

namespace {

// Each function once: its name, ATen's call and the long double reference.
struct Function {
  const char* name;
  bool float64;  // over doubles, else floats
  at::Tensor (*aten)(const at::Tensor&);
  long double (*reference)(long double);
};

constexpr Function kFunctions[] = {
    {"cos", false, [](const at::Tensor& x) { return x.cos(); }, [](long double x) { return std::cos(x); }},
    {"sin", false, [](const at::Tensor& x) { return x.sin(); }, [](long double x) { return std::sin(x); }},
    {"log", false, [](const at::Tensor& x) { return x.log(); }, [](long double x) { return std::log(x); }},
    {"sqrt", false, [](const at::Tensor& x) { return x.sqrt(); }, [](long double x) { return std::sqrt(x); }},
    {"exp64", true, [](const at::Tensor& x) { return x.exp(); }, [](long double x) { return std::exp(x); }},
};

}  // namespace

int main(int argc, char** argv) {
  const Function* function = nullptr;
  for (const Function& f : kFunctions) {
    if (argc > 1 && std::strcmp(argv[1], f.name) == 0) function = &f;
  }
  if (function == nullptr) {
    std::fprintf(stderr, "usage: vector_math_probe cos|sin|log|sqrt|exp64 [--prepared]\n");
    return 2;
  }
  if (argc > 2 && std::strcmp(argv[2], "--prepared") == 0) kvforge::prepare_cpu_vector_math();
  at::Tensor a = at::randn({32, 512}), w = at::randn({512, 512});
  for (int i = 0; i < 5; ++i) a = at::linear(a, w) / 20;
  const bool float64 = function->float64;
  const at::Tensor x = float64 ? at::linspace(-15, 15, 8192, at::kDouble) : at::linspace(0.5, 30, 8192, at::kFloat);
  const at::Tensor y = function->aten(x).to(at::kDouble);
  const at::Tensor x64 = x.to(at::kDouble);
  const double* got = y.data_ptr<double>();
  const double* in = x64.data_ptr<double>();
  const double ulp = float64 ? 0x1p-52 : 0x1p-23;  // relative, at the top of a binade
  double worst = 0;
  int64_t worst_at = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const long double expected = function->reference(in[i]);
    // cos and sin near their zeros: against the function's scale, 1.
    const long double scale = std::fabs(expected) < 1 ? 1.0L : std::fabs(expected);
    const double error = static_cast<double>(std::fabs(got[i] - expected) / scale) / ulp;
    if (error > worst) worst = error, worst_at = i;
  }
  if (worst > 2) {
    std::printf("%s: element %lld of 8192 off by %.3g ulps\n", function->name, static_cast<long long>(worst_at), worst);
    return 1;
  }
  return 0;
}
