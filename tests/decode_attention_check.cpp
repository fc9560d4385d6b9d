#include "tests/decode_attention_check.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "kernels/cuda_graph.h"
#include "kernels/cuda_runtime_check.h"
#include "kernels/cuda_stream.h"
#include "kernels/decode_attention_launch.h"
#include "kernels/element_conversion.h"
#include "tests/kernel_activations.h"

namespace kvforge::testing {

using kernels::ElementType;
using kernels::TensorKind;

// ------------------------------------------------------------ device copies

DeviceArrays::~DeviceArrays() {
  for (void* memory : buffers_) cudaFree(memory);
}

void* DeviceArrays::allocate(int64_t bytes) {
  void* memory = nullptr;
  KVFORGE_CUDA_CHECK(cudaMalloc(&memory, static_cast<size_t>(bytes)));
  buffers_.push_back(memory);
  return memory;
}

void* DeviceArrays::copy_bytes(const void* host, int64_t bytes) {
  if (host == nullptr || bytes == 0) return nullptr;
  void* memory = allocate(bytes);
  KVFORGE_CUDA_CHECK(cudaMemcpy(memory, host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice));
  return memory;
}

namespace {

// A decode step as a server replays it: planner.launch captured from a
// non-blocking stream into a CUDA graph (kernels::CapturedGraph), launched
// once on that stream into an output cleared first; returns the output's
// bytes.
std::vector<uint8_t> replay_in_graph(kernels::DecodePlanner& planner, const kernels::DecodeParams& on_device,
                                     size_t output_bytes) {
  const kernels::CudaStream stream;
  KVFORGE_CUDA_CHECK(cudaMemsetAsync(on_device.output, 0, output_bytes, stream.get()));
  const kernels::CapturedGraph graph = kernels::CapturedGraph::capture(
      stream.get(), [&](cudaStream_t capturing) { planner.launch(on_device, capturing); });
  graph.launch(stream.get());
  std::vector<uint8_t> replayed(output_bytes);
  KVFORGE_CUDA_CHECK(
      cudaMemcpyAsync(replayed.data(), on_device.output, output_bytes, cudaMemcpyDeviceToHost, stream.get()));
  KVFORGE_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  return replayed;
}

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

}  // namespace

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

// ------------------------------------------------------------ cases

void PrintTo(const DecodeCase& c, std::ostream* os) { *os << c.name; }

DecodeCase decode_case(KernelCase layout) {
  DecodeCase c;
  if (layout.tokens_per_split == KernelCase{}.tokens_per_split) layout.tokens_per_split = 256;
  static_cast<KernelCase&>(c) = std::move(layout);
  return c;
}

DecodeCase make_decode_case(std::string name, QuantMethod method, int bits, int64_t head_dim, int64_t heads) {
  return decode_case(make_kernel_case(std::move(name), method, bits, head_dim, heads));
}

namespace {

KernelActivations synthetic(int64_t windows, int64_t tokens, int64_t dim, ElementType element,
                            const RotaryEmbedding& rope) {
  return synthetic_activations(windows, kDecodeKvHeads, tokens, dim, 1.0, element, rope);
}

}  // namespace

QuantizerConfig fitted_decode_config(const DecodeCase& c, const RotaryEmbedding& rope) {
  return fitted_kernel_config(c.name, c.fit, 1, kDecodeKvHeads, c.head_dim, c.element, c.key_rotation, c.value_rotation,
                              c.key_centre, rope);
}

kernels::ModelDimensions decode_dimensions(const DecodeCase& c) {
  return kernel_model_dimensions(1, c.heads, kDecodeKvHeads, c.head_dim, RopeConfig{});
}

// ------------------------------------------------------------ float64 attention

SequenceReadback read_back_sequence(const kernels::QuantizedKVCache& cache, const kernels::DecodeParams& host,
                                    int32_t sequence, int64_t tokens) {
  const int64_t dim = host.key_cache.layout.spec.head_dim, half = dim / 2;
  const int64_t kv_heads = host.key_cache.layout.spec.kv_heads, width = kv_heads * dim;
  SequenceReadback r;
  r.tokens = tokens;
  r.kv_heads = kv_heads;
  r.dim = dim;
  r.keys.resize(static_cast<size_t>(tokens * width));
  r.values.resize(static_cast<size_t>(tokens * width));
  // read_token only reads the host cache: tokens are independent.
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const kernels::TokenReadout k = cache.read_token(0, TensorKind::kKeys, sequence, t);
      const kernels::TokenReadout v = cache.read_token(0, TensorKind::kValues, sequence, t);
      double* key = r.keys.data() + t * width;
      std::copy(k.values.begin(), k.values.end(), key);
      std::copy(v.values.begin(), v.values.end(), r.values.data() + t * width);
      if (!host.keys_pre_rope) continue;
      for (int64_t head = 0; head < kv_heads; ++head) {
        double* x = key + head * dim;
        for (int64_t j = 0; j < half; ++j) {
          const double angle = static_cast<double>(static_cast<float>(t) * host.rope_inverse_frequencies[j]);
          const double a = x[j], b = x[j + half];
          x[j] = a * std::cos(angle) - b * std::sin(angle);
          x[j + half] = b * std::cos(angle) + a * std::sin(angle);
        }
      }
    }
  });
  r.key_norm.assign(static_cast<size_t>(kv_heads), 0.0);
  r.value_norm.assign(static_cast<size_t>(kv_heads), 0.0);
  r.key_max.assign(static_cast<size_t>(kv_heads), 0.0);
  r.value_max.assign(static_cast<size_t>(kv_heads), 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t head = 0; head < kv_heads; ++head) {
      double key_norm = 0, value_norm = 0;
      for (int64_t d = 0; d < dim; ++d) {
        const double k = r.keys[(t * kv_heads + head) * dim + d], v = r.values[(t * kv_heads + head) * dim + d];
        key_norm += k * k;
        value_norm += v * v;
        r.key_max[head] = std::max(r.key_max[head], std::fabs(k));
        r.value_max[head] = std::max(r.value_max[head], std::fabs(v));
      }
      r.key_norm[head] = std::max(r.key_norm[head], std::sqrt(key_norm));
      r.value_norm[head] = std::max(r.value_norm[head], std::sqrt(value_norm));
    }
  }
  return r;
}

Float64Attention float64_attention(const SequenceReadback& readback, const kernels::DecodeParams& host,
                                   const float* query, int64_t kv_head) {
  const int64_t dim = readback.dim, half = dim / 2, tokens = readback.tokens, width = readback.kv_heads * dim;
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
  r.key_norm = readback.key_norm[kv_head];
  r.value_norm = readback.value_norm[kv_head];
  r.key_max = readback.key_max[kv_head];
  r.value_max = readback.value_max[kv_head];
  std::vector<double> logits(static_cast<size_t>(tokens));
  const double scale = host.softmax_scale;
  double max_logit = -INFINITY;
  for (int64_t t = 0; t < tokens; ++t) {
    const double* key = readback.keys.data() + t * width + kv_head * dim;
    double dot = 0;
    for (int64_t d = 0; d < dim; ++d) dot += q[d] * key[d];
    logits[t] = dot * scale;
    max_logit = std::max(max_logit, logits[t]);
  }
  std::vector<double> o(static_cast<size_t>(dim), 0.0);
  double sum = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const double w = std::exp(logits[t] - max_logit);
    const double* value = readback.values.data() + t * width + kv_head * dim;
    sum += w;
    for (int64_t d = 0; d < dim; ++d) o[d] += w * value[d];
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

namespace {

constexpr double kUnit = 0x1p-24;  // float32 unit roundoff

double gamma(double n) { return n * kUnit / (1 - n * kUnit); }

// Half an ulp of the io type's significand (11 bits fp16, 8 bits bf16); 0 for float32.
double io_unit(ElementType io) {
  return io == ElementType::kFloat16 ? 0x1p-11 : io == ElementType::kBFloat16 ? 0x1p-8 : 0.0;
}

}  // namespace

// The float32 error of a decode kernel against float64 attention over the
// same read-back (worst case, Higham's gamma_n = n u / (1 - n u), u = 2^-24):
//   logits: the query rotation (D fmas), the dot product (D fmas), RoPE (a
//     few roundings and sin/cos within 2 ulp) and the scale: |delta s| <=
//     gamma(2D + 16) * scale * ||q'|| max ||k'||;
//   a logit error delta moves a softmax weight by a factor within
//     e^(+-2 delta), so the output by <= 4 delta max ||v'|| (delta < 0.1);
//   the weights' exp (2 ulp), the running rescales (2 roundings per token
//     or tile of a split of S tokens), the accumulations (an fma per
//     token), the merge (3 per split) and the sum's division: gamma(4S +
//     3 splits + 8) max ||v'||; the values' rotation back: gamma(D) max ||v'||;
//   an io type coarser than float32 rounds each output once more: half an
//     ulp of its significand relative to max ||v'||.
//
// The tensor-core kernel (docs/runtime-layout.md 6.4; plan.tensor_cores, its
// splits plan.tokens_per_split) adds: codes enter the mmas exactly, the other
// operand (q'_d, times a per-channel scale, or a weight p_t times a token
// scale) as bf16 hi + lo within 2^-16 relative; the tensor cores' float32
// sums may truncate (2^-23 per addition: D + 16 per logit, 32 per output
// and tile). The factored sums run over |a| + |b| code <= 3 max |x^| of a
// group (its extremes are codes 0 and 2^b - 1), so
//   logits: |delta s| <= scale (2^-16 + (D + 16) 2^-23) 3 sum_d |q'_d| max |k'|,
//     moving the output by <= 4 |delta s| max ||v'||;
//   values: |delta o_d| <= (2^-16 + 32 * 2^-23) 3 max |v'|.
// The exact kernel's bf16 rows (its tensor-core passes, beside either
// tensor-core kernel) enter exactly against hi + lo queries and weights:
// within the terms above (|k| <= max |k'|, p <= 1), which the 8-bit
// kernel's below exceed.
// The 8-bit integer kernel (plan.int8; kernels/decode_int8_kernel.cuh)
// instead: each q'_d (times its channel scale) within max |q'| / (127 * 256)
// (two int8 parts; max |q'| <= ||q'||) of its value, against codes times a
// scale, |b code| <= 3 max |k'|, over D channels; each weight W_t = p_t b_t
// within the step's largest W (of the head, over its value groups) / 65535
// times 1 / 2 (its two uint8 parts, one 16-bit fixed-point number) plus
// 65535 * 2^-21 (the parts come from an approximate inverse of the unit,
// within 2 ulp), so a step's n tokens (32, or 64 in its wide steps:
// plan.int8_steps) move
// an output by <= top * n (1 / 2 + 65535 * 2^-21) / 65535 of its largest W
// (codes up to top = 2^b - 1), and summed over the steps and normalized by
// sum p, of top * max_t b_t = max (hi - lo) <= 2 max |v'| (at 2 and 4 bits
// alike; the bound below keeps 2 bits' looser 3 * 3 max |v'|):
//   logits: |delta s| <= scale (3 D ||q'|| / (127 * 256) + (D + 16) 2^-23 3 sum_d |q'_d|) max |k'|;
//   values: |delta o_d| <= (3 * n (1 / 2 + 65535 * 2^-21) / 65535 + 32 * 2^-23) 3 max |v'|.
// The lookup kernel (plan.lookup; kernels/decode_lookup_kernel.cuh) is
// float32 throughout, its splits planned as the tensor-core kernels'; it
// adds a key outlier's change as its own correction of the dot (q' . RoPE
// of x - x^: a subtraction, a product by sin or cos and two fmas per head,
// each within 2^-23 of terms up to 2 max |k'| |q'_d|) and sums the values
// as sum_t p_t a_t + sum_t (p_t b_t) L[code] (each product within 2^-23
// relative, the two sums up to 3 max |v'| apart from their sum, rounded
// once more when added), so
//   logits: |delta s| <= scale 8 2^-23 3 sum_d |q'_d| max |k'|;
//   values: |delta o_d| <= 32 * 2^-23 3 max |v'|.
double attention_error_bound(const Float64Attention& f, double softmax_scale, int64_t dim, int64_t tokens,
                             int64_t tokens_per_split, ElementType io, const kernels::DecodePlan& plan) {
  // With tensor cores the longest sum of one block: a quantized split or
  // an exact chunk (plan.exact_chunk tokens, in passes whose rescales the
  // 4S below counts per token).
  const int64_t split = plan.tensor_cores || plan.lookup
                            ? std::max<int64_t>(plan.tokens_per_split, plan.exact_splits > 0 ? plan.exact_chunk : 0)
                            : tokens_per_split;
  const int64_t s = split > 0 ? std::min(split, tokens) : tokens;
  const int64_t splits = (tokens + s - 1) / s;
  const double logit = gamma(2.0 * dim + 16) * softmax_scale * f.query_norm * f.key_norm;
  double bound = 4 * logit * f.value_norm + gamma(4.0 * s + 3.0 * splits + 8 + dim) * f.value_norm +
                 io_unit(io) * f.value_norm;
  if (plan.int8) {
    const double operand_logit =
        softmax_scale * (3.0 * dim / (127.0 * 256.0) * f.query_norm + (dim + 16.0) * 0x1p-23 * 3 * f.query_l1) * f.key_max;
    const double weight_part = 0.5 + 65535.0 * 0x1p-21;
    const double step_tokens = plan.int8_steps == kernels::Int8Steps::kSteps32 ? 32 : 64;
    bound += 4 * operand_logit * f.value_norm +
             (3.0 * step_tokens * weight_part / 65535.0 + 32 * 0x1p-23) * 3 * f.value_max;
  } else if (plan.tensor_cores) {
    const double operand_logit = softmax_scale * (0x1p-16 + (dim + 16.0) * 0x1p-23) * 3 * f.query_l1 * f.key_max;
    bound += 4 * operand_logit * f.value_norm + (0x1p-16 + 32 * 0x1p-23) * 3 * f.value_max;
  } else if (plan.lookup) {
    const double correction_logit = softmax_scale * 8 * 0x1p-23 * 3 * f.query_l1 * f.key_max;
    bound += 4 * correction_logit * f.value_norm + 32 * 0x1p-23 * 3 * f.value_max;
  }
  return bound;
}

// ------------------------------------------------------------ comparison

void expect_head_within_bounds(const HeadComparison& h, ElementType io, const std::string& where,
                               bool float64_within_1e3) {
  const double unit = io_unit(io);
  // Both round to the io type: a float32 difference at a rounding boundary
  // is one io ulp (2 io_unit) apart.
  EXPECT_LE(h.vs_reference, (1e-3 + 2 * unit) * h.value_norm) << where << " against the CPU reference";
  EXPECT_LE(h.vs_reference, 2 * h.bound) << where << " against the CPU reference";
  EXPECT_LE(h.vs_float64, h.bound) << where << " against float64 attention";
  if (float64_within_1e3) {
    EXPECT_LE(h.vs_float64, (1e-3 + unit) * h.value_norm) << where << " against float64 attention (the issue's 1e-3)";
  }
}

namespace {

void store_io(ElementType io, double value, std::vector<uint8_t>& bytes, int64_t index) {
  kernels::store_element(io, value, bytes.data() + index * kernels::element_bytes(io));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

DecodeCaseSummary check_decode_case(const DecodeCase& c, const DecodeCheckOptions& check) {
  const auto cpu_start = std::chrono::steady_clock::now();
  at::manual_seed(4321);
  const RotaryEmbedding rope(RopeConfig{}, c.head_dim, at::kCPU);
  const QuantizerConfig config = fitted_decode_config(c, rope);

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
  const int64_t width = kDecodeKvHeads * c.head_dim;
  // Room for a quarter of all elements as outliers: far above any rule here.
  options.max_outlier_pages_per_sequence = kernels::ceil_div(longest * width / 4, options.outlier_page_entries) + 1;
  options.max_outlier_pages = kernels::ceil_div(total * width / 4, options.outlier_page_entries) + count;
  options.max_pages = count * (kernels::ceil_div(longest, c.page_size) + 1);
  kernels::QuantizedKVCache cache(config, decode_dimensions(c), options);

  // Prefill in chunks of up to 1000 tokens, the last 3 tokens decoded one by
  // one (the windows and rings move as when serving).
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < count; ++i) {
    const int32_t id = cache.add_sequence();
    ids.push_back(id);
    const int64_t n = c.lengths[i];
    const KernelActivations a = synthetic(1, n, c.head_dim, c.element, rope);
    const at::Tensor keys = (config.settings.keys_pre_rope ? a.keys_pre : a.keys)[0].permute({1, 0, 2}).contiguous();
    const at::Tensor values = a.values[0].permute({1, 0, 2}).contiguous();
    if (c.repeat_from >= 0 && c.repeat_from < n) {
      for (const at::Tensor& x : {keys, values}) {
        at::Tensor repeated = x.slice(0, c.repeat_from);
        repeated.copy_(x[c.repeat_from].expand_as(repeated));
      }
    }
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
  const at::Tensor query_values = at::randn({io_count}, at::kDouble).contiguous();
  const double* query_data = query_values.data_ptr<double>();
  std::vector<uint8_t> queries(static_cast<size_t>(io_count * kernels::element_bytes(c.io)));
  for (int64_t i = 0; i < io_count; ++i) store_io(c.io, query_data[i], queries, i);
  std::vector<uint8_t> reference(queries.size()), got(queries.size());
  host.batch.count = static_cast<int32_t>(count);
  host.batch.slots = ids.data();
  host.batch.lengths = lengths.data();
  host.io = c.io;
  host.queries = queries.data();
  host.output = reference.data();
  host.kernel = c.kernel;
  host.int8_steps = c.int8_steps;
  host.exact_chunk_tokens = c.exact_chunk_tokens;
  host.rotate_before_exact_blocks = !c.exact_blocks_first;
  kernels::decode_attention_reference(host);
  double cpu_seconds = seconds_since(cpu_start);

  const auto gpu_start = std::chrono::steady_clock::now();
  const PoolSizes sizes{count, options.max_pages, options.max_outlier_pages};
  kernels::DecodePlan plan;
  {
    DeviceArrays device;
    kernels::DecodeParams on_device = device_params(device, host, sizes);
    if (c.misaligned_queries) {
      const int64_t element = kernels::element_bytes(c.io);
      std::vector<uint8_t> shifted(element);
      shifted.insert(shifted.end(), queries.begin(), queries.end());
      on_device.queries = device.copy(shifted.data(), static_cast<int64_t>(shifted.size())) + element;
    }
    int multiprocessors = 0;
    KVFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0));
    plan = kernels::plan_decode_attention(on_device, multiprocessors);
    if (c.kernel == kernels::DecodeKernel::kInt8TensorCores) {
      EXPECT_TRUE(plan.int8) << c.name << ": the 8-bit integer kernel does not read this layout";
    }
    if (c.kernel == kernels::DecodeKernel::kAuto) {  // the default: the int8 kernel wherever it reads the layout
      EXPECT_EQ(plan.int8, kernels::int8_decode_supported(on_device)) << c.name;
    }
    if (c.kernel == kernels::DecodeKernel::kBf16TensorCores) EXPECT_FALSE(plan.int8 || plan.lookup) << c.name;
    // The lookup kernel where no tensor-core kernel reads the layout and it
    // does (the default), or where it reads it and is asked for.
    if (c.kernel == kernels::DecodeKernel::kAuto) {
      EXPECT_EQ(plan.lookup, !plan.tensor_cores && kernels::lookup_decode_supported(on_device)) << c.name;
    }
    if (c.kernel == kernels::DecodeKernel::kLookup) {
      EXPECT_TRUE(plan.lookup) << c.name << ": the lookup kernel does not read this layout";
      EXPECT_FALSE(plan.tensor_cores) << c.name;
    }
    if (c.int8_steps != kernels::Int8Steps::kAuto) {
      EXPECT_TRUE(plan.int8) << c.name;
      EXPECT_EQ(plan.int8_steps, c.int8_steps) << c.name;
    }
    if (plan.int8 && c.int8_steps == kernels::Int8Steps::kAuto) {  // the default's steps: 64 tokens where they read it
      EXPECT_EQ(plan.int8_steps, kernels::int8_wide_steps_supported(on_device) ? kernels::Int8Steps::kSteps64Stages4
                                                                              : kernels::Int8Steps::kSteps32)
          << c.name;
    }
    if (c.kernel == kernels::DecodeKernel::kGeneral) EXPECT_FALSE(plan.tensor_cores || plan.lookup) << c.name;
    if (plan.exact_slots_reserved && on_device.key_rotation.kind == kernels::RotationKind::kMatrix) {
      EXPECT_EQ(plan.exact_first, c.exact_blocks_first) << c.name << ": the exact blocks' order";
      EXPECT_EQ(plan.rotate_queries_first, !c.exact_blocks_first) << c.name;
    }
    if (c.exact_blocks_first) EXPECT_TRUE(plan.exact_first) << c.name << ": the exact blocks do not launch first";
    // The planner's chunk where there are exact ranges: the exact kernel's
    // two passes, the general kernel's one.
    if ((plan.tensor_cores || plan.lookup) && plan.exact_splits > 0) {
      EXPECT_EQ(plan.exact_chunk, c.exact_chunk_tokens > 0 ? c.exact_chunk_tokens : plan.exact_kernel ? 128 : 64)
          << c.name;
    }
    // A DecodePlanner (the CudaBackend's path: the device's facts asked once)
    // plans the same launch; the one-call launcher runs first, the planner's
    // second launch (from its cache) writes the output checked below.
    kernels::DecodePlanner planner;
    for (int call = 0; call < 2; ++call) {
      const kernels::DecodePlan planned = planner.plan(on_device);
      EXPECT_EQ(planned.tensor_cores, plan.tensor_cores) << c.name;
      EXPECT_EQ(planned.lookup, plan.lookup) << c.name;
      EXPECT_EQ(planned.int8, plan.int8) << c.name;
      EXPECT_EQ(planned.splits, plan.splits) << c.name;
      EXPECT_EQ(planned.tokens_per_split, plan.tokens_per_split) << c.name;
      EXPECT_EQ(planned.states, plan.states) << c.name;
      EXPECT_EQ(planned.wide_merge, plan.wide_merge) << c.name;
      EXPECT_EQ(planned.merge_heads, plan.merge_heads) << c.name;
      EXPECT_EQ(planned.cluster_merge, plan.cluster_merge) << c.name;
      EXPECT_EQ(planned.exact_kernel, plan.exact_kernel) << c.name;
      EXPECT_EQ(planned.rotate_queries_first, plan.rotate_queries_first) << c.name;
      EXPECT_EQ(planned.rotation_step_in_one_wave, plan.rotation_step_in_one_wave) << c.name;
      EXPECT_EQ(planned.exact_first, plan.exact_first) << c.name;
      EXPECT_EQ(planned.exact_slots_reserved, plan.exact_slots_reserved) << c.name;
      EXPECT_EQ(planned.int8_steps, plan.int8_steps) << c.name;
      EXPECT_EQ(planned.exact_chunk, plan.exact_chunk) << c.name;
    }
    kernels::launch_decode_attention(on_device, nullptr);
    planner.launch(on_device, nullptr);
    KVFORGE_CUDA_CHECK(cudaDeviceSynchronize());
    KVFORGE_CUDA_CHECK(cudaMemcpy(got.data(), on_device.output, got.size(), cudaMemcpyDeviceToHost));
    // Captured in a CUDA graph and replayed, the same kernels write the
    // same bytes (every kernel's order of sums is fixed).
    EXPECT_TRUE(replay_in_graph(planner, on_device, got.size()) == got)
        << c.name << ": the decode replayed from a CUDA graph differs from its direct launch";
    // A batch small enough for the launch's own arrays (InlineDecodeArrays,
    // QuantizedKVCache's path), the device's slots and lengths null: the
    // same bytes.
    if (count <= kernels::kInlineBatchEntries) {
      kernels::DecodeParams in_launch = on_device;
      in_launch.inline_arrays.count = static_cast<int32_t>(count);
      std::copy(ids.begin(), ids.end(), in_launch.inline_arrays.slots);
      std::copy(lengths.begin(), lengths.end(), in_launch.inline_arrays.lengths);
      in_launch.batch.slots = nullptr;
      in_launch.batch.lengths = nullptr;
      std::vector<uint8_t> carried(got.size());
      KVFORGE_CUDA_CHECK(cudaMemset(in_launch.output, 0, carried.size()));
      planner.launch(in_launch, nullptr);
      KVFORGE_CUDA_CHECK(cudaDeviceSynchronize());
      KVFORGE_CUDA_CHECK(cudaMemcpy(carried.data(), in_launch.output, carried.size(), cudaMemcpyDeviceToHost));
      EXPECT_TRUE(carried == got) << c.name << ": the decode with its arrays in the launch differs from the uploaded";
    }
  }
  const double gpu_seconds = seconds_since(gpu_start);

  const auto float64_start = std::chrono::steady_clock::now();
  const int64_t dim = c.head_dim, group = c.heads / kDecodeKvHeads;
  const int64_t io_size = kernels::element_bytes(c.io);
  DecodeCaseSummary summary;
  for (int64_t i = 0; i < count; ++i) {
    const SequenceReadback readback = read_back_sequence(cache, host, ids[i], lengths[i]);
    // The heads in parallel, the expectations in order afterwards.
    std::vector<HeadComparison> heads(static_cast<size_t>(c.heads));
    at::parallel_for(0, c.heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t head = begin; head < end; ++head) {
        std::vector<float> q(static_cast<size_t>(dim));
        for (int64_t d = 0; d < dim; ++d) {
          q[d] = kernels::load_element(c.io, queries.data() + ((i * c.heads + head) * dim + d) * io_size);
        }
        const Float64Attention f = float64_attention(readback, host, q.data(), head / group);
        HeadComparison& h = heads[static_cast<size_t>(head)];
        h.bound = attention_error_bound(f, host.softmax_scale, dim, lengths[i], c.tokens_per_split, c.io, plan);
        h.value_norm = f.value_norm;
        for (int64_t d = 0; d < dim; ++d) {
          const int64_t at = ((i * c.heads + head) * dim + d) * io_size;
          const double g = kernels::load_element(c.io, got.data() + at);
          const double r = kernels::load_element(c.io, reference.data() + at);
          h.vs_reference = std::max(h.vs_reference, std::fabs(g - r));
          h.vs_float64 = std::max(h.vs_float64, std::fabs(g - f.output[d]));
        }
      }
    });
    for (int64_t head = 0; head < c.heads; ++head) {
      const HeadComparison& h = heads[static_cast<size_t>(head)];
      const std::string where = c.name + " sequence " + std::to_string(i) + " (T=" + std::to_string(lengths[i]) +
                                ") head " + std::to_string(head);
      expect_head_within_bounds(h, c.io, where, check.float64_within_1e3);
      summary.worst_vs_reference = std::max(summary.worst_vs_reference, h.vs_reference / h.value_norm);
      summary.worst_vs_float64 = std::max(summary.worst_vs_float64, h.vs_float64 / h.value_norm);
      summary.worst_vs_float64_of_bound = std::max(summary.worst_vs_float64_of_bound, h.vs_float64 / h.bound);
      ++summary.heads_checked;
    }
  }
  cpu_seconds += seconds_since(float64_start);
  std::string exact_ranges = plan.exact_splits == 0 ? ""
                             : plan.exact_kernel    ? " and the exact kernel's ranges"
                                                    : " and the general kernel's exact ranges";
  if (plan.exact_splits > 0) exact_ranges += " in chunks of " + std::to_string(plan.exact_chunk);
  const std::string merge = plan.cluster_merge ? "merged in clusters of their blocks"
                            : std::string("merged by ") + (plan.wide_merge ? "four thread groups" : "one thread group") +
                                  ", " + std::to_string(plan.merge_heads) + " head" +
                                  (plan.merge_heads == 1 ? "" : "s") + " a block";
  std::printf("[ %s ] %s%s kernel%s, splits of %lld tokens, %lld states %s\n", c.name.c_str(),
              plan.rotate_queries_first ? "queries rotated first, " : "",
              plan.lookup                                             ? "lookup"
              : !plan.int8                                            ? (plan.tensor_cores ? "tensor-core" : "general")
              : plan.int8_steps == kernels::Int8Steps::kSteps32       ? "int8 tensor-core"
              : plan.int8_steps == kernels::Int8Steps::kSteps64Stages3 ? "int8 tensor-core (64-token steps, 3 stages)"
                                                                      : "int8 tensor-core (64-token steps, 4 stages)",
              exact_ranges.c_str(),
              static_cast<long long>(plan.tokens_per_split), static_cast<long long>(plan.states), merge.c_str());
  if (check.print_timing) {
    std::printf("[ %s ] %lld sequences, %lld tokens, %lld heads: worst |cuda - reference| %.2e of max||v||, "
                "worst |cuda - float64| %.2e of max||v|| and %.3f of its bound (cpu %.1f s, gpu %.2f s)\n",
                c.name.c_str(), static_cast<long long>(count), static_cast<long long>(total),
                static_cast<long long>(summary.heads_checked), summary.worst_vs_reference, summary.worst_vs_float64,
                summary.worst_vs_float64_of_bound, cpu_seconds, gpu_seconds);
  } else {
    std::printf("[ %s ] worst |cuda - reference| %.2e of max||v||, worst |cuda - float64| %.3f of its bound\n",
                c.name.c_str(), summary.worst_vs_reference, summary.worst_vs_float64_of_bound);
  }
  return summary;
}

}  // namespace kvforge::testing
