#include "tests/kernel_cases.h"

#include <utility>

namespace kvforge::testing {

void PrintTo(const KernelCase& c, std::ostream* os) { *os << c.name; }

KernelCase make_kernel_case(std::string name, QuantMethod method, int bits, int64_t head_dim, int64_t heads) {
  KernelCase c;
  c.name = std::move(name);
  c.fit = kernel_test_fit(method, bits);
  c.head_dim = head_dim;
  c.heads = heads;
  return c;
}

std::vector<KernelCase> layout_cases() {
  using kernels::ElementType;
  std::vector<KernelCase> all;
  {  // KVQuant: offline pre-RoPE keys with thresholds, all-heads values with top/bottom outliers, Q-Norm, sink 1.
    KernelCase c = make_kernel_case("kvquant_2bit_d128_gqa4", QuantMethod::kKvquant, 2, 128, 8);
    c.fit.outlier_fraction = 0.04;
    all.push_back(c);
  }
  {  // Rotated: pair angles on the pre-RoPE keys, a matrix on the values; 4 bits, a page of 12.
    KernelCase c = make_kernel_case("kvquant_rotated_4bit_d64_gqa1_page12", QuantMethod::kKvquant, 4, 64, 2);
    c.fit.outlier_fraction = 0.04;
    c.page_size = 12;
    c.key_rotation = RotationForm::kPairAngles;
    c.value_rotation = RotationForm::kMatrix;
    c.tokens_per_split = 0;
    all.push_back(c);
  }
  {  // KVQuant's tau variant: per-head values with token_tau outliers; bf16 elements.
    KernelCase c = make_kernel_case("kvquant_tau_2bit_d64_gqa4_bf16", QuantMethod::kKvquant, 2, 64, 8);
    c.fit.value_outlier_rule = OutlierRule::kTokenTau;
    c.fit.outlier_fraction = 0.03;
    c.element = ElementType::kBFloat16;
    all.push_back(c);
  }
  {  // KIVI: per-channel key groups of 32 with block flush, per-token values sliding.
    KernelCase c = make_kernel_case("kivi_2bit_d128_gqa4", QuantMethod::kKivi, 2, 128, 8);
    c.fit.residual_tokens = 32;
    all.push_back(c);
  }
  {  // KIVI at 4 bits with a sink, a page (12) that divides no group of 32, sliding keys.
    KernelCase c = make_kernel_case("kivi_sliding_sink_4bit_d64_gqa1_page12", QuantMethod::kKivi, 4, 64, 2);
    c.fit.residual_tokens = 32;
    c.fit.sink_tokens = 2;
    c.fit.key_residual_rule = ResidualRule::kSliding;
    c.page_size = 12;
    c.tokens_per_split = 32;
    all.push_back(c);
  }
  {  // KIVI with a page (64) holding two groups; fp32 elements.
    KernelCase c = make_kernel_case("kivi_4bit_d128_gqa1_page64_fp32", QuantMethod::kKivi, 4, 128, 2);
    c.fit.residual_tokens = 64;
    c.fit.key_group = 32;
    c.page_size = 64;
    c.element = ElementType::kFloat32;
    all.push_back(c);
  }
  {  // int2-rot with its learned-rotation form: a matrix (with a centre) on the keys and the values.
    KernelCase c = make_kernel_case("int2rot_rotated_2bit_d128_gqa4", QuantMethod::kInt2Rot, 2, 128, 8);
    c.fit.sink_tokens = 4;
    c.fit.residual_tokens = 16;
    c.key_rotation = RotationForm::kMatrix;
    c.value_rotation = RotationForm::kMatrix;
    c.key_centre = true;
    all.push_back(c);
  }
  {  // int2-rot unrotated at 4 bits, page 12.
    KernelCase c = make_kernel_case("int2rot_4bit_d64_gqa1_page12", QuantMethod::kInt2Rot, 4, 64, 2);
    c.fit.sink_tokens = 4;
    c.fit.residual_tokens = 16;
    c.page_size = 12;
    all.push_back(c);
  }
  {  // RTN, no windows.
    all.push_back(make_kernel_case("rtn_2bit_d128_gqa1", QuantMethod::kRtn, 2, 128, 2));
    KernelCase c = make_kernel_case("rtn_4bit_d64_gqa4_split64", QuantMethod::kRtn, 4, 64, 8);
    c.tokens_per_split = 64;
    all.push_back(c);
  }
  {  // Long contexts (3003 and 1404 tokens), splits of 256: KVQuant, and int2-rot rotated.
    KernelCase c = make_kernel_case("kvquant_long_2bit_d128_gqa4", QuantMethod::kKvquant, 2, 128, 8);
    c.fit.outlier_fraction = 0.02;
    c.tokens_per_split = 256;
    c.long_context = true;
    all.push_back(c);
    KernelCase r = make_kernel_case("int2rot_rotated_long_4bit_d128_gqa4", QuantMethod::kInt2Rot, 4, 128, 8);
    r.fit.sink_tokens = 4;
    r.fit.residual_tokens = 64;
    r.key_rotation = r.value_rotation = RotationForm::kMatrix;
    r.tokens_per_split = 256;
    r.long_context = true;
    all.push_back(r);
  }
  {  // RTN with groups of 32 channels and top/bottom outliers per head.
    KernelCase c = make_kernel_case("rtn_groups32_outliers_2bit_d128_gqa4", QuantMethod::kRtn, 2, 128, 8);
    c.fit.key_group = 32;
    c.fit.value_group = 32;
    c.fit.outlier_fraction = 0.05;
    all.push_back(c);
  }
  return all;
}

}  // namespace kvforge::testing
