#include "formats/hdf5_file.h"

#include <stdexcept>

#include "formats/input_error.h"

namespace kvforge::hdf5 {
namespace {

herr_t collect_description(unsigned /*depth*/, const H5E_error2_t* error, void* lines) {
  if (error->desc != nullptr && *error->desc != '\0') {
    static_cast<std::vector<std::string>*>(lines)->push_back(error->desc);
  }
  return 0;
}

// HDF5's reason for the last failure on this thread, outermost description
// first ("unable to open file (file signature not found)"); clears the stack.
std::string take_error_reason() {
  std::vector<std::string> lines;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect_description, &lines);
  H5Eclear2(H5E_DEFAULT);
  if (lines.empty()) return {};
  if (lines.size() == 1 || lines.front() == lines.back()) return lines.front();
  return lines.front() + " (" + lines.back() + ")";
}

// Class, size and sign agree; byte order may differ (HDF5 converts).
bool same_kind(hid_t a, hid_t b) {
  const H5T_class_t kind = H5Tget_class(a);
  if (kind != H5Tget_class(b) || H5Tget_size(a) != H5Tget_size(b)) return false;
  return kind != H5T_INTEGER || H5Tget_sign(a) == H5Tget_sign(b);
}

DatatypeId utf8_string_type(const Location& where, size_t size) {
  DatatypeId type(where.check(H5Tcopy(H5T_C_S1), "cannot make a string type"));
  where.check(H5Tset_size(type.get(), size), "cannot make a string type");
  where.check(H5Tset_cset(type.get(), H5T_CSET_UTF8), "cannot make a string type");
  return type;
}

// Reads the strings of `attribute` (fixed or variable length) in file order.
std::vector<std::string> read_string_values(hid_t attribute, const Location& where) {
  DatatypeId file_type(where.check(H5Aget_type(attribute), "cannot read its type"));
  DataspaceId space(where.check(H5Aget_space(attribute), "cannot read its shape"));
  const auto count =
      static_cast<size_t>(where.check(H5Sget_simple_extent_npoints(space.get()), "cannot read its shape"));
  std::vector<std::string> values;
  values.reserve(count);
  if (where.check(H5Tis_variable_str(file_type.get()), "cannot read its type") > 0) {
    DatatypeId memory_type = utf8_string_type(where, H5T_VARIABLE);
    where.check(H5Tset_cset(memory_type.get(), H5Tget_cset(file_type.get())), "cannot read its type");
    std::vector<char*> pointers(count, nullptr);
    const herr_t status = H5Aread(attribute, memory_type.get(), pointers.data());
    for (char* p : pointers) {
      if (status >= 0) values.emplace_back(p != nullptr ? p : "");
      H5free_memory(p);
    }
    where.check(status, "cannot read");
    return values;
  }
  const size_t size = H5Tget_size(file_type.get());
  const bool space_padded = H5Tget_strpad(file_type.get()) == H5T_STR_SPACEPAD;
  std::vector<char> bytes(count * size);
  where.check(H5Aread(attribute, file_type.get(), bytes.data()), "cannot read");
  for (size_t i = 0; i < count; ++i) {
    std::string value(bytes.data() + i * size, size);
    value.resize(value.find('\0') == std::string::npos ? value.size() : value.find('\0'));
    if (space_padded) value.erase(value.find_last_not_of(' ') + 1);
    values.push_back(std::move(value));
  }
  return values;
}

PropertyListId file_access_properties(const Location& where) {
  PropertyListId fapl(where.check(H5Pcreate(H5P_FILE_ACCESS), "cannot make file access properties"));
#if (H5_VERS_MAJOR == 1 && H5_VERS_MINOR == 10 && H5_VERS_RELEASE >= 7) || H5_VERSION_GE(1, 12, 1)
  // Lock the file, but still work on file systems without locks (NFS, Lustre).
  where.check(H5Pset_file_locking(fapl.get(), true, true), "cannot make file access properties");
#endif
  return fapl;
}

}  // namespace

QuietErrors::QuietErrors() {
  H5Eget_auto2(H5E_DEFAULT, &handler_, &data_);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

QuietErrors::~QuietErrors() { H5Eset_auto2(H5E_DEFAULT, handler_, data_); }

void Location::fail(const std::string& what) const { throw InputError(file_.string(), name_, what); }

void Location::fail_hdf5(const std::string& what) const {
  const std::string reason = take_error_reason();
  fail(reason.empty() ? what : what + ": " + reason);
}

std::string Location::child(const std::string& name) const {
  return name_.empty() || name_ == "/" ? "/" + name : name_ + "/" + name;
}

std::string describe_type(hid_t type) {
  const auto bits = std::to_string(8 * H5Tget_size(type));
  switch (H5Tget_class(type)) {
    case H5T_INTEGER: return (H5Tget_sign(type) == H5T_SGN_NONE ? "uint" : "int") + bits;
    case H5T_FLOAT: return "float" + bits;
    case H5T_STRING: return "string";
    case H5T_COMPOUND: return "compound";
    case H5T_ENUM: return "enum";
    case H5T_ARRAY: return "array";
    case H5T_VLEN: return "variable-length sequence";
    case H5T_OPAQUE: return "opaque";
    case H5T_REFERENCE: return "reference";
    case H5T_BITFIELD: return "bitfield";
    default: return "unknown type";
  }
}

// --- Dataset ------------------------------------------------------------

std::vector<int64_t> Dataset::shape() const {
  DataspaceId space(where_.check(H5Dget_space(id()), "cannot read its shape"));
  const int rank = where_.check(H5Sget_simple_extent_ndims(space.get()), "cannot read its shape");
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  where_.check(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr), "cannot read its shape");
  return {dims.begin(), dims.end()};
}

std::string Dataset::type_name() const {
  DatatypeId type(where_.check(H5Dget_type(id()), "cannot read its type"));
  return describe_type(type.get());
}

template <class T>
bool Dataset::holds() const {
  DatatypeId type(where_.check(H5Dget_type(id()), "cannot read its type"));
  return same_kind(type.get(), TypeOf<T>::memory());
}

void Dataset::select(hid_t file_space, std::span<const hsize_t> start, std::span<const hsize_t> count) const {
  const int rank = where_.check(H5Sget_simple_extent_ndims(file_space), "cannot read its shape");
  if (start.size() != static_cast<size_t>(rank) || count.size() != start.size()) {
    throw std::logic_error(where_.name() + ": hyperslab rank differs from the dataset's");
  }
  where_.check(H5Sselect_hyperslab(file_space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
               "cannot select a hyperslab");
}

template <class T>
void Dataset::write(std::span<const hsize_t> start, std::span<const hsize_t> count, const T* data) {
  DataspaceId file_space(where_.check(H5Dget_space(id()), "cannot read its shape"));
  select(file_space.get(), start, count);
  DataspaceId memory_space(
      where_.check(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr), "cannot write"));
  where_.check(H5Dwrite(id(), TypeOf<T>::memory(), memory_space.get(), file_space.get(), H5P_DEFAULT, data),
               "cannot write");
}

template <class T>
void Dataset::read(std::span<const hsize_t> start, std::span<const hsize_t> count, T* data) const {
  DataspaceId file_space(where_.check(H5Dget_space(id()), "cannot read its shape"));
  select(file_space.get(), start, count);
  DataspaceId memory_space(
      where_.check(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr), "cannot read"));
  where_.check(H5Dread(id(), TypeOf<T>::memory(), memory_space.get(), file_space.get(), H5P_DEFAULT, data),
               "cannot read");
}

template bool Dataset::holds<float>() const;
template bool Dataset::holds<int32_t>() const;
template bool Dataset::holds<int64_t>() const;
template bool Dataset::holds<double>() const;
template bool Dataset::holds<uint8_t>() const;
template void Dataset::write<float>(std::span<const hsize_t>, std::span<const hsize_t>, const float*);
template void Dataset::write<int32_t>(std::span<const hsize_t>, std::span<const hsize_t>, const int32_t*);
template void Dataset::write<int64_t>(std::span<const hsize_t>, std::span<const hsize_t>, const int64_t*);
template void Dataset::write<double>(std::span<const hsize_t>, std::span<const hsize_t>, const double*);
template void Dataset::write<uint8_t>(std::span<const hsize_t>, std::span<const hsize_t>, const uint8_t*);
template void Dataset::read<float>(std::span<const hsize_t>, std::span<const hsize_t>, float*) const;
template void Dataset::read<int32_t>(std::span<const hsize_t>, std::span<const hsize_t>, int32_t*) const;
template void Dataset::read<int64_t>(std::span<const hsize_t>, std::span<const hsize_t>, int64_t*) const;
template void Dataset::read<double>(std::span<const hsize_t>, std::span<const hsize_t>, double*) const;
template void Dataset::read<uint8_t>(std::span<const hsize_t>, std::span<const hsize_t>, uint8_t*) const;

// --- Group --------------------------------------------------------------

bool Group::has_child(const std::string& name) const {
  return where_.check(H5Lexists(id(), name.c_str(), H5P_DEFAULT), "cannot list " + name) > 0;
}

int64_t Group::child_count() const {
  H5G_info_t info;
  where_.check(H5Gget_info(id(), &info), "cannot list its members");
  return static_cast<int64_t>(info.nlinks);
}

Group Group::create_group(const std::string& name) {
  Location where(where_.file(), where_.child(name));
  GroupId group(where.check(H5Gcreate2(id(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "cannot create"));
  return Group(std::move(group), std::move(where));
}

Group Group::open_group(const std::string& name) const {
  Location where(where_.file(), where_.child(name));
  if (!has_child(name)) where.fail("missing (a required group)");
  GroupId group(where.check(H5Gopen2(id(), name.c_str(), H5P_DEFAULT), "cannot open as a group"));
  return Group(std::move(group), std::move(where));
}

template <class T>
Dataset Group::create_dataset(const std::string& name, const std::vector<hsize_t>& shape, const StorageSpec& storage) {
  Location where(where_.file(), where_.child(name));
  PropertyListId dcpl(where.check(H5Pcreate(H5P_DATASET_CREATE), "cannot create"));
  if (!storage.chunk.empty()) {
    where.check(H5Pset_chunk(dcpl.get(), static_cast<int>(storage.chunk.size()), storage.chunk.data()),
                "cannot set its chunks");
    if (storage.deflate_level > 0) {
      where.check(H5Pset_shuffle(dcpl.get()), "cannot set the shuffle filter");
      where.check(H5Pset_deflate(dcpl.get(), static_cast<unsigned>(storage.deflate_level)),
                  "cannot set the deflate filter");
    }
  }
  DataspaceId space(
      where.check(H5Screate_simple(static_cast<int>(shape.size()), shape.data(), nullptr), "cannot create"));
  DatasetId dataset(
      where.check(H5Dcreate2(id(), name.c_str(), TypeOf<T>::file(), space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
                  "cannot create"));
  return Dataset(std::move(dataset), std::move(where));
}

template Dataset Group::create_dataset<float>(const std::string&, const std::vector<hsize_t>&, const StorageSpec&);
template Dataset Group::create_dataset<int32_t>(const std::string&, const std::vector<hsize_t>&, const StorageSpec&);
template Dataset Group::create_dataset<int64_t>(const std::string&, const std::vector<hsize_t>&, const StorageSpec&);
template Dataset Group::create_dataset<double>(const std::string&, const std::vector<hsize_t>&, const StorageSpec&);
template Dataset Group::create_dataset<uint8_t>(const std::string&, const std::vector<hsize_t>&, const StorageSpec&);

Dataset Group::open_dataset(const std::string& name) const {
  Location where(where_.file(), where_.child(name));
  if (!has_child(name)) where.fail("missing (a required dataset)");
  DatasetId dataset(where.check(H5Dopen2(id(), name.c_str(), H5P_DEFAULT), "cannot open as a dataset"));
  return Dataset(std::move(dataset), std::move(where));
}

Location Group::attribute_location(const std::string& name) const {
  return Location(where_.file(), where_.name() + "@" + name);
}

bool Group::has_attribute(const std::string& name) const {
  return where_.check(H5Aexists(id(), name.c_str()), "cannot list attribute " + name) > 0;
}

AttributeId Group::open_attribute(const std::string& name, H5T_class_t expected_class, const char* expected) const {
  const Location where = attribute_location(name);
  if (!has_attribute(name)) where.fail("missing (a required attribute)");
  AttributeId attribute(where.check(H5Aopen(id(), name.c_str(), H5P_DEFAULT), "cannot open"));
  DatatypeId type(where.check(H5Aget_type(attribute.get()), "cannot read its type"));
  if (H5Tget_class(type.get()) != expected_class) {
    where.fail(std::string("expected ") + expected + ", got " + describe_type(type.get()));
  }
  return attribute;
}

AttributeId Group::create_or_open_attribute(const std::string& name, hid_t file_type, hid_t space) {
  const Location where = attribute_location(name);
  if (has_attribute(name)) {
    // Replaced rather than rewritten: the old one may have another type or shape.
    where.check(H5Adelete(id(), name.c_str()), "cannot replace");
  }
  return AttributeId(
      where.check(H5Acreate2(id(), name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT), "cannot create"));
}

void Group::write_string(const std::string& name, const std::string& value) {
  const Location where = attribute_location(name);
  DatatypeId type = utf8_string_type(where, H5T_VARIABLE);
  DataspaceId space(where.check(H5Screate(H5S_SCALAR), "cannot create"));
  AttributeId attribute = create_or_open_attribute(name, type.get(), space.get());
  const char* text = value.c_str();
  where.check(H5Awrite(attribute.get(), type.get(), &text), "cannot write");
}

void Group::write_strings(const std::string& name, const std::vector<std::string>& values) {
  const Location where = attribute_location(name);
  DatatypeId type = utf8_string_type(where, H5T_VARIABLE);
  const hsize_t count = values.size();
  DataspaceId space(where.check(H5Screate_simple(1, &count, nullptr), "cannot create"));
  AttributeId attribute = create_or_open_attribute(name, type.get(), space.get());
  std::vector<const char*> texts;
  for (const auto& value : values) texts.push_back(value.c_str());
  where.check(H5Awrite(attribute.get(), type.get(), texts.data()), "cannot write");
}

template <class T>
void Group::write_scalar(const std::string& name, T value) {
  const Location where = attribute_location(name);
  AttributeId attribute;
  if (has_attribute(name)) {
    // Rewritten in place: samples_complete changes once per sample.
    attribute = open_attribute(name, H5T_INTEGER, "an integer");
  } else {
    DataspaceId space(where.check(H5Screate(H5S_SCALAR), "cannot create"));
    attribute = create_or_open_attribute(name, TypeOf<T>::file(), space.get());
  }
  where.check(H5Awrite(attribute.get(), TypeOf<T>::memory(), &value), "cannot write");
}

template void Group::write_scalar<int64_t>(const std::string&, int64_t);
template void Group::write_scalar<uint64_t>(const std::string&, uint64_t);
template void Group::write_scalar<uint8_t>(const std::string&, uint8_t);

std::string Group::read_string(const std::string& name) const {
  AttributeId attribute = open_attribute(name, H5T_STRING, "a string");
  const Location where = attribute_location(name);
  std::vector<std::string> values = read_string_values(attribute.get(), where);
  if (values.size() != 1) where.fail("expected one string, got " + std::to_string(values.size()));
  return values.front();
}

std::vector<std::string> Group::read_strings(const std::string& name) const {
  AttributeId attribute = open_attribute(name, H5T_STRING, "a list of strings");
  const Location where = attribute_location(name);
  DataspaceId space(where.check(H5Aget_space(attribute.get()), "cannot read its shape"));
  if (H5Sget_simple_extent_ndims(space.get()) != 1) where.fail("expected a 1-D list of strings");
  return read_string_values(attribute.get(), where);
}

template <class T>
T Group::read_integer(const std::string& name) const {
  AttributeId attribute = open_attribute(name, H5T_INTEGER, "an integer");
  const Location where = attribute_location(name);
  DataspaceId space(where.check(H5Aget_space(attribute.get()), "cannot read its shape"));
  if (H5Sget_simple_extent_npoints(space.get()) != 1) where.fail("expected a single integer");
  T value{};
  where.check(H5Aread(attribute.get(), TypeOf<T>::memory(), &value), "cannot read");
  return value;
}

template int64_t Group::read_integer<int64_t>(const std::string&) const;
template uint64_t Group::read_integer<uint64_t>(const std::string&) const;

// --- File ---------------------------------------------------------------

File File::create(const std::filesystem::path& path) {
  const Location where(path, "");
  PropertyListId fapl = file_access_properties(where);
  FileId id(where.check(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), "cannot create"));
  return File(std::move(id), path);
}

File File::open(const std::filesystem::path& path, Mode mode) {
  const Location where(path, "");
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) where.fail("no such file");
#if H5_VERSION_GE(1, 12, 0)
  const htri_t is_hdf5 = H5Fis_accessible(path.c_str(), H5P_DEFAULT);
#else
  const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
#endif
  if (where.check(is_hdf5, "cannot read") == 0) where.fail("not an HDF5 file (no HDF5 signature)");
  PropertyListId fapl = file_access_properties(where);
  const unsigned flags = mode == Mode::kReadWrite ? H5F_ACC_RDWR : H5F_ACC_RDONLY;
  FileId id(where.check(H5Fopen(path.c_str(), flags, fapl.get()), "cannot open"));
  return File(std::move(id), path);
}

Group File::root() const {
  const Location where(path_, "/");
  GroupId group(where.check(H5Gopen2(id_.get(), "/", H5P_DEFAULT), "cannot open"));
  return Group(std::move(group), where);
}

void File::flush() { Location(path_, "").check(H5Fflush(id_.get(), H5F_SCOPE_GLOBAL), "cannot flush"); }

void File::close() {
  if (!id_) return;
  Location(path_, "").check(H5Fclose(id_.release()), "cannot close");
}

}  // namespace kvforge::hdf5
