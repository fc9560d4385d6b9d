// docs/runtime-layout.md says it specifies the runtime cache's bytes
// "precisely enough that another engine could read the same pages". This
// test holds it to that: for every layout of tests/kernel_cases.h, a
// QuantizedKVCache on the CPU reference is fed prefill chunks and decoding
// steps of three sequences; its pools, page tables and per-layer constants
// are written out as raw bytes with the configuration in the page's terms,
// and tests/check_runtime_pages.py, written from the page alone (it shares
// no code with kernels/), reads every token of every sequence back (sections
// 1-5, 6.2): its values, codes, outlier positions and exact/quantized flags
// must equal read_token's bit for bit. From the appended inputs it also
// predicts, in float64 as section 6.1 says, every byte append stored: the
// sink's and window's exact rows, every code row past the sink, the group
// (min, max) pairs and the outlier entries, each at the page's position.
// From the tokens it read it attends in float64 as section 6.3 says (query
// rotation, RoPE, GQA, softmax, the values' rotation back), within 1e-3 of
// decode_attention's outputs. And it works out section 7's bytes held and
// read per sequence from the
// page's formulas, to equal the engine's counts (held: from the allocators'
// state). The CUDA kernels store the same bytes as the CPU reference
// (tests/test_append_cuda.cpp), so the page describes theirs too. A flipped
// code byte, a wrong page-table entry and an input the pages were not
// written from must make it fail: the comparisons can.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/quantized_kv_cache.h"
#include "model/rope.h"
#include "tests/kernel_activations.h"
#include "tests/kernel_cases.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

namespace fs = std::filesystem;
using kernels::ElementType;
using kernels::TensorKind;
using Case = testing::KernelCase;

constexpr int64_t kKvHeads = 2, kLayers = 2, kSequences = 3;

std::string element_name(ElementType element) {
  switch (element) {
    case ElementType::kFloat16: return "fp16";
    case ElementType::kBFloat16: return "bf16";
    case ElementType::kFloat32: return "fp32";
  }
  return "?";
}

std::string grouping_name(kernels::ScaleGrouping grouping) {
  switch (grouping) {
    case kernels::ScaleGrouping::kPerToken: return "per_token";
    case kernels::ScaleGrouping::kPerChannelTokens: return "per_channel_tokens";
    case kernels::ScaleGrouping::kPerChannelOffline: return "per_channel_offline";
    case kernels::ScaleGrouping::kPerTokenAllHeads: return "per_token_all_heads";
  }
  return "?";
}

const char* kind_name(TensorKind kind) { return kind == TensorKind::kKeys ? "keys" : "values"; }

template <class T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Prefill chunks and decoding steps over three sequences, interleaved so
// that their pages interleave in the pool: across groups, flushes, page and
// outlier-page boundaries (the long schedule reaches 2003 and 704 tokens).
std::vector<std::vector<std::pair<int, int64_t>>> schedule(bool long_context) {
  std::vector<std::vector<std::pair<int, int64_t>>> steps;
  if (long_context) {
    steps.push_back({{0, 1000}, {1, 700}});
    steps.push_back({{0, 1000}, {2, 9}});
    for (int i = 0; i < 3; ++i) steps.push_back({{0, 1}, {1, 1}, {2, 1}});
    return steps;
  }
  steps.push_back({{0, 37}, {1, 5}});
  for (int i = 0; i < 4; ++i) steps.push_back({{0, 1}, {1, 1}});
  steps.push_back({{1, 20}, {0, 1}, {2, 33}});
  for (int i = 0; i < 8; ++i) steps.push_back({{2, 1}, {0, 1}, {1, 1}});
  steps.push_back({{0, 41}, {2, 1}});
  for (int i = 0; i < 6; ++i) steps.push_back({{0, 1}, {1, 1}, {2, 1}});
  return steps;
}

// What a case wrote and what read_token says of it.
struct Dump {
  fs::path dir;
  int64_t tokens = 0, quantized = 0, outliers = 0;  // summed over layers, kinds and sequences
  // What append stored, by the layout's formulas: exact rows read (sink and
  // window), code rows (a token and KV head past the sink whose group is
  // complete) and outlier entries (cache.outlier_entries).
  int64_t exact_rows = 0, code_rows = 0, outlier_entries = 0;
  int64_t first_entry_offset = 0;  // sequence 0's first page-table entry, in page_table.bin
  int32_t first_page = -1;         // its page id
  int64_t key_page_bytes = 0;
};

// A case's cache fed by the schedule: what the dump is written from.
struct FedCache {
  QuantizerConfig config;
  kernels::ModelDimensions model;
  kernels::CacheOptions options;
  std::unique_ptr<kernels::QuantizedKVCache> cache;
  std::vector<std::vector<testing::KernelActivations>> inputs;  // [sequence][layer]
  std::vector<int32_t> ids;
  std::vector<int64_t> lengths;
};

FedCache feed(const Case& c) {
  at::manual_seed(23);
  const RopeConfig rope_config;
  const RotaryEmbedding rope(rope_config, c.head_dim, at::kCPU);
  FedCache f;
  f.config = testing::fitted_kernel_config(c.name, c.fit, kLayers, kKvHeads, c.head_dim, c.element, c.key_rotation,
                                           c.value_rotation, c.key_centre, rope);
  f.model = testing::kernel_model_dimensions(kLayers, c.heads, kKvHeads, c.head_dim, rope_config);
  f.options.page_size = c.page_size;
  f.options.element = c.element;
  f.options.max_sequences = 4;
  f.options.max_context = c.long_context ? 4096 : 256;
  f.options.outlier_page_entries = 64;
  f.cache = std::make_unique<kernels::QuantizedKVCache>(f.config, f.model, f.options);

  const auto steps = schedule(c.long_context);
  std::vector<int64_t> totals(kSequences, 1);
  for (const auto& step : steps) {
    for (auto [seq, n] : step) totals[seq] += n;
  }
  f.inputs.resize(kSequences);
  for (int s = 0; s < kSequences; ++s) {
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      f.inputs[s].push_back(testing::synthetic_activations(1, kKvHeads, totals[s], c.head_dim, 1.0 + 0.5 * layer,
                                                           c.element, rope));
    }
  }
  f.ids.assign(kSequences, -1);
  f.lengths.assign(kSequences, 0);
  for (const auto& step : steps) {
    kernels::AppendBatch batch;
    for (auto [seq, n] : step) {
      if (f.ids[seq] < 0) f.ids[seq] = f.cache->add_sequence();
      batch.sequences.push_back(f.ids[seq]);
      batch.positions.push_back(f.lengths[seq]);
      batch.tokens.push_back(n);
    }
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      std::vector<float> keys, values;
      for (auto [seq, n] : step) {
        testing::append_token_rows(f.inputs[seq][layer], f.config.settings.keys_pre_rope, f.lengths[seq], n, keys,
                                   values);
      }
      batch.keys = keys.data();
      batch.values = values.data();
      f.cache->append(layer, batch);
    }
    for (auto [seq, n] : step) f.lengths[seq] += n;
  }
  return f;
}

// Section 6.3: one query per sequence and query head at its last position,
// decoded layer by layer (softmax_scale the default), into manifest
// "decode".
nlohmann::json write_decode(FedCache& f, const fs::path& dir) {
  nlohmann::json decode;
  decode["num_heads"] = f.model.num_heads;
  decode["keys_pre_rope"] = f.config.settings.keys_pre_rope;
  decode["rope_inverse_frequencies"] = f.model.rope_inverse_frequencies;
  decode["layers"] = nlohmann::json::array();
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    const at::Tensor queries = at::randn({kSequences, f.model.num_heads, f.model.head_dim}, at::kFloat).contiguous();
    std::vector<float> output(static_cast<size_t>(queries.numel()));
    f.cache->decode_attention(layer, f.ids, queries.data_ptr<float>(), output.data());
    const std::string prefix = "layer" + std::to_string(layer) + "_decode_";
    testing::write_file(dir / (prefix + "queries.bin"),
                        std::string(reinterpret_cast<const char*>(queries.data_ptr<float>()), queries.numel() * 4));
    testing::write_file(dir / (prefix + "output.bin"), bytes_of(output));
    decode["layers"].push_back({{"queries", prefix + "queries.bin"}, {"output", prefix + "output.bin"}});
  }
  return decode;
}

// One layer's keys or values: the configuration in the page's terms, the
// pools, what append was fed, section 7's counts and read_token's readback
// (a manifest "tensors" entry); the layout's counts added to `dump`.
nlohmann::json write_tensor(const FedCache& f, int64_t layer, TensorKind kind, const fs::path& dir, Dump& dump) {
  const kernels::QuantizedKVCache& cache = *f.cache;
  const std::string prefix = "layer" + std::to_string(layer) + "_" + kind_name(kind) + "_";
  const kernels::TensorLayoutSpec& spec = cache.layout(kind).spec;
  const bool keys = kind == TensorKind::kKeys;
  const TensorQuantizer& q = keys ? f.config.layers[layer].keys : f.config.layers[layer].values;
  const TensorQuantizerSettings& settings = keys ? f.config.settings.keys : f.config.settings.values;
  nlohmann::json t;
  t["layer"] = layer;
  t["kind"] = kind_name(kind);
  // The configuration, as the page names it (sections 1-5).
  t["kv_heads"] = spec.kv_heads;
  t["head_dim"] = spec.head_dim;
  t["bits"] = spec.bits;
  t["page_size"] = spec.page_size;
  t["grouping"] = grouping_name(spec.grouping);
  t["group"] = spec.group;
  t["element"] = element_name(spec.element);
  t["sink_tokens"] = spec.sink_tokens;
  t["residual_tokens"] = spec.residual_tokens;
  t["window_rule"] = spec.window_rule == kernels::WindowRule::kSliding ? "sliding" : "block_flush";
  t["outliers"] = spec.outliers;
  t["outlier_page_entries"] = spec.outlier_page_entries;
  // The layer's constants as the artifact stores them (section 5 derives
  // the level table from them).
  t["grid"] = q.grid;
  t["clip_ratio"] = static_cast<double>(q.clip_ratio);
  t["channel_scale"] = q.channel_scale.values;
  t["channel_offset"] = q.channel_offset.values;
  // What append needs besides (section 6.1): what it was fed and in which
  // element type, the outlier rule and its parameters, the encode grid,
  // the rotation.
  std::vector<float> fed_keys, fed_values;
  for (int s = 0; s < kSequences; ++s) {
    testing::append_token_rows(f.inputs[s][layer], f.config.settings.keys_pre_rope, 0, f.lengths[s], fed_keys,
                               fed_values);
  }
  testing::write_file(dir / (prefix + "input.bin"), bytes_of(keys ? fed_keys : fed_values));
  t["input"] = prefix + "input.bin";
  t["input_element"] = "fp32";
  t["outlier_rule"] = std::string(outlier_rule_name(settings.outlier_rule));
  t["outlier_fraction"] = settings.outlier_fraction;
  t["outlier_tau"] = static_cast<double>(q.outlier_tau);
  t["outlier_low"] = q.outlier_low.values;
  t["outlier_high"] = q.outlier_high.values;
  t["encode_grid"] = q.encode_grid;
  const RotationForm form = !f.config.rotation || f.config.rotation->folded ? RotationForm::kNone
                            : keys                                          ? f.config.rotation->keys
                                                                            : f.config.rotation->values;
  const TensorRotation& rotation = keys ? f.config.layers[layer].rotation.keys : f.config.layers[layer].rotation.values;
  nlohmann::json r;
  r["form"] = std::string(rotation_form_name(form));
  if (form == RotationForm::kMatrix) {
    testing::write_file(dir / (prefix + "rotation.bin"), bytes_of(rotation.matrix.values));
    r["matrix"] = prefix + "rotation.bin";
    r["centre"] = rotation.centre.values;
  } else if (form == RotationForm::kPairAngles) {
    r["angles"] = rotation.angles.values;
  }
  t["rotation"] = r;
  // The pools.
  const kernels::TensorPoolCopy pools = cache.copy_pools(layer, kind);
  for (const auto& [name, bytes] : {std::pair{"pages", bytes_of(pools.pages)}, std::pair{"exact", bytes_of(pools.exact)},
                                    std::pair{"outlier_pages", bytes_of(pools.outlier_pages)},
                                    std::pair{"outlier_page_table", bytes_of(pools.outlier_page_table)}}) {
    testing::write_file(dir / (prefix + name + ".bin"), bytes);
    t[name] = prefix + name + ".bin";
  }
  // read_token's readback (sequences in manifest order, tokens in order),
  // section 7's counts per sequence (held: from the allocators' state;
  // read: the formula with the outlier entries of the quantized tokens)
  // and the layout's counts.
  std::vector<float> values;
  std::vector<uint8_t> codes, outliers, quantized;
  t["held_bytes"] = nlohmann::json::array();
  t["read_bytes"] = nlohmann::json::array();
  for (int s = 0; s < kSequences; ++s) {
    const int64_t begin = kernels::quantized_begin(spec, f.lengths[s]), end = kernels::quantized_end(spec, f.lengths[s]);
    int64_t visible = 0;
    for (int64_t token = 0; token < f.lengths[s]; ++token) {
      const kernels::TokenReadout readout = cache.read_token(layer, kind, f.ids[s], token);
      values.insert(values.end(), readout.values.begin(), readout.values.end());
      codes.insert(codes.end(), readout.codes.begin(), readout.codes.end());
      outliers.insert(outliers.end(), readout.outliers.begin(), readout.outliers.end());
      quantized.push_back(readout.quantized ? 1 : 0);
      ++dump.tokens;
      dump.quantized += readout.quantized ? 1 : 0;
      for (uint8_t o : readout.outliers) {
        dump.outliers += o;
        if (token >= begin && token < end) visible += o;
      }
    }
    t["held_bytes"].push_back(cache.held_bytes(layer, kind, f.ids[s]).total());
    t["read_bytes"].push_back(kernels::bytes_read(cache.layout(kind), f.lengths[s], visible).total());
    dump.exact_rows += f.lengths[s] - (end - begin);
    int64_t past_sink = std::max<int64_t>(f.lengths[s] - spec.sink_tokens, 0);
    if (spec.grouping == kernels::ScaleGrouping::kPerChannelTokens) past_sink = past_sink / spec.group * spec.group;
    dump.code_rows += past_sink * spec.kv_heads;
    dump.outlier_entries += cache.outlier_entries(layer, kind, f.ids[s]);
  }
  testing::write_file(dir / (prefix + "expected_values.bin"), bytes_of(values));
  testing::write_file(dir / (prefix + "expected_codes.bin"), bytes_of(codes));
  testing::write_file(dir / (prefix + "expected_outliers.bin"), bytes_of(outliers));
  testing::write_file(dir / (prefix + "expected_quantized.bin"), bytes_of(quantized));
  t["expected"] = {{"values", prefix + "expected_values.bin"},
                   {"codes", prefix + "expected_codes.bin"},
                   {"outliers", prefix + "expected_outliers.bin"},
                   {"quantized", prefix + "expected_quantized.bin"}};
  return t;
}

// Feeds the case's cache and writes dir/manifest.json with what it names.
Dump write_dump(const Case& c, const fs::path& dir) {
  FedCache f = feed(c);
  Dump dump;
  dump.dir = dir;
  fs::create_directories(dir);
  nlohmann::json manifest;
  manifest["case"] = c.name;
  manifest["max_sequences"] = f.options.max_sequences;
  const std::vector<int32_t> page_table = f.cache->copy_page_table();
  testing::write_file(dir / "page_table.bin", bytes_of(page_table));
  manifest["page_table"] = "page_table.bin";
  manifest["sequences"] = nlohmann::json::array();
  for (int s = 0; s < kSequences; ++s) manifest["sequences"].push_back({{"slot", f.ids[s]}, {"length", f.lengths[s]}});
  const int64_t stride = static_cast<int64_t>(page_table.size()) / f.options.max_sequences;
  dump.first_entry_offset = f.ids[0] * stride * static_cast<int64_t>(sizeof(int32_t));
  dump.first_page = page_table[static_cast<size_t>(f.ids[0] * stride)];
  dump.key_page_bytes = f.cache->layout(TensorKind::kKeys).page_bytes;
  manifest["decode"] = write_decode(f, dir);
  manifest["tensors"] = nlohmann::json::array();
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    for (TensorKind kind : {TensorKind::kKeys, TensorKind::kValues}) {
      manifest["tensors"].push_back(write_tensor(f, layer, kind, dir, dump));
    }
  }
  testing::write_file(dir / "manifest.json", manifest.dump(1));
  return dump;
}

// tests/check_runtime_pages.py on a dump: its JSON report on stdout, a
// difference on stderr.
testing::CommandResult run_reader(const fs::path& dir) {
  return testing::run_python(testing::fixtures_dir().parent_path() / "check_runtime_pages.py", dir);
}

class RuntimePagesReader : public ::testing::TestWithParam<Case> {};

TEST_P(RuntimePagesReader, ReadsEveryTokenAsTheReferenceDoes) {
  KVFORGE_REQUIRE_NUMPY();
  const Case& c = GetParam();
  const Dump dump = write_dump(c, testing::scratch_dir("runtime-pages-" + c.name));
  ASSERT_GT(dump.quantized, 0);
  const testing::CommandResult result = run_reader(dump.dir);
  ASSERT_EQ(result.exit_code, 0) << result.stderr_text;
  // The reader reports what it compared: every token, and as many quantized
  // tokens and outlier elements as read_token saw (a reader that skipped
  // them would not be caught by the comparison alone).
  const nlohmann::json report = nlohmann::json::parse(result.stdout_text);
  EXPECT_EQ(report.at("tokens").get<int64_t>(), dump.tokens);
  EXPECT_EQ(report.at("quantized").get<int64_t>(), dump.quantized);
  EXPECT_EQ(report.at("outliers").get<int64_t>(), dump.outliers);
  if (c.fit.outlier_fraction > 0) EXPECT_GT(dump.outliers, 0);
  // And it predicted every byte append stored from the inputs.
  EXPECT_EQ(report.at("exact_rows").get<int64_t>(), dump.exact_rows);
  EXPECT_EQ(report.at("codes").get<int64_t>(), dump.code_rows);
  EXPECT_EQ(report.at("outlier_entries").get<int64_t>(), dump.outlier_entries);
  EXPECT_GT(report.at("pairs").get<int64_t>(), 0);  // every layout here has per-token or per-channel-token groups
  // And section 6.3's attention, per layer, sequence and query head.
  EXPECT_EQ(report.at("decoded").get<int64_t>(), kLayers * kSequences * c.heads);
  // And section 7's bytes held and read, per sequence, layer and kind.
  EXPECT_EQ(report.at("byte_counts").get<int64_t>(), 2 * kSequences * kLayers * 2);
}

INSTANTIATE_TEST_SUITE_P(Layouts, RuntimePagesReader, ::testing::ValuesIn(testing::layout_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// The comparisons can fail: a flipped code byte of sequence 0's first page,
// a page-table entry pointing at another page, an input the pages were not
// written from.
TEST(RuntimePagesReaderCatches, AFlippedCodeAWrongPageTableEntryAndAnotherInput) {
  KVFORGE_REQUIRE_NUMPY();
  const Case c = testing::make_kernel_case("rtn_2bit_d128_gqa1", QuantMethod::kRtn, 2, 128, 2);
  const Dump dump = write_dump(c, testing::scratch_dir("runtime-pages-catches"));
  ASSERT_EQ(run_reader(dump.dir).exit_code, 0);

  const fs::path pages = dump.dir / "layer0_keys_pages.bin";
  const std::string original = testing::read_file(pages);
  std::string flipped = original;
  flipped[static_cast<size_t>(dump.first_page * dump.key_page_bytes)] ^= 0x01;
  testing::write_file(pages, flipped);
  testing::CommandResult result = run_reader(dump.dir);
  EXPECT_EQ(result.exit_code, 1) << result.stdout_text;
  EXPECT_NE(result.stderr_text.find("layer 0 keys"), std::string::npos) << result.stderr_text;
  testing::write_file(pages, original);

  const fs::path table = dump.dir / "page_table.bin";
  std::string entries = testing::read_file(table);
  char* entry = entries.data() + dump.first_entry_offset;  // sequence 0's first page-table entry
  const int32_t other = dump.first_page + 1;
  std::memcpy(entry, &other, 4);
  testing::write_file(table, entries);
  result = run_reader(dump.dir);
  EXPECT_EQ(result.exit_code, 1) << result.stdout_text;
  std::memcpy(entry, &dump.first_page, 4);
  testing::write_file(table, entries);
  ASSERT_EQ(run_reader(dump.dir).exit_code, 0);

  // An input the pages were not written from: its group's (min, max) and
  // codes are predicted differently.
  const fs::path input = dump.dir / "layer1_values_input.bin";
  std::string rows = testing::read_file(input);
  const float large = 100.0f;
  std::memcpy(rows.data(), &large, 4);  // sequence 0, token 0, head 0, channel 0
  testing::write_file(input, rows);
  result = run_reader(dump.dir);
  EXPECT_EQ(result.exit_code, 1) << result.stdout_text;
  EXPECT_NE(result.stderr_text.find("layer 1 values sequence 0 token 0"), std::string::npos) << result.stderr_text;
}

}  // namespace
}  // namespace kvforge
