#pragma once
// `kvforge rotate` over a whole model: each layer's captured activations
// (an activation store) and o_proj weights (the checkpoint) through
// rotation_fit.h, one layer at a time on the options' device; and the key
// and value terms of any configuration (rotated or not) measured on another
// store, for the bench table.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "formats/activation_store.h"
#include "formats/safetensors.h"
#include "formats/quantizer_config.h"
#include "rotation/rotation_fit.h"

namespace kvforge {

struct ModelRotationOptions {
  RotationOptions rotation;
  std::string name;          // the rotated configuration's name; each base's is name + "-" + basis_name
  int64_t max_samples = 0;   // windows read from the store (0: every committed one)
  int64_t max_tokens = 0;    // leading positions of each window (0: all)
  int64_t max_layers = 0;    // the first layers only (0: all; a partial configuration, for tests)
  // Called after each layer with its index and fit (besides the log lines).
  std::function<void(int64_t, const LayerRotationFit&)> on_layer;
};

struct ModelRotation {
  QuantizerConfig rotated;             // settings copied, `rotation` set, every layer's quantizers refitted
  std::vector<QuantizerConfig> bases;  // one per options.rotation.fixed_bases, in order
};

// The windows a store of `samples` splits into: fit windows first, then
// round(samples * validation_fraction) validation windows (at least 1, at
// most samples - 1). std::invalid_argument for fewer than 2 windows or a
// fraction outside (0, 1).
struct WindowSplit {
  int64_t fit = 0, validation = 0;
};
WindowSplit split_windows(int64_t samples, double validation_fraction);

// Reads one layer of a store (fields q, the configuration's keys (k_pre or
// k_post), v, fisher_k/fisher_v when Fisher-weighted) and the layer's
// o_proj weight; the first `windows` windows, `tokens` leading positions,
// float32 on the CPU. InputError naming the store and the missing field, or
// the checkpoint and the o_proj weight of an unexpected shape.
RotationLayerData read_rotation_layer(const ActivationStoreReader& store, const Checkpoint& checkpoint,
                                      const QuantizerSettings& settings, int64_t layer, int64_t windows,
                                      int64_t tokens, bool fisher);

// Rotates a configuration with `settings` (e.g. an artifact's int2-rot or
// kvquant configuration; its fitted parameters are not used: every
// quantizer is refitted) on the store's captures. model_dir: the
// checkpoint the store was captured from (InputError when its k/v/o
// weights are not those of the store's fingerprint).
ModelRotation rotate_model(const ActivationStoreReader& store, const std::filesystem::path& model_dir,
                           const QuantizerSettings& settings, const ModelRotationOptions& options);

// The key term (KL, post-W_O output error and their weighted sum) and the
// value term (exact probabilities) of a configuration on a store, per layer
// and KV head, with the float64 simulation (quantize_simulation.h,
// rotation-aware) in front of the objective.
struct AttentionTermOptions {
  int64_t last_queries = 64;
  double key_kl_weight = 1.0, key_output_weight = 1.0;
  int64_t max_samples = 0, max_tokens = 0, max_layers = 0;  // as ModelRotationOptions
  c10::Device device = c10::Device(c10::kCPU);
  at::ScalarType dtype = at::kFloat;
};
struct LayerAttentionTerms {
  std::vector<double> key_kl, key_output, key, value;  // per KV head
};
std::vector<LayerAttentionTerms> measure_attention_terms(const ActivationStoreReader& store,
                                                         const std::filesystem::path& model_dir,
                                                         const QuantizerConfig& config,
                                                         const AttentionTermOptions& options);

}  // namespace kvforge
