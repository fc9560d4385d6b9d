#pragma once
// The model the benchmarks measure when given no checkpoint: Llama-3-8B's
// shapes (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocab 128256,
// llama3 RoPE), filled with random weights by Transformer::random.
#include <cstdint>

#include "formats/hf_config.h"

namespace kvforge {

inline ModelConfig llama3_8b_shapes(int64_t layers) {
  ModelConfig config;
  config.architecture = Architecture::kLlama;
  config.model_type = "llama";
  config.vocab_size = 128256;
  config.hidden_size = 4096;
  config.intermediate_size = 14336;
  config.num_layers = layers;
  config.num_heads = 32;
  config.num_kv_heads = 8;
  config.head_dim = 128;
  config.max_position_embeddings = 131072;
  config.rms_norm_eps = 1e-5;
  config.rope = {RopeType::kLlama3, 500000.0, 8.0, 1.0, 4.0, 8192};
  config.layer_window.assign(static_cast<size_t>(layers), 0);
  return config;
}

}  // namespace kvforge
