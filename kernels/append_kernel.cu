// The append launcher: host checks of the params, the dispatch on grouping
// and bits, the shared-memory size, and one launch for keys and values (the
// methods' grouping pairs; the kinds share no memory) or one per kind; the
// token-parallel kernel (append_token_kernel.cuh) where both kinds' tokens
// are quantized on their own.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/append_kernel.cuh"
#include "kernels/append_launch.h"
#include "kernels/append_token_kernel.cuh"
#include "kernels/cuda_runtime_check.h"

namespace kvforge::kernels {
namespace {

using append_device::TensorAppendArgs;

[[noreturn]] void refuse(const char* kind, const std::string& what) {
  throw std::invalid_argument(std::string("append (CUDA): ") + kind + " " + what);
}

void check(const TensorAppendArgs& args, const char* kind) {
  const TensorLayoutSpec& s = args.cache.layout.spec;
  if (s.bits != 2 && s.bits != 4) refuse(kind, "bits " + std::to_string(s.bits) + ": expected 2 or 4");
  if (s.kv_heads < 1 || s.head_dim < 1 || (static_cast<int64_t>(s.head_dim) * s.bits) % 32 != 0) {
    refuse(kind, "head_dim " + std::to_string(s.head_dim) + " x bits: expected a multiple of 32 bits per row");
  }
  if (args.quantization.bits != s.bits) refuse(kind, "quantization bits differ from the layout's");
  if (s.grouping == ScaleGrouping::kPerToken && (s.group < 1 || s.head_dim % s.group != 0)) {
    refuse(kind, "per_token group " + std::to_string(s.group) + ": expected a divisor of head_dim");
  }
  if (s.grouping == ScaleGrouping::kPerChannelTokens && s.group < 1) refuse(kind, "per_channel_tokens group < 1");
  if (s.grouping == ScaleGrouping::kPerChannelTokens && s.group > 1 && args.cache.layout.ring_capacity < s.group - 1) {
    refuse(kind, "ring of " + std::to_string(args.cache.layout.ring_capacity) + " tokens: expected group - 1 or more");
  }
  if ((args.quantization.outliers != OutlierSelection::kNone) != (args.cache.layout.outlier_spans > 0)) {
    refuse(kind, "outlier selection and layout disagree");
  }
  if (args.quantization.non_uniform && args.quantization.encode_midpoints == nullptr) {
    refuse(kind, "non-uniform quantization without encode midpoints");
  }
  if (s.grouping == ScaleGrouping::kPerChannelOffline &&
      (args.quantization.channel_scale == nullptr || args.quantization.channel_offset == nullptr)) {
    refuse(kind, "per_channel_offline without channel scale and offset");
  }
}

// The shared memory a block gets without asking for more.
constexpr int64_t kSharedWithoutOptIn = 48 * 1024;

// A kernel's dynamic shared memory beyond kSharedWithoutOptIn, within the
// device's opt-in limit.
template <class Kernel>
void allow_shared(Kernel kernel, int64_t shared) {
  if (shared <= kSharedWithoutOptIn) return;
  int device = 0, limit = 0;
  KVFORGE_CUDA_CHECK(cudaGetDevice(&device));
  KVFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (shared > limit) {
    throw std::invalid_argument("append (CUDA): " + std::to_string(shared) +
                                " bytes of shared memory per block (kv_heads * head_dim, group): the device has " +
                                std::to_string(limit));
  }
  KVFORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)));
}

int64_t shared_bytes(const TensorAppendArgs& args) { return args.shared.bytes; }

template <ScaleGrouping kGrouping, int kBits>
void launch(const TensorAppendArgs& args, const InlineBatchArrays& arrays, int32_t count, cudaStream_t stream) {
  const int64_t shared = shared_bytes(args);
  const auto kernel = append_device::append_kernel<kGrouping, kBits>;
  allow_shared(kernel, shared);
  const dim3 grid(static_cast<unsigned>(count),
                  static_cast<unsigned>(channel_slices(args.cache.layout, args.quantization)));
  kernel<<<grid, append_device::kThreads, static_cast<size_t>(shared), stream>>>(args, arrays);
  KVFORGE_CUDA_CHECK(cudaGetLastError());
}

template <ScaleGrouping kKeys, ScaleGrouping kValues, int kBits>
void launch_pair(const TensorAppendArgs& keys, const TensorAppendArgs& values, const InlineBatchArrays& arrays,
                 int32_t count, cudaStream_t stream) {
  const int64_t shared = std::max(shared_bytes(keys), shared_bytes(values));
  const auto kernel = append_device::append_pair_kernel<kKeys, kValues, kBits>;
  allow_shared(kernel, shared);
  const int32_t slices = channel_slices(keys.cache.layout, keys.quantization) +
                         channel_slices(values.cache.layout, values.quantization);
  kernel<<<dim3(static_cast<unsigned>(count), static_cast<unsigned>(slices)), append_device::kThreads,
           static_cast<size_t>(shared), stream>>>(keys, values, arrays);
  KVFORGE_CUDA_CHECK(cudaGetLastError());
}

// Keys and values in one launch for the groupings the methods' defaults use
// (kvquant: per_channel_offline keys, per_token_all_heads values; kivi:
// per_channel_tokens, per_token; rtn and int2-rot: per_token, per_token);
// false for any other pair (two launches).
template <int kBits>
bool launch_pair_bits(const TensorAppendArgs& keys, const TensorAppendArgs& values, const InlineBatchArrays& arrays,
                      int32_t count, cudaStream_t stream) {
  const ScaleGrouping k = keys.cache.layout.spec.grouping, v = values.cache.layout.spec.grouping;
  using G = ScaleGrouping;
  if (k == G::kPerChannelOffline && v == G::kPerTokenAllHeads) {
    launch_pair<G::kPerChannelOffline, G::kPerTokenAllHeads, kBits>(keys, values, arrays, count, stream);
  } else if (k == G::kPerChannelTokens && v == G::kPerToken) {
    launch_pair<G::kPerChannelTokens, G::kPerToken, kBits>(keys, values, arrays, count, stream);
  } else if (k == G::kPerToken && v == G::kPerToken) {
    launch_pair<G::kPerToken, G::kPerToken, kBits>(keys, values, arrays, count, stream);
  } else {
    return false;
  }
  return true;
}

template <int kBits>
void launch_bits(const TensorAppendArgs& args, const InlineBatchArrays& arrays, int32_t count, cudaStream_t stream) {
  switch (args.cache.layout.spec.grouping) {
    case ScaleGrouping::kPerToken: return launch<ScaleGrouping::kPerToken, kBits>(args, arrays, count, stream);
    case ScaleGrouping::kPerChannelTokens: return launch<ScaleGrouping::kPerChannelTokens, kBits>(args, arrays, count, stream);
    case ScaleGrouping::kPerChannelOffline:
      return launch<ScaleGrouping::kPerChannelOffline, kBits>(args, arrays, count, stream);
    case ScaleGrouping::kPerTokenAllHeads: return launch<ScaleGrouping::kPerTokenAllHeads, kBits>(args, arrays, count, stream);
  }
  refuse("", "unknown grouping");
}

void launch_tensor(const TensorAppendArgs& args, const InlineBatchArrays& arrays, int32_t count, cudaStream_t stream) {
  if (args.cache.layout.spec.bits == 2) {
    launch_bits<2>(args, arrays, count, stream);
  } else {
    launch_bits<4>(args, arrays, count, stream);
  }
}

TensorAppendArgs key_args(const AppendParams& params) {
  return {params.batch,     params.page_table,       params.token_offsets,
          params.keys,      params.input,            params.key_cache,
          params.key_quantization, params.key_rotation, params.key_outliers};
}

TensorAppendArgs value_args(const AppendParams& params) {
  return {params.batch,       params.page_table,         params.token_offsets,
          params.values,      params.input,              params.value_cache,
          params.value_quantization, params.value_rotation, params.value_outliers};
}

// Whether the token-parallel kernel takes this kind: per-token groups of
// whole lanes' channels, no outliers, no rotation or a matrix one (its rows
// 16-byte aligned: they are copied 16 bytes at a time), head_dim 64, 128 or
// 256 (two, four or eight channels a lane).
bool token_parallel(const PagedTensor& cache, const Quantization& q, const Rotation& r) {
  const TensorLayoutSpec& s = cache.layout.spec;
  const int32_t per_lane = s.head_dim / 32;
  return s.grouping == ScaleGrouping::kPerToken && cache.layout.outlier_spans == 0 &&
         q.outliers == OutlierSelection::kNone &&
         (r.kind == RotationKind::kNone ||
          (r.kind == RotationKind::kMatrix && reinterpret_cast<std::uintptr_t>(r.matrix) % 16 == 0)) &&
         (s.head_dim == 64 || s.head_dim == 128 || s.head_dim == 256) && s.group % per_lane == 0;
}

append_device::TokenTensorArgs token_args(const TensorAppendArgs& args) {
  return {args.cache, args.quantization, args.rotation, args.input};
}

// The rotated kernel where a kind has a matrix rotation (its rows staged
// once for a block of rotated_block_rows rows), else a block per row and
// kTokenWarps heads.
template <int kE, int kBits, ElementType kElement>
void launch_token_on(const append_device::TokenAppendArgs& args, const InlineBatchArrays& arrays, int32_t kv_heads,
                     cudaStream_t stream) {
  const int64_t rows = args.rows;
  using append_device::kTokenWarps;
  constexpr int threads = 32 * kTokenWarps;
  const bool rotated = args.kinds[0].rotation.kind == RotationKind::kMatrix ||
                       args.kinds[1].rotation.kind == RotationKind::kMatrix;
  if (rotated) {
    const int block_rows = rotated_block_rows(rows, kv_heads);
    const dim3 grid(static_cast<unsigned>((rows + block_rows - 1) / block_rows), static_cast<unsigned>(kv_heads), 2);
    switch (block_rows) {
      case 1: append_device::append_token_rotated_kernel<kE, kBits, kElement, 1><<<grid, threads, 0, stream>>>(args, arrays); break;
      case 2: append_device::append_token_rotated_kernel<kE, kBits, kElement, 2><<<grid, threads, 0, stream>>>(args, arrays); break;
      default: append_device::append_token_rotated_kernel<kE, kBits, kElement, 4><<<grid, threads, 0, stream>>>(args, arrays); break;
    }
  } else {
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((kv_heads + kTokenWarps - 1) / kTokenWarps), 2);
    append_device::append_token_kernel<kE, kBits, kElement><<<grid, threads, 0, stream>>>(args, arrays);
  }
}

template <int kE, int kBits>
void launch_token(const append_device::TokenAppendArgs& args, const InlineBatchArrays& arrays, int32_t kv_heads,
                  cudaStream_t stream) {
  using E = ElementType;
  switch (args.kinds[0].cache.layout.spec.element) {
    case E::kFloat16: launch_token_on<kE, kBits, E::kFloat16>(args, arrays, kv_heads, stream); break;
    case E::kBFloat16: launch_token_on<kE, kBits, E::kBFloat16>(args, arrays, kv_heads, stream); break;
    case E::kFloat32: launch_token_on<kE, kBits, E::kFloat32>(args, arrays, kv_heads, stream); break;
  }
  KVFORGE_CUDA_CHECK(cudaGetLastError());
}

template <int kE>
void launch_token_bits(const append_device::TokenAppendArgs& args, const InlineBatchArrays& arrays, int32_t kv_heads,
                       int32_t bits, cudaStream_t stream) {
  if (bits == 2) {
    launch_token<kE, 2>(args, arrays, kv_heads, stream);
  } else {
    launch_token<kE, 4>(args, arrays, kv_heads, stream);
  }
}

// Keys and values by the token-parallel kernel when both qualify (same
// bits); false otherwise.
bool launch_token_parallel(const TensorAppendArgs& keys, const TensorAppendArgs& values, const AppendParams& params,
                           cudaStream_t stream) {
  if (!takes_token_parallel(params)) return false;
  const TensorLayoutSpec& k = keys.cache.layout.spec;
  append_device::TokenAppendArgs args;
  args.kinds[0] = token_args(keys);
  args.kinds[1] = token_args(values);
  args.input_type = params.input;
  args.batch = params.batch;
  args.token_offsets = params.token_offsets;
  args.page_table = params.page_table;
  args.rows = params.rows;
  const InlineBatchArrays& arrays = params.inline_arrays;
  switch (k.head_dim) {
    case 64: launch_token_bits<2>(args, arrays, k.kv_heads, k.bits, stream); break;
    case 128: launch_token_bits<4>(args, arrays, k.kv_heads, k.bits, stream); break;
    default: launch_token_bits<8>(args, arrays, k.kv_heads, k.bits, stream); break;
  }
  return true;
}

}  // namespace

bool takes_token_parallel(const AppendParams& params) {
  const TensorLayoutSpec& k = params.key_cache.layout.spec;
  const TensorLayoutSpec& v = params.value_cache.layout.spec;
  return params.kernel == AppendKernel::kAuto && params.rows > 0 && params.rows <= 0x7fffffff &&
         k.element == v.element &&
         token_parallel(params.key_cache, params.key_quantization, params.key_rotation) &&
         token_parallel(params.value_cache, params.value_quantization, params.value_rotation) && k.bits == v.bits &&
         k.head_dim == v.head_dim && k.kv_heads == v.kv_heads;
}

void check_append_params(const AppendParams& params) {
  check(key_args(params), "keys");
  check(value_args(params), "values");
  // One page table for both kinds: their token slots must be the same.
  const TensorLayoutSpec& ks = params.key_cache.layout.spec;
  const TensorLayoutSpec& vs = params.value_cache.layout.spec;
  if (ks.sink_tokens != vs.sink_tokens || ks.page_size != vs.page_size) {
    throw std::invalid_argument("append (CUDA): keys and values differ in sink_tokens or page_size: expected one "
                                "page table's token slots for both");
  }
  const int32_t count = params.batch.count;
  const InlineBatchArrays& arrays = params.inline_arrays;
  check_inline_count("append (CUDA)", arrays.count, count);
  if (params.page_table == nullptr && opens_inline_pages(params.inline_arrays)) {
    throw std::invalid_argument("append (CUDA): inline new pages without a writable page_table");
  }
}

void launch_append(const AppendParams& params, cudaStream_t stream) {
  if (params.batch.count <= 0) return;
  check_append_params(params);
  TensorAppendArgs keys = key_args(params), values = value_args(params);
  const int32_t count = params.batch.count;
  const InlineBatchArrays& arrays = params.inline_arrays;
  if (launch_token_parallel(keys, values, params, stream)) return;
  keys.shared = append_device::shared_layout(keys.cache.layout, keys.quantization);
  values.shared = append_device::shared_layout(values.cache.layout, values.quantization);
  const bool paired = keys.cache.layout.spec.bits == values.cache.layout.spec.bits &&
                      (keys.cache.layout.spec.bits == 2 ? launch_pair_bits<2>(keys, values, arrays, count, stream)
                                                        : launch_pair_bits<4>(keys, values, arrays, count, stream));
  if (!paired) {
    launch_tensor(keys, arrays, count, stream);
    launch_tensor(values, arrays, count, stream);
  }
}

}  // namespace kvforge::kernels
