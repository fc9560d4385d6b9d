#pragma once
// The layouts the runtime-kernel tests run (tests/test_runtime_kernels_cpu.cpp
// on the CPU reference, tests/test_append_cuda.cpp on the CUDA append
// against it): one list, so that the GPU is checked on every configuration
// the CPU reference is.
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "calib/quantizer_fit.h"
#include "kernels/runtime_layout.h"
#include "tests/kernel_activations.h"

namespace kvforge::testing {

struct KernelCase {
  std::string name;
  FitOptions fit;
  int64_t head_dim = 128;
  int64_t heads = 2;  // query heads (the tests' caches have 2 KV heads)
  int64_t page_size = 16;
  kernels::ElementType element = kernels::ElementType::kFloat16;
  RotationForm key_rotation = RotationForm::kNone;
  RotationForm value_rotation = RotationForm::kNone;
  bool key_centre = false;
  int64_t tokens_per_split = 16;  // decode's context split (the CPU tests' attention); append ignores it
  bool long_context = false;      // thousands of tokens in chunks of 1000 instead of the short schedule
};

// gtest's name for a case in failure messages.
void PrintTo(const KernelCase& c, std::ostream* os);

// A case of kernel_test_fit(method, bits) at the given head_dim and query heads.
KernelCase make_kernel_case(std::string name, QuantMethod method, int bits, int64_t head_dim, int64_t heads);

// Every method's layouts: KVQuant (offline pre-RoPE keys, rotated, tau),
// KIVI (block flush, sliding with a sink, fp32 pages of 64), int2-rot
// (rotated with a centre, unrotated at 4 bits), RTN (plain, groups of 32
// with outliers), and two long contexts.
std::vector<KernelCase> layout_cases();

}  // namespace kvforge::testing
