#include "tools/text_input.h"

#include <fstream>
#include <sstream>

#include "formats/input_error.h"

namespace kvforge::cli {

std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path.string(), "", "cannot open the text file");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

Tokenizer load_tokenizer(const std::filesystem::path& model_dir) {
  const auto path = model_dir / "tokenizer.json";
  if (!std::filesystem::exists(path)) {
    throw InputError(path.string(), "", "the model folder has no tokenizer.json");
  }
  return Tokenizer::from_file(path);
}

std::optional<int32_t> bos_token(const ModelConfig& config, bool disabled) {
  if (disabled || !config.bos_token_id) return std::nullopt;
  return static_cast<int32_t>(*config.bos_token_id);
}

}  // namespace kvforge::cli
