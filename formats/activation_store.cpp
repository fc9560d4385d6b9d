#include "formats/activation_store.h"

#include "formats/fingerprint_attributes.h"
#include "formats/remove_on_failure.h"
#include "formats/utc_timestamp.h"

#include <algorithm>
#include <array>
#include <ctime>
#include <map>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "formats/hdf5_file.h"
#include "formats/input_error.h"
#include "kvforge/version.h"

namespace kvforge {
namespace {

using hdf5::Dataset;
using hdf5::File;
using hdf5::Group;

constexpr const char* kSchema = "kvforge.activations";
// Chunks are one head of one sample, split along seq_len above this size so
// long windows do not make chunks that are slow to (de)compress in one piece.
constexpr int64_t kMaxChunkBytes = int64_t{4} << 20;

struct FieldName {
  ActivationField field;
  std::string_view name;
};
constexpr std::array<FieldName, 6> kFieldNames = {{
    {ActivationField::kQueries, "q"},
    {ActivationField::kKeysPreRope, "k_pre"},
    {ActivationField::kKeysPostRope, "k_post"},
    {ActivationField::kValues, "v"},
    {ActivationField::kFisherKeys, "fisher_k"},
    {ActivationField::kFisherValues, "fisher_v"},
}};

std::string field_text(ActivationField field) { return std::string(field_name(field)); }

// --- layout values ------------------------------------------------------

// One comparable item of a layout, named as in error messages
// ("model.kvo_sha256"): resume and merge compare layouts item by item.
struct LayoutItem {
  std::string name;
  std::string value;
  bool digest = false;  // shown abbreviated
};

std::string join_fields(const std::vector<ActivationField>& fields) {
  std::string text;
  for (const auto field : fields) text += (text.empty() ? "" : ",") + field_text(field);
  return text;
}

std::vector<LayoutItem> layout_items(const ActivationStoreLayout& layout) {
  const ModelFingerprint& m = layout.model;
  const CaptureProvenance& p = layout.provenance;
  return {
      {"model.architecture", m.architecture},
      {"model.num_layers", std::to_string(m.num_layers)},
      {"model.num_heads", std::to_string(m.num_heads)},
      {"model.num_kv_heads", std::to_string(m.num_kv_heads)},
      {"model.head_dim", std::to_string(m.head_dim)},
      {"model.hidden_size", std::to_string(m.hidden_size)},
      {"model.vocab_size", std::to_string(m.vocab_size)},
      {"model.rope", m.rope},
      {"model.kvo_sha256", m.kvo_sha256, true},
      {"model.tokenizer_sha256", m.tokenizer_sha256, true},
      {"provenance.data_file", p.data_file},
      {"provenance.data_sha256", p.data_sha256, true},
      {"provenance.data_tokens", std::to_string(p.data_tokens)},
      {"provenance.samples", std::to_string(p.samples)},
      {"provenance.seq_len", std::to_string(p.seq_len)},
      {"provenance.seed", std::to_string(p.seed)},
      {"provenance.bos", p.bos ? "true" : "false"},
      {"provenance.compute_dtype", p.compute_dtype},
      {"provenance.device", p.device},
      {"provenance.tool_version", p.tool_version},
      {"provenance.command_line", p.command_line},
      {"fields", join_fields(layout.fields)},
      {"compression_level", std::to_string(layout.compression_level)},
  };
}

std::string shown(const LayoutItem& item) {
  constexpr size_t kDigestChars = 12;
  if (item.value.empty()) return "\"\"";
  if (item.digest && item.value.size() > kDigestChars) return item.value.substr(0, kDigestChars) + "...";
  return item.value;
}

// The first item, in layout_items order, that `compared` selects and that
// differs between a and b: {a's, b's}.
template <class Predicate>
std::optional<std::pair<LayoutItem, LayoutItem>> first_difference(const ActivationStoreLayout& a,
                                                                  const ActivationStoreLayout& b, Predicate compared) {
  const auto items_a = layout_items(a);
  const auto items_b = layout_items(b);
  for (size_t i = 0; i < items_a.size(); ++i) {
    if (compared(items_a[i].name) && items_a[i].value != items_b[i].value) return std::pair{items_a[i], items_b[i]};
  }
  return std::nullopt;
}

bool compared_on_resume(const std::string& name) {
  static constexpr std::array<std::string_view, 4> kNotCompared = {
      "provenance.data_file", "provenance.device", "provenance.tool_version", "provenance.command_line"};
  return std::find(kNotCompared.begin(), kNotCompared.end(), name) == kNotCompared.end();
}

bool compared_on_merge(const std::string& name) {
  return name.starts_with("model.") || name == "provenance.seq_len" || name == "provenance.bos" || name == "fields";
}

// The first rule of the layout that `layout` breaks: {item name, expectation}.
std::optional<std::pair<std::string, std::string>> layout_problem(const ActivationStoreLayout& layout) {
  const ModelFingerprint& m = layout.model;
  const CaptureProvenance& p = layout.provenance;
  const std::array<std::pair<const char*, int64_t>, 8> positive = {{
      {"model.num_layers", m.num_layers},
      {"model.num_heads", m.num_heads},
      {"model.num_kv_heads", m.num_kv_heads},
      {"model.head_dim", m.head_dim},
      {"model.hidden_size", m.hidden_size},
      {"model.vocab_size", m.vocab_size},
      {"provenance.samples", p.samples},
      {"provenance.seq_len", p.seq_len},
  }};
  for (const auto& [name, value] : positive) {
    if (value <= 0) return std::pair{name, "a positive integer, got " + std::to_string(value)};
  }
  if (m.num_heads % m.num_kv_heads != 0) {
    return std::pair{"model.num_kv_heads", "a divisor of num_heads (" + std::to_string(m.num_heads) + "), got " +
                                               std::to_string(m.num_kv_heads)};
  }
  if (p.data_tokens < 0) return std::pair{"provenance.data_tokens", "a non-negative integer"};
  if (layout.fields.empty()) return std::pair{"fields", "at least one field"};
  for (size_t i = 1; i < layout.fields.size(); ++i) {
    if (layout.fields[i] <= layout.fields[i - 1]) {
      return std::pair{"fields", "each field once, got " + field_text(layout.fields[i]) + " twice"};
    }
  }
  if (layout.compression_level < 0 || layout.compression_level > 9) {
    return std::pair{"compression_level", "0..9, got " + std::to_string(layout.compression_level)};
  }
  return std::nullopt;
}

// Fields in all_activation_fields() order (duplicates kept for layout_problem).
ActivationStoreLayout normalized(ActivationStoreLayout layout) {
  std::sort(layout.fields.begin(), layout.fields.end());
  return layout;
}

// "model.num_heads" -> "/model@num_heads", "fields" -> "/@fields".
std::string attribute_path(const std::string& item) {
  const auto dot = item.find('.');
  if (dot == std::string::npos) return "/@" + item;
  return "/" + item.substr(0, dot) + "@" + item.substr(dot + 1);
}

int64_t heads_of(const ModelFingerprint& model, ActivationField field) {
  return uses_query_heads(field) ? model.num_heads : model.num_kv_heads;
}

std::vector<hsize_t> activation_shape(const ActivationStoreLayout& layout, ActivationField field) {
  return {static_cast<hsize_t>(layout.provenance.samples), static_cast<hsize_t>(heads_of(layout.model, field)),
          static_cast<hsize_t>(layout.provenance.seq_len), static_cast<hsize_t>(layout.model.head_dim)};
}

hdf5::StorageSpec activation_storage(const ActivationStoreLayout& layout) {
  const int64_t row_bytes = layout.model.head_dim * static_cast<int64_t>(sizeof(float));
  const int64_t rows = std::clamp<int64_t>(kMaxChunkBytes / row_bytes, 1, layout.provenance.seq_len);
  return {{1, 1, static_cast<hsize_t>(rows), static_cast<hsize_t>(layout.model.head_dim)}, layout.compression_level};
}

std::string layer_name(int64_t layer) { return std::to_string(layer); }

std::string activation_path(int64_t layer, ActivationField field) {
  return "layers/" + layer_name(layer) + "/" + field_text(field);
}

// --- attributes <-> structs ---------------------------------------------

std::vector<ActivationField> read_fields(const Group& root) {
  const hdf5::Location where(root.where().file(), "/@fields");
  std::vector<ActivationField> fields;
  for (const auto& name : root.read_strings("fields")) {
    const auto field = parse_activation_field(name);
    if (!field) where.fail("expected names among q, k_pre, k_post, v, fisher_k, fisher_v, got \"" + name + "\"");
    fields.push_back(*field);
  }
  std::sort(fields.begin(), fields.end());
  return fields;
}

// --- the whole store ----------------------------------------------------

void write_root_attributes(Group& root, const ActivationStoreLayout& layout, const std::string& command_line) {
  root.write_string("schema", kSchema);
  root.write_scalar<int64_t>("schema_version", kActivationStoreVersion);
  root.write_string("created_utc", current_utc_timestamp());
  root.write_string("tool_version", kVersion);
  root.write_string("command_line", command_line);
  std::vector<std::string> names;
  for (const auto field : layout.fields) names.push_back(field_text(field));
  root.write_strings("fields", names);
  root.write_scalar<int64_t>("compression_level", layout.compression_level);
  root.write_scalar<int64_t>("samples_complete", 0);
}

// What a store holds besides its arrays.
struct StoreState {
  ActivationStoreLayout layout;
  int64_t samples_complete = 0;
  std::vector<CaptureProvenance> sources;  // empty unless merged
};

void write_sources(Group& root, const std::vector<CaptureProvenance>& sources) {
  Group group = root.create_group("sources");
  int64_t first_sample = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    Group source = group.create_group(std::to_string(i));
    write_capture_provenance(source, sources[i]);
    source.write_scalar<int64_t>("first_sample", first_sample);
    first_sample += sources[i].samples;
  }
}

std::vector<CaptureProvenance> read_sources(const Group& root, const CaptureProvenance& merged) {
  if (!root.has_child("sources")) return {};
  const Group group = root.open_group("sources");
  std::vector<CaptureProvenance> sources;
  int64_t samples = 0;
  for (int64_t i = 0; i < group.child_count(); ++i) {
    const Group source = group.open_group(std::to_string(i));
    if (source.read_integer<int64_t>("first_sample") != samples) {
      hdf5::Location(source.where().file(), source.where().name() + "@first_sample")
          .fail("expected " + std::to_string(samples) + " (the samples of the sources before it)");
    }
    sources.push_back(read_capture_provenance(source));
    samples += sources.back().samples;
  }
  if (sources.empty() || samples != merged.samples) {
    group.where().fail("expected sources whose samples add up to /provenance@samples (" +
                       std::to_string(merged.samples) + "), got " + std::to_string(samples) + " in " +
                       std::to_string(sources.size()) + " sources");
  }
  return sources;
}

template <class T>
void expect_dataset(const Group& parent, const std::string& name, const std::vector<hsize_t>& shape,
                    const char* type_name) {
  const Dataset dataset = parent.open_dataset(name);
  if (!dataset.holds<T>()) dataset.where().fail(std::string("expected ") + type_name + ", got " + dataset.type_name());
  const std::vector<int64_t> actual = dataset.shape();
  if (!std::equal(actual.begin(), actual.end(), shape.begin(), shape.end())) {
    auto text = [](const auto& dims) {
      std::string out = "[";
      for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
      return out + "]";
    };
    dataset.where().fail("expected shape " + text(shape) + ", got " + text(actual));
  }
}

void validate_datasets(const Group& root, const ActivationStoreLayout& layout) {
  const auto samples = static_cast<hsize_t>(layout.provenance.samples);
  expect_dataset<int32_t>(root, "tokens", {samples, static_cast<hsize_t>(layout.provenance.seq_len)}, "int32");
  expect_dataset<int64_t>(root, "stream_start", {samples}, "int64");
  const Group layers = root.open_group("layers");
  for (int64_t layer = 0; layer < layout.model.num_layers; ++layer) {
    const Group group = layers.open_group(layer_name(layer));
    for (const auto field : layout.fields) {
      expect_dataset<float>(group, field_text(field), activation_shape(layout, field), "float32");
    }
  }
}

void validate_schema(const Group& root) {
  const std::string schema = root.read_string("schema");
  if (schema != kSchema) {
    hdf5::Location(root.where().file(), "/@schema")
        .fail(std::string("expected \"") + kSchema + "\", got \"" + schema + "\"");
  }
  const int64_t version = root.read_integer<int64_t>("schema_version");
  if (version != kActivationStoreVersion) {
    hdf5::Location(root.where().file(), "/@schema_version")
        .fail("expected " + std::to_string(kActivationStoreVersion) + " (the version this kvforge reads), got " +
              std::to_string(version));
  }
  for (const char* name : {"created_utc", "tool_version", "command_line"}) root.read_string(name);
}

// Reads and validates everything but the arrays' contents.
StoreState load_state(const File& file) {
  const Group root = file.root();
  validate_schema(root);
  StoreState state;
  state.layout.model = read_model_fingerprint(root.open_group("model"));
  state.layout.provenance = read_capture_provenance(root.open_group("provenance"));
  state.layout.fields = read_fields(root);
  state.layout.compression_level = static_cast<int>(root.read_integer<int64_t>("compression_level"));
  if (const auto problem = layout_problem(state.layout)) {
    hdf5::Location(file.path(), attribute_path(problem->first)).fail("expected " + problem->second);
  }
  state.samples_complete = root.read_integer<int64_t>("samples_complete");
  if (state.samples_complete < 0 || state.samples_complete > state.layout.provenance.samples) {
    hdf5::Location(file.path(), "/@samples_complete")
        .fail("expected 0.." + std::to_string(state.layout.provenance.samples) + ", got " +
              std::to_string(state.samples_complete));
  }
  validate_datasets(root, state.layout);
  state.sources = read_sources(root, state.layout.provenance);
  return state;
}

void check_index(const char* what, int64_t value, int64_t end) {
  if (value < 0 || value >= end) {
    throw std::out_of_range(std::string(what) + " " + std::to_string(value) + " is outside 0.." +
                            std::to_string(end - 1));
  }
}

void check_field(const ActivationStoreLayout& layout, ActivationField field) {
  if (std::find(layout.fields.begin(), layout.fields.end(), field) == layout.fields.end()) {
    throw std::invalid_argument("field " + field_text(field) +
                                " is not in this store (fields: " + join_fields(layout.fields) + ")");
  }
}


}  // namespace

// --- fields -------------------------------------------------------------

std::string_view field_name(ActivationField field) {
  for (const auto& entry : kFieldNames) {
    if (entry.field == field) return entry.name;
  }
  throw std::invalid_argument("unknown ActivationField");
}

std::optional<ActivationField> parse_activation_field(std::string_view name) {
  for (const auto& entry : kFieldNames) {
    if (entry.name == name) return entry.field;
  }
  return std::nullopt;
}

bool uses_query_heads(ActivationField field) { return field == ActivationField::kQueries; }

std::vector<ActivationField> all_activation_fields() {
  std::vector<ActivationField> fields;
  for (const auto& entry : kFieldNames) fields.push_back(entry.field);
  return fields;
}

// --- writer -------------------------------------------------------------

struct ActivationStoreWriter::Impl {
  File file;
  ActivationStoreLayout layout;
  int64_t samples_complete = 0;
  // Per uncommitted sample: which (layer, field) slabs and whether the tokens
  // were written; bounded by how many samples the caller has in flight.
  std::map<int64_t, std::vector<bool>> written;

  Impl(File f, ActivationStoreLayout l, int64_t complete)
      : file(std::move(f)), layout(std::move(l)), samples_complete(complete) {}

  size_t slot(int64_t layer, ActivationField field) const {
    const auto index = std::find(layout.fields.begin(), layout.fields.end(), field) - layout.fields.begin();
    return static_cast<size_t>(layer) * layout.fields.size() + static_cast<size_t>(index);
  }
  size_t tokens_slot() const { return static_cast<size_t>(layout.model.num_layers) * layout.fields.size(); }

  void mark_written(int64_t sample, size_t slot_index) {
    auto& slots = written[sample];
    slots.resize(tokens_slot() + 1, false);
    slots[slot_index] = true;
  }

  void check_writable(int64_t sample) const {
    if (!file.is_open()) throw std::logic_error(file.path().string() + ": the store is closed");
    check_index("sample", sample, layout.provenance.samples);
    if (sample < samples_complete) {
      throw std::logic_error("sample " + std::to_string(sample) + " is already committed");
    }
  }

  // What of `sample` has not been written, or "" when all was.
  std::string first_missing(int64_t sample) const {
    const auto entry = written.find(sample);
    for (size_t i = 0; i <= tokens_slot(); ++i) {
      if (entry != written.end() && entry->second[i]) continue;
      if (i == tokens_slot()) return "tokens";
      const auto layer = static_cast<int64_t>(i / layout.fields.size());
      return activation_path(layer, layout.fields[i % layout.fields.size()]);
    }
    return {};
  }

  static std::unique_ptr<Impl> create(const std::filesystem::path& path, const ActivationStoreLayout& given,
                                      const std::string& command_line, const std::vector<CaptureProvenance>& sources) {
    ActivationStoreLayout layout = normalized(given);
    if (const auto problem = layout_problem(layout)) {
      throw InputError(path.string(), problem->first, "expected " + problem->second);
    }
    File file = File::create(path);
    Group root = file.root();
    write_root_attributes(root, layout, command_line);
    Group model = root.create_group("model");
    write_model_fingerprint(model, layout.model);
    Group provenance = root.create_group("provenance");
    write_capture_provenance(provenance, layout.provenance);
    if (!sources.empty()) write_sources(root, sources);
    create_datasets(root, layout);
    file.flush();
    return std::make_unique<Impl>(std::move(file), std::move(layout), 0);
  }

  static void create_datasets(Group& root, const ActivationStoreLayout& layout) {
    const auto samples = static_cast<hsize_t>(layout.provenance.samples);
    root.create_dataset<int32_t>("tokens", {samples, static_cast<hsize_t>(layout.provenance.seq_len)}, {});
    root.create_dataset<int64_t>("stream_start", {samples}, {});
    Group layers = root.create_group("layers");
    const hdf5::StorageSpec storage = activation_storage(layout);
    for (int64_t layer = 0; layer < layout.model.num_layers; ++layer) {
      Group group = layers.create_group(layer_name(layer));
      for (const auto field : layout.fields) {
        group.create_dataset<float>(field_text(field), activation_shape(layout, field), storage);
      }
    }
  }

  void write_tokens(int64_t sample, int64_t stream_start, std::span<const int32_t> tokens) {
    check_writable(sample);
    if (static_cast<int64_t>(tokens.size()) != layout.provenance.seq_len) {
      throw std::invalid_argument("write_tokens: expected " + std::to_string(layout.provenance.seq_len) +
                                  " tokens (seq_len), got " + std::to_string(tokens.size()));
    }
    const Group root = file.root();
    const auto row = static_cast<hsize_t>(sample);
    const std::array<hsize_t, 2> start = {row, 0};
    const std::array<hsize_t, 2> count = {1, tokens.size()};
    root.open_dataset("tokens").write<int32_t>(start, count, tokens.data());
    const std::array<hsize_t, 1> one = {1};
    const std::array<hsize_t, 1> at = {row};
    root.open_dataset("stream_start").write<int64_t>(at, one, &stream_start);
    mark_written(sample, tokens_slot());
  }

  void write(ActivationField field, int64_t layer, int64_t sample, std::span<const float> values) {
    check_writable(sample);
    check_field(layout, field);
    check_index("layer", layer, layout.model.num_layers);
    std::array<hsize_t, 4> count{};
    std::copy_n(activation_shape(layout, field).begin(), 4, count.begin());
    count[0] = 1;
    const auto expected = count[1] * count[2] * count[3];
    if (values.size() != expected) {
      throw std::invalid_argument("write(" + field_text(field) + "): expected " + std::to_string(expected) +
                                  " values ([heads, seq_len, head_dim]), got " + std::to_string(values.size()));
    }
    const std::array<hsize_t, 4> start = {static_cast<hsize_t>(sample), 0, 0, 0};
    file.root().open_dataset(activation_path(layer, field)).write<float>(start, count, values.data());
    mark_written(sample, slot(layer, field));
  }

  void commit_sample(int64_t sample) {
    check_writable(sample);
    if (sample != samples_complete) {
      throw std::logic_error("commit_sample(" + std::to_string(sample) + "): samples are committed in order, next is " +
                             std::to_string(samples_complete));
    }
    if (const std::string missing = first_missing(sample); !missing.empty()) {
      throw std::logic_error("commit_sample(" + std::to_string(sample) + "): " + missing + " was not written");
    }
    file.root().write_scalar<int64_t>("samples_complete", sample + 1);
    file.flush();
    samples_complete = sample + 1;
    written.erase(sample);
  }
};

ActivationStoreWriter::ActivationStoreWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ActivationStoreWriter::ActivationStoreWriter(ActivationStoreWriter&&) noexcept = default;
ActivationStoreWriter& ActivationStoreWriter::operator=(ActivationStoreWriter&&) noexcept = default;

ActivationStoreWriter::~ActivationStoreWriter() {
  try {
    close();
  } catch (...) {
    // A destructor must not throw; close() reports the error to callers who ask.
  }
}

ActivationStoreWriter::Impl& ActivationStoreWriter::impl() const {
  if (!impl_) throw std::logic_error("ActivationStoreWriter was moved from");
  return *impl_;
}

ActivationStoreWriter ActivationStoreWriter::create(const std::filesystem::path& path,
                                                    const ActivationStoreLayout& layout) {
  hdf5::QuietErrors quiet;
  return ActivationStoreWriter(Impl::create(path, layout, layout.provenance.command_line, {}));
}

ActivationStoreWriter ActivationStoreWriter::resume(const std::filesystem::path& path,
                                                    const ActivationStoreLayout& layout) {
  hdf5::QuietErrors quiet;
  File file = File::open(path, File::Mode::kReadWrite);
  StoreState state = load_state(file);
  if (const auto difference = first_difference(state.layout, normalized(layout), compared_on_resume)) {
    const auto& [stored, given] = *difference;
    throw InputError(path.string(), stored.name,
                     "expected " + shown(stored) + " (what the store was created with), got " + shown(given));
  }
  return ActivationStoreWriter(
      std::make_unique<Impl>(std::move(file), std::move(state.layout), state.samples_complete));
}

int64_t ActivationStoreWriter::samples_complete() const { return impl().samples_complete; }
const ActivationStoreLayout& ActivationStoreWriter::layout() const { return impl().layout; }

void ActivationStoreWriter::write_tokens(int64_t sample, int64_t stream_start, std::span<const int32_t> tokens) {
  hdf5::QuietErrors quiet;
  impl().write_tokens(sample, stream_start, tokens);
}

void ActivationStoreWriter::write(ActivationField field, int64_t layer, int64_t sample, std::span<const float> values) {
  hdf5::QuietErrors quiet;
  impl().write(field, layer, sample, values);
}

void ActivationStoreWriter::commit_sample(int64_t sample) {
  hdf5::QuietErrors quiet;
  impl().commit_sample(sample);
}

void ActivationStoreWriter::close() {
  if (!impl_) return;
  hdf5::QuietErrors quiet;
  impl_->file.close();
}

// --- reader -------------------------------------------------------------

struct ActivationStoreReader::Impl {
  File file;
  StoreState state;

  const ActivationStoreLayout& layout() const { return state.layout; }

  void check_samples(int64_t first, int64_t count) const {
    if (count < 0 || first < 0 || first + count > state.samples_complete) {
      throw std::out_of_range("samples " + std::to_string(first) + ".." + std::to_string(first + count - 1) +
                              " are not all committed (samples_complete = " + std::to_string(state.samples_complete) +
                              ")");
    }
  }

  Dataset activations(ActivationField field, int64_t layer) const {
    check_field(layout(), field);
    check_index("layer", layer, layout().model.num_layers);
    return file.root().open_dataset(activation_path(layer, field));
  }

  // [count, heads_count, L, D] from samples [first, ...) and heads [head, ...).
  std::vector<float> read_block(ActivationField field, int64_t layer, int64_t first, int64_t count, int64_t head,
                                int64_t heads_count) const {
    const Dataset dataset = activations(field, layer);
    check_samples(first, count);
    const auto L = static_cast<hsize_t>(layout().provenance.seq_len);
    const auto D = static_cast<hsize_t>(layout().model.head_dim);
    const std::array<hsize_t, 4> start = {static_cast<hsize_t>(first), static_cast<hsize_t>(head), 0, 0};
    const std::array<hsize_t, 4> extent = {static_cast<hsize_t>(count), static_cast<hsize_t>(heads_count), L, D};
    std::vector<float> values(extent[0] * extent[1] * L * D);
    if (!values.empty()) dataset.read<float>(start, extent, values.data());
    return values;
  }
};

ActivationStoreReader::ActivationStoreReader(const std::filesystem::path& path) {
  hdf5::QuietErrors quiet;
  File file = File::open(path, File::Mode::kReadOnly);
  StoreState state = load_state(file);
  impl_ = std::make_unique<Impl>(Impl{std::move(file), std::move(state)});
}

ActivationStoreReader::ActivationStoreReader(ActivationStoreReader&&) noexcept = default;
ActivationStoreReader& ActivationStoreReader::operator=(ActivationStoreReader&&) noexcept = default;
ActivationStoreReader::~ActivationStoreReader() = default;

ActivationStoreReader::Impl& ActivationStoreReader::impl() const {
  if (!impl_) throw std::logic_error("ActivationStoreReader was moved from");
  return *impl_;
}

const std::filesystem::path& ActivationStoreReader::path() const { return impl().file.path(); }
const ActivationStoreLayout& ActivationStoreReader::layout() const { return impl().layout(); }
int64_t ActivationStoreReader::samples_complete() const { return impl().state.samples_complete; }
bool ActivationStoreReader::complete() const { return samples_complete() == layout().provenance.samples; }

std::vector<float> ActivationStoreReader::read(ActivationField field, int64_t layer, int64_t sample) const {
  hdf5::QuietErrors quiet;
  return impl().read_block(field, layer, sample, 1, 0, heads_of(layout().model, field));
}

std::vector<float> ActivationStoreReader::read_head(ActivationField field, int64_t layer, int64_t head, int64_t first,
                                                    int64_t count) const {
  hdf5::QuietErrors quiet;
  check_index("head", head, heads_of(layout().model, field));
  return impl().read_block(field, layer, first, count, head, 1);
}

std::vector<int32_t> ActivationStoreReader::read_tokens(int64_t sample) const {
  hdf5::QuietErrors quiet;
  impl().check_samples(sample, 1);
  std::vector<int32_t> tokens(static_cast<size_t>(layout().provenance.seq_len));
  const std::array<hsize_t, 2> start = {static_cast<hsize_t>(sample), 0};
  const std::array<hsize_t, 2> count = {1, tokens.size()};
  impl().file.root().open_dataset("tokens").read<int32_t>(start, count, tokens.data());
  return tokens;
}

int64_t ActivationStoreReader::stream_start(int64_t sample) const {
  hdf5::QuietErrors quiet;
  impl().check_samples(sample, 1);
  int64_t value = 0;
  const std::array<hsize_t, 1> at = {static_cast<hsize_t>(sample)};
  const std::array<hsize_t, 1> one = {1};
  impl().file.root().open_dataset("stream_start").read<int64_t>(at, one, &value);
  return value;
}

std::vector<CaptureProvenance> ActivationStoreReader::sources() const {
  if (impl().state.sources.empty()) return {layout().provenance};
  return impl().state.sources;
}

// --- merge --------------------------------------------------------------

namespace {

// The value every source agrees on, or `mixed` when they differ.
template <class T>
T common(const std::vector<CaptureProvenance>& sources, T CaptureProvenance::*member, T mixed) {
  for (const auto& source : sources) {
    if (source.*member != sources.front().*member) return mixed;
  }
  return sources.front().*member;
}

// Provenance of the concatenation: total samples; other items kept when all
// sources agree, emptied (0 for numbers) when they differ.
CaptureProvenance merged_provenance(const std::vector<CaptureProvenance>& sources) {
  CaptureProvenance merged;
  merged.data_file = common(sources, &CaptureProvenance::data_file, std::string());
  merged.data_sha256 = common(sources, &CaptureProvenance::data_sha256, std::string());
  merged.data_tokens = common(sources, &CaptureProvenance::data_tokens, int64_t{0});
  for (const auto& source : sources) merged.samples += source.samples;
  merged.seq_len = sources.front().seq_len;
  merged.seed = common(sources, &CaptureProvenance::seed, uint64_t{0});
  merged.bos = sources.front().bos;
  merged.compute_dtype = common(sources, &CaptureProvenance::compute_dtype, std::string());
  merged.device = common(sources, &CaptureProvenance::device, std::string());
  merged.tool_version = common(sources, &CaptureProvenance::tool_version, std::string());
  merged.command_line = common(sources, &CaptureProvenance::command_line, std::string());
  return merged;
}

void check_mergeable(const ActivationStoreReader& first, const ActivationStoreReader& other) {
  const std::string file = other.path().string();
  if (!other.complete()) {
    throw InputError(file, "samples_complete",
                     "expected a complete store (" + std::to_string(other.layout().provenance.samples) +
                         " samples), got " + std::to_string(other.samples_complete()));
  }
  if (&first == &other) return;
  if (const auto difference = first_difference(first.layout(), other.layout(), compared_on_merge)) {
    const auto& [expected, got] = *difference;
    const std::string what = expected.name.starts_with("model.") ? "model" : expected.name;
    throw InputError(
        file, expected.name,
        "expected the same " + what + " as " + first.path().string() + " (" + shown(expected) + "), got " + shown(got));
  }
}

}  // namespace

// A friend of the writer: it writes through Impl, which also writes /sources.
void merge_activation_stores(const std::vector<std::filesystem::path>& inputs, const std::filesystem::path& output) {
  hdf5::QuietErrors quiet;
  if (inputs.empty()) throw std::invalid_argument("merge_activation_stores: no inputs");
  std::vector<ActivationStoreReader> readers;
  std::vector<CaptureProvenance> sources;
  std::string command_line = "merge";
  for (const auto& input : inputs) {
    std::error_code error;
    if (std::filesystem::equivalent(input, output, error)) {
      throw InputError(output.string(), "", "the merge output is also one of its inputs");
    }
    readers.emplace_back(input);
    check_mergeable(readers.front(), readers.back());
    for (auto& source : readers.back().sources()) sources.push_back(std::move(source));
    command_line += " " + input.string();
  }

  ActivationStoreLayout layout = readers.front().layout();
  layout.provenance = merged_provenance(sources);
  std::filesystem::path temporary = output;
  temporary += ".tmp";
  RemoveOnFailure cleanup(temporary);
  auto writer = ActivationStoreWriter::Impl::create(temporary, layout, command_line, sources);
  int64_t output_sample = 0;
  // One sample of one layer and field in memory at a time.
  for (const auto& reader : readers) {
    for (int64_t sample = 0; sample < reader.samples_complete(); ++sample, ++output_sample) {
      writer->write_tokens(output_sample, reader.stream_start(sample), reader.read_tokens(sample));
      for (int64_t layer = 0; layer < layout.model.num_layers; ++layer) {
        for (const auto field : layout.fields) {
          writer->write(field, layer, output_sample, reader.read(field, layer, sample));
        }
      }
      writer->commit_sample(output_sample);
    }
  }
  writer->file.close();
  std::filesystem::rename(temporary, output);
  cleanup.release();
}

}  // namespace kvforge
