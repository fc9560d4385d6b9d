// The CUDA decode_attention (kernels/decode_attention.cu) on the caches the
// CPU reference builds: for every layout (kvquant with outliers and pre-RoPE
// keys, kivi block flush and sliding, int2-rot with rotations, rtn), head_dim
// 64 and 128, GQA 1/4/8, 2 and 4 bits, a batch of mixed lengths (1 to ~4K)
// and one 32K context, every pool and table of the cache's DecodeParams is
// copied to the device and launch_decode_attention's output is compared
//   - with the CPU reference's decode_attention on the same bytes: within
//     1e-3 of the values' magnitude and within twice the float32 bound
//     derived below (both compute the same float32 formula, in different
//     orders inside a split);
//   - with float64 attention over the reference's read-back of every token
//     (read_token: the dequantized values, which test_runtime_kernels_cpu
//     checks against calib's float64 oracle), within the float32 bound.
// Skipped without a GPU.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "calib/kv_rotation.h"
#include "calib/quantizer_fit.h"
#include "kernels/cuda_runtime_check.h"
#include "kernels/decode_attention_launch.h"
#include "kernels/element_conversion.h"
#include "kernels/quantized_kv_cache.h"
#include "tests/kernel_activations.h"
#include "model/rope.h"

namespace kvforge {
namespace {

using kernels::ElementType;
using kernels::TensorKind;

constexpr double kUnit = 0x1p-24;  // float32 unit roundoff
constexpr int64_t kKvHeads = 2;

// ------------------------------------------------------------ device copies

// cudaMalloc'd copies of host arrays, freed together.
class DeviceArrays {
 public:
  DeviceArrays() = default;
  DeviceArrays(const DeviceArrays&) = delete;
  DeviceArrays& operator=(const DeviceArrays&) = delete;
  ~DeviceArrays() {
    for (void* memory : buffers_) cudaFree(memory);
  }
  void* allocate(int64_t bytes) {
    void* memory = nullptr;
    KVFORGE_CUDA_CHECK(cudaMalloc(&memory, static_cast<size_t>(bytes)));
    buffers_.push_back(memory);
    return memory;
  }
  // Null for a null host pointer (an absent table stays absent).
  template <class T>
  T* copy(const T* host, int64_t count) {
    if (host == nullptr || count == 0) return nullptr;
    void* memory = allocate(count * static_cast<int64_t>(sizeof(T)));
    KVFORGE_CUDA_CHECK(cudaMemcpy(memory, host, static_cast<size_t>(count) * sizeof(T), cudaMemcpyHostToDevice));
    return static_cast<T*>(memory);
  }

 private:
  std::vector<void*> buffers_;
};

// The pool sizes the test chose (CacheOptions), which DecodeParams does not carry.
struct PoolSizes {
  int64_t max_sequences = 0, max_pages = 0, max_outlier_pages = 0;
};

kernels::PagedTensor device_tensor(DeviceArrays& device, const kernels::PagedTensor& host, const PoolSizes& sizes) {
  kernels::PagedTensor d = host;
  const kernels::TensorPageLayout& l = host.layout;
  d.pages = device.copy(host.pages, sizes.max_pages * l.page_bytes);
  d.exact = device.copy(host.exact, sizes.max_sequences * l.exact_slot_bytes);
  if (l.outlier_spans > 0) {
    d.outlier_pages = device.copy(host.outlier_pages, sizes.max_outlier_pages * l.outlier_page_bytes);
    d.outlier_page_table = device.copy(host.outlier_page_table, sizes.max_sequences * host.outlier_table_stride);
  }
  return d;
}

kernels::Dequantization device_dequantization(DeviceArrays& device, const kernels::Dequantization& host,
                                              const kernels::TensorPageLayout& l) {
  kernels::Dequantization d = host;
  const int64_t width = static_cast<int64_t>(l.spec.kv_heads) * l.spec.head_dim;
  d.levels = device.copy(host.levels, int64_t{1} << l.spec.bits);
  d.channel_scale = device.copy(host.channel_scale, width);
  d.channel_offset = device.copy(host.channel_offset, width);
  return d;
}

kernels::Rotation device_rotation(DeviceArrays& device, const kernels::Rotation& host, const kernels::TensorPageLayout& l) {
  kernels::Rotation d = host;
  const int64_t heads = l.spec.kv_heads, dim = l.spec.head_dim;
  d.matrix = device.copy(host.matrix, heads * dim * dim);
  d.centre = device.copy(host.centre, heads * dim);
  d.pair_cos = device.copy(host.pair_cos, heads * dim / 2);
  d.pair_sin = device.copy(host.pair_sin, heads * dim / 2);
  return d;
}

// The host DecodeParams (CPU backend memory) with every pointer replaced by
// a device copy; output is a fresh device buffer.
kernels::DecodeParams device_params(DeviceArrays& device, const kernels::DecodeParams& host, const PoolSizes& sizes) {
  kernels::DecodeParams d = host;
  const kernels::TensorLayoutSpec& spec = host.key_cache.layout.spec;
  const int64_t count = host.batch.count, io_count = count * host.num_heads * spec.head_dim;
  const int64_t io_bytes = io_count * kernels::element_bytes(host.io);
  d.batch.slots = device.copy(host.batch.slots, count);
  d.batch.lengths = device.copy(host.batch.lengths, count);
  d.batch.page_table = device.copy(host.batch.page_table, sizes.max_sequences * host.batch.page_table_stride);
  d.queries = device.copy(static_cast<const uint8_t*>(host.queries), io_bytes);
  d.output = device.allocate(io_bytes);
  d.key_cache = device_tensor(device, host.key_cache, sizes);
  d.value_cache = device_tensor(device, host.value_cache, sizes);
  d.key_dequantization = device_dequantization(device, host.key_dequantization, host.key_cache.layout);
  d.value_dequantization = device_dequantization(device, host.value_dequantization, host.value_cache.layout);
  d.key_rotation = device_rotation(device, host.key_rotation, host.key_cache.layout);
  d.value_rotation = device_rotation(device, host.value_rotation, host.value_cache.layout);
  d.rope_inverse_frequencies = device.copy(host.rope_inverse_frequencies, spec.head_dim / 2);
  d.read_tally = nullptr;
  return d;
}

// ------------------------------------------------------------ configurations

struct Case {
  std::string name;
  FitOptions fit;
  int64_t head_dim = 128;
  int64_t heads = 2;  // query heads; kv_heads is 2
  int64_t page_size = 16;
  ElementType element = ElementType::kFloat16;
  ElementType io = ElementType::kFloat32;
  RotationForm key_rotation = RotationForm::kNone;
  RotationForm value_rotation = RotationForm::kNone;
  bool key_centre = false;
  int64_t tokens_per_split = 256;
  std::vector<int64_t> lengths{1, 5, 37, 300, 1031, 4099};
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

using testing::array_of;
using testing::to_element;
using Activations = testing::KernelActivations;
Activations synthetic(int64_t windows, int64_t tokens, int64_t dim, ElementType element, const RotaryEmbedding& rope) {
  return testing::synthetic_activations(windows, kKvHeads, tokens, dim, 1.0, element, rope);
}

// One layer's configuration fitted by calib on synthetic windows (rotated
// ones for a rotated case).
QuantizerConfig fitted_config(const Case& c, const RotaryEmbedding& rope) {
  QuantizerConfig config;
  config.name = c.name;
  config.settings = resolve_settings(c.fit, c.head_dim);
  if (c.key_rotation != RotationForm::kNone || c.value_rotation != RotationForm::kNone) {
    RotationSettings r;
    r.keys = c.key_rotation;
    r.values = c.value_rotation;
    r.key_centred = c.key_centre;
    r.steps = 0;
    config.rotation = r;
  }
  const Activations calibration = synthetic(2, 96, c.head_dim, c.element, rope);
  config.layers.push_back(testing::fit_randomly_rotated_layer(config.settings, c.fit, calibration, kKvHeads, c.head_dim,
                                                              c.key_rotation, c.value_rotation, c.key_centre));
  return config;
}

// ------------------------------------------------------------ float64 attention

// What float64 attention over the reference's read-back gives for query
// head `head` of one sequence, in the model's basis: the stored-basis keys
// (RoPE applied in float64 for pre-RoPE keys) against the query rotated by
// the keys' rotation in float64 (a centre shifts every logit equally), the
// output rotated back by the values' matrix in float64. Also the norms the
// float32 bound needs.
struct Float64Attention {
  std::vector<double> output;
  double query_norm = 0, key_norm = 0, value_norm = 0;  // ||q'||, max_t ||k'_t||, max_t ||v'_t||
  double query_l1 = 0;                  // sum_d |q'_d|
  double key_max = 0, value_max = 0;    // max_t,d |k'_td|, |v'_td| (stored basis, before RoPE)
};

Float64Attention float64_attention(const kernels::QuantizedKVCache& cache, const kernels::DecodeParams& host,
                                   int32_t sequence, int64_t tokens, const float* query, int64_t kv_head) {
  const int64_t dim = host.key_cache.layout.spec.head_dim, half = dim / 2;
  Float64Attention r;
  std::vector<double> q(static_cast<size_t>(dim));
  const kernels::Rotation& kr = host.key_rotation;
  for (int64_t j = 0; j < dim; ++j) {
    if (kr.kind == kernels::RotationKind::kMatrix) {
      double sum = 0;
      for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(query[i]) * kr.matrix[(kv_head * dim + i) * dim + j];
      q[j] = sum;
    } else if (kr.kind == kernels::RotationKind::kPairAngles) {
      const int64_t p = j % half;
      const double c = kr.pair_cos[kv_head * half + p], s = kr.pair_sin[kv_head * half + p];
      q[j] = j < half ? query[p] * c - query[p + half] * s : query[p] * s + query[p + half] * c;
    } else {
      q[j] = query[j];
    }
    r.query_norm += q[j] * q[j];
    r.query_l1 += std::fabs(q[j]);
  }
  r.query_norm = std::sqrt(r.query_norm);
  std::vector<double> logits(static_cast<size_t>(tokens));
  std::vector<std::vector<double>> values(static_cast<size_t>(tokens));
  const double scale = host.softmax_scale;
  double max_logit = -INFINITY;
  for (int64_t t = 0; t < tokens; ++t) {
    const kernels::TokenReadout k = cache.read_token(0, TensorKind::kKeys, sequence, t);
    const kernels::TokenReadout v = cache.read_token(0, TensorKind::kValues, sequence, t);
    std::vector<double> key(k.values.begin() + kv_head * dim, k.values.begin() + (kv_head + 1) * dim);
    for (double x : key) r.key_max = std::max(r.key_max, std::fabs(x));
    if (host.keys_pre_rope) {
      for (int64_t j = 0; j < half; ++j) {
        const double angle = static_cast<double>(static_cast<float>(t) * host.rope_inverse_frequencies[j]);
        const double a = key[j], b = key[j + half];
        key[j] = a * std::cos(angle) - b * std::sin(angle);
        key[j + half] = b * std::cos(angle) + a * std::sin(angle);
      }
    }
    double dot = 0, key_norm = 0, value_norm = 0;
    for (int64_t d = 0; d < dim; ++d) {
      dot += q[d] * key[d];
      key_norm += key[d] * key[d];
    }
    values[t].assign(v.values.begin() + kv_head * dim, v.values.begin() + (kv_head + 1) * dim);
    for (double x : values[t]) {
      value_norm += x * x;
      r.value_max = std::max(r.value_max, std::fabs(x));
    }
    r.key_norm = std::max(r.key_norm, std::sqrt(key_norm));
    r.value_norm = std::max(r.value_norm, std::sqrt(value_norm));
    logits[t] = dot * scale;
    max_logit = std::max(max_logit, logits[t]);
  }
  std::vector<double> o(static_cast<size_t>(dim), 0.0);
  double sum = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const double w = std::exp(logits[t] - max_logit);
    sum += w;
    for (int64_t d = 0; d < dim; ++d) o[d] += w * values[t][d];
  }
  for (double& x : o) x /= sum;
  r.output = o;
  const kernels::Rotation& vr = host.value_rotation;
  if (vr.kind == kernels::RotationKind::kMatrix) {
    for (int64_t j = 0; j < dim; ++j) {
      double x = 0;
      for (int64_t i = 0; i < dim; ++i) x += o[i] * vr.matrix[(kv_head * dim + j) * dim + i];
      r.output[j] = x;
    }
  }
  return r;
}

double gamma(double n) { return n * kUnit / (1 - n * kUnit); }

// The float32 error of either kernel against float64 attention over the
// same read-back (worst case, Higham's gamma_n = n u / (1 - n u)):
//   logits: the query rotation (D fmas), the dot product (D fmas), RoPE (a
//     few roundings and sin/cos within 2 ulp) and the scale: |delta s| <=
//     gamma(2D + 16) * scale * ||q'|| max ||k'||;
//   a logit error delta moves a softmax weight by a factor within
//     e^(+-2 delta), so the output by <= 4 delta max ||v'|| (delta < 0.1);
//   the weights' exp (2 ulp), the running rescales (2 roundings per token
//     or tile of a split of S tokens), the accumulations (an fma per
//     token), the merge (3 per split) and the sum's division: gamma(4S +
//     3 splits + 8) max ||v'||; the values' rotation back: gamma(D) max ||v'||.
double float32_bound(const Float64Attention& f, double scale, int64_t dim, int64_t tokens, int64_t split) {
  const int64_t s = split > 0 ? std::min(split, tokens) : tokens;
  const int64_t splits = (tokens + s - 1) / s;
  const double logit = gamma(2.0 * dim + 16) * scale * f.query_norm * f.key_norm;
  return 4 * logit * f.value_norm + gamma(4.0 * s + 3.0 * splits + 8 + dim) * f.value_norm;
}

// The tensor-core kernel (docs/runtime-layout.md 6.4) on top of the float32
// bound (its softmax, splits and merge are float32 as above): codes enter
// the mmas exactly, and the other operand, q'_d (times a per-channel scale)
// or p_t times a token scale, as bf16 hi + lo, within 2^-16 relative; the
// tensor cores' float32 sums may truncate (2^-23 per addition, D + 16 of
// them per logit, 16 per tile and output). The factored sums run over
// |a| + |b| code <= 3 max |x^| of a group (the group's extremes are codes 0
// and 2^b - 1), so
//   logits: |delta s| <= scale (2^-16 + (D + 16) 2^-23) 3 sum_d |q'_d| max |k'|,
//     moving the output by <= 4 |delta s| max ||v'||;
//   values: |delta o_d| <= (2^-16 + 32 * 2^-23) 3 max |v'|.
double tensor_core_bound(const Float64Attention& f, double scale, int64_t dim, int64_t tokens, int64_t split) {
  const double logit = scale * (0x1p-16 + (dim + 16.0) * 0x1p-23) * 3 * f.query_l1 * f.key_max;
  const double value = (0x1p-16 + 32 * 0x1p-23) * 3 * f.value_max;
  return float32_bound(f, scale, dim, tokens, split) + 4 * logit * f.value_norm + value;
}

// ------------------------------------------------------------ the test

void store_io(ElementType io, double value, std::vector<uint8_t>& bytes, int64_t index) {
  kernels::store_element(io, value, bytes.data() + index * kernels::element_bytes(io));
}

class DecodeAttentionCuda : public ::testing::TestWithParam<Case> {};

TEST_P(DecodeAttentionCuda, EqualsTheCpuReferenceAndFloat64Attention) {
  if (kernels::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  at::manual_seed(4321);
  const RopeConfig rope_config;
  const RotaryEmbedding rope(rope_config, c.head_dim, at::kCPU);
  const QuantizerConfig config = fitted_config(c, rope);

  kernels::ModelDimensions dims;
  dims.num_layers = 1;
  dims.num_heads = c.heads;
  dims.num_kv_heads = kKvHeads;
  dims.head_dim = c.head_dim;
  const at::Tensor inv = rope_inverse_frequencies(rope_config, c.head_dim).contiguous();
  dims.rope_inverse_frequencies.assign(inv.data_ptr<float>(), inv.data_ptr<float>() + inv.numel());

  const auto count = static_cast<int64_t>(c.lengths.size());
  int64_t longest = 0, total = 0;
  for (int64_t n : c.lengths) {
    longest = std::max(longest, n);
    total += n;
  }
  kernels::CacheOptions options;
  options.page_size = c.page_size;
  options.max_sequences = count;
  options.max_context = longest;
  options.element = c.element;
  options.tokens_per_split = c.tokens_per_split;
  options.outlier_page_entries = 256;
  const int64_t width = kKvHeads * c.head_dim;
  // Room for a quarter of all elements as outliers: far above any rule here.
  options.max_outlier_pages_per_sequence = kernels::ceil_div(longest * width / 4, options.outlier_page_entries) + 1;
  options.max_outlier_pages = kernels::ceil_div(total * width / 4, options.outlier_page_entries) + count;
  options.max_pages = count * (kernels::ceil_div(longest, c.page_size) + 1);
  kernels::QuantizedKVCache cache(config, dims, options);

  // Prefill in chunks of up to 1000 tokens, the last 3 tokens decoded one by
  // one (the windows and rings move as when serving).
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < count; ++i) {
    const int32_t id = cache.add_sequence();
    ids.push_back(id);
    const int64_t n = c.lengths[i];
    const Activations a = synthetic(1, n, c.head_dim, c.element, rope);
    const at::Tensor keys = (config.settings.keys_pre_rope ? a.keys_pre : a.keys)[0].permute({1, 0, 2}).contiguous();
    const at::Tensor values = a.values[0].permute({1, 0, 2}).contiguous();
    int64_t position = 0;
    while (position < n) {
      const int64_t chunk = n - position > 3 ? std::min<int64_t>(1000, n - 3 - position) : 1;
      cache.append(0, {{id}, {position}, {chunk}, keys.data_ptr<float>() + position * width,
                       values.data_ptr<float>() + position * width});
      position += chunk;
    }
  }

  // The reference on host memory, the kernel on device copies of the same bytes.
  kernels::DecodeParams host = cache.decode_params(0);
  std::vector<int64_t> lengths(c.lengths.begin(), c.lengths.end());
  const int64_t io_count = count * c.heads * c.head_dim;
  const at::Tensor query_values = at::randn({io_count}, at::kDouble);
  std::vector<uint8_t> queries(static_cast<size_t>(io_count * kernels::element_bytes(c.io)));
  for (int64_t i = 0; i < io_count; ++i) store_io(c.io, query_values[i].item<double>(), queries, i);
  std::vector<uint8_t> reference(queries.size()), got(queries.size());
  host.batch.count = static_cast<int32_t>(count);
  host.batch.slots = ids.data();
  host.batch.lengths = lengths.data();
  host.io = c.io;
  host.queries = queries.data();
  host.output = reference.data();
  kernels::decode_attention_reference(host);

  const PoolSizes sizes{count, options.max_pages, options.max_outlier_pages};
  DeviceArrays device;
  const kernels::DecodeParams on_device = device_params(device, host, sizes);
  int multiprocessors = 0;
  KVFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0));
  const kernels::DecodePlan plan = kernels::plan_decode_attention(on_device, multiprocessors);
  std::printf("[ %s ] %s kernel, splits of %lld tokens\n", c.name.c_str(), plan.tensor_cores ? "tensor-core" : "general",
              static_cast<long long>(plan.tokens_per_split));
  kernels::launch_decode_attention(on_device, nullptr);
  KVFORGE_CUDA_CHECK(cudaDeviceSynchronize());
  KVFORGE_CUDA_CHECK(cudaMemcpy(got.data(), on_device.output, got.size(), cudaMemcpyDeviceToHost));

  const int64_t dim = c.head_dim, group = c.heads / kKvHeads;
  const int64_t io_size = kernels::element_bytes(c.io);
  // An io type coarser than float32 rounds each output once: half an ulp of
  // its 11 (fp16) or 8 (bf16) significant bits, relative to max ||v'||.
  const double io_unit = c.io == ElementType::kFloat16 ? 0x1p-11 : c.io == ElementType::kBFloat16 ? 0x1p-8 : 0.0;
  double worst_vs_reference = 0, worst_vs_float64 = 0;
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t head = 0; head < c.heads; ++head) {
      std::vector<float> q(static_cast<size_t>(dim));
      for (int64_t d = 0; d < dim; ++d) {
        q[d] = kernels::load_element(c.io, queries.data() + ((i * c.heads + head) * dim + d) * io_size);
      }
      const Float64Attention f = float64_attention(cache, host, ids[i], lengths[i], q.data(), head / group);
      const int64_t split = plan.tensor_cores ? plan.tokens_per_split : c.tokens_per_split;
      const double bound = (plan.tensor_cores ? tensor_core_bound : float32_bound)(f, host.softmax_scale, dim,
                                                                                    lengths[i], split) +
                           io_unit * f.value_norm;
      double vs_reference = 0, vs_float64 = 0;
      for (int64_t d = 0; d < dim; ++d) {
        const int64_t at = ((i * c.heads + head) * dim + d) * io_size;
        const double g = kernels::load_element(c.io, got.data() + at);
        const double r = kernels::load_element(c.io, reference.data() + at);
        vs_reference = std::max(vs_reference, std::fabs(g - r));
        vs_float64 = std::max(vs_float64, std::fabs(g - f.output[d]));
      }
      const std::string where = c.name + " sequence " + std::to_string(i) + " (T=" + std::to_string(lengths[i]) +
                                ") head " + std::to_string(head);
      // Both round to the io type: a float32 difference at a rounding
      // boundary is one io ulp (2 io_unit) apart.
      EXPECT_LE(vs_reference, (1e-3 + 2 * io_unit) * f.value_norm) << where << " against the CPU reference";
      EXPECT_LE(vs_reference, 2 * bound) << where << " against the CPU reference";
      EXPECT_LE(vs_float64, bound) << where << " against float64 attention";
      worst_vs_reference = std::max(worst_vs_reference, vs_reference / f.value_norm);
      worst_vs_float64 = std::max(worst_vs_float64, vs_float64 / bound);
    }
  }
  std::printf("[ %s ] worst |cuda - reference| %.2e of max||v||, worst |cuda - float64| %.3f of its bound\n",
              c.name.c_str(), worst_vs_reference, worst_vs_float64);
}

Case make_case(std::string name, QuantMethod method, int bits, int64_t head_dim, int64_t heads) {
  Case c;
  c.name = std::move(name);
  c.fit.method = method;
  c.fit.bits = bits;
  c.fit.fisher = false;
  c.fit.max_calibration_tokens = 0;
  c.head_dim = head_dim;
  c.heads = heads;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> all;
  {  // KVQuant: offline pre-RoPE keys with thresholds, all-heads values with top/bottom outliers, sink 1.
    Case c = make_case("kvquant_2bit_d128_gqa4", QuantMethod::kKvquant, 2, 128, 8);
    c.fit.outlier_fraction = 0.04;
    all.push_back(c);
  }
  {  // Rotated KVQuant: pair angles on the pre-RoPE keys, a matrix on the values; 4 bits, page 12, one split.
    Case c = make_case("kvquant_rotated_4bit_d64_gqa1_page12_fp16io", QuantMethod::kKvquant, 4, 64, 2);
    c.fit.outlier_fraction = 0.04;
    c.page_size = 12;
    c.key_rotation = RotationForm::kPairAngles;
    c.value_rotation = RotationForm::kMatrix;
    c.tokens_per_split = 0;
    c.io = ElementType::kFloat16;
    all.push_back(c);
  }
  {  // KVQuant's tau variant: per-head values with token_tau outliers; bf16 elements and io; GQA 8.
    Case c = make_case("kvquant_tau_2bit_d64_gqa8_bf16", QuantMethod::kKvquant, 2, 64, 16);
    c.fit.value_outlier_rule = OutlierRule::kTokenTau;
    c.fit.outlier_fraction = 0.03;
    c.element = ElementType::kBFloat16;
    c.io = ElementType::kBFloat16;
    c.tokens_per_split = 64;
    all.push_back(c);
  }
  {  // KIVI: per-channel key groups of 32 with block flush, per-token values sliding.
    Case c = make_case("kivi_2bit_d128_gqa4", QuantMethod::kKivi, 2, 128, 8);
    c.fit.residual_tokens = 32;
    all.push_back(c);
  }
  {  // KIVI at 4 bits with a sink, a page (12) dividing no group of 32, sliding keys, splits of 32.
    Case c = make_case("kivi_sliding_sink_4bit_d64_gqa1_page12", QuantMethod::kKivi, 4, 64, 2);
    c.fit.residual_tokens = 32;
    c.fit.sink_tokens = 2;
    c.fit.key_residual_rule = ResidualRule::kSliding;
    c.page_size = 12;
    c.tokens_per_split = 32;
    all.push_back(c);
  }
  {  // KIVI with a page of 64 holding two key groups, fp32 elements, GQA 8.
    Case c = make_case("kivi_4bit_d128_gqa8_page64_fp32", QuantMethod::kKivi, 4, 128, 16);
    c.fit.residual_tokens = 64;
    c.fit.key_group = 32;
    c.page_size = 64;
    c.element = ElementType::kFloat32;
    all.push_back(c);
  }
  {  // int2-rot with a matrix (and a centre) on the keys and the values; GQA 8.
    Case c = make_case("int2rot_rotated_2bit_d128_gqa8", QuantMethod::kInt2Rot, 2, 128, 16);
    c.fit.sink_tokens = 4;
    c.fit.residual_tokens = 16;
    c.key_rotation = RotationForm::kMatrix;
    c.value_rotation = RotationForm::kMatrix;
    c.key_centre = true;
    all.push_back(c);
  }
  {  // int2-rot unrotated at 4 bits, page 12, GQA 4.
    Case c = make_case("int2rot_4bit_d64_gqa4_page12", QuantMethod::kInt2Rot, 4, 64, 8);
    c.fit.sink_tokens = 4;
    c.fit.residual_tokens = 16;
    c.page_size = 12;
    all.push_back(c);
  }
  {  // RTN, no windows; groups of 32 channels with top/bottom outliers per head.
    all.push_back(make_case("rtn_2bit_d128_gqa1", QuantMethod::kRtn, 2, 128, 2));
    Case c = make_case("rtn_groups32_outliers_4bit_d128_gqa8", QuantMethod::kRtn, 4, 128, 16);
    c.fit.key_group = 32;
    c.fit.value_group = 32;
    c.fit.outlier_fraction = 0.05;
    c.tokens_per_split = 128;
    all.push_back(c);
  }
  {  // One 32K context (and a short sequence beside it): KVQuant, splits of 512.
    Case c = make_case("kvquant_32k_2bit_d128_gqa4", QuantMethod::kKvquant, 2, 128, 8);
    c.fit.outlier_fraction = 0.02;
    c.tokens_per_split = 512;
    c.lengths = {32771, 9};
    all.push_back(c);
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(Layouts, DecodeAttentionCuda, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(DecodeAttentionCudaRefusals, BadParamsAreOneLine) {
  kernels::DecodeParams p;
  p.key_cache.layout.spec.head_dim = p.value_cache.layout.spec.head_dim = 96;
  try {
    kernels::launch_decode_attention(p, nullptr);
    ADD_FAILURE() << "head_dim 96 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("head_dim 96"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvforge
