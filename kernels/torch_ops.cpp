// The PyTorch custom-operator library of the runtime KV cache
// (libkvforge_torch_ops.so): TORCH_LIBRARY(kvforge) registers the custom class
// torch.classes.kvforge.QuantizedKVCache, which loads one configuration of a
// calibration artifact for a Hugging Face model directory and exposes
// QuantizedKVCache's sequences, append and decode_attention to Python and
// TorchScript (docs/serving.md). Tensors on the cache's device are handed to
// the kernels in place (AppendBatch::backend_memory); every refusal is a
// RuntimeError naming what was expected.
//
// Built with the CUDA kernels when KVFORGE_TORCH_OPS_CUDA is defined;
// without it a "cuda" device is refused.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Device.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "formats/artifact.h"
#include "formats/hf_config.h"
#include "formats/input_error.h"
#include "formats/model_fingerprint.h"
#include "kernels/quantized_kv_cache.h"
#include "model/rope.h"

#ifdef KVFORGE_TORCH_OPS_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "kernels/cuda_backend.h"
#endif

namespace kvforge {
namespace {

// Runs `body`, turning every exception but torch's own into a c10::Error
// (Python: RuntimeError) with the same one-line message.
template <class Body>
auto refusing(Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    C10_THROW_ERROR(Error, e.what());
  }
}

kernels::ElementType parse_element(const std::string& element) {
  if (element == "fp16") return kernels::ElementType::kFloat16;
  if (element == "bf16") return kernels::ElementType::kBFloat16;
  TORCH_CHECK(element == "fp32", "kvforge.QuantizedKVCache: element '", element, "': expected fp16, bf16 or fp32");
  return kernels::ElementType::kFloat32;
}

// The kernels' element type of a float32, float16 or bfloat16 tensor.
kernels::ElementType io_element(const at::Tensor& t, const char* method, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return kernels::ElementType::kFloat32;
    case at::kHalf: return kernels::ElementType::kFloat16;
    case at::kBFloat16: return kernels::ElementType::kBFloat16;
    default: break;
  }
  TORCH_CHECK(false, "kvforge.QuantizedKVCache.", method, ": ", name, " of dtype ", t.scalar_type(),
              ": expected float32, float16 or bfloat16");
  return kernels::ElementType::kFloat32;  // not reached
}

c10::Device parse_device(const std::string& device) {
  c10::Device parsed(c10::kCPU);
  try {
    parsed = c10::Device(device);
  } catch (const c10::Error&) {
    TORCH_CHECK(false, "kvforge.QuantizedKVCache: device '", device, "': expected cpu, cuda or cuda:N");
  }
  TORCH_CHECK(parsed.is_cpu() || parsed.is_cuda(), "kvforge.QuantizedKVCache: device '", device,
              "': expected cpu, cuda or cuda:N");
#ifndef KVFORGE_TORCH_OPS_CUDA
  TORCH_CHECK(parsed.is_cpu(), "kvforge.QuantizedKVCache: device '", device,
              "': this library was built without the CUDA kernels: expected cpu");
#endif
  if (parsed.is_cuda() && !parsed.has_index()) parsed.set_index(0);
#ifdef KVFORGE_TORCH_OPS_CUDA
  // Checked here, in torch's terms, rather than met as cudaSetDevice's
  // "invalid device ordinal" inside the backend.
  if (parsed.is_cuda()) {
    const int count = c10::cuda::device_count();
    TORCH_CHECK(count > 0, "kvforge.QuantizedKVCache: device '", device, "': this process sees no CUDA device: expected cpu");
    TORCH_CHECK(parsed.index() < count, "kvforge.QuantizedKVCache: device '", device, "': this process sees ", count,
                " CUDA device(s): expected cuda:0..cuda:", count - 1);
  }
#endif
  return parsed;
}

const QuantizerConfig& find_config(const Artifact& artifact, const std::string& name, const std::string& file) {
  std::string names;
  for (const QuantizerConfig& config : artifact.configs) {
    if (config.name == name) return config;
    names += (names.empty() ? "" : ", ") + config.name;
  }
  throw InputError(file, "/configs/" + name, "no such configuration: expected one of " + names);
}

// The artifact was fitted for a model of these shapes and this RoPE (the
// weight hashes are not recomputed here: that would read the checkpoint).
void check_model_shapes(const Artifact& artifact, const ModelConfig& model, const std::string& file) {
  const ModelFingerprint& fitted = artifact.model;
  const auto expect = [&](bool same, const std::string& field, const std::string& ours, const std::string& theirs) {
    if (!same) throw InputError(file, "model." + field, "fitted for " + theirs + ", the model directory has " + ours);
  };
  expect(fitted.architecture == architecture_name(model.architecture), "architecture",
         architecture_name(model.architecture), fitted.architecture);
  expect(fitted.num_layers == model.num_layers, "num_layers", std::to_string(model.num_layers),
         std::to_string(fitted.num_layers));
  expect(fitted.num_heads == model.num_heads, "num_heads", std::to_string(model.num_heads),
         std::to_string(fitted.num_heads));
  expect(fitted.num_kv_heads == model.num_kv_heads, "num_kv_heads", std::to_string(model.num_kv_heads),
         std::to_string(fitted.num_kv_heads));
  expect(fitted.head_dim == model.head_dim, "head_dim", std::to_string(model.head_dim),
         std::to_string(fitted.head_dim));
  expect(fitted.rope == rope_json(model.rope), "rope", rope_json(model.rope), fitted.rope);
}

kernels::ModelDimensions dimensions_of(const ModelConfig& model) {
  kernels::ModelDimensions d;
  d.num_layers = model.num_layers;
  d.num_heads = model.num_heads;
  d.num_kv_heads = model.num_kv_heads;
  d.head_dim = model.head_dim;
  const at::Tensor inverse = rope_inverse_frequencies(model.rope, model.head_dim).contiguous();
  d.rope_inverse_frequencies.assign(inverse.data_ptr<float>(), inverse.data_ptr<float>() + inverse.numel());
  return d;
}

std::vector<int32_t> sequence_ids(const std::vector<int64_t>& sequences, const char* method) {
  std::vector<int32_t> ids;
  for (int64_t s : sequences) {
    TORCH_CHECK(s >= 0 && s <= INT32_MAX, "kvforge.QuantizedKVCache.", method, ": sequence ", s,
                ": expected an id from add_sequence()");
    ids.push_back(static_cast<int32_t>(s));
  }
  return ids;
}

}  // namespace

// torch.classes.kvforge.QuantizedKVCache.
class QuantizedKVCacheClass : public torch::CustomClassHolder {
 public:
  QuantizedKVCacheClass(std::string artifact_path, std::string config_name, std::string model_dir,
                        std::string device, int64_t page_size, int64_t max_sequences, int64_t max_context,
                        std::string element, bool asynchronous_append)
      : device_(parse_device(device)), asynchronous_append_(asynchronous_append) {
    refusing([&] {
      const Artifact artifact = read_artifact(artifact_path);
      const QuantizerConfig& config = find_config(artifact, config_name, artifact_path);
      const ModelConfig model = load_model_config(model_dir);
      check_model_shapes(artifact, model, artifact_path);
      kernels::CacheOptions options;
      options.page_size = page_size;
      options.max_sequences = max_sequences;
      options.max_context = max_context;
      options.element = parse_element(element);
      options.asynchronous_append = asynchronous_append;
      std::unique_ptr<kernels::KernelBackend> backend;
#ifdef KVFORGE_TORCH_OPS_CUDA
      if (device_.is_cuda()) {
        auto cuda = std::make_unique<kernels::CudaBackend>(device_.index());
        backend_stream_ = cuda->stream();
        backend = std::move(cuda);
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&torch_ready_, cudaEventDisableTiming));
        C10_CUDA_CHECK(cudaEventCreateWithFlags(&backend_done_, cudaEventDisableTiming));
      }
#endif
      layers_ = model.num_layers;
      heads_ = model.num_heads;
      kv_heads_ = model.num_kv_heads;
      head_dim_ = model.head_dim;
      keys_pre_rope_ = config.settings.keys_pre_rope;
      cache_ = std::make_unique<kernels::QuantizedKVCache>(config, dimensions_of(model), options, std::move(backend));
    });
  }

  ~QuantizedKVCacheClass() override {
#ifdef KVFORGE_TORCH_OPS_CUDA
    if (torch_ready_ != nullptr) cudaEventDestroy(torch_ready_);  // no throwing from a destructor
    if (backend_done_ != nullptr) cudaEventDestroy(backend_done_);
#endif
  }
  QuantizedKVCacheClass(const QuantizedKVCacheClass&) = delete;
  QuantizedKVCacheClass& operator=(const QuantizedKVCacheClass&) = delete;

  int64_t add_sequence() {
    return refusing([&] { return static_cast<int64_t>(cache_->add_sequence()); });
  }
  void remove_sequence(int64_t sequence) {
    refusing([&] { cache_->remove_sequence(sequence_ids({sequence}, "remove_sequence")[0]); });
  }
  int64_t length(int64_t sequence, int64_t layer) {
    check_layer("length", layer);
    return refusing([&] { return cache_->length(sequence_ids({sequence}, "length")[0], layer); });
  }
  bool keys_pre_rope() const { return keys_pre_rope_; }
  std::string name() const { return cache_->name(); }
  std::string device() const { return device_.str(); }

  // keys, values [sum(tokens), kv_heads, head_dim] on the cache's device,
  // contiguous, in sequence order, both float32, float16 or bfloat16 (the
  // same dtype); each value is rounded once to the cache's element type.
  void append(int64_t layer, const at::Tensor& keys, const at::Tensor& values, std::vector<int64_t> sequences,
              std::vector<int64_t> tokens) {
    check_layer("append", layer);
    check_append_rows("append", keys, values, sequences, tokens);
    refusing([&] {
      const kernels::AppendBatch batch = append_batch("append", layer, keys, values, sequences, tokens);
      order_after_torch();
      cache_->append(layer, batch);
      // Asynchronous: the kernel reads keys and values after the call; torch
      // must not hand their memory to a new tensor before it has. Torch's
      // stream waits for it on the device: a block freed on that stream is
      // reused only by work queued after the wait. (recordStream on the
      // backend's stream did it too, but the allocator records an event on
      // that stream when the tensor dies, a segfault once the cache, and its
      // stream, had been destroyed first.)
      if (asynchronous_append_) order_torch_after();
    });
  }

  // One decoding step of the layer: append's keys, values, sequences and
  // tokens, then decode_attention's queries over the same sequences (one
  // each, at its new last position); returns decode_attention's output
  // (QuantizedKVCache::decode_step). With asynchronous_append the call
  // returns once both are queued, and torch's stream waits for them on the
  // device.
  at::Tensor decode_step(int64_t layer, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& queries,
                         std::vector<int64_t> sequences, std::vector<int64_t> tokens) {
    check_layer("decode_step", layer);
    check_append_rows("decode_step", keys, values, sequences, tokens);
    const auto count = static_cast<int64_t>(sequences.size());
    check_rows("decode_step", "queries", queries, {count, heads_, head_dim_}, "[len(sequences), num_heads, head_dim]");
    const kernels::ElementType io = io_element(queries, "decode_step", "queries");
    at::Tensor output = at::empty({count, heads_, head_dim_}, queries.options());
    refusing([&] {
      const kernels::AppendBatch batch = append_batch("decode_step", layer, keys, values, sequences, tokens);
      order_after_torch();
      cache_->decode_step(layer, batch, queries.const_data_ptr(), output.mutable_data_ptr(), /*backend_memory=*/true,
                          io);
      if (asynchronous_append_) order_torch_after();  // else the output was complete on return
    });
    return output;
  }

  // Waits for every queued append; reports an outlier pool an asynchronous
  // append exhausted (RuntimeError).
  void synchronize() {
    refusing([&] { cache_->synchronize(); });
  }
  bool asynchronous_append() const { return asynchronous_append_; }

  // queries [S, heads, head_dim] (post-RoPE) float32, float16 or bfloat16
  // on the cache's device, one per sequence; returns [S, heads, head_dim] of
  // the queries' dtype (attention in float32, rounded once to it).
  at::Tensor decode_attention(int64_t layer, const at::Tensor& queries, std::vector<int64_t> sequences) {
    check_layer("decode_attention", layer);
    const auto count = static_cast<int64_t>(sequences.size());
    check_rows("decode_attention", "queries", queries, {count, heads_, head_dim_},
               "[len(sequences), num_heads, head_dim]");
    const kernels::ElementType io = io_element(queries, "decode_attention", "queries");
    at::Tensor output = at::empty({count, heads_, head_dim_}, queries.options());
    refusing([&] {
      const std::vector<int32_t> ids = sequence_ids(sequences, "decode_attention");
      order_after_torch();
      cache_->decode_attention(layer, ids, queries.const_data_ptr(), output.mutable_data_ptr(), nullptr,
                               /*backend_memory=*/true, io);
    });
    return output;
  }

 private:
  void check_layer(const char* method, int64_t layer) const {
    TORCH_CHECK(layer >= 0 && layer < layers_, "kvforge.QuantizedKVCache.", method, ": no such layer ", layer,
                ": expected 0..", layers_ - 1);
  }
  // append's rows: one token count (>= 0) per sequence, keys and values of
  // one dtype and [sum(tokens), kv_heads, head_dim].
  void check_append_rows(const char* method, const at::Tensor& keys, const at::Tensor& values,
                         const std::vector<int64_t>& sequences, const std::vector<int64_t>& tokens) const {
    TORCH_CHECK(sequences.size() == tokens.size(), "kvforge.QuantizedKVCache.", method, ": ", sequences.size(),
                " sequences and ", tokens.size(), " token counts: expected one count per sequence");
    int64_t rows = 0;
    for (int64_t t : tokens) {
      TORCH_CHECK(t >= 0, "kvforge.QuantizedKVCache.", method, ": token count ", t, ": expected >= 0");
      rows += t;
    }
    check_rows(method, "keys", keys, {rows, kv_heads_, head_dim_}, "[sum(tokens), kv_heads, head_dim]");
    check_rows(method, "values", values, {rows, kv_heads_, head_dim_}, "[sum(tokens), kv_heads, head_dim]");
    io_element(keys, method, "keys");
    TORCH_CHECK(values.scalar_type() == keys.scalar_type(), "kvforge.QuantizedKVCache.", method, ": values of dtype ",
                values.scalar_type(), " with keys of dtype ", keys.scalar_type(), ": expected the keys' dtype");
  }
  // The checked rows as the cache's batch, at the sequences' lengths.
  kernels::AppendBatch append_batch(const char* method, int64_t layer, const at::Tensor& keys, const at::Tensor& values,
                                    const std::vector<int64_t>& sequences, const std::vector<int64_t>& tokens) const {
    kernels::AppendBatch batch;
    batch.sequences = sequence_ids(sequences, method);
    for (int32_t s : batch.sequences) batch.positions.push_back(cache_->length(s, layer));
    batch.tokens = tokens;
    batch.keys = keys.const_data_ptr();
    batch.values = values.const_data_ptr();
    batch.input = io_element(keys, method, "keys");
    batch.backend_memory = true;
    return batch;
  }

  void check_rows(const char* method, const char* name, const at::Tensor& t, const std::vector<int64_t>& shape,
                  const char* shape_text) const {
    TORCH_CHECK(t.device() == device_, "kvforge.QuantizedKVCache.", method, ": ", name, " on ", t.device().str(),
                ": expected the cache's device ", device_.str());
    io_element(t, method, name);
    TORCH_CHECK(t.sizes().vec() == shape, "kvforge.QuantizedKVCache.", method, ": ", name, " of shape ", t.sizes(),
                ": expected ", c10::IntArrayRef(shape), " ", shape_text);
    TORCH_CHECK(t.is_contiguous(), "kvforge.QuantizedKVCache.", method, ": ", name,
                " is not contiguous: expected a contiguous tensor (call .contiguous())");
  }

  // The kernels run on the backend's own stream: it waits, on the device,
  // for what torch's current stream has queued (the inputs' producers, the
  // last users of the output's memory), without a host sync.
  void order_after_torch() const {
#ifdef KVFORGE_TORCH_OPS_CUDA
    if (!device_.is_cuda()) return;
    // One event, recorded anew per call: a wait uses the record made before it.
    C10_CUDA_CHECK(cudaEventRecord(torch_ready_, c10::cuda::getCurrentCUDAStream(device_.index()).stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(backend_stream_, torch_ready_, 0));
#endif
  }

  // Torch's current stream waits, on the device, for what the backend's has
  // queued (an asynchronous append's reads of its inputs, a queued
  // decode_step's output).
  void order_torch_after() const {
#ifdef KVFORGE_TORCH_OPS_CUDA
    if (!device_.is_cuda()) return;
    C10_CUDA_CHECK(cudaEventRecord(backend_done_, backend_stream_));
    C10_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_.index()).stream(), backend_done_, 0));
#endif
  }

  c10::Device device_;
  bool asynchronous_append_ = false;
#ifdef KVFORGE_TORCH_OPS_CUDA
  cudaStream_t backend_stream_ = nullptr;
  cudaEvent_t torch_ready_ = nullptr;  // torch's stream at the call, for the backend's to wait on
  cudaEvent_t backend_done_ = nullptr;  // the backend's stream after a queued call, for torch's to wait on
#endif
  int64_t layers_ = 0, heads_ = 0, kv_heads_ = 0, head_dim_ = 0;
  bool keys_pre_rope_ = false;
  std::unique_ptr<kernels::QuantizedKVCache> cache_;
};

TORCH_LIBRARY(kvforge, m) {
  m.class_<QuantizedKVCacheClass>("QuantizedKVCache")
      .def(torch::init<std::string, std::string, std::string, std::string, int64_t, int64_t, int64_t, std::string,
                       bool>(),
           "", {torch::arg("artifact"), torch::arg("config"), torch::arg("model_dir"), torch::arg("device"),
                torch::arg("page_size"), torch::arg("max_sequences"), torch::arg("max_context"), torch::arg("element"),
                torch::arg("asynchronous_append") = false})
      .def("add_sequence", &QuantizedKVCacheClass::add_sequence)
      .def("remove_sequence", &QuantizedKVCacheClass::remove_sequence)
      .def("length", &QuantizedKVCacheClass::length)
      .def("keys_pre_rope", &QuantizedKVCacheClass::keys_pre_rope)
      .def("name", &QuantizedKVCacheClass::name)
      .def("device", &QuantizedKVCacheClass::device)
      .def("append", &QuantizedKVCacheClass::append)
      .def("synchronize", &QuantizedKVCacheClass::synchronize)
      .def("asynchronous_append", &QuantizedKVCacheClass::asynchronous_append)
      .def("decode_attention", &QuantizedKVCacheClass::decode_attention)
      .def("decode_step", &QuantizedKVCacheClass::decode_step);
}

}  // namespace kvforge
