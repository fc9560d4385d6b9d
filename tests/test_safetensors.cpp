// Safetensors reading: files built byte by byte here, every kind of bad
// header, sharded checkpoints, and the real pyllama-16m fixture.
#include "formats/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
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

// --- building files ----------------------------------------------------------

std::string u64_le(uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  return bytes;
}

// A safetensors file from a hand-written header and data section.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  return u64_le(header.size()) + header + data;
}

template <typename T>
std::string raw_bytes(const std::vector<T>& values) {
  std::string bytes(values.size() * sizeof(T), '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

struct TensorSpec {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string data;
};

// A well-formed file: tensors laid out back to back in the given order.
std::string build_file(const std::vector<TensorSpec>& tensors,
                       const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.data.size()}}};
    data += t.data;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  return safetensors_bytes(header.dump(), data);
}

fs::path write_in(const fs::path& dir, const std::string& name, const std::string& bytes) {
  const auto path = dir / name;
  write_file(path, bytes);
  return path;
}

std::vector<uint16_t> halves(const TensorView& view) {
  std::vector<uint16_t> values(view.bytes.size() / 2);
  std::memcpy(values.data(), view.bytes.data(), view.bytes.size());
  return values;
}

// --- checking errors ---------------------------------------------------------

// what() of the InputError `action` throws; a test failure when it throws none.
template <typename Action>
std::string input_error(Action action) {
  try {
    action();
  } catch (const InputError& error) {
    return error.what();
  }
  ADD_FAILURE() << "expected an InputError";
  return "";
}

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

// Writes `bytes` as a .safetensors file, opens it, returns the error line,
// after checking that it names the file.
std::string open_error(const std::string& test, const std::string& bytes) {
  const auto path = write_in(scratch_dir(test), "bad.safetensors", bytes);
  const auto message = input_error([&] { SafetensorsFile file(path); });
  EXPECT_TRUE(Contains(message, path.string()));
  return message;
}

// --- good files --------------------------------------------------------------

TEST(SafetensorsFile, ReadsValuesShapesAndMetadata) {
  const auto dir = scratch_dir("st-values");
  const std::vector<float> f32 = {1.5f, -2.0f, 0.25f, 8.0f, 0.0f, -0.5f};
  const std::vector<uint16_t> f16 = {0x3C00, 0xC000, 0x3800};   // 1.0, -2.0, 0.5
  const std::vector<uint16_t> bf16 = {0x3F80, 0x4040};          // 1.0, 3.0
  const auto path = write_in(dir, "model.safetensors",
                             build_file({{"a.f32", "F32", {2, 3}, raw_bytes(f32)},
                                         {"b.f16", "F16", {3}, raw_bytes(f16)},
                                         {"c.bf16", "BF16", {1, 2}, raw_bytes(bf16)}},
                                        {{"format", "pt"}}));
  SafetensorsFile file(path);
  ASSERT_EQ(file.tensors().size(), 3u);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.path(), path);

  const auto& a = file.tensors().at("a.f32");
  EXPECT_EQ(a.dtype, DType::kF32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.numel(), 6);
  ASSERT_EQ(a.bytes.size(), 24u);
  std::vector<float> a_values(6);
  std::memcpy(a_values.data(), a.bytes.data(), 24);
  EXPECT_EQ(a_values, f32);
  EXPECT_EQ(a.file, path);

  const auto& b = file.tensors().at("b.f16");
  EXPECT_EQ(b.dtype, DType::kF16);
  EXPECT_EQ(b.shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(halves(b), f16);

  const auto& c = file.tensors().at("c.bf16");
  EXPECT_EQ(c.dtype, DType::kBF16);
  EXPECT_EQ(c.shape, (std::vector<int64_t>{1, 2}));
  const auto c_bits = halves(c);
  float three = 0;
  const uint32_t widened = uint32_t{c_bits[1]} << 16;  // bf16 is the top half of an f32
  std::memcpy(&three, &widened, 4);
  EXPECT_EQ(three, 3.0f);
}

TEST(SafetensorsFile, AcceptsScalarsEmptyTensorsAndPadding) {
  // A scalar (shape []), a zero-size tensor and 4 padding bytes nobody owns.
  const std::string header =
      R"({"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},)"
      R"( "z": {"dtype": "F16", "shape": [0, 7], "data_offsets": [4, 4]}}   )";
  const auto path = write_in(scratch_dir("st-scalar"), "x.safetensors",
                             safetensors_bytes(header, raw_bytes(std::vector<float>{2.0f, 0.0f})));
  SafetensorsFile file(path);
  EXPECT_EQ(file.tensors().at("s").numel(), 1);
  EXPECT_EQ(file.tensors().at("z").numel(), 0);
  EXPECT_TRUE(file.tensors().at("z").bytes.empty());
  EXPECT_TRUE(file.metadata().empty());
}

TEST(SafetensorsFile, AcceptsHeaderWithoutTensors) {
  const auto path = write_in(scratch_dir("st-empty"), "x.safetensors", safetensors_bytes("{}", ""));
  EXPECT_TRUE(SafetensorsFile(path).tensors().empty());
}

// --- bad files ---------------------------------------------------------------

TEST(SafetensorsFile, RejectsMissingFile) {
  const auto path = scratch_dir("st-missing") / "absent.safetensors";
  EXPECT_TRUE(Contains(input_error([&] { SafetensorsFile file(path); }), path.string()));
}

TEST(SafetensorsFile, RejectsEmptyFile) {
  EXPECT_TRUE(Contains(open_error("st-empty-file", ""), "header length"));
}

TEST(SafetensorsFile, RejectsFileCutInLengthPrefix) {
  EXPECT_TRUE(Contains(open_error("st-cut-prefix", u64_le(2).substr(0, 5)), "header length"));
}

TEST(SafetensorsFile, RejectsFileCutInHeader) {
  const auto whole = build_file({{"w", "F32", {2}, raw_bytes(std::vector<float>{1, 2})}});
  const auto message = open_error("st-cut-header", whole.substr(0, 20));
  EXPECT_TRUE(Contains(message, "header length"));
  EXPECT_TRUE(Contains(message, "truncated"));
}

TEST(SafetensorsFile, RejectsFileCutInData) {
  const auto whole = build_file({{"layer.w", "F32", {4}, raw_bytes(std::vector<float>{1, 2, 3, 4})}});
  const auto message = open_error("st-cut-data", whole.substr(0, whole.size() - 3));
  EXPECT_TRUE(Contains(message, "layer.w"));
  EXPECT_TRUE(Contains(message, "data section of 13 bytes"));
}

TEST(SafetensorsFile, RejectsHeaderLengthBeyondFile) {
  const auto message = open_error("st-len-beyond", u64_le(1000) + "{}");
  EXPECT_TRUE(Contains(message, "header length"));
  EXPECT_TRUE(Contains(message, "1000"));
}

TEST(SafetensorsFile, RejectsHeaderLengthAboveLimit) {
  // Would wrap around if 8 + N were computed without care.
  const auto message = open_error("st-len-huge", u64_le(~uint64_t{0}) + "{}");
  EXPECT_TRUE(Contains(message, "header length"));
  EXPECT_TRUE(Contains(message, "at most 100000000"));
}

TEST(SafetensorsFile, RejectsHeaderThatIsNotJson) {
  const auto message = open_error("st-not-json", safetensors_bytes("{\"w\": {\"dtype\": ", ""));
  EXPECT_TRUE(Contains(message, "header"));
  EXPECT_TRUE(Contains(message, "valid JSON"));
}

TEST(SafetensorsFile, RejectsHeaderThatIsNotAnObject) {
  const auto message = open_error("st-not-object", safetensors_bytes("[1, 2]", ""));
  EXPECT_TRUE(Contains(message, "header: a JSON object"));
}

TEST(SafetensorsFile, RejectsDuplicateTensorNames) {
  const std::string header = R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                             R"( "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})";
  const auto message = open_error("st-dup", safetensors_bytes(header, std::string(8, '\0')));
  EXPECT_TRUE(Contains(message, "w: a key that appears once"));
}

TEST(SafetensorsFile, RejectsUnknownDtype) {
  const std::string header = R"({"ids": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})";
  const auto message = open_error("st-dtype", safetensors_bytes(header, std::string(8, '\0')));
  EXPECT_TRUE(Contains(message, "ids: dtype: one of F32, F16, BF16; got I64"));
}

TEST(SafetensorsFile, RejectsEntryMissingAField) {
  const std::string header = R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})";
  const auto message = open_error("st-no-shape", safetensors_bytes(header, std::string(4, '\0')));
  EXPECT_TRUE(Contains(message, "w: shape"));
  EXPECT_TRUE(Contains(message, "missing"));
}

TEST(SafetensorsFile, RejectsFieldsOfTheWrongType) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"w": 5})", "w: an object"},
      {R"({"w": {"dtype": 5, "shape": [1], "data_offsets": [0, 4]}})", "w: dtype: a string"},
      {R"({"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}})", "w: shape: a list"},
      {R"({"w": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}})", "w: shape: non-negative integer"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", "w: data_offsets: [begin, end]"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]}})", "w: data_offsets: [begin, end]"},
      {R"({"__metadata__": {"format": 1}})", "__metadata__.format: a string"},
  };
  for (const auto& [header, expected] : cases) {
    EXPECT_TRUE(Contains(open_error("st-types", safetensors_bytes(header, std::string(4, '\0'))), expected))
        << header;
  }
}

TEST(SafetensorsFile, RejectsNegativeDimension) {
  const std::string header = R"({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 4]}})";
  const auto message = open_error("st-neg", safetensors_bytes(header, std::string(4, '\0')));
  EXPECT_TRUE(Contains(message, "w: shape: non-negative integer dimensions, got [2,-1]"));
}

TEST(SafetensorsFile, RejectsShapeThatDisagreesWithByteRange) {
  const std::string header = R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}})";
  const auto message = open_error("st-mismatch", safetensors_bytes(header, std::string(10, '\0')));
  EXPECT_TRUE(Contains(message, "w: shape [2, 3] x 2 bytes = 12 bytes, but data_offsets span 10"));
}

TEST(SafetensorsFile, RejectsShapeWhoseSizeOverflows) {
  // 2^32 * 2^32 elements would wrap to 0 and "match" an empty range.
  const std::string header =
      R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})";
  const auto message = open_error("st-overflow", safetensors_bytes(header, ""));
  EXPECT_TRUE(Contains(message, "w: shape [4294967296, 4294967296]"));
  EXPECT_TRUE(Contains(message, "overflows"));
}

TEST(SafetensorsFile, RejectsBeginAfterEnd) {
  const std::string header = R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})";
  const auto message = open_error("st-reversed", safetensors_bytes(header, std::string(8, '\0')));
  EXPECT_TRUE(Contains(message, "w: data_offsets: begin <= end, got [8, 4]"));
}

TEST(SafetensorsFile, RejectsOffsetsPastTheEnd) {
  const std::string header = R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})";
  const auto message = open_error("st-past-end", safetensors_bytes(header, std::string(8, '\0')));
  EXPECT_TRUE(Contains(message, "w: data_offsets end 12 within the data section of 8 bytes"));
}

TEST(SafetensorsFile, RejectsOverlappingRanges) {
  const std::string header = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                             R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})";
  const auto message = open_error("st-overlap", safetensors_bytes(header, std::string(12, '\0')));
  EXPECT_TRUE(Contains(message, "b: data_offsets disjoint"));
  EXPECT_TRUE(Contains(message, "overlaps 'a' [0, 8)"));
}

// --- checkpoints -------------------------------------------------------------

std::string one_tensor_file(const std::string& name, std::vector<float> values) {
  return build_file({{name, "F32", {static_cast<int64_t>(values.size())}, raw_bytes(values)}});
}

std::string index_json(const std::map<std::string, std::string>& weight_map) {
  return nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump();
}

// Two shards: a.safetensors holds x and y, b.safetensors holds z.
fs::path write_sharded(const std::string& test) {
  const auto dir = scratch_dir(test);
  write_in(dir, "a.safetensors",
           build_file({{"x", "F32", {2}, raw_bytes(std::vector<float>{1, 2})},
                       {"y", "F32", {1, 1}, raw_bytes(std::vector<float>{3})}}));
  write_in(dir, "b.safetensors", one_tensor_file("z", {4, 5, 6}));
  write_in(dir, "model.safetensors.index.json",
           index_json({{"x", "a.safetensors"}, {"y", "a.safetensors"}, {"z", "b.safetensors"}}));
  return dir;
}

std::string checkpoint_error(const fs::path& dir) {
  return input_error([&] { Checkpoint checkpoint(dir); });
}

TEST(SafetensorsCheckpoint, ReadsSingleFile) {
  const auto dir = scratch_dir("ck-single");
  write_in(dir, "model.safetensors", one_tensor_file("w", {7, 8}));
  Checkpoint checkpoint(dir);
  EXPECT_EQ(checkpoint.directory(), dir);
  EXPECT_EQ(checkpoint.names(), std::vector<std::string>{"w"});
  EXPECT_EQ(checkpoint.files(), std::vector<fs::path>{dir / "model.safetensors"});
  EXPECT_TRUE(checkpoint.contains("w"));
  EXPECT_EQ(checkpoint.tensor("w", {2}).numel(), 2);
}

TEST(SafetensorsCheckpoint, ReadsShardsListedByIndex) {
  const auto dir = write_sharded("ck-sharded");
  Checkpoint checkpoint(dir);
  EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"x", "y", "z"}));
  EXPECT_EQ(checkpoint.files(), (std::vector<fs::path>{dir / "a.safetensors", dir / "b.safetensors"}));
  EXPECT_EQ(checkpoint.tensor("y", {1, 1}).file, dir / "a.safetensors");
  const auto& z = checkpoint.tensor("z", {3});
  EXPECT_EQ(z.file, dir / "b.safetensors");
  std::vector<float> values(3);
  std::memcpy(values.data(), z.bytes.data(), 12);
  EXPECT_EQ(values, (std::vector<float>{4, 5, 6}));
}

TEST(SafetensorsCheckpoint, PrefersIndexOverSingleFile) {
  const auto dir = write_sharded("ck-both");
  write_in(dir, "model.safetensors", one_tensor_file("other", {1}));
  EXPECT_FALSE(Checkpoint(dir).contains("other"));
}

TEST(SafetensorsCheckpoint, RejectsDirectoryWithoutWeights) {
  const auto dir = scratch_dir("ck-none");
  const auto message = checkpoint_error(dir);
  EXPECT_TRUE(Contains(message, dir.string()));
  EXPECT_TRUE(Contains(message, "no model.safetensors or model.safetensors.index.json"));
}

TEST(SafetensorsCheckpoint, RejectsTensorMissingFromItsShard) {
  const auto dir = write_sharded("ck-missing-in-shard");
  write_in(dir, "model.safetensors.index.json",
           index_json({{"x", "a.safetensors"}, {"y", "a.safetensors"}, {"z", "b.safetensors"},
                       {"ghost", "b.safetensors"}}));
  const auto message = checkpoint_error(dir);
  EXPECT_TRUE(Contains(message, (dir / "model.safetensors.index.json").string()));
  EXPECT_TRUE(Contains(message, "ghost: listed in shard b.safetensors"));
}

TEST(SafetensorsCheckpoint, RejectsMissingShardFile) {
  const auto dir = write_sharded("ck-missing-shard");
  fs::remove(dir / "b.safetensors");
  const auto message = checkpoint_error(dir);
  EXPECT_TRUE(Contains(message, (dir / "model.safetensors.index.json").string()));
  EXPECT_TRUE(Contains(message, "z: shard file"));
  EXPECT_TRUE(Contains(message, "b.safetensors"));
}

TEST(SafetensorsCheckpoint, RejectsTensorInTwoShards) {
  const auto dir = write_sharded("ck-two-shards");
  write_in(dir, "b.safetensors",
           build_file({{"z", "F32", {3}, raw_bytes(std::vector<float>{4, 5, 6})},
                       {"x", "F32", {2}, raw_bytes(std::vector<float>{1, 2})}}));
  const auto message = checkpoint_error(dir);
  EXPECT_TRUE(Contains(message, "x: in its indexed shard a.safetensors only, but shard b.safetensors holds it too"));
}

TEST(SafetensorsCheckpoint, RejectsShardTensorMissingFromIndex) {
  const auto dir = write_sharded("ck-unindexed");
  write_in(dir, "model.safetensors.index.json", index_json({{"x", "a.safetensors"}, {"z", "b.safetensors"}}));
  EXPECT_TRUE(Contains(checkpoint_error(dir), "y: listed in the index"));
}

TEST(SafetensorsCheckpoint, RejectsIndexPathsEscapingTheDirectory) {
  for (const std::string shard : {"../a.safetensors", "/tmp/a.safetensors", "sub/../../a.safetensors", ""}) {
    const auto dir = write_sharded("ck-escape");
    write_in(dir, "model.safetensors.index.json", index_json({{"x", shard}}));
    const auto message = checkpoint_error(dir);
    EXPECT_TRUE(Contains(message, "model.safetensors.index.json: x: a shard file name inside the checkpoint"))
        << shard;
  }
}

TEST(SafetensorsCheckpoint, RejectsMalformedIndex) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{not json", "valid JSON"},
      {R"({"metadata": {}})", "weight_map: an object"},
      {R"({"weight_map": []})", "weight_map: a non-empty object"},
      {R"({"weight_map": {"x": 3}})", "x: a shard file name"},
  };
  for (const auto& [text, expected] : cases) {
    const auto dir = write_sharded("ck-bad-index");
    write_in(dir, "model.safetensors.index.json", text);
    EXPECT_TRUE(Contains(checkpoint_error(dir), expected)) << text;
  }
}

TEST(SafetensorsCheckpoint, ReportsBadShardByItsOwnName) {
  const auto dir = write_sharded("ck-bad-shard");
  write_in(dir, "b.safetensors", u64_le(3) + "{}");
  const auto message = checkpoint_error(dir);
  EXPECT_TRUE(Contains(message, (dir / "b.safetensors").string()));
  EXPECT_TRUE(Contains(message, "header length"));
}

TEST(SafetensorsCheckpoint, RejectsLookupOfMissingTensor) {
  const auto dir = write_sharded("ck-lookup");
  Checkpoint checkpoint(dir);
  EXPECT_FALSE(checkpoint.contains("lm_head.weight"));
  const auto message = input_error([&] { checkpoint.tensor("lm_head.weight"); });
  EXPECT_TRUE(Contains(message, dir.string()));
  EXPECT_TRUE(Contains(message, "lm_head.weight: tensor missing from checkpoint"));
}

TEST(SafetensorsCheckpoint, RejectsLookupWithWrongShape) {
  const auto dir = write_sharded("ck-shape");
  Checkpoint checkpoint(dir);
  const auto message = input_error([&] { checkpoint.tensor("y", {1, 2}); });
  EXPECT_TRUE(Contains(message, (dir / "a.safetensors").string()));
  EXPECT_TRUE(Contains(message, "y: expected shape [1, 2], got [1, 1]"));
}

// --- the real fixture --------------------------------------------------------

TEST(SafetensorsCheckpoint, OpensPyllama16m) {
  const auto dir = testing::pyllama_dir();
  const auto index = nlohmann::json::parse(read_file(dir / "model.safetensors.index.json"));
  Checkpoint checkpoint(dir);

  EXPECT_EQ(checkpoint.names().size(), index["weight_map"].size());
  EXPECT_EQ(checkpoint.names().size(), 47u);  // 5 layers x 9 + embeddings + final norm (tied head)
  EXPECT_EQ(checkpoint.files().size(), 4u);

  const auto& embed = checkpoint.tensor("model.embed_tokens.weight", {8192, 512});
  EXPECT_EQ(embed.dtype, DType::kBF16);
  EXPECT_EQ(embed.bytes.size(), 8192u * 512u * 2u);
  EXPECT_EQ(checkpoint.tensor("model.layers.0.self_attn.q_proj.weight", {512, 512}).dtype, DType::kBF16);
  EXPECT_EQ(checkpoint.tensor("model.layers.4.self_attn.k_proj.weight", {256, 512}).dtype, DType::kBF16);
  EXPECT_EQ(checkpoint.tensor("model.layers.2.mlp.down_proj.weight", {512, 1024}).dtype, DType::kBF16);
  EXPECT_EQ(checkpoint.tensor("model.norm.weight", {512}).dtype, DType::kBF16);
  EXPECT_FALSE(checkpoint.contains("lm_head.weight"));
  for (const auto& [name, shard] : index["weight_map"].items()) {
    EXPECT_EQ(checkpoint.tensor(name).file, dir / shard.get<std::string>()) << name;
  }
}

}  // namespace
}  // namespace kvforge
