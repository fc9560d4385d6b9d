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
#include "kernels/decode_params.h"
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
  // test_append_cuda: inputs rounded to multiples of this step (0: as
  // drawn), so that outlier selections and group extremes meet ties.
  double activation_step = 0;
  // The CUDA append kernel the case asks for (CacheOptions::append_kernel).
  kernels::AppendKernel append_kernel = kernels::AppendKernel::kAuto;
};

// gtest's name for a case in failure messages.
void PrintTo(const KernelCase& c, std::ostream* os);

// A case of kernel_test_fit(method, bits) at the given head_dim and query heads.
KernelCase make_kernel_case(std::string name, QuantMethod method, int bits, int64_t head_dim, int64_t heads);

// The layouts the tests share, each at any bits, head_dim and query heads:
// KVQuant with outliers (0.04); rotated (pair angles on the pre-RoPE keys,
// a matrix on the values, a page of 12, one split); the tau variant (per-head
// values with token_tau outliers, 0.03; bf16 elements); KIVI (a window of
// 32); KIVI sliding with a sink of 2 and a page (12) that divides no group of
// 32, in splits of 32; KIVI with a page (64) holding two groups of 32 keys
// and a window of 64, fp32 elements; int2-rot with a sink of 4 and a window
// of 16, rotated (a matrix with a centre on the keys, a matrix on the
// values) or on a page of 12; RTN in groups of 32 channels with top/bottom
// outliers (0.05).
KernelCase kvquant_layout(std::string name, int bits, int64_t head_dim, int64_t heads);
KernelCase kvquant_rotated_layout(std::string name, int bits, int64_t head_dim, int64_t heads);
KernelCase kvquant_tau_layout(std::string name, int bits, int64_t head_dim, int64_t heads);
KernelCase kivi_layout(std::string name, int bits, int64_t head_dim, int64_t heads);
KernelCase kivi_sliding_sink_layout(std::string name, int bits, int64_t head_dim, int64_t heads);
KernelCase kivi_page64_layout(std::string name, int bits, int64_t head_dim, int64_t heads);
KernelCase int2rot_window_layout(std::string name, int bits, int64_t head_dim, int64_t heads);
KernelCase int2rot_rotated_layout(std::string name, int bits, int64_t head_dim, int64_t heads);
KernelCase int2rot_page12_layout(std::string name, int bits, int64_t head_dim, int64_t heads);
KernelCase rtn_groups32_outliers_layout(std::string name, int bits, int64_t head_dim, int64_t heads);

// Every method's layouts: KVQuant (offline pre-RoPE keys, rotated, tau),
// KIVI (block flush, sliding with a sink, fp32 pages of 64), int2-rot
// (rotated with a centre, unrotated at 4 bits), RTN (plain, groups of 32
// with outliers), and two long contexts.
std::vector<KernelCase> layout_cases();

}  // namespace kvforge::testing
