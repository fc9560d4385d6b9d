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

KernelCase kvquant_layout(std::string name, int bits, int64_t head_dim, int64_t heads) {
  KernelCase c = make_kernel_case(std::move(name), QuantMethod::kKvquant, bits, head_dim, heads);
  c.fit.outlier_fraction = 0.04;
  return c;
}

KernelCase kvquant_rotated_layout(std::string name, int bits, int64_t head_dim, int64_t heads) {
  KernelCase c = kvquant_layout(std::move(name), bits, head_dim, heads);
  c.page_size = 12;
  c.key_rotation = RotationForm::kPairAngles;
  c.value_rotation = RotationForm::kMatrix;
  c.tokens_per_split = 0;
  return c;
}

KernelCase kvquant_tau_layout(std::string name, int bits, int64_t head_dim, int64_t heads) {
  KernelCase c = make_kernel_case(std::move(name), QuantMethod::kKvquant, bits, head_dim, heads);
  c.fit.value_outlier_rule = OutlierRule::kTokenTau;
  c.fit.outlier_fraction = 0.03;
  c.element = kernels::ElementType::kBFloat16;
  return c;
}

KernelCase kivi_layout(std::string name, int bits, int64_t head_dim, int64_t heads) {
  KernelCase c = make_kernel_case(std::move(name), QuantMethod::kKivi, bits, head_dim, heads);
  c.fit.residual_tokens = 32;
  return c;
}

KernelCase kivi_sliding_sink_layout(std::string name, int bits, int64_t head_dim, int64_t heads) {
  KernelCase c = kivi_layout(std::move(name), bits, head_dim, heads);
  c.fit.sink_tokens = 2;
  c.fit.key_residual_rule = ResidualRule::kSliding;
  c.page_size = 12;
  c.tokens_per_split = 32;
  return c;
}

KernelCase kivi_page64_layout(std::string name, int bits, int64_t head_dim, int64_t heads) {
  KernelCase c = make_kernel_case(std::move(name), QuantMethod::kKivi, bits, head_dim, heads);
  c.fit.residual_tokens = 64;
  c.fit.key_group = 32;
  c.page_size = 64;
  c.element = kernels::ElementType::kFloat32;
  return c;
}

KernelCase int2rot_window_layout(std::string name, int bits, int64_t head_dim, int64_t heads) {
  KernelCase c = make_kernel_case(std::move(name), QuantMethod::kInt2Rot, bits, head_dim, heads);
  c.fit.sink_tokens = 4;
  c.fit.residual_tokens = 16;
  return c;
}

KernelCase int2rot_rotated_layout(std::string name, int bits, int64_t head_dim, int64_t heads) {
  KernelCase c = int2rot_window_layout(std::move(name), bits, head_dim, heads);
  c.key_rotation = RotationForm::kMatrix;
  c.value_rotation = RotationForm::kMatrix;
  c.key_centre = true;
  return c;
}

KernelCase int2rot_page12_layout(std::string name, int bits, int64_t head_dim, int64_t heads) {
  KernelCase c = int2rot_window_layout(std::move(name), bits, head_dim, heads);
  c.page_size = 12;
  return c;
}

KernelCase rtn_groups32_outliers_layout(std::string name, int bits, int64_t head_dim, int64_t heads) {
  KernelCase c = make_kernel_case(std::move(name), QuantMethod::kRtn, bits, head_dim, heads);
  c.fit.key_group = 32;
  c.fit.value_group = 32;
  c.fit.outlier_fraction = 0.05;
  return c;
}

std::vector<KernelCase> layout_cases() {
  std::vector<KernelCase> all;
  all.push_back(kvquant_layout("kvquant_2bit_d128_gqa4", 2, 128, 8));
  all.push_back(kvquant_rotated_layout("kvquant_rotated_4bit_d64_gqa1_page12", 4, 64, 2));
  all.push_back(kvquant_tau_layout("kvquant_tau_2bit_d64_gqa4_bf16", 2, 64, 8));
  all.push_back(kivi_layout("kivi_2bit_d128_gqa4", 2, 128, 8));
  all.push_back(kivi_sliding_sink_layout("kivi_sliding_sink_4bit_d64_gqa1_page12", 4, 64, 2));
  all.push_back(kivi_page64_layout("kivi_4bit_d128_gqa1_page64_fp32", 4, 128, 2));
  all.push_back(int2rot_rotated_layout("int2rot_rotated_2bit_d128_gqa4", 2, 128, 8));
  all.push_back(int2rot_page12_layout("int2rot_4bit_d64_gqa1_page12", 4, 64, 2));
  all.push_back(make_kernel_case("rtn_2bit_d128_gqa1", QuantMethod::kRtn, 2, 128, 2));
  {
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
  all.push_back(rtn_groups32_outliers_layout("rtn_groups32_outliers_2bit_d128_gqa4", 2, 128, 8));
  return all;
}

}  // namespace kvforge::testing
