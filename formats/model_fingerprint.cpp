#include "formats/model_fingerprint.h"

#include <nlohmann/json.hpp>

#include "formats/sha256.h"

namespace kvforge {

std::string rope_json(const RopeConfig& rope) {
  nlohmann::json json = {{"type", rope_type_name(rope.type)}, {"theta", rope.theta}};
  if (rope.type != RopeType::kDefault) json["factor"] = rope.factor;
  if (rope.type == RopeType::kLlama3) {
    json["low_freq_factor"] = rope.low_freq_factor;
    json["high_freq_factor"] = rope.high_freq_factor;
    json["original_max_position_embeddings"] = rope.original_max_position_embeddings;
  }
  return json.dump();  // nlohmann::json objects keep keys sorted
}

ModelFingerprint fingerprint_model(const ModelConfig& config, const Checkpoint& checkpoint,
                                   const std::string& tokenizer_sha256) {
  Sha256 weights;
  for (int64_t layer = 0; layer < config.num_layers; ++layer) {
    const std::string prefix = "model.layers." + std::to_string(layer) + ".self_attn.";
    for (const char* name : {"k_proj.weight", "v_proj.weight", "o_proj.weight"}) {
      weights.update(checkpoint.tensor(prefix + name).bytes);
    }
  }
  ModelFingerprint fingerprint;
  fingerprint.architecture = architecture_name(config.architecture);
  fingerprint.num_layers = config.num_layers;
  fingerprint.num_heads = config.num_heads;
  fingerprint.num_kv_heads = config.num_kv_heads;
  fingerprint.head_dim = config.head_dim;
  fingerprint.hidden_size = config.hidden_size;
  fingerprint.vocab_size = config.vocab_size;
  fingerprint.rope = rope_json(config.rope);
  fingerprint.kvo_sha256 = weights.hex_digest();
  fingerprint.tokenizer_sha256 = tokenizer_sha256;
  return fingerprint;
}

}  // namespace kvforge
