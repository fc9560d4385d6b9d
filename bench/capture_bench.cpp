// Capture throughput against a plain forward pass of the same model, in one
// run (bench/README.md). Default model: Llama-3-8B shapes with random weights.
//
//   kvforge_bench_capture [--device cuda] [--seq-len 2048] [--iters 5] [--layers 32] [--out FILE]
//
// Measures, per window of seq-len tokens (batch 1):
//   forward          model.forward (logits), nothing recorded
//   forward_hidden   the decoder stack without the LM head, nothing recorded:
//                    the same work as record_qkv minus the recording
//   record_qkv       forward recording q, k_pre, k_post, v to pinned host memory
//   record_fisher    the same plus the Fisher pass (layer-wise recomputed backward)
//   store_qkv        record_qkv written to an uncompressed HDF5 store (disk-bound)
// and with --long-context N: the Fisher pass over one window of N tokens
// (recorded tensors discarded), its time and peak GPU memory, to show that
// layer-wise recomputation fits the model's whole context on one GPU.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>

#include "bench/llama3_shapes.h"
#include "capture/activation_recorder.h"
#include "capture/capture.h"
#include "capture/host_stager.h"
#include "formats/activation_store.h"
#include "model/transformer.h"

namespace kvforge {
namespace {

void synchronize(const c10::Device& device) {
  if (device.is_cuda()) c10::cuda::device_synchronize();
}

// Mean seconds per call after `warmup` untimed calls.
double time_per_call(const c10::Device& device, int warmup, int iters, const std::function<void()>& call) {
  for (int i = 0; i < warmup; ++i) call();
  synchronize(device);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) call();
  synchronize(device);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
}

}  // namespace
}  // namespace kvforge

int main(int argc, char** argv) {
  using namespace kvforge;
  CLI::App app{"capture throughput against a plain forward pass"};
  std::string device_name = "cuda";
  int64_t seq_len = 2048;
  int64_t layers = 32;
  int iters = 5;
  int warmup = 2;
  std::string out;
  std::vector<int64_t> long_contexts;
  std::string store_dir = std::filesystem::temp_directory_path().string();
  app.add_option("--device", device_name)->capture_default_str();
  app.add_option("--seq-len", seq_len)->capture_default_str();
  app.add_option("--layers", layers, "Decoder layers (32 for Llama-3-8B)")->capture_default_str();
  app.add_option("--iters", iters)->capture_default_str();
  app.add_option("--warmup", warmup)->capture_default_str();
  app.add_option("--store-dir", store_dir, "Where the store_qkv run writes")->capture_default_str();
  app.add_option("--out", out, "Write the JSON result here too");
  app.add_option("--long-context", long_contexts, "Fisher pass over one window of each of these lengths");
  CLI11_PARSE(app, argc, argv);

  const c10::Device device = parse_device(device_name);
  const ComputeTarget target{device, device.is_cuda() ? c10::kBFloat16 : c10::kFloat,
                             device.is_cuda() ? AttentionBackend::kFused : AttentionBackend::kEager};
  const ModelConfig config = llama3_8b_shapes(layers);
  const Transformer model = Transformer::random(config, target, 1234);
  const at::Tensor ids = at::randint(1, config.vocab_size, {1, seq_len}, at::TensorOptions().dtype(at::kLong)).to(device);
  const std::vector<ActivationField> qkv = {ActivationField::kQueries, ActivationField::kKeysPreRope,
                                            ActivationField::kKeysPostRope, ActivationField::kValues};
  HostStager stager(device);
  auto record = [&](const std::vector<ActivationField>& fields) {
    int64_t bytes = 0;
    record_activations(model, ids, {fields, 1024}, [&](ActivationField, int64_t, const at::Tensor& values) {
      bytes += values.numel() * values.element_size();
      stager.stage(values[0], [](const at::Tensor&) {});
    });
    stager.drain();
    return bytes;
  };

  nlohmann::json result;
  const double forward = time_per_call(device, warmup, iters, [&] {
    c10::InferenceMode guard;
    model.forward(ids);
  });
  const double forward_hidden = time_per_call(device, warmup, iters, [&] {
    c10::InferenceMode guard;
    model.hidden_states(ids);
  });
  int64_t recorded_bytes = 0;
  const double record_qkv = time_per_call(device, warmup, iters, [&] { recorded_bytes = record(qkv); });
  const double record_fisher = time_per_call(device, 1, std::max(1, iters / 2), [&] { record(all_activation_fields()); });

  // The real capture loop into an uncompressed store.
  ActivationStoreLayout layout;
  layout.model.architecture = "LlamaForCausalLM";
  layout.model.num_layers = config.num_layers;
  layout.model.num_heads = config.num_heads;
  layout.model.num_kv_heads = config.num_kv_heads;
  layout.model.head_dim = config.head_dim;
  layout.model.hidden_size = config.hidden_size;
  layout.model.vocab_size = config.vocab_size;
  layout.model.rope = "{}";
  layout.model.kvo_sha256 = "random";
  layout.model.tokenizer_sha256 = "none";
  const int store_samples = 2;
  layout.provenance = {"random", "none", seq_len, store_samples, seq_len, 0, false, "bf16", device.str(), "bench", "bench"};
  layout.fields = qkv;
  layout.compression_level = 0;
  const auto store_path = std::filesystem::path(store_dir) / "kvforge-bench-capture.h5";
  std::vector<int32_t> stream(static_cast<size_t>(seq_len));
  for (size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<int32_t>(1 + (i * 7919) % (config.vocab_size - 1));
  double store_qkv = 0;
  {
    ActivationStoreWriter writer = ActivationStoreWriter::create(store_path, layout);
    CaptureSettings settings;
    settings.samples = store_samples;
    settings.seq_len = seq_len;
    settings.recorder.fields = qkv;
    synchronize(device);
    const auto start = std::chrono::steady_clock::now();
    run_capture(model, stream, settings, writer);
    store_qkv = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / store_samples;
  }
  std::filesystem::remove(store_path);

  for (const int64_t length : long_contexts) {
    const at::Tensor long_ids =
        at::randint(1, config.vocab_size, {1, length}, at::TensorOptions().dtype(at::kLong)).to(device);
    if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
    synchronize(device);
    const auto start = std::chrono::steady_clock::now();
    int64_t recorded = 0;
    record_activations(model, long_ids, {all_activation_fields(), 1024},
                       [&](ActivationField, int64_t, const at::Tensor& values) { recorded += values.numel(); });
    synchronize(device);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    nlohmann::json entry = {{"seq_len", length}, {"seconds", seconds}, {"tokens_per_second", length / seconds},
                            {"recorded_elements", recorded}};
    if (device.is_cuda()) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
      entry["peak_gpu_bytes"] = stats.allocated_bytes[0].peak;
      entry["peak_gpu_gib"] = static_cast<double>(stats.allocated_bytes[0].peak) / (1ull << 30);
    }
    std::cerr << entry.dump() << std::endl;
    result["long_context_fisher"].push_back(entry);
  }

  const double tokens = static_cast<double>(seq_len);
  result["model"] = "Llama-3-8B shapes (" + std::to_string(layers) + " layers), random weights, " +
                    dtype_label(target.dtype) + ", " + attention_label(target.attention) + " attention";
  result["device"] = device.str();
  result["seq_len"] = seq_len;
  result["iters"] = iters;
  result["recorded_bytes_per_window_qkv"] = recorded_bytes;
  for (const auto& [name, seconds] : {std::pair{"forward", forward}, {"forward_hidden", forward_hidden},
                                      {"record_qkv", record_qkv}, {"record_fisher", record_fisher},
                                      {"store_qkv", store_qkv}}) {
    result["runs"][name] = {{"seconds_per_window", seconds},
                            {"tokens_per_second", tokens / seconds},
                            {"time_over_forward", seconds / forward},
                            {"time_over_forward_hidden", seconds / forward_hidden}};
  }
  // The target: recording q/k/v costs at most 10% over the plain
  // forward of the same computation.
  result["recording_overhead"] = record_qkv / forward_hidden - 1.0;
  std::cout << result.dump(2) << std::endl;
  if (!out.empty()) std::ofstream(out) << result.dump(2) << "\n";
  return 0;
}
