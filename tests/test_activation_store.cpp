// The HDF5 activation store: round trips with and without compression,
// resume (also after a killed writer), refusal of malformed files crafted
// with the HDF5 C API, merge, read_head, and an independent h5py reader
// (tests/check_activation_store.py) that must agree with ours.
#include "formats/activation_store.h"

#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "formats/input_error.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

namespace fs = std::filesystem;
using testing::read_file;
using testing::scratch_dir;
using testing::write_file;

// --- test data ---------------------------------------------------------------

ActivationStoreLayout small_layout(int compression_level = 1, int64_t samples = 3) {
  ActivationStoreLayout layout;
  layout.model = {.architecture = "LlamaForCausalLM",
                  .num_layers = 2,
                  .num_heads = 4,
                  .num_kv_heads = 2,
                  .head_dim = 8,
                  .hidden_size = 32,
                  .vocab_size = 1000,
                  .rope = R"({"theta":10000.0,"type":"default"})",
                  .kvo_sha256 = std::string(64, 'a'),
                  .tokenizer_sha256 = std::string(64, 'b')};
  layout.provenance = {.data_file = "calib.txt",
                       .data_sha256 = std::string(64, 'c'),
                       .data_tokens = 5000,
                       .samples = samples,
                       .seq_len = 16,
                       .seed = 42,
                       .bos = true,
                       .compute_dtype = "fp32",
                       .device = "cpu",
                       .tool_version = "0.1.0",
                       .command_line = "kvforge capture --samples 3"};
  layout.fields = all_activation_fields();
  layout.compression_level = compression_level;
  return layout;
}

int64_t heads(const ActivationStoreLayout& layout, ActivationField field) {
  return uses_query_heads(field) ? layout.model.num_heads : layout.model.num_kv_heads;
}

// Deterministic values for (salt, field, layer, sample); Fisher values are
// tiny like real ones, so a float16 round trip would flush them to zero.
std::vector<float> make_values(const ActivationStoreLayout& layout, ActivationField field, int64_t layer,
                               int64_t sample, uint32_t salt) {
  std::mt19937 rng(salt * 1000003u + static_cast<uint32_t>(field) * 7919u + static_cast<uint32_t>(layer) * 104729u +
                   static_cast<uint32_t>(sample));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const bool fisher = field == ActivationField::kFisherKeys || field == ActivationField::kFisherValues;
  std::vector<float> values(
      static_cast<size_t>(heads(layout, field) * layout.provenance.seq_len * layout.model.head_dim));
  for (auto& value : values) value = fisher ? 1e-12f * std::abs(normal(rng)) : normal(rng);
  return values;
}

std::vector<int32_t> make_tokens(const ActivationStoreLayout& layout, int64_t sample, uint32_t salt) {
  std::mt19937 rng(salt * 31u + static_cast<uint32_t>(sample));
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(layout.model.vocab_size) - 1);
  std::vector<int32_t> tokens(static_cast<size_t>(layout.provenance.seq_len));
  for (auto& t : tokens) t = token(rng);
  return tokens;
}

int64_t make_stream_start(int64_t sample, uint32_t salt) { return 1000 * salt + 15 * sample; }

void write_sample(ActivationStoreWriter& writer, int64_t sample, uint32_t salt, int64_t layers_to_write = -1) {
  const auto& layout = writer.layout();
  writer.write_tokens(sample, make_stream_start(sample, salt), make_tokens(layout, sample, salt));
  const int64_t layers = layers_to_write < 0 ? layout.model.num_layers : layers_to_write;
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (const auto field : layout.fields) {
      writer.write(field, layer, sample, make_values(layout, field, layer, sample, salt));
    }
  }
}

void write_store(const fs::path& path, const ActivationStoreLayout& layout, uint32_t salt) {
  auto writer = ActivationStoreWriter::create(path, layout);
  for (int64_t sample = 0; sample < layout.provenance.samples; ++sample) {
    write_sample(writer, sample, salt);
    writer.commit_sample(sample);
  }
  writer.close();
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every committed sample of `reader` holds what write_sample wrote with `salt`.
void expect_contents(const ActivationStoreReader& reader, int64_t first_sample, int64_t count, uint32_t salt,
                     int64_t sample_offset = 0) {
  const auto& layout = reader.layout();
  for (int64_t s = 0; s < count; ++s) {
    const int64_t stored = sample_offset + s;
    const int64_t original = first_sample + s;
    EXPECT_EQ(reader.read_tokens(stored), make_tokens(layout, original, salt)) << "sample " << stored;
    EXPECT_EQ(reader.stream_start(stored), make_stream_start(original, salt)) << "sample " << stored;
    for (int64_t layer = 0; layer < layout.model.num_layers; ++layer) {
      for (const auto field : layout.fields) {
        EXPECT_TRUE(same_bits(reader.read(field, layer, stored), make_values(layout, field, layer, original, salt)))
            << field_name(field) << " layer " << layer << " sample " << stored;
      }
    }
  }
}

void expect_same_datasets(const ActivationStoreReader& a, const ActivationStoreReader& b) {
  ASSERT_EQ(a.samples_complete(), b.samples_complete());
  ASSERT_EQ(a.layout().fields, b.layout().fields);
  for (int64_t sample = 0; sample < a.samples_complete(); ++sample) {
    EXPECT_EQ(a.read_tokens(sample), b.read_tokens(sample));
    EXPECT_EQ(a.stream_start(sample), b.stream_start(sample));
    for (int64_t layer = 0; layer < a.layout().model.num_layers; ++layer) {
      for (const auto field : a.layout().fields) {
        EXPECT_TRUE(same_bits(a.read(field, layer, sample), b.read(field, layer, sample)))
            << field_name(field) << " layer " << layer << " sample " << sample;
      }
    }
  }
}

// Runs `body` and returns the InputError it throws (failing the test if none).
InputError input_error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const InputError& error) {
    return error;
  }
  ADD_FAILURE() << "no InputError was thrown";
  return InputError("", "", "");
}

// --- crafting files with the HDF5 C API --------------------------------------

void edit_hdf5(const fs::path& path, const std::function<void(hid_t file)>& edit) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(file, 0);
  edit(file);
  ASSERT_GE(H5Fclose(file), 0);
}

void set_string_attribute(hid_t object, const char* name, const std::string& value) {
  if (H5Aexists(object, name) > 0) H5Adelete(object, name);
  const hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, H5T_VARIABLE);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t attribute = H5Acreate2(object, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
  const char* text = value.c_str();
  EXPECT_GE(H5Awrite(attribute, type, &text), 0);
  H5Aclose(attribute);
  H5Sclose(space);
  H5Tclose(type);
}

void set_int_attribute(hid_t object, const char* name, int64_t value) {
  if (H5Aexists(object, name) > 0) H5Adelete(object, name);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t attribute = H5Acreate2(object, name, H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT);
  EXPECT_GE(H5Awrite(attribute, H5T_NATIVE_INT64, &value), 0);
  H5Aclose(attribute);
  H5Sclose(space);
}

void replace_dataset(hid_t file, const char* name, hid_t type, std::vector<hsize_t> shape) {
  ASSERT_GE(H5Ldelete(file, name, H5P_DEFAULT), 0);
  const hid_t space = H5Screate_simple(static_cast<int>(shape.size()), shape.data(), nullptr);
  const hid_t dataset = H5Dcreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  ASSERT_GE(dataset, 0);
  H5Dclose(dataset);
  H5Sclose(space);
}

// Number of filters and chunk shape of one dataset, read with the C API.
std::pair<int, std::vector<hsize_t>> storage_of(const fs::path& path, const char* name) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  const hid_t dataset = H5Dopen2(file, name, H5P_DEFAULT);
  const hid_t dcpl = H5Dget_create_plist(dataset);
  std::vector<hsize_t> chunk(4);
  H5Pget_chunk(dcpl, 4, chunk.data());
  const int filters = H5Pget_nfilters(dcpl);
  H5Pclose(dcpl);
  H5Dclose(dataset);
  H5Fclose(file);
  return {filters, chunk};
}

// --- fields ------------------------------------------------------------------

TEST(ActivationFields, NamesRoundTrip) {
  const std::vector<std::string> names = {"q", "k_pre", "k_post", "v", "fisher_k", "fisher_v"};
  const auto fields = all_activation_fields();
  ASSERT_EQ(fields.size(), names.size());
  for (size_t i = 0; i < fields.size(); ++i) {
    EXPECT_EQ(field_name(fields[i]), names[i]);
    EXPECT_EQ(parse_activation_field(names[i]), fields[i]);
    EXPECT_EQ(uses_query_heads(fields[i]), names[i] == "q");
  }
  EXPECT_FALSE(parse_activation_field("k").has_value());
}

// --- round trip --------------------------------------------------------------

class RoundTrip : public ::testing::TestWithParam<int> {};

TEST_P(RoundTrip, ReadsBackWhatWasWritten) {
  const auto dir = scratch_dir("store-roundtrip");
  const auto path = dir / "a.h5";
  auto layout = small_layout(GetParam());
  std::reverse(layout.fields.begin(), layout.fields.end());  // stored in canonical order regardless
  write_store(path, layout, 1);

  const ActivationStoreReader reader(path);
  EXPECT_EQ(reader.layout().model, layout.model);
  EXPECT_EQ(reader.layout().provenance, layout.provenance);
  EXPECT_EQ(reader.layout().fields, all_activation_fields());
  EXPECT_EQ(reader.layout().compression_level, GetParam());
  EXPECT_EQ(reader.samples_complete(), 3);
  EXPECT_TRUE(reader.complete());
  ASSERT_EQ(reader.sources().size(), 1u);
  EXPECT_EQ(reader.sources()[0], layout.provenance);
  expect_contents(reader, 0, 3, 1);

  const auto [filters, chunk] = storage_of(path, "/layers/1/fisher_v");
  EXPECT_EQ(filters, GetParam() > 0 ? 2 : 0);  // shuffle + deflate
  EXPECT_EQ(chunk, (std::vector<hsize_t>{1, 1, 16, 8}));
}

INSTANTIATE_TEST_SUITE_P(Compression, RoundTrip, ::testing::Values(0, 1, 9));

TEST(ActivationStore, ReadHeadEqualsSlicingRead) {
  const auto dir = scratch_dir("store-readhead");
  const auto path = dir / "a.h5";
  write_store(path, small_layout(), 1);
  const ActivationStoreReader reader(path);
  const size_t plane = 16 * 8;
  for (const auto field : {ActivationField::kQueries, ActivationField::kValues}) {
    const int64_t head_count = heads(reader.layout(), field);
    for (int64_t head = 0; head < head_count; ++head) {
      const auto slab = reader.read_head(field, 1, head, 1, 2);
      ASSERT_EQ(slab.size(), 2 * plane);
      for (int64_t s = 0; s < 2; ++s) {
        const auto sample = reader.read(field, 1, 1 + s);
        const std::vector<float> expected(sample.begin() + static_cast<ptrdiff_t>(head * plane),
                                          sample.begin() + static_cast<ptrdiff_t>((head + 1) * plane));
        const std::vector<float> got(slab.begin() + static_cast<ptrdiff_t>(s * plane),
                                     slab.begin() + static_cast<ptrdiff_t>((s + 1) * plane));
        EXPECT_TRUE(same_bits(got, expected)) << field_name(field) << " head " << head << " sample " << 1 + s;
      }
    }
  }
  EXPECT_THROW(reader.read_head(ActivationField::kValues, 0, 2, 0, 1), std::out_of_range);  // 2 kv heads
  EXPECT_THROW(reader.read_head(ActivationField::kQueries, 0, 0, 2, 2), std::out_of_range);
}

TEST(ActivationStore, ChunksSplitLongWindowsAtFourMegabytes) {
  const auto dir = scratch_dir("store-chunks");
  const auto path = dir / "a.h5";
  auto layout = small_layout(0, 1);
  layout.model.num_layers = 1;
  layout.model.head_dim = 128;
  layout.provenance.seq_len = 16384;  // one head of one sample: 8 MB
  layout.fields = {ActivationField::kValues};
  ActivationStoreWriter::create(path, layout).close();
  EXPECT_EQ(storage_of(path, "/layers/0/v").second, (std::vector<hsize_t>{1, 1, 8192, 128}));
}

// --- writer misuse -----------------------------------------------------------

TEST(ActivationStore, WriterRefusesMisuse) {
  const auto dir = scratch_dir("store-misuse");
  auto writer = ActivationStoreWriter::create(dir / "a.h5", small_layout());
  const auto& layout = writer.layout();
  EXPECT_THROW(writer.write(ActivationField::kValues, 0, 0, std::vector<float>(5)), std::invalid_argument);
  EXPECT_THROW(writer.write_tokens(0, 0, std::vector<int32_t>(3)), std::invalid_argument);
  EXPECT_THROW(writer.write(ActivationField::kValues, 2, 0, make_values(layout, ActivationField::kValues, 0, 0, 1)),
               std::out_of_range);
  EXPECT_THROW(writer.write(ActivationField::kValues, 0, 3, make_values(layout, ActivationField::kValues, 0, 0, 1)),
               std::out_of_range);
  write_sample(writer, 1, 1);
  EXPECT_THROW(writer.commit_sample(1), std::logic_error);  // 0 comes first
  write_sample(writer, 0, 1, 1);                            // layer 1 missing
  try {
    writer.commit_sample(0);
    ADD_FAILURE() << "commit of an incomplete sample";
  } catch (const std::logic_error& error) {
    EXPECT_NE(std::string(error.what()).find("layers/1/q"), std::string::npos) << error.what();
  }
  write_sample(writer, 0, 1);
  writer.commit_sample(0);
  writer.commit_sample(1);
  EXPECT_EQ(writer.samples_complete(), 2);
  EXPECT_THROW(write_sample(writer, 1, 1), std::logic_error);  // already committed
  writer.close();
  writer.close();  // idempotent

  const ActivationStoreReader reader(dir / "a.h5");
  EXPECT_EQ(reader.samples_complete(), 2);
  EXPECT_FALSE(reader.complete());
  EXPECT_THROW(reader.read(ActivationField::kQueries, 0, 2), std::out_of_range);
  EXPECT_THROW(reader.read_tokens(2), std::out_of_range);
}

TEST(ActivationStore, CreateRefusesAnInvalidLayout) {
  const auto dir = scratch_dir("store-badlayout");
  auto layout = small_layout();
  layout.model.num_kv_heads = 3;
  auto error = input_error_of([&] { ActivationStoreWriter::create(dir / "a.h5", layout); });
  EXPECT_EQ(error.field(), "model.num_kv_heads");
  layout = small_layout();
  layout.fields = {ActivationField::kValues, ActivationField::kValues};
  EXPECT_EQ(input_error_of([&] { ActivationStoreWriter::create(dir / "a.h5", layout); }).field(), "fields");
  layout = small_layout(10);
  EXPECT_EQ(input_error_of([&] { ActivationStoreWriter::create(dir / "a.h5", layout); }).field(), "compression_level");
  EXPECT_FALSE(fs::exists(dir / "a.h5"));
}

// --- resume ------------------------------------------------------------------

TEST(ActivationStore, ResumeContinuesAndMatchesAnUninterruptedWrite) {
  const auto dir = scratch_dir("store-resume");
  const auto layout = small_layout();
  write_store(dir / "whole.h5", layout, 1);
  {
    auto writer = ActivationStoreWriter::create(dir / "resumed.h5", layout);
    write_sample(writer, 0, 1);
    writer.commit_sample(0);
    write_sample(writer, 1, 1, 1);  // interrupted half-way through sample 1
  }
  auto changed_run = layout;  // what may change between runs
  changed_run.provenance.command_line += " --resume";
  changed_run.provenance.device = "cuda";
  changed_run.provenance.data_file = "/elsewhere/calib.txt";
  auto writer = ActivationStoreWriter::resume(dir / "resumed.h5", changed_run);
  EXPECT_EQ(writer.samples_complete(), 1);
  EXPECT_EQ(writer.layout().provenance, layout.provenance);  // the stored one
  for (int64_t sample = writer.samples_complete(); sample < 3; ++sample) {
    write_sample(writer, sample, 1);
    writer.commit_sample(sample);
  }
  writer.close();
  expect_same_datasets(ActivationStoreReader(dir / "whole.h5"), ActivationStoreReader(dir / "resumed.h5"));
}

TEST(ActivationStore, ResumeAfterTheWriterWasKilled) {
  const auto dir = scratch_dir("store-killed");
  const auto layout = small_layout();
  write_store(dir / "whole.h5", layout, 1);
  const pid_t child = ::fork();
  if (child == 0) {
    // No close, no destructors: like a process killed mid-sample.
    auto* writer = new ActivationStoreWriter(ActivationStoreWriter::create(dir / "killed.h5", layout));
    write_sample(*writer, 0, 1);
    writer->commit_sample(0);
    write_sample(*writer, 1, 1, 1);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  auto writer = ActivationStoreWriter::resume(dir / "killed.h5", layout);
  ASSERT_EQ(writer.samples_complete(), 1);
  for (int64_t sample = 1; sample < 3; ++sample) {
    write_sample(writer, sample, 1);
    writer.commit_sample(sample);
  }
  writer.close();
  expect_same_datasets(ActivationStoreReader(dir / "whole.h5"), ActivationStoreReader(dir / "killed.h5"));
}

TEST(ActivationStore, ResumeRefusesAnotherLayoutNamingTheAttribute) {
  const auto dir = scratch_dir("store-resume-refused");
  const auto path = dir / "a.h5";
  {
    auto writer = ActivationStoreWriter::create(path, small_layout());
    write_sample(writer, 0, 1);
    writer.commit_sample(0);
  }
  auto layout = small_layout();
  layout.provenance.seed = 43;
  auto error = input_error_of([&] { ActivationStoreWriter::resume(path, layout); });
  EXPECT_EQ(error.file(), path.string());
  EXPECT_EQ(error.field(), "provenance.seed");
  EXPECT_NE(std::string(error.what()).find("expected 42"), std::string::npos) << error.what();

  layout = small_layout();
  layout.model.kvo_sha256 = std::string(64, 'f');
  EXPECT_EQ(input_error_of([&] { ActivationStoreWriter::resume(path, layout); }).field(), "model.kvo_sha256");
  layout = small_layout();
  layout.fields = {ActivationField::kQueries};
  EXPECT_EQ(input_error_of([&] { ActivationStoreWriter::resume(path, layout); }).field(), "fields");
  layout = small_layout();
  layout.provenance.samples = 4;
  EXPECT_EQ(input_error_of([&] { ActivationStoreWriter::resume(path, layout); }).field(), "provenance.samples");
  layout = small_layout();
  layout.provenance.compute_dtype = "bf16";
  EXPECT_EQ(input_error_of([&] { ActivationStoreWriter::resume(path, layout); }).field(), "provenance.compute_dtype");
  EXPECT_EQ(input_error_of([&] { ActivationStoreWriter::resume(dir / "none.h5", small_layout()); }).file(),
            (dir / "none.h5").string());
}

// --- the reader refuses malformed files --------------------------------------

struct Malformed {
  const char* name;
  std::function<void(const fs::path&)> damage;
  std::string field;     // the InputError's field
  std::string expected;  // a part of its message
};

class ReaderRefuses : public ::testing::TestWithParam<Malformed> {};

TEST_P(ReaderRefuses, NamingFileAndObject) {
  const auto dir = scratch_dir(std::string("store-refuses-") + GetParam().name);
  const auto path = dir / "a.h5";
  write_store(path, small_layout(), 1);
  GetParam().damage(path);
  const auto error = input_error_of([&] {
    const ActivationStoreReader reader(path);
    // A truncated file may open and fail only when a damaged chunk is read.
    for (int64_t layer = 0; layer < 2; ++layer) {
      for (const auto field : all_activation_fields()) reader.read_head(field, layer, 0, 0, 3);
    }
  });
  EXPECT_EQ(error.file(), path.string()) << error.what();
  EXPECT_EQ(error.field(), GetParam().field) << error.what();
  EXPECT_NE(std::string(error.what()).find(GetParam().expected), std::string::npos) << error.what();
}

INSTANTIATE_TEST_SUITE_P(
    Malformed, ReaderRefuses,
    ::testing::Values(
        Malformed{"wrong_schema",
                  [](const fs::path& p) { edit_hdf5(p, [](hid_t f) { set_string_attribute(f, "schema", "other"); }); },
                  "/@schema", "expected \"kvforge.activations\", got \"other\""},
        Malformed{"other_version",
                  [](const fs::path& p) { edit_hdf5(p, [](hid_t f) { set_int_attribute(f, "schema_version", 2); }); },
                  "/@schema_version", "expected 1"},
        Malformed{"missing_dataset",
                  [](const fs::path& p) {
                    edit_hdf5(p, [](hid_t f) { ASSERT_GE(H5Ldelete(f, "/layers/1/v", H5P_DEFAULT), 0); });
                  },
                  "/layers/1/v", "missing"},
        Malformed{"wrong_shape",
                  [](const fs::path& p) {
                    edit_hdf5(p, [](hid_t f) { replace_dataset(f, "/layers/0/k_pre", H5T_IEEE_F32LE, {3, 2, 16, 4}); });
                  },
                  "/layers/0/k_pre", "expected shape [3, 2, 16, 8], got [3, 2, 16, 4]"},
        Malformed{"wrong_type",
                  [](const fs::path& p) {
                    edit_hdf5(p, [](hid_t f) {
                      replace_dataset(f, "/layers/1/fisher_k", H5T_IEEE_F64LE, {3, 2, 16, 8});
                    });
                  },
                  "/layers/1/fisher_k", "expected float32, got float64"},
        Malformed{"wrong_tokens",
                  [](const fs::path& p) {
                    edit_hdf5(p, [](hid_t f) { replace_dataset(f, "/tokens", H5T_STD_I32LE, {3, 15}); });
                  },
                  "/tokens", "expected shape [3, 16]"},
        Malformed{"missing_attribute",
                  [](const fs::path& p) {
                    edit_hdf5(p,
                              [](hid_t f) { ASSERT_GE(H5Adelete_by_name(f, "model", "kvo_sha256", H5P_DEFAULT), 0); });
                  },
                  "/model@kvo_sha256", "missing"},
        Malformed{"string_for_integer",
                  [](const fs::path& p) {
                    edit_hdf5(p, [](hid_t f) {
                      const hid_t g = H5Gopen2(f, "provenance", H5P_DEFAULT);
                      set_string_attribute(g, "seq_len", "16");
                      H5Gclose(g);
                    });
                  },
                  "/provenance@seq_len", "expected an integer, got string"},
        Malformed{"not_hdf5", [](const fs::path& p) { write_file(p, "q,k,v\n1,2,3\n"); }, "", "not an HDF5 file"},
        Malformed{"truncated",
                  [](const fs::path& p) {
                    const std::string bytes = read_file(p);
                    write_file(p, bytes.substr(0, bytes.size() / 2));
                  },
                  "", "truncated"},
        Malformed{"missing_file", [](const fs::path& p) { fs::remove(p); }, "", "no such file"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(ActivationStore, ReaderIgnoresUnknownExtraAttributes) {
  const auto dir = scratch_dir("store-extra");
  const auto path = dir / "a.h5";
  write_store(path, small_layout(), 1);
  edit_hdf5(path, [](hid_t file) {
    set_string_attribute(file, "future_note", "added by a later minor revision");
    const hid_t model = H5Gopen2(file, "model", H5P_DEFAULT);
    set_int_attribute(model, "num_experts", 8);
    H5Gclose(model);
  });
  const ActivationStoreReader reader(path);
  EXPECT_TRUE(reader.complete());
}

// --- merge -------------------------------------------------------------------

TEST(ActivationStore, MergeConcatenatesSamplesTokensAndSources) {
  const auto dir = scratch_dir("store-merge");
  auto a = small_layout(1, 3);
  auto b = small_layout(0, 2);  // compression may differ
  b.provenance.data_file = "more.txt";
  b.provenance.data_sha256 = std::string(64, 'd');
  b.provenance.seed = 7;
  write_store(dir / "a.h5", a, 1);
  write_store(dir / "b.h5", b, 2);

  merge_activation_stores({dir / "a.h5", dir / "b.h5"}, dir / "ab.h5");
  EXPECT_FALSE(fs::exists(dir / "ab.h5.tmp"));
  const ActivationStoreReader merged(dir / "ab.h5");
  EXPECT_TRUE(merged.complete());
  EXPECT_EQ(merged.samples_complete(), 5);
  EXPECT_EQ(merged.layout().model, a.model);
  EXPECT_EQ(merged.layout().provenance.samples, 5);
  EXPECT_EQ(merged.layout().provenance.seq_len, 16);
  EXPECT_EQ(merged.layout().provenance.data_file, "");  // the sources differ
  EXPECT_EQ(merged.layout().provenance.compute_dtype, "fp32");
  ASSERT_EQ(merged.sources().size(), 2u);
  EXPECT_EQ(merged.sources()[0], a.provenance);
  EXPECT_EQ(merged.sources()[1], b.provenance);
  expect_contents(merged, 0, 3, 1, 0);
  expect_contents(merged, 0, 2, 2, 3);

  // Merging a merge lists the original captures.
  merge_activation_stores({dir / "ab.h5", dir / "a.h5"}, dir / "aba.h5");
  const ActivationStoreReader twice(dir / "aba.h5");
  ASSERT_EQ(twice.sources().size(), 3u);
  EXPECT_EQ(twice.sources()[2], a.provenance);
  expect_contents(twice, 0, 3, 1, 5);
}

TEST(ActivationStore, MergeRefusesAnotherModelNamingTheField) {
  const auto dir = scratch_dir("store-merge-refused");
  auto b = small_layout();
  b.model.kvo_sha256 = "9c1e" + std::string(60, '0');
  write_store(dir / "a.h5", small_layout(), 1);
  write_store(dir / "b.h5", b, 2);
  const auto error = input_error_of([&] { merge_activation_stores({dir / "a.h5", dir / "b.h5"}, dir / "ab.h5"); });
  EXPECT_EQ(error.file(), (dir / "b.h5").string());
  EXPECT_EQ(error.field(), "model.kvo_sha256");
  const std::string message = error.what();
  EXPECT_NE(message.find("expected the same model as " + (dir / "a.h5").string() + " (aaaaaaaaaaaa...), got 9c1e"),
            std::string::npos)
      << message;
  EXPECT_FALSE(fs::exists(dir / "ab.h5"));
  EXPECT_FALSE(fs::exists(dir / "ab.h5.tmp"));

  auto c = small_layout();
  c.provenance.seq_len = 32;
  write_store(dir / "c.h5", c, 3);
  EXPECT_EQ(input_error_of([&] {
              merge_activation_stores({dir / "a.h5", dir / "c.h5"}, dir / "ac.h5");
            }).field(),
            "provenance.seq_len");
}

TEST(ActivationStore, MergeRefusesAPartialStore) {
  const auto dir = scratch_dir("store-merge-partial");
  write_store(dir / "a.h5", small_layout(), 1);
  {
    auto writer = ActivationStoreWriter::create(dir / "p.h5", small_layout());
    write_sample(writer, 0, 2);
    writer.commit_sample(0);
  }
  const auto error = input_error_of([&] { merge_activation_stores({dir / "a.h5", dir / "p.h5"}, dir / "ap.h5"); });
  EXPECT_EQ(error.file(), (dir / "p.h5").string());
  EXPECT_EQ(error.field(), "samples_complete");
  EXPECT_FALSE(fs::exists(dir / "ap.h5"));
}

// --- the independent h5py reader ---------------------------------------------

// The independent reader's report on `path` (it must exit 0).
std::string run_reader(const fs::path& path) {
  const testing::CommandResult result =
      testing::run_python(testing::fixtures_dir().parent_path() / "check_activation_store.py", path);
  EXPECT_EQ(result.exit_code, 0) << path << "\n" << result.stdout_text << result.stderr_text;
  return result.stdout_text;
}

// The script's checksums of one dataset: its float64 sum, and the sum with
// position weights weight(i) = ((i * 2654435761) mod 2^32 + 1) / 2^32, i the
// row-major index, which values moved to another sample, head, token or
// channel change. `magnitude` (the weighted sum of |x|) scales the
// tolerance: both sides round each product once and sum in other orders.
struct Checksum {
  double sum = 0, weighted = 0, magnitude = 0;
  uint64_t next_index = 0;
  void add(double value) {
    const double weight = static_cast<double>(((next_index++ * 2654435761ull) & 0xFFFFFFFFull) + 1) / 4294967296.0;
    sum += value;
    weighted += weight * value;
    magnitude += weight * std::abs(value);
  }
  template <class Values>
  void add_all(const Values& values) {
    for (const auto value : values) add(static_cast<double>(value));
  }
};

std::map<std::string, Checksum> our_checksums(const ActivationStoreReader& reader) {
  std::map<std::string, Checksum> checksums;
  for (int64_t sample = 0; sample < reader.samples_complete(); ++sample) {
    checksums["tokens"].add_all(reader.read_tokens(sample));
    checksums["stream_start"].add(static_cast<double>(reader.stream_start(sample)));
    for (int64_t layer = 0; layer < reader.layout().model.num_layers; ++layer) {
      for (const auto field : reader.layout().fields) {
        checksums["layers/" + std::to_string(layer) + "/" + std::string(field_name(field))].add_all(
            reader.read(field, layer, sample));
      }
    }
  }
  return checksums;
}

// layers/0/<first field> with each sample's values moved by one token (a
// permutation): the plain sum cannot tell, the weighted one must.
Checksum checksum_moved_by_one_token(const ActivationStoreReader& reader) {
  Checksum checksum;
  for (int64_t sample = 0; sample < reader.samples_complete(); ++sample) {
    std::vector<float> values = reader.read(reader.layout().fields.front(), 0, sample);
    std::rotate(values.begin(), values.begin() + reader.layout().model.head_dim, values.end());
    checksum.add_all(values);
  }
  return checksum;
}

void expect_python_agrees(const fs::path& path) {
  const auto report = nlohmann::json::parse(run_reader(path));
  const ActivationStoreReader reader(path);
  EXPECT_EQ(report.at("samples_complete").get<int64_t>(), reader.samples_complete());
  EXPECT_EQ(report.at("sources").get<size_t>(), reader.sources().size());
  const auto checksums = our_checksums(reader);
  ASSERT_EQ(report.at("sums").size(), checksums.size()) << report.dump();
  ASSERT_EQ(report.at("weighted_sums").size(), checksums.size()) << report.dump();
  // float64 products and sums of at most ~10^6 terms: within 1e-12 of the
  // magnitude; 1e-9 leaves room and still sees one value out of place.
  auto tolerance = [](const Checksum& c) { return 1e-9 * std::max(1.0, c.magnitude); };
  for (const auto& [name, ours] : checksums) {
    const double sum = report.at("sums").at(name).get<double>();
    const double weighted = report.at("weighted_sums").at(name).get<double>();
    EXPECT_NEAR(sum, ours.sum, tolerance(ours)) << name;
    EXPECT_NEAR(weighted, ours.weighted, tolerance(ours)) << name;
    if (name.find("fisher") != std::string::npos) EXPECT_GT(sum, 0.0) << name;  // tiny, not flushed to 0
  }
  if (reader.samples_complete() > 0) {
    const std::string first = "layers/0/" + std::string(field_name(reader.layout().fields.front()));
    const Checksum moved = checksum_moved_by_one_token(reader);
    const double weighted = report.at("weighted_sums").at(first).get<double>();
    EXPECT_NEAR(report.at("sums").at(first).get<double>(), moved.sum, tolerance(moved)) << first;
    EXPECT_GT(std::abs(weighted - moved.weighted), tolerance(moved)) << first << ": a permutation passes";
  }
}

TEST(ActivationStore, IndependentH5pyReaderAgrees) {
  KVFORGE_REQUIRE_H5PY();
  const auto dir = scratch_dir("store-h5py");
  write_store(dir / "a.h5", small_layout(1), 1);
  write_store(dir / "b.h5", small_layout(0, 2), 2);
  merge_activation_stores({dir / "a.h5", dir / "b.h5"}, dir / "ab.h5");
  {
    auto writer = ActivationStoreWriter::create(dir / "partial.h5", small_layout());
    write_sample(writer, 0, 3);
    writer.commit_sample(0);
  }
  for (const char* name : {"a.h5", "b.h5", "ab.h5", "partial.h5"}) {
    SCOPED_TRACE(name);
    expect_python_agrees(dir / name);
  }
}

}  // namespace
}  // namespace kvforge
