#pragma once
// SHA-256 digests (hex) for fingerprints of models, tokenizers and data.
#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace kvforge {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(std::span<const std::byte> bytes);
  void update(std::string_view text);
  std::string hex_digest();  // finalizes; the object cannot be updated afterwards

 private:
  struct Context;
  std::unique_ptr<Context> context_;
};

std::string sha256_hex(std::string_view bytes);
std::string sha256_file_hex(const std::filesystem::path& path);

}  // namespace kvforge
