#include "eval/kernel_kv_cache.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "model/rope.h"
#ifdef KVFORGE_HAVE_CUDA_KERNELS
#include "kernels/cuda_backend.h"
#endif

namespace kvforge {
namespace {

kernels::ModelDimensions dimensions_of(const ModelConfig& config) {
  kernels::ModelDimensions dims;
  dims.num_layers = config.num_layers;
  dims.num_heads = config.num_heads;
  dims.num_kv_heads = config.num_kv_heads;
  dims.head_dim = config.head_dim;
  const at::Tensor frequencies = rope_inverse_frequencies(config.rope, config.head_dim).to(at::kCPU, at::kFloat).contiguous();
  dims.rope_inverse_frequencies.assign(frequencies.data_ptr<float>(), frequencies.data_ptr<float>() + frequencies.numel());
  return dims;
}

kernels::ElementType element_of(c10::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return kernels::ElementType::kBFloat16;
    case at::kHalf: return kernels::ElementType::kFloat16;
    default: return kernels::ElementType::kFloat32;
  }
}

std::unique_ptr<kernels::KernelBackend> backend_for(const c10::Device& device) {
  if (!device.is_cuda()) return nullptr;  // the CPU reference
#ifdef KVFORGE_HAVE_CUDA_KERNELS
  return std::make_unique<kernels::CudaBackend>(device.has_index() ? device.index() : 0);
#else
  throw std::invalid_argument("--through-kernels on " + device.str() +
                              ": this kvforge was built without the CUDA kernels (no nvcc at build time)");
#endif
}

kernels::CacheOptions options_for(const Transformer& model, int64_t batch, int64_t capacity) {
  kernels::CacheOptions options;
  options.max_sequences = batch;
  options.max_context = capacity;
  options.element = element_of(model.target().dtype);
  options.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(model.config().head_dim)));
  return options;
}

// [B, heads, D] float32, contiguous, on the cache's side: the model's device
// (the CUDA kernels read device memory in place; the CPU reference, host
// memory): token t of a [B, heads, T, D] block.
at::Tensor step_rows(const at::Tensor& block, int64_t t) { return block.select(2, t).to(at::kFloat).contiguous(); }

// torch queues its kernels on its own stream, the CUDA backend on another:
// the inputs are complete before the runtime kernels read them.
void wait_for_torch(const at::Tensor& t) {
  if (t.is_cuda()) c10::cuda::device_synchronize();
}

}  // namespace

KernelKVCache::KernelKVCache(const Transformer& model, const QuantizerConfig& config, int64_t batch,
                             int64_t capacity)
    : cache_(config, dimensions_of(model.config()), options_for(model, batch, capacity),
             backend_for(model.target().device)),
      keys_pre_rope_(config.settings.keys_pre_rope),
      softmax_scale_(static_cast<float>(1.0 / std::sqrt(static_cast<double>(model.config().head_dim)))) {
  for (int64_t b = 0; b < batch; ++b) sequences_.push_back(cache_.add_sequence());
}

CachedKeysValues KernelKVCache::append(const NewKeysValues&) {
  throw std::logic_error("KernelKVCache: the model attends through append_and_attend()");
}

at::Tensor KernelKVCache::append_and_attend(const NewKeysValues& block, const at::Tensor& queries, double scale,
                                            int64_t window) {
  if (window > 0) {
    throw std::invalid_argument("--through-kernels: layer " + std::to_string(block.layer) +
                                " has a sliding window, which the runtime kernels do not implement");
  }
  if (std::abs(scale - softmax_scale_) > 1e-6 * softmax_scale_) {
    throw std::invalid_argument("--through-kernels: the model's softmax scale is not 1/sqrt(head_dim)");
  }
  const int64_t batch = queries.size(0), tokens = queries.size(2);
  if (batch != static_cast<int64_t>(sequences_.size()) || block.position_start != length_) {
    throw std::invalid_argument("KernelKVCache: a block of " + std::to_string(batch) + " rows at position " +
                                std::to_string(block.position_start) + " for a cache of " +
                                std::to_string(sequences_.size()) + " rows holding " + std::to_string(length_));
  }
  const at::Tensor& keys = keys_pre_rope_ ? block.keys_pre_rope : block.keys;
  std::vector<at::Tensor> outputs;
  for (int64_t t = 0; t < tokens; ++t) {
    kernels::AppendBatch step;
    step.sequences = sequences_;
    for (const int32_t sequence : sequences_) {
      step.positions.push_back(cache_.length(sequence, block.layer));
      step.tokens.push_back(1);
    }
    const at::Tensor k = step_rows(keys, t), v = step_rows(block.values, t);
    step.keys = k.data_ptr<float>();
    step.values = v.data_ptr<float>();
    step.backend_memory = true;
    wait_for_torch(k);
    cache_.append(block.layer, step);
    const at::Tensor q = step_rows(queries, t);
    at::Tensor out = at::empty_like(q);
    wait_for_torch(q);
    // Returns with the output written (the backend synchronizes).
    cache_.decode_attention(block.layer, sequences_, q.data_ptr<float>(), out.data_ptr<float>(), nullptr, true);
    outputs.push_back(out);
  }
  return at::stack(outputs, 2).to(queries.device(), queries.scalar_type());
}

void KernelKVCache::clear() {
  for (int32_t& sequence : sequences_) {
    cache_.remove_sequence(sequence);
    sequence = cache_.add_sequence();
  }
  length_ = 0;
}

}  // namespace kvforge
