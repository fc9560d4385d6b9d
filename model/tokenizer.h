#pragma once
// Hugging Face tokenizer.json: BPE models with byte-level pre-tokenization
// (GPT-2, Llama 3, Qwen 2/3) or SentencePiece-style normalization with byte
// fallback (Llama 2, Mistral), added and special tokens. encode() equals HF
// tokenizers token for token; anything the file uses that is not
// implemented is an InputError naming the component.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvforge {

class Tokenizer {
 public:
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json);
  static Tokenizer from_json(const std::string& json_text, const std::string& file_for_errors);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // add_special_tokens applies the post-processor's template (e.g. Llama's
  // leading <s>), as HF's encode(add_special_tokens=True) does. `text` must
  // be UTF-8 (InputError naming the byte offset otherwise). Thread-safe.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // Ids the tokenizer does not know are skipped, as HF does; invalid UTF-8
  // produced by byte-level tokens becomes U+FFFD.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  int64_t vocab_size() const;  // largest id + 1, added tokens included
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::string id_to_token(int32_t id) const;  // empty when unknown
  // SHA-256 of the tokenizer.json bytes, for fingerprints.
  const std::string& sha256() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvforge
