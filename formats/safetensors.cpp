#include "formats/safetensors.h"
#include "formats/json_error_text.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "formats/input_error.h"

namespace kvforge {
namespace {

using json = nlohmann::json;

constexpr uint64_t kLengthPrefixBytes = 8;
constexpr const char* kIndexFileName = "model.safetensors.index.json";
constexpr const char* kSingleFileName = "model.safetensors";

std::string format_shape(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}


uint64_t read_u64_le(std::span<const std::byte> bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | std::to_integer<uint64_t>(bytes[i]);
  return value;
}

// Non-negative JSON integer that fits in int64 (nlohmann keeps positive
// numbers as unsigned, so a huge value would wrap if read as int64 blindly).
std::optional<uint64_t> as_non_negative(const json& value) {
  if (value.is_number_unsigned()) {
    const auto v = value.get<uint64_t>();
    if (v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return v;
    return std::nullopt;
  }
  if (value.is_number_integer() && value.get<int64_t>() >= 0) return value.get<int64_t>();
  return std::nullopt;
}

// One header entry after validation, before it is turned into a view.
struct Entry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

DType parse_dtype_field(const json& entry, const std::string& file, const std::string& name) {
  const auto it = entry.find("dtype");
  if (it == entry.end()) throw InputError(file, name, "dtype: a dtype string; field missing");
  if (!it->is_string()) throw InputError(file, name, "dtype: a string, got " + quote_json(*it));
  const auto dtype = parse_safetensors_dtype(it->get<std::string>());
  if (!dtype) {
    throw InputError(file, name, "dtype: one of F32, F16, BF16; got " + it->get<std::string>());
  }
  return *dtype;
}

std::vector<int64_t> parse_shape_field(const json& entry, const std::string& file,
                                       const std::string& name) {
  const auto it = entry.find("shape");
  if (it == entry.end()) throw InputError(file, name, "shape: a list of dimensions; field missing");
  if (!it->is_array()) throw InputError(file, name, "shape: a list of integers, got " + quote_json(*it));
  std::vector<int64_t> shape;
  for (const auto& dim : *it) {
    const auto value = as_non_negative(dim);
    if (!value) {
      throw InputError(file, name, "shape: non-negative integer dimensions, got " + quote_json(*it));
    }
    shape.push_back(static_cast<int64_t>(*value));
  }
  return shape;
}

std::pair<uint64_t, uint64_t> parse_offsets_field(const json& entry, const std::string& file,
                                                  const std::string& name) {
  const auto it = entry.find("data_offsets");
  if (it == entry.end()) {
    throw InputError(file, name, "data_offsets: [begin, end]; field missing");
  }
  const auto expected = "data_offsets: [begin, end] of non-negative integers, got " + quote_json(*it);
  if (!it->is_array() || it->size() != 2) throw InputError(file, name, expected);
  const auto begin = as_non_negative((*it)[0]);
  const auto end = as_non_negative((*it)[1]);
  if (!begin || !end) throw InputError(file, name, expected);
  if (*begin > *end) {
    throw InputError(file, name,
                     "data_offsets: begin <= end, got [" + std::to_string(*begin) + ", " +
                         std::to_string(*end) + "]");
  }
  return {*begin, *end};
}

// Bytes the shape needs; nullopt when a lying header makes it overflow.
std::optional<uint64_t> checked_byte_count(const std::vector<int64_t>& shape, DType dtype) {
  uint64_t count = element_size(dtype);
  for (const int64_t dim : shape) {
    if (__builtin_mul_overflow(count, static_cast<uint64_t>(dim), &count)) return std::nullopt;
  }
  if (count > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return count;
}

Entry parse_entry(const std::string& name, const json& value, uint64_t data_size,
                  const std::string& file) {
  if (!value.is_object()) {
    throw InputError(file, name, "an object {dtype, shape, data_offsets}, got " + quote_json(value));
  }
  Entry entry{name, parse_dtype_field(value, file, name), parse_shape_field(value, file, name), 0, 0};
  std::tie(entry.begin, entry.end) = parse_offsets_field(value, file, name);

  const uint64_t span = entry.end - entry.begin;
  const auto size = element_size(entry.dtype);
  const auto bytes = checked_byte_count(entry.shape, entry.dtype);
  if (!bytes) {
    throw InputError(file, name,
                     "shape " + format_shape(entry.shape) + " x " + std::to_string(size) +
                         " bytes overflows 64 bits, but data_offsets span " + std::to_string(span));
  }
  if (*bytes != span) {
    throw InputError(file, name,
                     "shape " + format_shape(entry.shape) + " x " + std::to_string(size) + " bytes = " +
                         std::to_string(*bytes) + " bytes, but data_offsets span " +
                         std::to_string(span));
  }
  if (entry.end > data_size) {
    throw InputError(file, name,
                     "data_offsets end " + std::to_string(entry.end) +
                         " within the data section of " + std::to_string(data_size) + " bytes");
  }
  return entry;
}

// Ranges must not share a byte. Gaps are accepted (the spec wants the data
// section fully covered, but Hugging Face tolerates padding).
void check_no_overlap(std::vector<Entry> entries, const std::string& file) {
  std::erase_if(entries, [](const Entry& e) { return e.begin == e.end; });
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  for (std::size_t i = 1; i < entries.size(); ++i) {
    const Entry& prev = entries[i - 1];
    const Entry& cur = entries[i];
    if (cur.begin < prev.end) {
      throw InputError(file, cur.name,
                       "data_offsets disjoint from other tensors, but [" + std::to_string(cur.begin) +
                           ", " + std::to_string(cur.end) + ") overlaps '" + prev.name + "' [" +
                           std::to_string(prev.begin) + ", " + std::to_string(prev.end) + ")");
    }
  }
}

std::map<std::string, std::string> parse_metadata(const json& value, const std::string& file) {
  const std::string expected = "an object of string values, got " + quote_json(value);
  if (!value.is_object()) throw InputError(file, "__metadata__", expected);
  std::map<std::string, std::string> metadata;
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) throw InputError(file, "__metadata__." + key, "a string, got " + quote_json(item));
    metadata.emplace(key, item.get<std::string>());
  }
  return metadata;
}

// Parses JSON text and rejects keys repeated in the top-level object:
// nlohmann would silently keep the last one, hiding an ambiguous header.
json parse_json_object(std::string_view text, const std::string& file, const std::string& what) {
  std::set<std::string> seen;
  std::optional<std::string> duplicate;
  const json::parser_callback_t callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && !seen.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json root;
  try {
    root = json::parse(text.begin(), text.end(), callback);
  } catch (const json::parse_error& error) {
    throw InputError(file, what, "valid JSON; " + parse_error_text(error));
  }
  if (!root.is_object()) throw InputError(file, what, "a JSON object, got " + quote_json(root));
  if (duplicate) throw InputError(file, *duplicate, "a key that appears once in the " + what);
  return root;
}

std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.is_open()) throw InputError(path.string(), "", "a readable file");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// A shard name from the index must stay inside the checkpoint directory.
bool is_contained_relative_path(const std::string& name) {
  const std::filesystem::path path(name);
  if (name.empty() || path.has_root_path()) return false;
  return std::none_of(path.begin(), path.end(), [](const auto& part) { return part == ".."; });
}

// tensor -> shard file name, as listed by the index.
std::map<std::string, std::string> parse_weight_map(const std::filesystem::path& index_path) {
  const std::string file = index_path.string();
  const json root = parse_json_object(read_text_file(index_path), file, "index");
  const auto it = root.find("weight_map");
  if (it == root.end()) throw InputError(file, "weight_map", "an object {tensor: shard file}; field missing");
  if (!it->is_object() || it->empty()) {
    throw InputError(file, "weight_map", "a non-empty object {tensor: shard file}, got " + quote_json(*it));
  }
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, shard] : it->items()) {
    if (!shard.is_string()) throw InputError(file, tensor, "a shard file name, got " + quote_json(shard));
    const auto name = shard.get<std::string>();
    if (!is_contained_relative_path(name)) {
      throw InputError(file, tensor,
                       "a shard file name inside the checkpoint directory, got '" + name + "'");
    }
    weight_map.emplace(tensor, name);
  }
  return weight_map;
}

// Each shard must hold exactly the tensors the index assigns to it.
void check_shard_matches_index(const SafetensorsFile& shard, const std::string& shard_name,
                               const std::map<std::string, std::string>& weight_map,
                               const std::string& index_file) {
  for (const auto& [tensor, assigned] : weight_map) {
    if (assigned == shard_name && !shard.tensors().contains(tensor)) {
      throw InputError(index_file, tensor, "listed in shard " + shard_name + ", which does not contain it");
    }
  }
  for (const auto& [tensor, view] : shard.tensors()) {
    const auto it = weight_map.find(tensor);
    if (it == weight_map.end()) {
      throw InputError(index_file, tensor, "listed in the index, as shard " + shard_name + " holds it");
    }
    if (it->second != shard_name) {
      throw InputError(index_file, tensor,
                       "in its indexed shard " + it->second + " only, but shard " + shard_name +
                           " holds it too");
    }
  }
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t count = 1;
  for (const int64_t dim : shape) count *= dim;
  return count;
}

// --- MappedFile --------------------------------------------------------------

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw InputError(path.string(), "", std::string("a readable file: ") + std::strerror(errno));
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    const int err = errno;
    ::close(fd);
    throw InputError(path.string(), "", std::string("a readable file: ") + std::strerror(err));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    throw InputError(path.string(), "", "a regular file");
  }
  size_ = static_cast<std::size_t>(info.st_size);
  if (size_ > 0) {  // mmap rejects length 0; an empty file maps to an empty span
    void* data = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    if (data == MAP_FAILED) {
      throw InputError(path.string(), "", std::string("a mappable file: ") + std::strerror(err));
    }
    data_ = static_cast<const std::byte*>(data);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
}

// --- SafetensorsFile ---------------------------------------------------------

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path)
    : file_(std::make_unique<MappedFile>(path)) {
  const std::string file = path.string();
  const auto bytes = file_->bytes();
  if (bytes.size() < kLengthPrefixBytes) {
    throw InputError(file, "header length",
                     "an 8-byte header length, but the file has " + std::to_string(bytes.size()) + " bytes");
  }
  const uint64_t header_size = read_u64_le(bytes);
  if (header_size > kMaxHeaderBytes) {
    throw InputError(file, "header length",
                     "at most " + std::to_string(kMaxHeaderBytes) + " bytes, got " + std::to_string(header_size));
  }
  const uint64_t available = bytes.size() - kLengthPrefixBytes;
  if (header_size > available) {
    throw InputError(file, "header length",
                     std::to_string(header_size) + " header bytes within the file, but only " +
                         std::to_string(available) + " follow the length (truncated?)");
  }

  const auto header_bytes = bytes.subspan(kLengthPrefixBytes, header_size);
  const std::string_view header_text(reinterpret_cast<const char*>(header_bytes.data()), header_bytes.size());
  const json header = parse_json_object(header_text, file, "header");
  const auto data = bytes.subspan(kLengthPrefixBytes + header_size);

  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      metadata_ = parse_metadata(value, file);
    } else {
      entries.push_back(parse_entry(name, value, data.size(), file));
    }
  }
  check_no_overlap(entries, file);

  for (auto& entry : entries) {
    const auto view_bytes = data.subspan(entry.begin, entry.end - entry.begin);
    tensors_.emplace(entry.name, TensorView{entry.name, entry.dtype, std::move(entry.shape), view_bytes, path});
  }
}

// --- Checkpoint --------------------------------------------------------------

Checkpoint::Checkpoint(const std::filesystem::path& model_dir) : dir_(model_dir) {
  const auto index_path = dir_ / kIndexFileName;
  const auto single_path = dir_ / kSingleFileName;

  if (std::filesystem::is_regular_file(index_path)) {
    const std::string index_file = index_path.string();
    const auto weight_map = parse_weight_map(index_path);
    std::set<std::string> shard_names;
    for (const auto& [tensor, shard] : weight_map) shard_names.insert(shard);

    for (const auto& shard_name : shard_names) {
      const auto shard_path = dir_ / shard_name;
      if (!std::filesystem::is_regular_file(shard_path)) {
        const auto& first = std::find_if(weight_map.begin(), weight_map.end(),
                                         [&](const auto& kv) { return kv.second == shard_name; })->first;
        throw InputError(index_file, first, "shard file " + shard_path.string() + " to exist; it does not");
      }
      auto shard = std::make_unique<SafetensorsFile>(shard_path);
      check_shard_matches_index(*shard, shard_name, weight_map, index_file);
      shards_.push_back(std::move(shard));
    }
  } else if (std::filesystem::is_regular_file(single_path)) {
    shards_.push_back(std::make_unique<SafetensorsFile>(single_path));
  } else {
    throw InputError(dir_.string(), "",
                     std::string("no ") + kSingleFileName + " or " + kIndexFileName + " in this directory");
  }

  for (const auto& shard : shards_) {
    for (const auto& [name, view] : shard->tensors()) index_.emplace(name, &view);
  }
}

bool Checkpoint::contains(const std::string& name) const { return index_.contains(name); }

const TensorView& Checkpoint::tensor(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) throw InputError(dir_.string(), name, "tensor missing from checkpoint");
  return *it->second;
}

const TensorView& Checkpoint::tensor(const std::string& name, const std::vector<int64_t>& shape) const {
  const TensorView& view = tensor(name);
  if (view.shape != shape) {
    throw InputError(view.file.string(), name,
                     "expected shape " + format_shape(shape) + ", got " + format_shape(view.shape));
  }
  return view;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> result;
  result.reserve(index_.size());
  for (const auto& [name, view] : index_) result.push_back(name);
  return result;
}

std::vector<std::filesystem::path> Checkpoint::files() const {
  std::vector<std::filesystem::path> result;
  for (const auto& shard : shards_) result.push_back(shard->path());
  return result;
}

}  // namespace kvforge
