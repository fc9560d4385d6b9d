#pragma once
// The activation store: one HDF5 file per capture holding, per layer and
// head, the queries, the keys before and after RoPE, the values and their
// Fisher sensitivity for every calibration window, plus the window's tokens
// and where it came from. `kvforge capture` writes it sample by sample (and
// can resume a partial one); `kvforge calibrate` reads it per layer and head.
// The layout on disk, its version and compatibility rules are specified in
// docs/activation-store.md.
//
// Bad files are InputError naming the file, the dataset or attribute and
// what was expected; misuse of the API (a wrong buffer size, an index out of
// range, committing out of order) is std::invalid_argument, std::out_of_range
// or std::logic_error. Memory stays bounded by one sample of one layer
// whatever the number of samples. Objects are not thread-safe.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvforge {

inline constexpr int kActivationStoreVersion = 1;  // of schema "kvforge.activations"

enum class ActivationField { kQueries, kKeysPreRope, kKeysPostRope, kValues, kFisherKeys, kFisherValues };

std::string_view field_name(ActivationField field);  // "q", "k_pre", "k_post", "v", "fisher_k", "fisher_v"
std::optional<ActivationField> parse_activation_field(std::string_view name);
bool uses_query_heads(ActivationField field);          // true only for q: num_heads heads, others num_kv_heads
std::vector<ActivationField> all_activation_fields();  // in the order above

struct ModelFingerprint {
  std::string architecture;  // "LlamaForCausalLM"
  int64_t num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, hidden_size = 0, vocab_size = 0;
  std::string rope;              // canonical JSON of the RoPE settings
  std::string kvo_sha256;        // SHA-256 over every layer's k_proj, v_proj, o_proj weights
  std::string tokenizer_sha256;  // SHA-256 of tokenizer.json
  bool operator==(const ModelFingerprint&) const = default;
};

struct CaptureProvenance {
  std::string data_file, data_sha256;
  int64_t data_tokens = 0;           // tokens in the whole data file
  int64_t samples = 0, seq_len = 0;  // planned samples (windows) and tokens per window
  uint64_t seed = 0;
  bool bos = true;  // window starts with the model's BOS
  std::string compute_dtype, device, tool_version, command_line;
  bool operator==(const CaptureProvenance&) const = default;
};

struct ActivationStoreLayout {
  ModelFingerprint model;
  CaptureProvenance provenance;
  std::vector<ActivationField> fields;  // stored in all_activation_fields() order, whatever order given
  int compression_level = 1;            // deflate level 0..9 (0: no compression), shuffle filter when > 0
  bool operator==(const ActivationStoreLayout&) const = default;
};

// Writes a store. Samples are written whole (tokens and every layer and
// field) and then committed in order; a crash loses at most the samples not
// yet committed. RAII: closes the file when destroyed; movable, not copyable.
class ActivationStoreWriter {
 public:
  // Creates the file (replacing one already there) with every dataset sized
  // for provenance.samples. InputError for an invalid layout (naming it).
  static ActivationStoreWriter create(const std::filesystem::path& path, const ActivationStoreLayout& layout);
  // Reopens a partial store for --resume; InputError (naming file and the
  // first differing attribute, e.g. "provenance.seed") when the layout differs
  // from the one it was created with. Compared: the model fingerprint, the
  // data's sha, token count, samples, seq_len, seed, bos, compute dtype,
  // fields and compression level; not the data file's path, the device, the
  // tool version or the command line. layout() is then the stored one.
  static ActivationStoreWriter resume(const std::filesystem::path& path, const ActivationStoreLayout& layout);

  ActivationStoreWriter(ActivationStoreWriter&&) noexcept;
  ActivationStoreWriter& operator=(ActivationStoreWriter&&) noexcept;
  ActivationStoreWriter(const ActivationStoreWriter&) = delete;
  ActivationStoreWriter& operator=(const ActivationStoreWriter&) = delete;
  ~ActivationStoreWriter();  // closes; errors are swallowed here, call close() to see them

  int64_t samples_complete() const;
  const ActivationStoreLayout& layout() const;

  // Writes for any sample not yet committed (samples_complete() <= sample <
  // provenance.samples); writing again replaces.
  void write_tokens(int64_t sample, int64_t stream_start, std::span<const int32_t> tokens);  // size seq_len
  // values: row-major [heads, seq_len, head_dim] float32 (heads = num_heads
  // for q, num_kv_heads otherwise).
  void write(ActivationField field, int64_t layer, int64_t sample, std::span<const float> values);
  // sample == samples_complete() and everything of it written (else
  // std::logic_error naming what is missing); sets the samples_complete
  // attribute and flushes the file.
  void commit_sample(int64_t sample);
  void close();  // idempotent; the destructor calls it

 private:
  struct Impl;
  // The merge writes through Impl, which also writes the /sources group.
  friend void merge_activation_stores(const std::vector<std::filesystem::path>& inputs,
                                      const std::filesystem::path& output);
  explicit ActivationStoreWriter(std::unique_ptr<Impl> impl);
  Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

// Reads a store, complete or partial. The constructor validates the schema,
// version, every required attribute and every dataset's shape and type.
class ActivationStoreReader {
 public:
  explicit ActivationStoreReader(const std::filesystem::path& path);
  ActivationStoreReader(ActivationStoreReader&&) noexcept;
  ActivationStoreReader& operator=(ActivationStoreReader&&) noexcept;
  ActivationStoreReader(const ActivationStoreReader&) = delete;
  ActivationStoreReader& operator=(const ActivationStoreReader&) = delete;
  ~ActivationStoreReader();

  const std::filesystem::path& path() const;
  const ActivationStoreLayout& layout() const;
  int64_t samples_complete() const;
  bool complete() const;  // samples_complete() == provenance.samples

  // Only committed samples (< samples_complete()) can be read.
  std::vector<float> read(ActivationField field, int64_t layer, int64_t sample) const;  // [heads, L, D]
  // One head across samples [first, first + count): [count, L, D].
  std::vector<float> read_head(ActivationField field, int64_t layer, int64_t head, int64_t first, int64_t count) const;
  std::vector<int32_t> read_tokens(int64_t sample) const;  // seq_len tokens
  int64_t stream_start(int64_t sample) const;              // first text token's index in its data file
  // One per merged input, in sample order; {layout().provenance} if not merged.
  std::vector<CaptureProvenance> sources() const;

 private:
  struct Impl;
  Impl& impl() const;
  std::unique_ptr<Impl> impl_;
};

// Concatenates complete stores of the same model (ModelFingerprint equal,
// same seq_len, bos and fields) into `output`, samples in input order. It is
// written to output + ".tmp" and renamed when complete; inputs are copied one
// sample at a time. InputError naming the input file and the differing field
// otherwise, e.g. "b.h5: model.kvo_sha256: expected the same model as a.h5
// (3f2a...), got 9c1e...".
void merge_activation_stores(const std::vector<std::filesystem::path>& inputs, const std::filesystem::path& output);

}  // namespace kvforge
