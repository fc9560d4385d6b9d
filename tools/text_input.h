#pragma once
// Reading the text a command evaluates and the tokenizer of a model folder.
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "formats/hf_config.h"
#include "model/tokenizer.h"

namespace kvforge::cli {

std::string read_text_file(const std::filesystem::path& path);  // InputError when unreadable
Tokenizer load_tokenizer(const std::filesystem::path& model_dir);
// The BOS id to prepend: config.json's bos_token_id unless disabled.
std::optional<int32_t> bos_token(const ModelConfig& config, bool disabled);

}  // namespace kvforge::cli
