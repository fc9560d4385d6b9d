// Tokenizer against Hugging Face tokenizers: every expected id comes from
// scripts/make_tokenizer_fixtures.py (tokenizers==0.23.2), never from
// kvforge itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "formats/input_error.h"
#include "formats/sha256.h"
#include "model/tokenizer.h"
#include "tests/test_paths.h"

namespace kvforge {
namespace {

using nlohmann::json;

std::filesystem::path tokenizer_fixtures() { return testing::fixtures_dir() / "tokenizers"; }

json read_json(const std::filesystem::path& path) { return json::parse(testing::read_file(path)); }

std::vector<int32_t> to_ids(const json& array) { return array.get<std::vector<int32_t>>(); }

// SHA-256 of the ids as int32 little-endian, the fixture's fingerprint.
std::string ids_sha256(const std::vector<int32_t>& ids) {
  std::string bytes(ids.size() * 4, '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto value = static_cast<uint32_t>(ids[i]);
    for (int b = 0; b < 4; ++b) bytes[i * 4 + b] = static_cast<char>((value >> (8 * b)) & 0xFF);
  }
  return sha256_hex(bytes);
}

std::string render_ids(const Tokenizer& tokenizer, const std::vector<int32_t>& ids, size_t begin, size_t end) {
  std::ostringstream out;
  for (size_t i = begin; i < std::min(end, ids.size()); ++i) {
    out << ids[i] << "(" << json(tokenizer.id_to_token(ids[i])).dump(-1, ' ', false, json::error_handler_t::replace)
        << ") ";
  }
  return out.str();
}

// Equal id sequences, or a message showing the first difference in context
// (gtest would print both vectors whole).
::testing::AssertionResult same_ids(const Tokenizer& tokenizer, const std::vector<int32_t>& expected,
                                    const std::vector<int32_t>& actual) {
  if (expected == actual) return ::testing::AssertionSuccess();
  const auto mismatch = std::mismatch(expected.begin(), expected.end(), actual.begin(), actual.end());
  const size_t at = static_cast<size_t>(mismatch.first - expected.begin());
  const size_t from = at < 4 ? 0 : at - 4;
  return ::testing::AssertionFailure() << "ids differ at index " << at << " (expected " << expected.size()
                                       << " ids, got " << actual.size() << ")\n  expected: "
                                       << render_ids(tokenizer, expected, from, at + 6)
                                       << "\n  actual:   " << render_ids(tokenizer, actual, from, at + 6);
}

// --- the shared model's tokenizer on heldout.txt ---------------------------

class TokenizerPyllama : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    fixture_ = new json(read_json(tokenizer_fixtures() / "pyllama_heldout.json"));
    tokenizer_ = new Tokenizer(Tokenizer::from_file(testing::pyllama_dir() / "tokenizer.json"));
    heldout_ = new std::string(testing::read_file(testing::shared_dir() / (*fixture_)["text"].get<std::string>()));
  }
  static void TearDownTestSuite() {
    delete fixture_;
    delete tokenizer_;
    delete heldout_;
  }
  static json* fixture_;
  static Tokenizer* tokenizer_;
  static std::string* heldout_;
};
json* TokenizerPyllama::fixture_ = nullptr;
Tokenizer* TokenizerPyllama::tokenizer_ = nullptr;
std::string* TokenizerPyllama::heldout_ = nullptr;

TEST_F(TokenizerPyllama, FixtureInputsAreTheOnesReferencesCameFrom) {
  EXPECT_EQ(tokenizer_->sha256(), (*fixture_)["tokenizer_sha256"].get<std::string>());
  EXPECT_EQ(sha256_hex(*heldout_), (*fixture_)["text_sha256"].get<std::string>());
}

TEST_F(TokenizerPyllama, VocabularyLookups) {
  EXPECT_EQ(tokenizer_->vocab_size(), 8192);
  EXPECT_EQ(tokenizer_->token_to_id("<|bos|>"), 0);
  EXPECT_EQ(tokenizer_->token_to_id("<|pad|>"), 2);
  EXPECT_EQ(tokenizer_->id_to_token(1), "<|eos|>");
  const auto double_space = tokenizer_->token_to_id("\xC4\xA0\xC4\xA0");  // "ĠĠ"
  ASSERT_TRUE(double_space.has_value());
  EXPECT_EQ(tokenizer_->id_to_token(*double_space), "\xC4\xA0\xC4\xA0");
  EXPECT_FALSE(tokenizer_->token_to_id("no such token").has_value());
  EXPECT_EQ(tokenizer_->id_to_token(8192), "");
  EXPECT_EQ(tokenizer_->id_to_token(-1), "");
}

TEST_F(TokenizerPyllama, HeldoutWholeFileMatchesHuggingFace) {
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tokenizer_->encode(*heldout_, false);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("encoded %zu bytes into %zu tokens in %.2f s\n", heldout_->size(), ids.size(), seconds);

  const std::vector<int32_t> prefix = to_ids((*fixture_)["prefix_ids"]);
  const std::vector<int32_t> head(ids.begin(), ids.begin() + std::min(ids.size(), prefix.size()));
  EXPECT_TRUE(same_ids(*tokenizer_, prefix, head));
  EXPECT_EQ(static_cast<int64_t>(ids.size()), (*fixture_)["count"].get<int64_t>());
  EXPECT_EQ(ids_sha256(ids), (*fixture_)["ids_sha256"].get<std::string>())
      << "see HeldoutChunksMatchHuggingFace for the first chunk that differs";
}

TEST_F(TokenizerPyllama, HeldoutChunksMatchHuggingFace) {
  const json& chunks = (*fixture_)["chunks"];
  ASSERT_GE(chunks.size(), 32u);
  for (size_t k = 0; k < chunks.size(); ++k) {
    const auto begin = chunks[k]["begin"].get<size_t>();
    const auto end = chunks[k]["end"].get<size_t>();
    ASSERT_LE(end, heldout_->size());
    const std::vector<int32_t> ids = tokenizer_->encode(std::string_view(*heldout_).substr(begin, end - begin));
    const bool same = static_cast<int64_t>(ids.size()) == chunks[k]["count"].get<int64_t>() &&
                      ids_sha256(ids) == chunks[k]["ids_sha256"].get<std::string>();
    const auto line = 1 + std::count(heldout_->begin(), heldout_->begin() + static_cast<std::ptrdiff_t>(begin), '\n');
    // Stop at the first failing chunk: that is where to look.
    ASSERT_TRUE(same) << "chunk " << k << " (bytes " << begin << ".." << end << ", from line " << line
                      << "): got " << ids.size() << " ids, HF " << chunks[k]["count"];
  }
}

TEST_F(TokenizerPyllama, HeldoutDecodeInvertsEncode) {
  const std::vector<int32_t> ids = tokenizer_->encode(*heldout_, false);
  EXPECT_TRUE(tokenizer_->decode(ids, false) == *heldout_);
}

TEST_F(TokenizerPyllama, ByteLevelRoundTripsArbitraryUtf8) {
  for (const std::string text : {"", "\xC3\xA9t\xC3\xA9 \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x98\x80\n\t\r\x01\x7F",
                                 "  \x0B\x0C\xC2\x85\xC2\xA0\xE2\x80\xA8 x", "<|bos|>a<|eos|><|pad|>"}) {
    EXPECT_EQ(tokenizer_->decode(tokenizer_->encode(text)), text);
  }
}

TEST_F(TokenizerPyllama, SpecialTokensAreSplitOutAndSkippable) {
  const std::vector<int32_t> ids = tokenizer_->encode("<|bos|>x = 1<|eos|>", true);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 0);
  EXPECT_EQ(ids.back(), 1);
  EXPECT_EQ(tokenizer_->decode(ids, true), "x = 1");
  EXPECT_EQ(tokenizer_->decode(ids, false), "<|bos|>x = 1<|eos|>");
}

TEST_F(TokenizerPyllama, ConcurrentEncodesAgree) {
  const std::string_view text = std::string_view(*heldout_).substr(0, 200000);
  const std::vector<int32_t> expected = tokenizer_->encode(text);
  std::vector<std::vector<int32_t>> results(4);
  std::vector<std::thread> threads;
  for (auto& result : results) threads.emplace_back([&] { result = tokenizer_->encode(text); });
  for (auto& thread : threads) thread.join();
  for (const auto& result : results) EXPECT_TRUE(result == expected);
}

// --- small tokenizers of each family, with variants ------------------------

json apply_patch(json document, const json& patch) {
  for (const auto& [key, value] : patch.items()) {
    if (key == "model") {
      for (const auto& [field, field_value] : value.items()) document["model"][field] = field_value;
    } else {
      document[key] = value;
    }
  }
  return document;
}

void expect_decoded(const json& expected, const std::string& actual, const char* what) {
  if (expected.contains("text")) {
    EXPECT_EQ(actual, expected["text"].get<std::string>()) << what;
  } else {
    EXPECT_EQ(sha256_hex(actual), expected["sha256"].get<std::string>()) << what;
  }
}

class TokenizerFamilies : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerFamilies, MatchHuggingFace) {
  const json suite = read_json(tokenizer_fixtures() / (GetParam() + ".cases.json"));
  const json base = read_json(tokenizer_fixtures() / suite["tokenizer"].get<std::string>());
  const std::string heldout = testing::read_file(testing::shared_dir() / "data" / "heldout.txt");
  std::vector<std::string> need_icu;
  for (const json& variant : suite["variants"]) {
    const std::string name = variant["name"].get<std::string>();
    SCOPED_TRACE("variant " + name);
    std::optional<Tokenizer> loaded;
    try {
      loaded.emplace(Tokenizer::from_json(apply_patch(base, variant["patch"]).dump(), name + ".json"));
    } catch (const InputError& error) {
      // A build without ICU refuses the Unicode normalizers by design.
      if (std::string(error.what()).find("built without ICU") == std::string::npos) throw;
      need_icu.push_back(name);
      continue;
    }
    const Tokenizer& tokenizer = *loaded;
    for (const json& c : variant["cases"]) {
      std::string text;
      if (c.contains("text")) {
        text = c["text"].get<std::string>();
      } else {
        const auto range = c["heldout"].get<std::vector<size_t>>();
        text = heldout.substr(range[0], range[1] - range[0]);
      }
      SCOPED_TRACE("text " + json(text.substr(0, 60)).dump(-1, ' ', false, json::error_handler_t::replace));
      EXPECT_TRUE(same_ids(tokenizer, to_ids(c["ids"]), tokenizer.encode(text, false)));
      const std::vector<int32_t> with_special = to_ids(c["ids_with_special"]);
      EXPECT_TRUE(same_ids(tokenizer, with_special, tokenizer.encode(text, true)));
      expect_decoded(c["decoded"], tokenizer.decode(with_special, false), "decode");
      expect_decoded(c["decoded_skip_special"], tokenizer.decode(with_special, true), "decode skipping specials");
    }
  }
  if (!need_icu.empty()) {
    std::string names;
    for (const std::string& name : need_icu) names += " " + name;
    GTEST_SKIP() << "kvforge built without ICU (libicu-dev); variants not checked:" << names;
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizer, TokenizerFamilies, ::testing::Values("llama3", "qwen2", "llama2", "gpt2"),
                         [](const auto& info) { return info.param; });

// --- bad input ---------------------------------------------------------------

json llama3_document() { return read_json(tokenizer_fixtures() / "llama3.tokenizer.json"); }

// The InputError message of loading `text`, or "" when it loads.
std::string load_error(const std::string& text, const std::string& file = "bad.json") {
  try {
    Tokenizer::from_json(text, file);
  } catch (const InputError& error) {
    EXPECT_EQ(std::string(error.what()).find('\n'), std::string::npos) << "not one line: " << error.what();
    return error.what();
  }
  return "";
}

TEST(TokenizerErrors, MalformedJson) {
  const std::string message = load_error("{\"model\": {\"type\": \"BPE\",, }", "bad.json");
  EXPECT_NE(message.find("bad.json"), std::string::npos) << message;
  EXPECT_NE(message.find("JSON"), std::string::npos) << message;
}

TEST(TokenizerErrors, TruncatedFile) {
  const std::string full = testing::read_file(testing::pyllama_dir() / "tokenizer.json");
  const auto path = testing::scratch_dir("tokenizer") / "truncated.json";
  testing::write_file(path, full.substr(0, full.size() / 2));
  try {
    Tokenizer::from_file(path);
    FAIL() << "a truncated file loaded";
  } catch (const InputError& error) {
    EXPECT_EQ(error.file(), path.string());
    EXPECT_NE(std::string(error.what()).find("JSON"), std::string::npos) << error.what();
  }
}

TEST(TokenizerErrors, NonexistentFile) {
  const auto path = testing::scratch_dir("tokenizer") / "missing" / "tokenizer.json";
  try {
    Tokenizer::from_file(path);
    FAIL() << "a missing file loaded";
  } catch (const InputError& error) {
    EXPECT_EQ(error.file(), path.string());
  }
}

TEST(TokenizerErrors, MissingModelOrVocab) {
  json document = llama3_document();
  document.erase("model");
  EXPECT_EQ(load_error(document.dump()), "bad.json: model: required field is missing");
  document = llama3_document();
  document["model"].erase("vocab");
  EXPECT_EQ(load_error(document.dump()), "bad.json: model.vocab: required field is missing");
}

TEST(TokenizerErrors, MergeWithUnknownToken) {
  json document = llama3_document();
  document["model"]["merges"][5] = json::array({"zzq", "qzz"});
  const std::string message = load_error(document.dump());
  EXPECT_NE(message.find("model.merges[5]"), std::string::npos) << message;
  EXPECT_NE(message.find("\"zzq\" is not in the vocab"), std::string::npos) << message;
}

TEST(TokenizerErrors, UnsupportedComponents) {
  json document = llama3_document();
  document["pre_tokenizer"]["pretokenizers"][1] = {{"type", "Whitespace"}};
  EXPECT_EQ(load_error(document.dump(), "tokenizer.json"),
            "tokenizer.json: pre_tokenizer.pretokenizers[1].type: one of Split, ByteLevel, Metaspace, Digits, "
            "Sequence; got \"Whitespace\"");

  document = llama3_document();
  document["model"]["type"] = "Unigram";
  EXPECT_NE(load_error(document.dump()).find("model.type: one of BPE; got \"Unigram\""), std::string::npos);

  document = llama3_document();
  document["normalizer"] = {{"type", "BertNormalizer"}};
  EXPECT_NE(load_error(document.dump()).find("normalizer.type: one of"), std::string::npos);

  document = llama3_document();
  document["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "WordPiece"}}}}};
  EXPECT_NE(load_error(document.dump()).find("decoder.decoders[0].type: one of"), std::string::npos);

  document = llama3_document();
  document["post_processor"] = {{"type", "BertProcessing"}};
  EXPECT_NE(load_error(document.dump()).find("post_processor.type: one of"), std::string::npos);

  document = llama3_document();
  document["truncation"] = {{"max_length", 512}};
  EXPECT_NE(load_error(document.dump()).find("truncation: null"), std::string::npos);

  document = llama3_document();
  document["model"]["dropout"] = 0.1;
  EXPECT_NE(load_error(document.dump()).find("model.dropout"), std::string::npos);
}

TEST(TokenizerErrors, WrongFieldTypes) {
  json document = llama3_document();
  document["model"]["vocab"]["!"] = "zero";
  EXPECT_NE(load_error(document.dump()).find("model.vocab[\"!\"]: an integer"), std::string::npos);

  document = llama3_document();
  document["added_tokens"][0]["content"] = 7;
  EXPECT_NE(load_error(document.dump()).find("added_tokens[0].content: a string"), std::string::npos);

  document = llama3_document();
  document["model"]["ignore_merges"] = "yes";
  EXPECT_NE(load_error(document.dump()).find("model.ignore_merges: a boolean"), std::string::npos);

  document = llama3_document();
  document["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(unclosed"}};
  EXPECT_NE(load_error(document.dump()).find("pre_tokenizer.pretokenizers[0].pattern.Regex: a supported regex"),
            std::string::npos);

  document = llama3_document();
  document["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
  EXPECT_NE(load_error(document.dump()).find("pretokenizers[0].behavior: one of Removed"), std::string::npos);

  EXPECT_NE(load_error("[1, 2]").find("an object"), std::string::npos);
}

TEST(TokenizerErrors, InvalidUtf8TextIsRejected) {
  const Tokenizer tokenizer = Tokenizer::from_json(llama3_document().dump(), "llama3.json");
  EXPECT_THROW(tokenizer.encode("ok \xC3\x28 no"), InputError);
  EXPECT_THROW(tokenizer.encode("\xED\xA0\x80"), InputError);  // a UTF-16 surrogate
}

// Every field of the non-vocabulary parts replaced by values of every JSON
// type: loading (and encoding, when it loads) either works or throws
// InputError; nothing else escapes and nothing crashes.
TEST(TokenizerErrors, MutatedFilesNeverCrash) {
  json base = read_json(tokenizer_fixtures() / "llama2.tokenizer.json");
  // Keep the model small so that thousands of loads stay quick.
  json small_vocab = json::object();
  for (const auto& [token, id] : base["model"]["vocab"].items()) {
    if (id.get<int>() < 300) small_vocab[token] = id;
  }
  base["model"]["vocab"] = small_vocab;
  base["model"]["merges"] = json::array();
  base["pre_tokenizer"] = read_json(tokenizer_fixtures() / "llama3.tokenizer.json")["pre_tokenizer"];

  const std::vector<json> replacements = {nullptr, true, -1, 3.5, "x", "", json::array(), json::object(),
                                          json::array({"a", "b"})};
  std::vector<json::json_pointer> pointers;
  const json flat = base.flatten();
  for (const auto& [path, value] : flat.items()) {
    if (path.rfind("/model/vocab/", 0) == 0) continue;
    // Every prefix of the path, so that whole objects are replaced too.
    json::json_pointer pointer(path);
    while (!pointer.empty()) {
      pointers.push_back(pointer);
      pointer = pointer.parent_pointer();
    }
  }
  std::sort(pointers.begin(), pointers.end(), [](const auto& a, const auto& b) { return a.to_string() < b.to_string(); });
  pointers.erase(std::unique(pointers.begin(), pointers.end()), pointers.end());
  int loaded = 0;
  for (const auto& pointer : pointers) {
    for (const json& replacement : replacements) {
      json document = base;
      document[pointer] = replacement;
      SCOPED_TRACE(pointer.to_string() + " = " + replacement.dump());
      try {
        const Tokenizer tokenizer = Tokenizer::from_json(document.dump(), "mutated.json");
        const std::vector<int32_t> ids = tokenizer.encode("Hello <s> w\xC3\xB6rld 42\n\t!", true);
        tokenizer.decode(ids, false);
        tokenizer.decode(ids, true);
        ++loaded;
      } catch (const InputError&) {
      } catch (const std::exception& error) {
        ADD_FAILURE() << "unexpected exception: " << error.what();
      }
    }
  }
  EXPECT_GT(loaded, 0);
}

}  // namespace
}  // namespace kvforge
