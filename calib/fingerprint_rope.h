#pragma once
// The RoPE settings back from a fingerprint's canonical JSON
// (formats/model_fingerprint.h rope_json: {"type", "theta", and "factor",
// "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"
// for the scaled types}), so that quantizers of pre-RoPE keys can rotate
// dequantized keys exactly as the model does.
#include <string>

#include "formats/hf_config.h"

namespace kvforge {

// InputError naming `file_for_errors` and "/model@rope" for malformed JSON,
// an unknown type or a missing or mistyped member.
RopeConfig parse_rope_json(const std::string& json_text, const std::string& file_for_errors);

}  // namespace kvforge
