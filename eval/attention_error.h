#pragma once
// Post-W_O attention-output error per layer of a configuration on held-out
// captures (an activation store of the model): rotation/model_rotation.h's
// measure_attention_terms (the float64 quantization simulation, rotations
// applied and undone, in front of the rotation objective's key and value
// terms), averaged over each layer's KV heads.
#include <cstdint>
#include <filesystem>
#include <vector>

#include "eval/evaluation.h"
#include "formats/activation_store.h"
#include "formats/quantizer_config.h"
#include "rotation/model_rotation.h"

namespace kvforge {

// One LayerAttentionError per layer measured (options.max_layers, else
// every layer of the store): key_kl, key_output and value_output are the
// means over KV heads of measure_attention_terms' key_kl, key_output and
// value. config == nullptr: the 16-bit cache, which stores the captured
// keys and values exactly: zeros, nothing read. InputError (from
// measure_attention_terms) for a store of another model or one missing a
// field the configuration needs.
std::vector<LayerAttentionError> measure_attention_error(const ActivationStoreReader& store,
                                                         const std::filesystem::path& model_dir,
                                                         const QuantizerConfig* config,
                                                         const AttentionTermOptions& options);

// Pure: the per-head terms of each layer averaged over heads (layer = its
// index). std::invalid_argument for a layer without heads or with terms of
// different head counts.
std::vector<LayerAttentionError> mean_over_kv_heads(const std::vector<LayerAttentionTerms>& terms);

}  // namespace kvforge
