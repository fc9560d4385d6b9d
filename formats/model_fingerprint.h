#pragma once
// Identifies the model an activation store or artifact was made from: the
// shapes that quantizers depend on and a hash of the weights they act
// through (k_proj, v_proj, o_proj of every layer).
#include <string>

#include "formats/activation_store.h"
#include "formats/hf_config.h"
#include "formats/safetensors.h"

namespace kvforge {

ModelFingerprint fingerprint_model(const ModelConfig& config, const Checkpoint& checkpoint,
                                   const std::string& tokenizer_sha256);
// Canonical JSON of the RoPE settings (sorted keys), as fingerprints store it.
std::string rope_json(const RopeConfig& rope);

}  // namespace kvforge
