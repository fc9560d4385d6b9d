#pragma once
// Memory-mapped safetensors checkpoints, single-file or sharded
// (model.safetensors.index.json). Headers are validated before anything is
// trusted: 8-byte length within bounds, JSON, known dtype, shape x element
// size equal to the byte range, ranges inside the data section and not
// overlapping. Every failure is an InputError naming file and tensor.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "formats/dtype.h"

namespace kvforge {

struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;  // points into the mapping; valid while the file lives
  std::filesystem::path file;        // for error messages
  int64_t numel() const;
};

// RAII read-only mapping of one file.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  std::span<const std::byte> bytes() const { return {data_, size_}; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// One .safetensors file.
class SafetensorsFile {
 public:
  // Upper bound on the JSON header, as the reference implementation uses.
  static constexpr uint64_t kMaxHeaderBytes = 100'000'000;

  explicit SafetensorsFile(const std::filesystem::path& path);
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::filesystem::path& path() const { return file_->path(); }

 private:
  std::unique_ptr<MappedFile> file_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory: model.safetensors, or the shards
// listed by model.safetensors.index.json (each shard must hold exactly the
// tensors the index assigns to it).
class Checkpoint {
 public:
  explicit Checkpoint(const std::filesystem::path& model_dir);

  bool contains(const std::string& name) const;
  // Throws InputError naming the directory and the tensor when absent.
  const TensorView& tensor(const std::string& name) const;
  // Also checks the shape: InputError "expected shape [a, b], got [c, d]".
  const TensorView& tensor(const std::string& name, const std::vector<int64_t>& shape) const;
  std::vector<std::string> names() const;
  const std::filesystem::path& directory() const { return dir_; }
  std::vector<std::filesystem::path> files() const;

 private:
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> shards_;
  std::map<std::string, const TensorView*> index_;
};

}  // namespace kvforge
