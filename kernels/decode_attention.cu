// The launcher of the CUDA decode_attention (decode_attention_kernel.cuh, decode_lookup_kernel.cuh,
// decode_exact_kernel.cuh, decode_merge_kernel.cuh,
// decode_tensor_core_kernel.cuh, decode_int8_kernel.cuh): host checks with
// one-line errors, the plan
// (which kernel, how many splits), the workspace of the splits' states, the
// dispatch on head_dim, bits, the GQA group size and the channel groups, and
// the merge.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/append_launch.h"
#include "kernels/cuda_runtime_check.h"
#include "kernels/decode_attention_kernel.cuh"
#include "kernels/decode_attention_launch.h"
#include "kernels/decode_exact_kernel.cuh"
#include "kernels/decode_int8_kernel.cuh"
#include "kernels/decode_lookup_kernel.cuh"
#include "kernels/decode_merge_kernel.cuh"
#include "kernels/split_plan.h"
#include "kernels/decode_tensor_core_kernel.cuh"
#include "kernels/rotate_queries_launch.h"

namespace kvforge::kernels {
namespace {

namespace device = decode_attention_device;

constexpr int kMaxGroup = 16;  // query heads per KV head: one warp each

[[noreturn]] void refuse(const std::string& what) {
  throw std::invalid_argument("decode_attention (CUDA): " + what);
}

void check_params(const DecodeParams& p) {
  const TensorLayoutSpec& keys = p.key_cache.layout.spec;
  const TensorLayoutSpec& values = p.value_cache.layout.spec;
  if (keys.head_dim != 64 && keys.head_dim != 128) {
    refuse("head_dim " + std::to_string(keys.head_dim) + " is not 64 or 128");
  }
  if (keys.bits != 2 && keys.bits != 4) refuse("bits " + std::to_string(keys.bits) + " is not 2 or 4");
  if (values.head_dim != keys.head_dim || values.kv_heads != keys.kv_heads || values.bits != keys.bits ||
      values.sink_tokens != keys.sink_tokens || values.page_size != keys.page_size) {
    refuse("keys and values differ in head_dim, kv_heads, bits, sink_tokens or page_size");
  }
  if (keys.kv_heads <= 0 || p.num_heads % keys.kv_heads != 0) {
    refuse("num_heads " + std::to_string(p.num_heads) + " is not a multiple of kv_heads " +
           std::to_string(keys.kv_heads));
  }
  if (p.num_heads / keys.kv_heads > kMaxGroup) {
    refuse("a GQA group of " + std::to_string(p.num_heads / keys.kv_heads) + " query heads, more than " +
           std::to_string(kMaxGroup));
  }
  if (p.tokens_per_split < 0) refuse("tokens_per_split " + std::to_string(p.tokens_per_split) + " is negative");
  if (p.exact_chunk_tokens < 0 || p.exact_chunk_tokens % device::kExactPass != 0) {
    refuse("exact_chunk_tokens " + std::to_string(p.exact_chunk_tokens) + ": expected 0 or a positive multiple of " +
           std::to_string(device::kExactPass));
  }
  if (p.batch.count > 65535) refuse("a batch of " + std::to_string(p.batch.count) + " sequences, more than 65535");
  const int32_t inline_count = p.inline_arrays.count;
  check_inline_count("decode_attention (CUDA)", inline_count, p.batch.count);
  const bool arrays = inline_count > 0 || (p.batch.slots != nullptr && p.batch.lengths != nullptr);
  if (p.batch.count > 0 && (!arrays || p.batch.page_table == nullptr || p.queries == nullptr || p.output == nullptr)) {
    refuse("a null slots, lengths, page_table, queries or output pointer");
  }
  if (p.keys_pre_rope && p.rope_inverse_frequencies == nullptr) refuse("pre-RoPE keys without RoPE frequencies");
  for (const Dequantization* dq : {&p.key_dequantization, &p.value_dequantization}) {
    if (dq->levels == nullptr) refuse("a null level table");
  }
  // The merge stages R_v by 16-byte copies (device::rotate_from_staged).
  for (const Rotation* rotation : {&p.key_rotation, &p.value_rotation}) {
    if (rotation->kind == RotationKind::kMatrix &&
        (rotation->matrix == nullptr || (reinterpret_cast<uintptr_t>(rotation->matrix) & 15u) != 0)) {
      refuse("a matrix rotation: expected a non-null, 16-byte aligned [kv_heads][D][D] float32 matrix");
    }
  }
  switch (p.int8_steps) {
    case Int8Steps::kAuto:
    case Int8Steps::kSteps32:
      break;
    case Int8Steps::kSteps64Stages3:
    case Int8Steps::kSteps64Stages4:
      if (p.kernel != DecodeKernel::kAuto && p.kernel != DecodeKernel::kInt8TensorCores) {
        refuse("int8_steps of 64 tokens with a kernel other than the int8 one");
      }
      if (!int8_wide_steps_supported(p)) {
        refuse("int8_steps of 64 tokens: expected one scale group per key and value row, no outliers and at most " +
               std::to_string(int8_mma::kPackedHeads) + " query heads per KV head");
      }
      break;
    default:
      refuse("int8_steps " + std::to_string(static_cast<int>(p.int8_steps)) + " is not an Int8Steps value");
  }
}

// The split kernels' grid: `blocks` per (KV head, sequence).
dim3 split_grid(const DecodeParams& p, int32_t blocks) {
  return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(p.key_cache.layout.spec.kv_heads),
              static_cast<unsigned>(p.batch.count));
}

template <int D, int kBits, int kWarps>
void launch_splits(const DecodeParams& p, const device::SplitWorkspace& workspace,
                   const device::SplitAssignment& assignment, int32_t blocks, cudaStream_t stream, bool dependent) {
  const dim3 grid = split_grid(p, blocks);
  launch_kernel(device::decode_split_kernel<D, kBits, kWarps>, grid, kWarps * device::kWarpSize, 0, stream, dependent, p,
         workspace, assignment);
}

// The general kernel over `blocks` splits per (KV head, sequence);
// `dependent` as launch's.
template <int D, int kBits>
void launch_general(const DecodeParams& p, const device::SplitWorkspace& workspace,
                    const device::SplitAssignment& assignment, int32_t blocks, cudaStream_t stream,
                    bool dependent = false) {
  const int group = p.num_heads / p.key_cache.layout.spec.kv_heads;
  // At least 4 warps dequantize; warps beyond the group only dequantize.
  if (group <= 4) {
    launch_splits<D, kBits, 4>(p, workspace, assignment, blocks, stream, dependent);
  } else if (group <= 8) {
    launch_splits<D, kBits, 8>(p, workspace, assignment, blocks, stream, dependent);
  } else {
    launch_splits<D, kBits, 16>(p, workspace, assignment, blocks, stream, dependent);
  }
}

// Whether decode_exact_kernel reads the exact ranges (else the general
// kernel does): every token of them exact in both tensors
// (same_quantized_ranges), one element type, both stores 16-byte aligned
// (every row is then: D elements of 2 or 4 bytes), at most 8 query heads per
// KV head (the tensor-core kernels' limit), and keys stored after RoPE or
// only token 0 exact (the kernel applies no RoPE, and at position 0 it is
// the identity: kvquant's one-token sink; a longer sink or a window of
// pre-RoPE keys goes to the general kernel, which rotates them).
bool exact_kernel_reads(const DecodeParams& p) {
  const TensorLayoutSpec& k = p.key_cache.layout.spec;
  const TensorLayoutSpec& v = p.value_cache.layout.spec;
  const auto aligned = [](const void* at) { return (reinterpret_cast<uintptr_t>(at) & 15u) == 0; };
  const bool rope_free = !p.keys_pre_rope || (k.sink_tokens <= 1 && p.key_cache.layout.ring_capacity == 0);
  return rope_free && same_quantized_ranges(k, v) && k.element == v.element && aligned(p.key_cache.exact) &&
         aligned(p.value_cache.exact) && p.num_heads / k.kv_heads <= 8;
}

template <int D, int kHeads, ElementType E>
void launch_exact_kernel(const DecodeParams& p, const device::SplitWorkspace& workspace,
                         const device::SplitAssignment& assignment, int32_t blocks, cudaStream_t stream,
                         bool dependent) {
  const dim3 grid = split_grid(p, blocks);
  prefer_max_shared_carveout(device::decode_exact_kernel<D, kHeads, E>);
  launch_kernel(device::decode_exact_kernel<D, kHeads, E>, grid, device::kExactWarps * device::kWarpSize, 0, stream,
                dependent, p, workspace, assignment);
}

template <int D, int kHeads>
void launch_exact_heads(const DecodeParams& p, const device::SplitWorkspace& workspace,
                        const device::SplitAssignment& assignment, int32_t blocks, cudaStream_t stream,
                        bool dependent) {
  switch (p.key_cache.layout.spec.element) {
    case ElementType::kFloat16:
      launch_exact_kernel<D, kHeads, ElementType::kFloat16>(p, workspace, assignment, blocks, stream, dependent);
      return;
    case ElementType::kBFloat16:
      launch_exact_kernel<D, kHeads, ElementType::kBFloat16>(p, workspace, assignment, blocks, stream, dependent);
      return;
    case ElementType::kFloat32:
      launch_exact_kernel<D, kHeads, ElementType::kFloat32>(p, workspace, assignment, blocks, stream, dependent);
      return;
  }
}

// The exact ranges' blocks (plan.exact_splits per KV head and sequence, their
// states after the tensor-core kernel's): decode_exact_kernel where
// DecodePlan::exact_kernel, else the general kernel. `dependent` as launch's.
template <int D, int kBits>
void launch_exact_ranges(const DecodeParams& p, const device::SplitWorkspace& workspace, const DecodePlan& plan,
                         cudaStream_t stream, bool dependent) {
  const device::SplitAssignment assignment{0, true, plan.splits, plan.exact_chunk};
  if (!plan.exact_kernel) {
    launch_general<D, kBits>(p, workspace, assignment, plan.exact_splits, stream, dependent);
  } else if (p.num_heads / p.key_cache.layout.spec.kv_heads <= 4) {
    launch_exact_heads<D, 4>(p, workspace, assignment, plan.exact_splits, stream, dependent);
  } else {
    launch_exact_heads<D, 8>(p, workspace, assignment, plan.exact_splits, stream, dependent);
  }
}

// The tile stages live in dynamic shared memory, beyond the 48 KB a block
// gets without asking.
template <int D, int kBits, int KG, int VG>
void allow_tensor_core_shared_memory() {
  KVFORGE_CUDA_CHECK(cudaFuncSetAttribute(device::decode_tensor_core_kernel<D, kBits, KG, VG>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          device::tensor_core_dynamic_shared_bytes<D, kBits, KG, VG>()));
}

template <int D, int kBits, int KG, int VG>
void launch_tensor_core_kernel(const DecodeParams& p, const device::SplitWorkspace& workspace,
                               const device::TensorCoreSplits& splits, dim3 grid, cudaStream_t stream) {
  allow_tensor_core_shared_memory<D, kBits, KG, VG>();
  constexpr int kThreads = device::kTensorCoreWarps * device::kWarpSize;
  device::decode_tensor_core_kernel<D, kBits, KG, VG>
      <<<grid, kThreads, device::tensor_core_dynamic_shared_bytes<D, kBits, KG, VG>(), stream>>>(p, workspace, splits);
}

template <int D, int kBits, int KG, int VG>
int tensor_core_blocks(int threads) {
  allow_tensor_core_shared_memory<D, kBits, KG, VG>();
  int blocks = 0;
  KVFORGE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, device::decode_tensor_core_kernel<D, kBits, KG, VG>, threads,
      device::tensor_core_dynamic_shared_bytes<D, kBits, KG, VG>()));
  return blocks;
}

bool grouped_channels(const TensorLayoutSpec& spec) {
  return spec.grouping == ScaleGrouping::kPerToken && spec.group < spec.head_dim;
}

template <int D, int kBits>
void launch_tensor_cores(const DecodeParams& p, const device::SplitWorkspace& workspace, const DecodePlan& plan,
                         cudaStream_t stream) {
  const dim3 grid = split_grid(p, plan.splits);
  const device::TensorCoreSplits splits{plan.tokens_per_split};
  if (grouped_channels(p.key_cache.layout.spec) || grouped_channels(p.value_cache.layout.spec)) {
    launch_tensor_core_kernel<D, kBits, 4, 4>(p, workspace, splits, grid, stream);
  } else {
    launch_tensor_core_kernel<D, kBits, 1, 1>(p, workspace, splits, grid, stream);
  }
}

// The int8 kernel's value groups per row: per-token groups of 32 channels
// (KIVI's) or one.
bool int8_value_groups_of_32(const DecodeParams& p) {
  const TensorLayoutSpec& v = p.value_cache.layout.spec;
  return v.grouping == ScaleGrouping::kPerToken && v.group == 32 && v.head_dim > 32;
}

// One scale group per token row of the tensor: all-heads groups, or
// per_token groups of head_dim.
bool one_group_per_row(const TensorLayoutSpec& s) {
  return s.grouping == ScaleGrouping::kPerTokenAllHeads ||
         (s.grouping == ScaleGrouping::kPerToken && s.group == s.head_dim);
}

// The int8 kernel packs both parts of its B operands into the mma's N
// where the GQA group leaves columns 4-7 idle.
bool int8_packed_parts(const DecodeParams& p) {
  return p.num_heads / p.key_cache.layout.spec.kv_heads <= int8_mma::kPackedHeads;
}

// Calls f with the int8 kernel instantiation that serves p (head_dim D,
// kBits bits) in `steps` (resolved: not kAuto; 64-token steps only where
// int8_wide_steps_supported).
template <int D, int kBits, typename F>
void with_int8_kernel_bits(const DecodeParams& p, Int8Steps steps, F&& f) {
  if (steps == Int8Steps::kSteps64Stages3) {
    f(device::decode_int8_kernel<D, 1, true, kBits, 2, 3>, device::int8_dynamic_shared_bytes<D, 1, kBits, 2, 3>);
    return;
  }
  if (steps == Int8Steps::kSteps64Stages4) {
    f(device::decode_int8_kernel<D, 1, true, kBits, 2, 4>, device::int8_dynamic_shared_bytes<D, 1, kBits, 2, 4>);
    return;
  }
  const bool groups_of_32 = int8_value_groups_of_32(p), packed = int8_packed_parts(p);
  if (groups_of_32) {
    packed ? f(device::decode_int8_kernel<D, D / 32, true, kBits>, device::int8_dynamic_shared_bytes<D, D / 32, kBits>)
           : f(device::decode_int8_kernel<D, D / 32, false, kBits>, device::int8_dynamic_shared_bytes<D, D / 32, kBits>);
  } else {
    packed ? f(device::decode_int8_kernel<D, 1, true, kBits>, device::int8_dynamic_shared_bytes<D, 1, kBits>)
           : f(device::decode_int8_kernel<D, 1, false, kBits>, device::int8_dynamic_shared_bytes<D, 1, kBits>);
  }
}
template <int D, typename F>
void with_int8_kernel(const DecodeParams& p, Int8Steps steps, F&& f) {
  if (p.key_cache.layout.spec.bits == 2) {
    with_int8_kernel_bits<D, 2>(p, steps, f);
  } else {
    with_int8_kernel_bits<D, 4>(p, steps, f);
  }
}

// The instantiation with a step's append (kStepAppend) of the wide steps
// `steps` (kSteps64Stages3 or kSteps64Stages4: step_append_host).
template <int D, int kBits, typename F>
void with_int8_step_kernel_bits(Int8Steps steps, F&& f) {
  if (steps == Int8Steps::kSteps64Stages3) {
    f(device::decode_int8_kernel<D, 1, true, kBits, 2, 3, true>, device::int8_dynamic_shared_bytes<D, 1, kBits, 2, 3>);
  } else {
    f(device::decode_int8_kernel<D, 1, true, kBits, 2, 4, true>, device::int8_dynamic_shared_bytes<D, 1, kBits, 2, 4>);
  }
}
template <int D, typename F>
void with_int8_step_kernel(const DecodeParams& p, Int8Steps steps, F&& f) {
  if (p.key_cache.layout.spec.bits == 2) {
    with_int8_step_kernel_bits<D, 2>(steps, f);
  } else {
    with_int8_step_kernel_bits<D, 4>(steps, f);
  }
}

using Int8Kernel = void (*)(DecodeParams, device::SplitWorkspace, device::TensorCoreSplits, NoStepAppend);
using Int8StepKernel = void (*)(DecodeParams, device::SplitWorkspace, device::TensorCoreSplits, StepAppendArgs);
using Int8SharedBytes = int (*)(bool, int);
constexpr int kInt8Threads = device::kInt8Warps * device::kWarpSize;

// The kernel's dynamic shared memory, set as its attribute: at every launch,
// not once per planner, because the kernel serves several sizes (with and
// without value outliers, and with KIVI keys' channel pairs) and the
// attribute is the function's, so a residency query for a smaller one
// lowers it for a larger.
template <typename Kernel>
int prepare_int8_kernel(Kernel kernel, Int8SharedBytes shared_bytes_of, const DecodeParams& p) {
  const TensorPageLayout& keys = p.key_cache.layout;
  const int channel_pair_bytes =
      keys.spec.grouping == ScaleGrouping::kPerChannelTokens ? static_cast<int>(keys.pair_bytes) : 0;
  const int shared_bytes = shared_bytes_of(p.value_cache.layout.outlier_spans > 0, channel_pair_bytes);
  KVFORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  return shared_bytes;
}

// The lookup kernel's instantiation for the GQA group (its heads padded to
// 4 or 8) with its dynamic shared memory set as the function's attribute.
using LookupKernel = void (*)(DecodeParams, device::SplitWorkspace, device::TensorCoreSplits);
template <int D, int kBits, typename F>
void with_lookup_kernel(const DecodeParams& p, F&& f) {
  const auto prepared = [&](LookupKernel kernel, int shared_bytes) {
    KVFORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
    // Four blocks of ~42 KB a multiprocessor (the occupancy the plan's
    // splits assume) whatever split the kernels before it left.
    prefer_max_shared_carveout(kernel);
    f(kernel, shared_bytes);
  };
  if (p.num_heads / p.key_cache.layout.spec.kv_heads <= 4) {
    prepared(device::decode_lookup_kernel<D, kBits, 4>, device::lookup_shared_bytes<D, kBits, 4>());
  } else {
    prepared(device::decode_lookup_kernel<D, kBits, 8>, device::lookup_shared_bytes<D, kBits, 8>());
  }
}
constexpr int kLookupThreads = device::kLookupWarps * device::kWarpSize;

template <int D, int kBits>
void launch_lookup(const DecodeParams& p, const device::SplitWorkspace& workspace, const DecodePlan& plan,
                   cudaStream_t stream) {
  with_lookup_kernel<D, kBits>(p, [&](LookupKernel kernel, int shared_bytes) {
    launch_kernel(kernel, split_grid(p, plan.splits), kLookupThreads, shared_bytes, stream, false, p, workspace,
                  device::TensorCoreSplits{plan.tokens_per_split, false});
  });
}

template <int D, int kBits>
int lookup_residency(const DecodeParams& p) {
  int blocks = 0;
  with_lookup_kernel<D, kBits>(p, [&](LookupKernel kernel, int shared_bytes) {
    KVFORGE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kLookupThreads, shared_bytes));
  });
  return blocks > 0 ? blocks : 1;
}

// `dependent` as launch's. With plan.cluster_merge the splits of a (KV
// head, sequence), consecutive along x, are one cluster.
// `step`: a decoding step's append that the kernel runs first (null: none).
template <int D>
void launch_int8(const DecodeParams& p, const device::SplitWorkspace& workspace, const DecodePlan& plan,
                 cudaStream_t stream, bool dependent, const StepAppendArgs* step) {
  const dim3 grid = split_grid(p, plan.splits);
  const int cluster_blocks = plan.cluster_merge ? plan.splits : 0;
  const device::TensorCoreSplits splits{plan.tokens_per_split, plan.cluster_merge};
  if (step != nullptr) {
    with_int8_step_kernel<D>(p, plan.int8_steps, [&](Int8StepKernel kernel, Int8SharedBytes shared_bytes_of) {
      const int shared_bytes = prepare_int8_kernel(kernel, shared_bytes_of, p);
      launch_kernel_in_clusters(kernel, grid, cluster_blocks, kInt8Threads, shared_bytes, stream, dependent, p,
                                workspace, splits, *step);
    });
    return;
  }
  with_int8_kernel<D>(p, plan.int8_steps, [&](Int8Kernel kernel, Int8SharedBytes shared_bytes_of) {
    const int shared_bytes = prepare_int8_kernel(kernel, shared_bytes_of, p);
    launch_kernel_in_clusters(kernel, grid, cluster_blocks, kInt8Threads, shared_bytes, stream, dependent, p,
                              workspace, splits, NoStepAppend{});
  });
}

// Clusters of `splits` int8 blocks the device holds at once.
template <int D>
int int8_resident_clusters(const DecodeParams& p, Int8Steps steps, int32_t splits) {
  int clusters = 0;
  with_int8_kernel<D>(p, steps, [&](Int8Kernel kernel, Int8SharedBytes shared_bytes_of) {
    const int shared_bytes = prepare_int8_kernel(kernel, shared_bytes_of, p);
    clusters = resident_clusters(kernel, splits, kInt8Threads, shared_bytes);
  });
  return clusters;
}

int int8_clusters_on_device(const DecodeParams& p, Int8Steps steps, int32_t splits) {
  return p.key_cache.layout.spec.head_dim == 64 ? int8_resident_clusters<64>(p, steps, splits)
                                                 : int8_resident_clusters<128>(p, steps, splits);
}

template <int D>
int int8_residency(const DecodeParams& p, Int8Steps steps) {
  int blocks = 0;
  with_int8_kernel<D>(p, steps, [&](Int8Kernel kernel, Int8SharedBytes shared_bytes_of) {
    const int shared_bytes = prepare_int8_kernel(kernel, shared_bytes_of, p);
    KVFORGE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kInt8Threads, shared_bytes));
  });
  return blocks > 0 ? blocks : 1;
}

// Blocks of the tensor-core kernel one multiprocessor holds at once (its
// registers decide), so that the plan fills the device in whole waves.
template <int D, int kBits>
int tensor_core_residency(const DecodeParams& p) {
  constexpr int kThreads = device::kTensorCoreWarps * device::kWarpSize;
  const int blocks = grouped_channels(p.key_cache.layout.spec) || grouped_channels(p.value_cache.layout.spec)
                         ? tensor_core_blocks<D, kBits, 4, 4>(kThreads)
                         : tensor_core_blocks<D, kBits, 1, 1>(kThreads);
  return blocks > 0 ? blocks : 1;
}

// One number per kernel instantiation and dynamic shared-memory size (what
// the occupancy depends on besides the device): the planner's cache key.
int kernel_variant(const DecodeParams& p, bool int8, bool lookup, Int8Steps steps) {
  const TensorLayoutSpec& k = p.key_cache.layout.spec;
  const int dim = k.head_dim == 64 ? 0 : 1;
  if (lookup) {  // 8 to 15: head_dim, bits, heads padded to 8
    const bool eight = p.num_heads / k.kv_heads > 4;
    return 8 + 4 * dim + (k.bits == 4 ? 2 : 0) + (eight ? 1 : 0);
  }
  if (int8) {  // 16 and up: steps, head_dim, bits, value groups, packed parts, value outliers, channel pairs' bytes
    const int channel_pairs =
        k.grouping != ScaleGrouping::kPerChannelTokens ? 0 : p.key_cache.layout.pair_bytes == 4 ? 1 : 2;
    int variant = dim;
    variant = 2 * variant + (k.bits == 4 ? 1 : 0);
    variant = 2 * variant + (int8_value_groups_of_32(p) ? 1 : 0);
    variant = 2 * variant + (int8_packed_parts(p) ? 1 : 0);
    variant = 2 * variant + (p.value_cache.layout.outlier_spans > 0 ? 1 : 0);
    return 16 + 4 * (3 * variant + channel_pairs) + static_cast<int>(steps);
  }
  const bool grouped = grouped_channels(k) || grouped_channels(p.value_cache.layout.spec);
  return 4 * dim + (k.bits == 2 ? 0 : 2) + (grouped ? 1 : 0);
}

int tensor_core_blocks_per_multiprocessor(const DecodeParams& p, bool int8, bool lookup, Int8Steps steps) {
  const TensorLayoutSpec& k = p.key_cache.layout.spec;
  if (lookup) {
    if (k.head_dim == 64) return k.bits == 2 ? lookup_residency<64, 2>(p) : lookup_residency<64, 4>(p);
    return k.bits == 2 ? lookup_residency<128, 2>(p) : lookup_residency<128, 4>(p);
  }
  if (int8) return k.head_dim == 64 ? int8_residency<64>(p, steps) : int8_residency<128>(p, steps);
  if (k.head_dim == 64) return k.bits == 2 ? tensor_core_residency<64, 2>(p) : tensor_core_residency<64, 4>(p);
  return k.bits == 2 ? tensor_core_residency<128, 2>(p) : tensor_core_residency<128, 4>(p);
}

// A decoding step's append as the launches take it: the kernel that runs
// it (step_append_host's) holds the args, the others null.
struct StepAppendKernels {
  const StepAppendArgs* int8 = nullptr;      // kInt8Kernel
  const StepAppendArgs* rotation = nullptr;  // kRotateQueries
};

// The queries rotated once for the call (DecodePlan::rotate_queries_first),
// with the step's rows where it carries them.
void launch_rotation_first(const DecodeParams& p, const device::SplitWorkspace& workspace,
                           const StepAppendKernels& step, cudaStream_t stream) {
  if (step.rotation != nullptr) {
    launch_rotate_queries_step(p, workspace.queries, *step.rotation, stream);
  } else {
    launch_rotate_queries(p, workspace.queries, stream);
  }
}

template <int D, int kBits>
void launch_for_bits(const DecodeParams& p, const device::SplitWorkspace& workspace, const DecodePlan& plan,
                     cudaStream_t stream, const StepAppendKernels& step) {
  if (plan.lookup) {
    launch_lookup<D, kBits>(p, workspace, plan, stream);
    if (plan.exact_splits > 0) launch_exact_ranges<D, kBits>(p, workspace, plan, stream, false);
    return;
  }
  if (plan.tensor_cores) {
    if (plan.rotate_queries_first) launch_rotation_first(p, workspace, step, stream);
    if (plan.int8) {
      // Both orders make the second kernel the first's programmatic
      // dependent: it reads nothing the first writes, and waits for it
      // before it exits (so that the merge, which waits for the second,
      // finds both done). Few exact blocks first, beside the int8 kernel's
      // from the start; else the int8 kernel first, the exact blocks
      // filling its last wave instead of starting after it, and, with the
      // queries rotated first, the rotation's dependent (it waits for the
      // queries, then lets the exact blocks launch: load_group_queries).
      if (plan.exact_first) {
        launch_exact_ranges<D, kBits>(p, workspace, plan, stream, false);
        launch_int8<D>(p, workspace, plan, stream, true, step.int8);
      } else {
        launch_int8<D>(p, workspace, plan, stream, plan.rotate_queries_first, step.int8);
        if (plan.exact_splits > 0) launch_exact_ranges<D, kBits>(p, workspace, plan, stream, true);
      }
      return;
    }
    launch_tensor_cores<D, kBits>(p, workspace, plan, stream);
    if (plan.exact_splits > 0) launch_exact_ranges<D, kBits>(p, workspace, plan, stream, false);
  } else {
    launch_general<D, kBits>(p, workspace, {plan.tokens_per_split, false, 0}, plan.splits, stream);
  }
}

// The merge as the split kernels' dependent: it launches while they run
// and waits for them (wait_for_prerequisite_grid). A rotated output
// in a block that stages R_v takes merge_rotation_shared_bytes of dynamic
// shared memory, beyond the 48 KB a block gets without asking.
template <int D, int kParts, int kHeads>
void launch_merge(const DecodeParams& p, const device::SplitWorkspace& workspace, dim3 grid, cudaStream_t stream) {
  constexpr auto kernel = device::decode_merge_kernel<D, kParts, kHeads>;
  const bool staged = p.value_rotation.kind == RotationKind::kMatrix;
  const int shared_bytes = staged ? device::merge_rotation_shared_bytes<D, kParts, kHeads>() : 0;
  if (shared_bytes > 0) {
    KVFORGE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  }
  launch_kernel(kernel, grid, device::merge_threads<D, kParts, kHeads>(), shared_bytes, stream, true, p, workspace);
}

template <int D>
void launch_for_head_dim(const DecodeParams& p, const device::SplitWorkspace& workspace, const DecodePlan& plan,
                         cudaStream_t stream, const StepAppendKernels& step) {
  if (p.key_cache.layout.spec.bits == 2) {
    launch_for_bits<D, 2>(p, workspace, plan, stream, step);
  } else {
    launch_for_bits<D, 4>(p, workspace, plan, stream, step);
  }
  if (plan.cluster_merge) return;  // the int8 kernel's clusters wrote the output
  const dim3 grid(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch.count));
  if (plan.wide_merge) {
    launch_merge<D, device::kMergeMaxParts, 1>(p, workspace, grid, stream);
  } else if (plan.merge_heads == device::kMergeGroupHeads) {
    constexpr int kHeads = device::kMergeGroupHeads;
    launch_merge<D, 1, kHeads>(p, workspace,
                               dim3(static_cast<unsigned>(p.num_heads / kHeads), static_cast<unsigned>(p.batch.count)),
                               stream);
  } else {
    launch_merge<D, 1, 1>(p, workspace, grid, stream);
  }
}

// The longest context of the batch: the caller's max_length, else what a
// page table row holds (sink plus stride * page_size tokens).
int64_t longest_context(const DecodeParams& p) {
  if (p.batch.max_length > 0) return p.batch.max_length;
  const TensorLayoutSpec& spec = p.key_cache.layout.spec;
  return spec.sink_tokens + p.batch.page_table_stride * spec.page_size;
}

int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

int multiprocessor_count() {
  int device = 0, count = 0;
  KVFORGE_CUDA_CHECK(cudaGetDevice(&device));
  KVFORGE_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// The split states (max and sum, then acc), then the rotated queries where
// the plan rotates them first.
int64_t workspace_bytes_for(const DecodeParams& p, const DecodePlan& plan) {
  const int64_t states = static_cast<int64_t>(p.batch.count) * p.num_heads * plan.states;
  const int64_t queries = plan.rotate_queries_first ? static_cast<int64_t>(p.batch.count) * p.num_heads : 0;
  return (states * (p.key_cache.layout.spec.head_dim + 2) + queries * p.key_cache.layout.spec.head_dim) *
         static_cast<int64_t>(sizeof(float));
}

}  // namespace

bool tensor_core_decode_supported(const DecodeParams& p) {
  const TensorLayoutSpec& k = p.key_cache.layout.spec;
  const TensorLayoutSpec& v = p.value_cache.layout.spec;
  const int dim = k.head_dim;
  if ((dim != 64 && dim != 128) || (k.bits != 2 && k.bits != 4)) return false;
  if (k.kv_heads <= 0 || p.num_heads / k.kv_heads > device::kMaxTensorCoreGroup) return false;
  if (p.keys_pre_rope || p.key_dequantization.non_uniform || p.value_dequantization.non_uniform) return false;
  const auto per_token_ok = [dim](const TensorLayoutSpec& s) {
    return s.grouping == ScaleGrouping::kPerTokenAllHeads ||
           (s.grouping == ScaleGrouping::kPerToken && s.group % 16 == 0 && dim / s.group <= 4);
  };
  const bool keys_ok = per_token_ok(k) || k.grouping == ScaleGrouping::kPerChannelOffline ||
                       (k.grouping == ScaleGrouping::kPerChannelTokens && k.group % 16 == 0);
  return keys_ok && per_token_ok(v);
}

namespace {

// The shapes the int8 and lookup kernels' walks take: head_dim 64 or 128,
// 2 or 4 bits, the same head_dim and bits for keys and values, at most 8
// query heads per KV head; their address arithmetic: 32-bit page sizes and
// in-page offsets, one page table (one page size) for both pools.
bool walk_shape_supported(const DecodeParams& p) {
  const TensorLayoutSpec& k = p.key_cache.layout.spec;
  const TensorLayoutSpec& v = p.value_cache.layout.spec;
  const int dim = k.head_dim;
  if ((dim != 64 && dim != 128) || (k.bits != 2 && k.bits != 4) || v.bits != k.bits || v.head_dim != dim) return false;
  if (k.kv_heads <= 0 || p.num_heads / k.kv_heads > device::kMaxTensorCoreGroup) return false;
  if (p.key_cache.layout.page_bytes > 0x7fffffff || p.value_cache.layout.page_bytes > 0x7fffffff) return false;
  return k.page_size == v.page_size;
}

}  // namespace

bool int8_decode_supported(const DecodeParams& p) {
  const TensorLayoutSpec& k = p.key_cache.layout.spec;
  const TensorLayoutSpec& v = p.value_cache.layout.spec;
  if (!walk_shape_supported(p)) return false;
  if (p.keys_pre_rope || p.key_dequantization.non_uniform || p.value_dequantization.non_uniform) return false;
  // Keys in per-channel token groups (KIVI's) come with KIVI's values, in
  // groups of 32 channels: the one instantiation that stages their channel
  // pairs (the others keep the registers that costs).
  const bool keys_ok = one_group_per_row(k) || k.grouping == ScaleGrouping::kPerChannelOffline ||
                       (k.grouping == ScaleGrouping::kPerChannelTokens && k.group % device::kInt8StepTokens == 0 &&
                        int8_value_groups_of_32(p));
  return keys_ok && (one_group_per_row(v) || int8_value_groups_of_32(p));
}

bool lookup_decode_supported(const DecodeParams& p) {
  const TensorLayoutSpec& k = p.key_cache.layout.spec;
  const TensorLayoutSpec& v = p.value_cache.layout.spec;
  if (!walk_shape_supported(p)) return false;
  if (p.key_dequantization.channel_scale == nullptr || p.key_dequantization.channel_offset == nullptr) return false;
  return k.grouping == ScaleGrouping::kPerChannelOffline && one_group_per_row(v);
}

bool int8_wide_steps_supported(const DecodeParams& p) {
  return int8_decode_supported(p) && one_group_per_row(p.key_cache.layout.spec) &&
         one_group_per_row(p.value_cache.layout.spec) &&
         p.key_cache.layout.outlier_spans == 0 && p.value_cache.layout.outlier_spans == 0 && int8_packed_parts(p);
}

Int8Steps default_int8_steps(const DecodeParams& p) {
  return int8_wide_steps_supported(p) ? Int8Steps::kSteps64Stages4 : Int8Steps::kSteps32;
}

namespace {

// resident_blocks(int8, lookup, steps): blocks per multiprocessor of the kernel;
// choose_splits(longest, per_split, resident, max_splits): as
// splits_for_whole_waves (kernels/split_plan.h); resident_clusters(steps,
// splits): clusters of `splits` int8 blocks on the device;
// rotation_step_resident(): blocks per multiprocessor of the query
// rotation's step variant (rotate_queries_step_blocks_per_multiprocessor).
template <typename Resident, typename ChooseSplits, typename ResidentClusters, typename RotationStepResident>
DecodePlan plan_with(const DecodeParams& p, int multiprocessors, Resident resident_blocks, ChooseSplits choose_splits,
                     ResidentClusters resident_clusters, RotationStepResident rotation_step_resident) {
  DecodePlan plan;
  const TensorLayoutSpec& k = p.key_cache.layout.spec;
  const int64_t longest = std::max<int64_t>(1, longest_context(p));
  // Enough blocks for a few per multiprocessor, from the longest sequence.
  const int64_t per_split = std::max<int64_t>(1, static_cast<int64_t>(p.batch.count) * k.kv_heads);
  plan.int8 = (p.kernel == DecodeKernel::kAuto || p.kernel == DecodeKernel::kInt8TensorCores) && int8_decode_supported(p);
  if (plan.int8) plan.int8_steps = p.int8_steps != Int8Steps::kAuto ? p.int8_steps : default_int8_steps(p);
  const int64_t step_tokens = plan.int8_steps == Int8Steps::kSteps32 ? device::kInt8StepTokens : 2 * device::kInt8StepTokens;
  plan.tensor_cores = p.kernel != DecodeKernel::kGeneral && p.kernel != DecodeKernel::kLookup &&
                      (plan.int8 || tensor_core_decode_supported(p));
  plan.lookup = !plan.tensor_cores && p.kernel != DecodeKernel::kGeneral && p.kernel != DecodeKernel::kBf16TensorCores &&
                lookup_decode_supported(p);
  if (plan.tensor_cores || plan.lookup) {
    const int64_t ring = std::max(p.key_cache.layout.ring_capacity, p.value_cache.layout.ring_capacity);
    const bool exact_kernel = exact_kernel_reads(p);
    plan.exact_chunk = p.exact_chunk_tokens > 0 ? p.exact_chunk_tokens
                       : exact_kernel          ? device::kExactChunk
                                               : device::kExactPass;
    plan.exact_splits = static_cast<int32_t>(ceil_div64(k.sink_tokens, plan.exact_chunk) +
                                             ceil_div64(ring, plan.exact_chunk));
    plan.exact_kernel = plan.exact_splits > 0 && exact_kernel;
    // The splits whose blocks finish first in whole waves of resident blocks
    // (kernels/split_plan.h), at least 256 tokens each, a whole number of
    // every warp's tiles (16 tokens; the int8 kernel's steps: 32 or 64). Few exact
    // blocks (DecodePlan::exact_slots_reserved) take a slot each from the
    // int8 kernel's (a general block needs fewer registers than an int8 one),
    // launched first or behind the query rotation.
    const int64_t exact_blocks = static_cast<int64_t>(plan.exact_splits) * per_split;
    const int64_t all_resident =
        static_cast<int64_t>(multiprocessors) * resident_blocks(plan.int8, plan.lookup, plan.int8_steps);
    plan.exact_slots_reserved = plan.int8 && exact_blocks > 0 && 8 * exact_blocks <= all_resident;
    const bool key_matrix = p.key_rotation.kind == RotationKind::kMatrix;
    plan.exact_first = plan.exact_slots_reserved && !(key_matrix && p.rotate_before_exact_blocks);
    plan.rotate_queries_first = plan.tensor_cores && key_matrix && !plan.exact_first;
    plan.rotation_step_in_one_wave =
        plan.rotate_queries_first &&
        2 * per_split <= static_cast<int64_t>(multiprocessors) * rotation_step_resident();
    const int64_t resident = plan.exact_slots_reserved ? all_resident - exact_blocks : all_resident;
    const int64_t wave_splits = choose_splits(
        longest, per_split, resident, std::min(ceil_div64(longest, 256), 4 * ceil_div64(resident, per_split)));
    const int64_t kQuantum = plan.int8     ? device::kInt8Warps * step_tokens
                             : plan.lookup ? device::kLookupWarps * device::kLookupStepTokens
                                           : device::kTensorCoreWarps * device::kTileRows;
    plan.tokens_per_split = std::max<int64_t>(256, ceil_div64(ceil_div64(longest, wave_splits), kQuantum) * kQuantum);
    plan.splits = static_cast<int32_t>(ceil_div64(longest, plan.tokens_per_split));
    // The device's clusters are asked for only where the layout allows them.
    const bool rotated = p.key_rotation.kind == RotationKind::kMatrix || p.value_rotation.kind == RotationKind::kMatrix;
    if (cluster_merge_applies(plan.int8, plan.exact_splits, rotated, plan.splits, device::kMaxClusterBlocks)) {
      const int64_t in_clusters = static_cast<int64_t>(resident_clusters(plan.int8_steps, plan.splits)) * plan.splits;
      plan.cluster_merge = clusters_add_no_wave(per_split * plan.splits, resident, in_clusters);
    }
  } else {
    // The caller's split (the CPU reference's) when it gives one.
    plan.tokens_per_split = p.tokens_per_split > 0 ? p.tokens_per_split : 0;
    plan.splits = static_cast<int32_t>(p.tokens_per_split > 0 ? ceil_div64(longest, p.tokens_per_split) : 1);
  }
  plan.states = plan.splits + plan.exact_splits;
  if (plan.cluster_merge) return plan;  // no merge kernel
  plan.wide_merge = wide_merge(plan.states, static_cast<int64_t>(p.num_heads) * p.batch.count, multiprocessors,
                               device::merge_per_part<1>());
  plan.merge_heads = merge_heads(p.value_rotation.kind == RotationKind::kMatrix, plan.wide_merge,
                                 p.num_heads / k.kv_heads, device::kMergeGroupHeads);
  return plan;
}

}  // namespace

DecodePlan plan_decode_attention(const DecodeParams& p, int multiprocessors) {
  return plan_with(
      p, multiprocessors,
      [&](bool int8, bool lookup, Int8Steps steps) {
        return tensor_core_blocks_per_multiprocessor(p, int8, lookup, steps);
      },
      splits_for_whole_waves,
      [&](Int8Steps steps, int32_t splits) { return int8_clusters_on_device(p, steps, splits); },
      [&] { return rotate_queries_step_blocks_per_multiprocessor(p); });
}


int DecodePlanner::resident_blocks(const DecodeParams& params, bool int8, bool lookup, Int8Steps steps) {
  const int variant = kernel_variant(params, int8, lookup, steps);
  const auto known = resident_.find(variant);
  if (known != resident_.end()) return known->second;
  const int blocks = tensor_core_blocks_per_multiprocessor(params, int8, lookup, steps);
  resident_.emplace(variant, blocks);
  return blocks;
}

DecodePlan DecodePlanner::plan(const DecodeParams& params) {
  if (multiprocessors_ == 0) multiprocessors_ = multiprocessor_count();
  // The split search runs once per batch shape: a server's layers (and the
  // workspace size before each launch) ask again with the same numbers.
  const auto choose_splits = [this](int64_t longest, int64_t per_split, int64_t resident, int64_t max_splits) {
    const SplitQuestion question{longest, per_split, resident, max_splits};
    if (!(question == last_question_)) {
      last_question_ = question;
      last_splits_ = splits_for_whole_waves(longest, per_split, resident, max_splits);
    }
    return last_splits_;
  };
  return plan_with(
      params, multiprocessors_,
      [&](bool int8, bool lookup, Int8Steps steps) { return resident_blocks(params, int8, lookup, steps); },
      choose_splits, [&](Int8Steps steps, int32_t splits) { return resident_clusters(params, steps, splits); },
      [&] { return rotation_step_resident(params); });
}

int DecodePlanner::rotation_step_resident(const DecodeParams& params) {
  const TensorLayoutSpec& k = params.key_cache.layout.spec;
  const int variant = static_cast<int>(k.head_dim) * 64 + k.bits * 4 + static_cast<int>(k.element);
  const auto known = rotation_step_resident_.find(variant);
  if (known != rotation_step_resident_.end()) return known->second;
  const int blocks = rotate_queries_step_blocks_per_multiprocessor(params);
  rotation_step_resident_.emplace(variant, blocks);
  return blocks;
}

int DecodePlanner::resident_clusters(const DecodeParams& params, Int8Steps steps, int32_t splits) {
  const std::pair<int, int32_t> key{kernel_variant(params, true, false, steps), splits};
  const auto known = resident_clusters_.find(key);
  if (known != resident_clusters_.end()) return known->second;
  const int clusters = int8_clusters_on_device(params, steps, splits);
  resident_clusters_.emplace(key, clusters);
  return clusters;
}

int64_t DecodePlanner::workspace_bytes(const DecodeParams& params, const DecodePlan& plan) {
  return workspace_bytes_for(params, plan);
}

int64_t DecodePlanner::workspace_bytes(const DecodeParams& params) { return workspace_bytes_for(params, plan(params)); }

void DecodePlanner::launch(const DecodeParams& params, cudaStream_t stream) {
  check_params(params);
  if (params.batch.count == 0) return;
  run(params, plan(params), stream, nullptr, StepAppendHost::kNone);
}

void DecodePlanner::launch(const DecodeParams& params, const DecodePlan& plan, cudaStream_t stream) {
  check_params(params);
  if (params.batch.count == 0) return;
  run(params, plan, stream, nullptr, StepAppendHost::kNone);
}

void DecodePlanner::run(const DecodeParams& params, const DecodePlan& plan, cudaStream_t stream,
                        const StepAppendArgs* step, StepAppendHost host) {
  if (plan.states > 0x7fffffff || plan.splits > 0x7fffffff) refuse("more than 2^31 - 1 context splits");
  const int64_t bytes = workspace_bytes_for(params, plan);
  void* memory = params.workspace;
  const bool owned = memory == nullptr || params.workspace_bytes < bytes;
  if (owned) KVFORGE_CUDA_CHECK(cudaMallocAsync(&memory, static_cast<size_t>(bytes), stream));
  const int64_t states = static_cast<int64_t>(params.batch.count) * params.num_heads * plan.states;
  device::SplitWorkspace workspace;
  workspace.max_sum = static_cast<float*>(memory);
  workspace.acc = workspace.max_sum + 2 * states;
  workspace.max_splits = static_cast<int32_t>(plan.states);
  if (plan.rotate_queries_first) workspace.queries = workspace.acc + states * params.key_cache.layout.spec.head_dim;
  StepAppendKernels step_kernels;
  if (host == StepAppendHost::kInt8Kernel) step_kernels.int8 = step;
  if (host == StepAppendHost::kRotateQueries) step_kernels.rotation = step;
  if (params.key_cache.layout.spec.head_dim == 64) {
    launch_for_head_dim<64>(params, workspace, plan, stream, step_kernels);
  } else {
    launch_for_head_dim<128>(params, workspace, plan, stream, step_kernels);
  }
  const cudaError_t launched = cudaGetLastError();
  if (owned) KVFORGE_CUDA_CHECK(cudaFreeAsync(memory, stream));
  KVFORGE_CUDA_CHECK(launched);
}

namespace {

// Every field: the kernels that append take the decode's layouts (its
// head_dim, bits, element, sink and window), the append's are what
// step_append_host checks.
bool same_spec(const TensorLayoutSpec& a, const TensorLayoutSpec& b) {
  return a.kv_heads == b.kv_heads && a.head_dim == b.head_dim && a.bits == b.bits && a.page_size == b.page_size &&
         a.grouping == b.grouping && a.group == b.group && a.element == b.element && a.sink_tokens == b.sink_tokens &&
         a.residual_tokens == b.residual_tokens && a.window_rule == b.window_rule && a.outliers == b.outliers &&
         a.outlier_page_entries == b.outlier_page_entries;
}

bool same_rotation(const Rotation& a, const Rotation& b) {
  return a.kind == b.kind && a.matrix == b.matrix && a.centre == b.centre && a.pair_cos == b.pair_cos &&
         a.pair_sin == b.pair_sin;
}

// A sliding window of at least one token: a step's new token is exact, in
// the window, and read from its exact row only.
bool slides_over_new_tokens(const TensorLayoutSpec& spec) {
  return spec.window_rule == WindowRule::kSliding && spec.residual_tokens > 0;
}

// step_append_host's answer for a rotated step whose other conditions hold.
StepAppendHost rotated_step_host(const AppendParams& append, const DecodeParams& decode, const DecodePlan& plan) {
  const TensorLayoutSpec& keys = append.key_cache.layout.spec;
  // The query rotation's kernel holds the keys' matrix, and the values' is
  // the decode's too; it runs first, so that the exact blocks, and the
  // kernels that let them launch, start after it has stored the token.
  if (append.key_rotation.kind != RotationKind::kMatrix || !same_rotation(append.key_rotation, decode.key_rotation) ||
      !same_rotation(append.value_rotation, decode.value_rotation)) {
    return StepAppendHost::kNone;
  }
  if (!slides_over_new_tokens(keys) || !slides_over_new_tokens(append.value_cache.layout.spec)) {
    return StepAppendHost::kNone;
  }
  if (keys.head_dim != 64 && keys.head_dim != 128) return StepAppendHost::kNone;
  if (!plan.tensor_cores || plan.lookup || !plan.rotate_queries_first) return StepAppendHost::kNone;
  // Its second block per (KV head, sequence) must add no wave that the
  // decode's kernels would wait for.
  if (!plan.rotation_step_in_one_wave) return StepAppendHost::kNone;
  return StepAppendHost::kRotateQueries;
}

}  // namespace

StepAppendHost step_append_host(const AppendParams& append, const DecodeParams& decode, const DecodePlan& plan) {
  const TensorPageLayout& keys = append.key_cache.layout;
  const TensorPageLayout& values = append.value_cache.layout;
  // The token-parallel append's layouts (each token quantized on its own),
  // into the pools and page table the decode reads, as the decode lays
  // them out.
  if (!takes_token_parallel(append)) return StepAppendHost::kNone;
  if (append.key_cache.pages != decode.key_cache.pages || append.value_cache.pages != decode.value_cache.pages ||
      append.key_cache.exact != decode.key_cache.exact || append.value_cache.exact != decode.value_cache.exact ||
      append.batch.page_table != decode.batch.page_table || append.page_table != decode.batch.page_table ||
      append.batch.page_table_stride != decode.batch.page_table_stride ||
      !same_spec(keys.spec, decode.key_cache.layout.spec) || !same_spec(values.spec, decode.value_cache.layout.spec)) {
    return StepAppendHost::kNone;
  }
  // One new token per entry, the entries in the decode's order: what the
  // inline arrays show is checked; uploaded arrays are the caller's word
  // (rows == count).
  const int32_t count = decode.batch.count;
  if (append.batch.count != count || append.rows != count) return StepAppendHost::kNone;
  const InlineBatchArrays& a = append.inline_arrays;
  const InlineDecodeArrays& d = decode.inline_arrays;
  if (a.count != d.count || !inline_count_fits(d.count, count)) return StepAppendHost::kNone;
  for (int32_t i = 0; i < a.count; ++i) {
    if (a.slots[i] != d.slots[i] || a.lengths[i] + 1 != d.lengths[i] || a.token_offsets[i + 1] != i + 1) {
      return StepAppendHost::kNone;
    }
  }
  if (append.key_rotation.kind != RotationKind::kNone || append.value_rotation.kind != RotationKind::kNone) {
    return rotated_step_host(append, decode, plan);
  }
  // Without a rotation, sink or window the int8 kernel's 64-token steps
  // read it from its codes, and nothing else runs beside them.
  if (keys.spec.sink_tokens != 0 || keys.ring_capacity != 0 || values.ring_capacity != 0) {
    return StepAppendHost::kNone;
  }
  if (!plan.tensor_cores || !plan.int8 || plan.lookup || plan.int8_steps == Int8Steps::kSteps32 ||
      plan.exact_splits != 0) {
    return StepAppendHost::kNone;
  }
  // Some warp's run must end at every entry's new token: the plan's splits
  // cover the longest context (a plan made for these parameters does; one
  // kept from shorter ones would drop the token and its page's id).
  int64_t longest = longest_context(decode);
  for (int32_t i = 0; i < d.count; ++i) longest = std::max(longest, d.lengths[i]);
  if (int64_t{plan.splits} * plan.tokens_per_split < longest) return StepAppendHost::kNone;
  return StepAppendHost::kInt8Kernel;
}

bool DecodePlanner::launch_step(const AppendParams& append, const DecodeParams& decode, cudaStream_t stream) {
  check_params(decode);
  return run_step(append, decode, decode.batch.count > 0 ? plan(decode) : DecodePlan{}, stream);
}

bool DecodePlanner::launch_step(const AppendParams& append, const DecodeParams& decode, const DecodePlan& plan,
                                cudaStream_t stream) {
  check_params(decode);
  return run_step(append, decode, plan, stream);
}

bool DecodePlanner::run_step(const AppendParams& append, const DecodeParams& decode, const DecodePlan& plan,
                             cudaStream_t stream) {
  const StepAppendHost host = decode.batch.count > 0 ? step_append_host(append, decode, plan) : StepAppendHost::kNone;
  if (host == StepAppendHost::kNone) {
    launch_append(append, stream);
    if (decode.batch.count > 0) run(decode, plan, stream, nullptr, StepAppendHost::kNone);
    return false;
  }
  check_append_params(append);
  const StepAppendArgs step = step_append_args(append);
  run(decode, plan, stream, &step, host);
  return true;
}

int64_t decode_workspace_bytes(const DecodeParams& p) { return DecodePlanner().workspace_bytes(p); }

void launch_decode_attention(const DecodeParams& params, cudaStream_t stream) { DecodePlanner().launch(params, stream); }

}  // namespace kvforge::kernels
