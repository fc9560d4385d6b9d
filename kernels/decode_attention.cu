// The launcher of the CUDA decode_attention (decode_attention_kernel.cuh):
// host checks with one-line errors, the split count, the workspace of the
// splits' states, the dispatch on head_dim, bits and the GQA group size,
// and the merge.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda_runtime_check.h"
#include "kernels/decode_attention_kernel.cuh"
#include "kernels/decode_attention_launch.h"

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
  if (p.batch.count > 65535) refuse("a batch of " + std::to_string(p.batch.count) + " sequences, more than 65535");
  if (p.batch.count > 0 && (p.batch.slots == nullptr || p.batch.lengths == nullptr || p.batch.page_table == nullptr ||
                            p.queries == nullptr || p.output == nullptr)) {
    refuse("a null slots, lengths, page_table, queries or output pointer");
  }
  if (p.keys_pre_rope && p.rope_inverse_frequencies == nullptr) refuse("pre-RoPE keys without RoPE frequencies");
  for (const Dequantization* dq : {&p.key_dequantization, &p.value_dequantization}) {
    if (dq->levels == nullptr) refuse("a null level table");
  }
}

template <int D, int kBits, int kWarps>
void launch_splits(const DecodeParams& p, const device::SplitWorkspace& workspace, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(workspace.max_splits), static_cast<unsigned>(p.key_cache.layout.spec.kv_heads),
                  static_cast<unsigned>(p.batch.count));
  device::decode_split_kernel<D, kBits, kWarps><<<grid, kWarps * device::kWarpSize, 0, stream>>>(p, workspace);
}

template <int D, int kBits>
void launch_splits_for_group(const DecodeParams& p, const device::SplitWorkspace& workspace, cudaStream_t stream) {
  const int group = p.num_heads / p.key_cache.layout.spec.kv_heads;
  // At least 4 warps dequantize; warps beyond the group only dequantize.
  if (group <= 4) {
    launch_splits<D, kBits, 4>(p, workspace, stream);
  } else if (group <= 8) {
    launch_splits<D, kBits, 8>(p, workspace, stream);
  } else {
    launch_splits<D, kBits, 16>(p, workspace, stream);
  }
}

template <int D>
void launch_for_head_dim(const DecodeParams& p, const device::SplitWorkspace& workspace, cudaStream_t stream) {
  if (p.key_cache.layout.spec.bits == 2) {
    launch_splits_for_group<D, 2>(p, workspace, stream);
  } else {
    launch_splits_for_group<D, 4>(p, workspace, stream);
  }
  const dim3 grid(static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch.count));
  device::decode_merge_kernel<D><<<grid, D, 0, stream>>>(p, workspace);
}

// Splits of the longest context a page table row can hold (sink plus
// stride * page_size tokens), so that no length is read back to the host;
// the blocks of splits past a sequence's length return at once.
int64_t max_splits(const DecodeParams& p) {
  if (p.tokens_per_split == 0) return 1;
  const TensorLayoutSpec& spec = p.key_cache.layout.spec;
  const int64_t max_tokens = spec.sink_tokens + p.batch.page_table_stride * spec.page_size;
  return std::max<int64_t>(1, (max_tokens + p.tokens_per_split - 1) / p.tokens_per_split);
}

}  // namespace

void launch_decode_attention(const DecodeParams& params, cudaStream_t stream) {
  check_params(params);
  if (params.batch.count == 0) return;
  const int64_t splits = max_splits(params);
  if (splits > 0x7fffffff) refuse("more than 2^31 - 1 context splits");
  const int64_t dim = params.key_cache.layout.spec.head_dim;
  const int64_t states = static_cast<int64_t>(params.batch.count) * params.num_heads * splits;
  void* memory = nullptr;
  KVFORGE_CUDA_CHECK(cudaMallocAsync(&memory, static_cast<size_t>(states * (dim + 2)) * sizeof(float), stream));
  device::SplitWorkspace workspace;
  workspace.max_sum = static_cast<float*>(memory);
  workspace.acc = workspace.max_sum + 2 * states;
  workspace.max_splits = static_cast<int32_t>(splits);
  if (dim == 64) {
    launch_for_head_dim<64>(params, workspace, stream);
  } else {
    launch_for_head_dim<128>(params, workspace, stream);
  }
  const cudaError_t launched = cudaGetLastError();
  KVFORGE_CUDA_CHECK(cudaFreeAsync(memory, stream));
  KVFORGE_CUDA_CHECK(launched);
}

}  // namespace kvforge::kernels
