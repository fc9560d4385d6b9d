#pragma once
// The check of the CUDA decode_attention (kernels/decode_attention.cu) shared
// by test_decode_attention_cuda (hand-picked layouts) and
// test_decode_attention_cuda_matrix (the covering matrix): a case is
// a layout fitted by calib on synthetic activations and a batch of sequence
// lengths; the CPU reference's cache is filled, every pool and table of its
// DecodeParams is copied to the device, and launch_decode_attention's output
// is compared per sequence and query head
//   - with the CPU reference's decode_attention on the same bytes: within
//     1e-3 of the values' magnitude and within twice attention_error_bound
//     (both compute the same float32 formula, in different orders inside a
//     split);
//   - with float64 attention over the reference's read-back of every token
//     (read_token: the dequantized values, which test_runtime_kernels_cpu
//     checks against calib's float64 oracle), within attention_error_bound.
#include <cuda_runtime.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "calib/quantizer_fit.h"
#include "formats/quantizer_config.h"
#include "kernels/decode_params.h"
#include "kernels/decode_attention_launch.h"
#include "kernels/quantized_kv_cache.h"
#include "tests/kernel_cases.h"
#include "model/rope.h"

namespace kvforge::testing {

constexpr int64_t kDecodeKvHeads = 2;  // every case's KV heads

// ------------------------------------------------------------ device copies

// cudaMalloc'd copies of host arrays, freed together.
class DeviceArrays {
 public:
  DeviceArrays() = default;
  DeviceArrays(const DeviceArrays&) = delete;
  DeviceArrays& operator=(const DeviceArrays&) = delete;
  ~DeviceArrays();
  void* allocate(int64_t bytes);
  // Null for a null host pointer (an absent table stays absent).
  template <class T>
  T* copy(const T* host, int64_t count) {
    return static_cast<T*>(copy_bytes(host, count * static_cast<int64_t>(sizeof(T))));
  }

 private:
  void* copy_bytes(const void* host, int64_t bytes);
  std::vector<void*> buffers_;
};

// The pool sizes the test chose (CacheOptions), which DecodeParams does not carry.
struct PoolSizes {
  int64_t max_sequences = 0, max_pages = 0, max_outlier_pages = 0;
};

// The host DecodeParams (CPU backend memory) with every pointer replaced by
// a device copy; output is a fresh device buffer.
kernels::DecodeParams device_params(DeviceArrays& device, const kernels::DecodeParams& host, const PoolSizes& sizes);

// ------------------------------------------------------------ cases

// A layout case (tests/kernel_cases.h; kv_heads is kDecodeKvHeads, splits
// of 256 tokens unless the case says otherwise) with what decode adds.
struct DecodeCase : KernelCase {
  kernels::ElementType io = kernels::ElementType::kFloat32;
  std::vector<int64_t> lengths{1, 5, 37, 300, 1031, 4099};
  // kInt8TensorCores: the case must be one the 8-bit integer kernel reads
  // (a test failure otherwise), and its operand terms join the bound.
  kernels::DecodeKernel kernel = kernels::DecodeKernel::kAuto;
  // Not kAuto: the int8 kernel's steps the launch must take (the plan's,
  // checked), and their step length in the bound.
  kernels::Int8Steps int8_steps = kernels::Int8Steps::kAuto;
  // DecodeParams::exact_chunk_tokens (0: the planner's: 128 for the exact kernel, 64 for the general one); the plan's,
  // checked.
  int32_t exact_chunk_tokens = 0;
  // DecodeParams::rotate_before_exact_blocks off: where the exact blocks
  // are few and the keys have a matrix rotation, they launch first, each
  // block rotating its queries (DecodePlan::exact_first), instead of behind
  // the query rotation and the int8 kernel in their kept slots (the
  // default). Where the plan keeps their slots, its order is checked.
  bool exact_blocks_first = false;
  // From this token on (>= 0), every token of a sequence repeats that
  // token's keys and values: each step's tokens then share their outlier
  // channels (the kernels' colliding corrections); -1: every token drawn.
  int64_t repeat_from = -1;
  // The queries one element past a 16-byte boundary on the device (a
  // view's offset): the kernels' element-wise loads instead of their
  // 16-byte ones (load_rows).
  bool misaligned_queries = false;
};

void PrintTo(const DecodeCase& c, std::ostream* os);

// A case of the method at `bits` without Fisher weights, calibrated on every
// token (make_kernel_case's), with splits of 256 tokens.
DecodeCase make_decode_case(std::string name, QuantMethod method, int bits, int64_t head_dim, int64_t heads);

// A layout of tests/kernel_cases.h as a decode case: its own splits (one
// split, splits of 32) kept, the CPU tests' default of 16 tokens made 256.
DecodeCase decode_case(KernelCase layout);

// One layer's configuration fitted by calib on synthetic windows (rotated
// ones for a rotated case); draws from torch's generator.
QuantizerConfig fitted_decode_config(const DecodeCase& c, const RotaryEmbedding& rope);

// One layer, the case's heads, the default RoPE's inverse frequencies.
kernels::ModelDimensions decode_dimensions(const DecodeCase& c);

// ------------------------------------------------------------ float64 attention

// Every token of one sequence as the reference reads it back, in float64:
// keys in the stored basis with RoPE applied in float64 where they were
// stored before RoPE (angle t * inv_freq rounded to float32, as the model's
// RoPE), values in the stored basis; the largest norms per KV head.
struct SequenceReadback {
  int64_t tokens = 0, kv_heads = 0, dim = 0;
  std::vector<double> keys, values;  // [tokens][kv_heads][dim]
  std::vector<double> key_norm, value_norm;  // [kv_heads]: max_t ||k'_t||, max_t ||v'_t||
  std::vector<double> key_max, value_max;    // [kv_heads]: max_t,d |k'_td|, |v'_td| (stored basis)
};

// Reads the layer-0 tokens of `sequence` in parallel (at::parallel_for).
SequenceReadback read_back_sequence(const kernels::QuantizedKVCache& cache, const kernels::DecodeParams& host,
                                    int32_t sequence, int64_t tokens);

// What float64 attention over the read-back gives for one query head, in the
// model's basis: the query rotated by the keys' rotation in float64 (a centre
// shifts every logit equally), the output rotated back by the values' matrix
// in float64; also the norms attention_error_bound needs.
struct Float64Attention {
  std::vector<double> output;
  double query_norm = 0, key_norm = 0, value_norm = 0;  // ||q'||, max_t ||k'_t||, max_t ||v'_t||
  double query_l1 = 0;                // sum_d |q'_d|
  double key_max = 0, value_max = 0;  // max_t,d |k'_td|, |v'_td|
};

Float64Attention float64_attention(const SequenceReadback& readback, const kernels::DecodeParams& host,
                                   const float* query, int64_t kv_head);

// The largest |kernel output - float64 attention| of one query head that a
// float32 decode kernel with io type `io` may show (per output channel); the
// arithmetic is in the definition.
// `plan` is the launch's (kernels::plan_decode_attention): the tensor-core
// kernel's operands and splits add their own terms.
double attention_error_bound(const Float64Attention& f, double softmax_scale, int64_t dim, int64_t tokens,
                             int64_t tokens_per_split, kernels::ElementType io, const kernels::DecodePlan& plan);

// ------------------------------------------------------------ comparison

// One query head's differences (max over channels).
struct HeadComparison {
  double vs_reference = 0;  // |cuda - CPU reference|
  double vs_float64 = 0;    // |cuda - float64 attention|
  double bound = 0;         // attention_error_bound
  double value_norm = 0;    // max_t ||v'_t||
};

// Adds a gtest failure naming `where` for each bound the head exceeds:
// vs_reference within (1e-3 + 2 io ulps) max||v'|| and within 2 bound,
// vs_float64 within bound; with `float64_within_1e3` also vs_float64 within
// (1e-3 + half an io ulp) max||v'|| (the tolerance against float64).
void expect_head_within_bounds(const HeadComparison& h, kernels::ElementType io, const std::string& where,
                               bool float64_within_1e3);

struct DecodeCheckOptions {
  bool float64_within_1e3 = false;  // expect_head_within_bounds's
  bool print_timing = false;        // the CPU and GPU seconds on the summary line
};

// The worst ratios over a case's heads, as printed.
struct DecodeCaseSummary {
  double worst_vs_reference = 0;        // of max||v'||
  double worst_vs_float64 = 0;          // of max||v'||
  double worst_vs_float64_of_bound = 0;
  int64_t heads_checked = 0;
};

// Builds the case's cache on the CPU reference (prefill in chunks of up to
// 1000 tokens, the last 3 tokens decoded one by one), runs the reference and
// the CUDA kernel on the same bytes with float64 queries drawn by
// at::randn, compares every head (expect_head_within_bounds) and prints one
// line of the worst ratios. Seeds torch's generator with 4321 first.
DecodeCaseSummary check_decode_case(const DecodeCase& c, const DecodeCheckOptions& options = {});

}  // namespace kvforge::testing
