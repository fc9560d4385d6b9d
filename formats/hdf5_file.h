#pragma once
// A thin RAII layer over the HDF5 C API: ids that close themselves, groups
// and datasets that remember their file and path, typed attributes and
// hyperslab I/O. Every failure is an InputError naming the file, the object
// and HDF5's own reason. Nothing here knows a schema; formats/activation_store
// builds on it.
//
// HDF5 is not thread-safe across one file: use one object per thread.
#include <hdf5.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace kvforge::hdf5 {

// Owns one HDF5 id and releases it with Close (H5Dclose, H5Gclose, ...).
template <herr_t (*Close)(hid_t)>
class Handle {
 public:
  Handle() = default;
  explicit Handle(hid_t id) : id_(id) {}
  ~Handle() { reset(); }
  Handle(Handle&& other) noexcept : id_(other.release()) {}
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      reset();
      id_ = other.release();
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  hid_t get() const { return id_; }
  explicit operator bool() const { return id_ >= 0; }
  hid_t release() { return std::exchange(id_, H5I_INVALID_HID); }
  void reset() {
    if (id_ >= 0) Close(id_);
    id_ = H5I_INVALID_HID;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
};

using FileId = Handle<H5Fclose>;
using GroupId = Handle<H5Gclose>;
using DatasetId = Handle<H5Dclose>;
using AttributeId = Handle<H5Aclose>;
using DataspaceId = Handle<H5Sclose>;
using DatatypeId = Handle<H5Tclose>;
using PropertyListId = Handle<H5Pclose>;

// While alive, HDF5 does not print its error stack to stderr on this thread
// (failures become exceptions instead); the previous handler comes back after.
class QuietErrors {
 public:
  QuietErrors();
  ~QuietErrors();
  QuietErrors(const QuietErrors&) = delete;
  QuietErrors& operator=(const QuietErrors&) = delete;

 private:
  H5E_auto2_t handler_ = nullptr;
  void* data_ = nullptr;
};

// Element types the helpers read and write: float, double, int32_t, int64_t,
// uint64_t and uint8_t, stored little-endian in the file.
template <class T>
struct TypeOf;
template <>
struct TypeOf<float> {
  static hid_t file() { return H5T_IEEE_F32LE; }
  static hid_t memory() { return H5T_NATIVE_FLOAT; }
};
template <>
struct TypeOf<double> {
  static hid_t file() { return H5T_IEEE_F64LE; }
  static hid_t memory() { return H5T_NATIVE_DOUBLE; }
};
template <>
struct TypeOf<int32_t> {
  static hid_t file() { return H5T_STD_I32LE; }
  static hid_t memory() { return H5T_NATIVE_INT32; }
};
template <>
struct TypeOf<int64_t> {
  static hid_t file() { return H5T_STD_I64LE; }
  static hid_t memory() { return H5T_NATIVE_INT64; }
};
template <>
struct TypeOf<uint64_t> {
  static hid_t file() { return H5T_STD_U64LE; }
  static hid_t memory() { return H5T_NATIVE_UINT64; }
};
template <>
struct TypeOf<uint8_t> {
  static hid_t file() { return H5T_STD_U8LE; }
  static hid_t memory() { return H5T_NATIVE_UINT8; }
};

// How a new dataset is stored: contiguous when `chunk` is empty, otherwise
// chunked, with shuffle + deflate(level) when deflate_level > 0.
struct StorageSpec {
  std::vector<hsize_t> chunk;
  int deflate_level = 0;
};

// Something in a file that error messages can name.
class Location {
 public:
  Location(std::filesystem::path file, std::string name) : file_(std::move(file)), name_(std::move(name)) {}
  const std::filesystem::path& file() const { return file_; }
  const std::string& name() const { return name_; }
  // Throws InputError(file, name, what).
  [[noreturn]] void fail(const std::string& what) const;
  // The same with HDF5's reason for its last failure appended (and its error
  // stack cleared): "cannot open: unable to open file (truncated file ...)".
  [[noreturn]] void fail_hdf5(const std::string& what) const;
  // Returns value when it is >= 0 (HDF5's success), otherwise fail_hdf5(what).
  template <class Id>
  Id check(Id value, const std::string& what) const {
    if (value < 0) fail_hdf5(what);
    return value;
  }
  // The path of child `name` below this location.
  std::string child(const std::string& name) const;

 private:
  std::filesystem::path file_;
  std::string name_;
};

// The type of a dataset or attribute as a short word for messages:
// "float32", "int64", "uint8", "string", "compound", ...
std::string describe_type(hid_t type);

class Dataset {
 public:
  Dataset(DatasetId id, Location where) : id_(std::move(id)), where_(std::move(where)) {}
  const Location& where() const { return where_; }
  hid_t id() const { return id_.get(); }

  std::vector<int64_t> shape() const;
  std::string type_name() const;  // describe_type of the stored type
  template <class T>
  bool holds() const;  // stored type is exactly T (class, size and sign)

  // Hyperslab I/O: `start` and `count` per dimension; the buffer holds
  // product(count) elements in row-major order.
  template <class T>
  void write(std::span<const hsize_t> start, std::span<const hsize_t> count, const T* data);
  template <class T>
  void read(std::span<const hsize_t> start, std::span<const hsize_t> count, T* data) const;

 private:
  void select(hid_t file_space, std::span<const hsize_t> start, std::span<const hsize_t> count) const;
  DatasetId id_;
  Location where_;
};

// A group (or the root, "/") with its attributes and children.
class Group {
 public:
  Group(GroupId id, Location where) : id_(std::move(id)), where_(std::move(where)) {}
  const Location& where() const { return where_; }
  hid_t id() const { return id_.get(); }

  bool has_child(const std::string& name) const;
  int64_t child_count() const;
  Group create_group(const std::string& name);
  Group open_group(const std::string& name) const;  // fails with "missing" when absent
  template <class T>
  Dataset create_dataset(const std::string& name, const std::vector<hsize_t>& shape, const StorageSpec& storage);
  Dataset open_dataset(const std::string& name) const;  // fails with "missing" when absent

  bool has_attribute(const std::string& name) const;
  // Writers create the attribute or overwrite its value (strings: UTF-8,
  // variable length, scalar).
  void write_string(const std::string& name, const std::string& value);
  void write_strings(const std::string& name, const std::vector<std::string>& values);  // 1-D
  template <class T>
  void write_scalar(const std::string& name, T value);
  // Readers fail naming the attribute when it is absent or of another kind;
  // strings may be fixed or variable length, integers of any width.
  std::string read_string(const std::string& name) const;
  std::vector<std::string> read_strings(const std::string& name) const;
  template <class T>
  T read_integer(const std::string& name) const;

 private:
  Location attribute_location(const std::string& name) const;
  AttributeId open_attribute(const std::string& name, H5T_class_t expected_class, const char* expected) const;
  AttributeId create_or_open_attribute(const std::string& name, hid_t file_type, hid_t space);
  GroupId id_;
  Location where_;
};

class File {
 public:
  enum class Mode { kReadOnly, kReadWrite };
  // Creates (replacing any file there) / opens an existing HDF5 file. Opening
  // fails with a plain message when the file is missing or not HDF5.
  static File create(const std::filesystem::path& path);
  static File open(const std::filesystem::path& path, Mode mode);

  const std::filesystem::path& path() const { return path_; }
  Group root() const;
  void flush();
  // Closes and reports a failure (a last flush that did not reach the disk);
  // the destructor closes silently.
  void close();
  bool is_open() const { return static_cast<bool>(id_); }

 private:
  File(FileId id, std::filesystem::path path) : id_(std::move(id)), path_(std::move(path)) {}
  FileId id_;
  std::filesystem::path path_;
};

}  // namespace kvforge::hdf5
