// Tokenizer: reads tokenizer.json into the pipeline stages and runs HF
// tokenizers' encode (added tokens, normalizer, pre-tokenizer, model,
// post-processor) and decode (added tokens or model vocab, then decoder).
#include "model/tokenizer.h"

#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "formats/input_error.h"
#include "formats/sha256.h"
#include "model/tokenizer_added.h"
#include "model/tokenizer_bpe.h"
#include "model/tokenizer_components.h"
#include "model/tokenizer_json.h"
#include "model/tokenizer_unicode.h"

namespace kvforge {

using tokenizer_detail::AddedToken;
using tokenizer_detail::AddedTokenMatcher;
using tokenizer_detail::BpeModel;
using tokenizer_detail::Field;
using tokenizer_detail::Piece;
using tokenizer_detail::Segment;

struct Tokenizer::Impl {
  std::string file;
  std::string sha256;
  std::unique_ptr<BpeModel> model;
  std::unique_ptr<tokenizer_detail::Normalizer> normalizer;
  std::unique_ptr<tokenizer_detail::PreTokenizer> pre_tokenizer;
  std::unique_ptr<tokenizer_detail::PostProcessor> post_processor;
  std::unique_ptr<tokenizer_detail::Decoder> decoder;

  std::vector<AddedToken> added_tokens;
  std::unordered_map<int32_t, size_t> added_by_id;                  // id -> index in added_tokens
  tokenizer_detail::StringMap<size_t> added_by_content;              // content -> index
  std::unordered_set<std::string> special_contents;                 // contents of special tokens
  AddedTokenMatcher raw_matcher;         // normalized=false tokens, matched in the raw text
  AddedTokenMatcher normalized_matcher;  // normalized=true tokens, matched after normalization
  int64_t vocab_size = 0;

  void encode_text(std::string_view text, bool at_origin, std::vector<int32_t>& ids) const;
  void encode_normalized(const std::string& text, bool at_origin, std::vector<int32_t>& ids) const;
  // The token of `id`: added tokens first, then the model; nullptr if unknown.
  const std::string* token_of(int32_t id) const;
  // Registers the "added_tokens" list (after the model and normalizer).
  void add_tokens(const Field& list);
};

namespace {

// nlohmann's message without its "[json.exception.parse_error.101] " tag.
std::string parse_error_text(const std::exception& error) {
  std::string text = error.what();
  const size_t tag_end = text.find("] ");
  if (!text.empty() && text.front() == '[' && tag_end != std::string::npos) text = text.substr(tag_end + 2);
  return tokenizer_detail::one_line(text, 200);
}

std::unique_ptr<BpeModel> parse_model(const Field& root) {
  const Field model = root.at("model");
  model.require_object();
  if (model.find("type")) {
    tokenizer_detail::component_type(model, {"BPE"});
  } else if (!model.find("merges")) {
    model.fail_plain("a BPE model (with \"type\": \"BPE\" or \"merges\"); other models are not supported");
  }
  return std::make_unique<BpeModel>(model);
}

AddedToken parse_added_token(const Field& field) {
  field.require_object();
  AddedToken token;
  token.id = static_cast<int32_t>(field.at("id").as_int(0, std::numeric_limits<int32_t>::max()));
  token.content = field.at("content").as_string();
  token.single_word = field.bool_or("single_word", false);
  token.lstrip = field.bool_or("lstrip", false);
  token.rstrip = field.bool_or("rstrip", false);
  token.special = field.bool_or("special", false);
  token.normalized = field.bool_or("normalized", !token.special);
  return token;
}

void require_null(const Field& root, std::string_view key, std::string_view what) {
  if (auto value = root.find(key)) value->fail("null (" + std::string(what) + " is not supported)");
}

std::string read_whole_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path.string(), "", "cannot open the file (missing or unreadable)");
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) throw InputError(path.string(), "", "cannot read the file");
  return out.str();
}

}  // namespace

void Tokenizer::Impl::encode_text(std::string_view text, bool at_origin, std::vector<int32_t>& ids) const {
  // Pieces between non-normalized added tokens are normalized, then searched
  // for normalized added tokens, then pre-tokenized and run through BPE.
  if (text.empty()) return;
  const std::string normalized = normalizer ? normalizer->normalize(std::string(text)) : std::string(text);
  encode_normalized(normalized, at_origin, ids);
}

void Tokenizer::Impl::encode_normalized(const std::string& text, bool at_origin, std::vector<int32_t>& ids) const {
  for (const Segment& segment : split_added_tokens(text, normalized_matcher, added_tokens)) {
    const bool segment_at_origin = at_origin && segment.text.data() == text.data();
    if (segment.id) {
      ids.push_back(*segment.id);
      continue;
    }
    std::vector<Piece> pieces{Piece{std::string(segment.text), segment_at_origin}};
    if (pre_tokenizer) pre_tokenizer->pre_tokenize(pieces);
    for (const Piece& piece : pieces) model->tokenize(piece.text, ids);
  }
}

void Tokenizer::Impl::add_tokens(const Field& list) {
  for (size_t i = 0; i < list.size(); ++i) {
    AddedToken token = parse_added_token(list.at(i));
    // As in HF, a content already in the model vocab keeps the model's id.
    if (auto model_id = model->token_to_id(token.content)) token.id = *model_id;
    const size_t index = added_tokens.size();
    added_by_id.emplace(token.id, index);
    added_by_content.emplace(token.content, index);
    if (token.special) special_contents.insert(token.content);
    vocab_size = std::max<int64_t>(vocab_size, int64_t{token.id} + 1);
    if (!token.normalized) {
      raw_matcher.add(token.content, index);
    } else if (!token.content.empty()) {
      // Normalized tokens are looked for in their normalized form.
      normalized_matcher.add(normalizer ? normalizer->normalize(token.content) : token.content, index);
    }
    added_tokens.push_back(std::move(token));
  }
}

const std::string* Tokenizer::Impl::token_of(int32_t id) const {
  auto it = added_by_id.find(id);
  if (it != added_by_id.end()) return &added_tokens[it->second].content;
  return model->id_to_token(id);
}

Tokenizer Tokenizer::from_file(const std::filesystem::path& tokenizer_json) {
  return from_json(read_whole_file(tokenizer_json), tokenizer_json.string());
}

Tokenizer Tokenizer::from_json(const std::string& json_text, const std::string& file_for_errors) {
  auto impl = std::make_unique<Impl>();
  impl->file = file_for_errors;
  impl->sha256 = sha256_hex(json_text);
  nlohmann::json document;
  try {
    document = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& error) {
    throw InputError(file_for_errors, "", "not valid JSON: " + parse_error_text(error));
  }
  try {
    const Field root(document, "", impl->file);
    root.require_object();
    require_null(root, "truncation", "truncation");
    require_null(root, "padding", "padding");
    impl->model = parse_model(root);
    if (auto field = root.find("normalizer")) impl->normalizer = tokenizer_detail::parse_normalizer(*field);
    if (auto field = root.find("pre_tokenizer")) impl->pre_tokenizer = tokenizer_detail::parse_pre_tokenizer(*field);
    if (auto field = root.find("post_processor")) {
      impl->post_processor = tokenizer_detail::parse_post_processor(*field);
    }
    if (auto field = root.find("decoder")) impl->decoder = tokenizer_detail::parse_decoder(*field);

    impl->vocab_size = impl->model->max_id() + 1;
    if (auto list = root.find("added_tokens")) impl->add_tokens(*list);
  } catch (const nlohmann::json::exception& error) {
    // Field checks types before every access; this is a safety net only.
    throw InputError(file_for_errors, "", "unexpected JSON content: " + parse_error_text(error));
  }
  return Tokenizer(std::move(impl));
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (auto bad = tokenizer_detail::first_invalid_utf8(text)) {
    throw InputError("text to encode", "byte " + std::to_string(*bad), "valid UTF-8");
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 16);
  for (const Segment& segment : split_added_tokens(text, impl_->raw_matcher, impl_->added_tokens)) {
    if (segment.id) {
      ids.push_back(*segment.id);
    } else {
      impl_->encode_text(segment.text, segment.text.data() == text.data(), ids);
    }
  }
  if (impl_->post_processor) impl_->post_processor->process(ids, add_special_tokens);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* token = impl_->token_of(id);
    if (token == nullptr) continue;  // HF drops ids it does not know
    // As in HF, "special" is a property of the content, whatever the id.
    if (skip_special_tokens && impl_->special_contents.count(*token) > 0) continue;
    tokens.push_back(*token);
  }
  if (!impl_->decoder) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) joined += (i == 0 ? "" : " ") + tokens[i];
    return joined;
  }
  impl_->decoder->decode_chain(tokens);
  std::string out;
  for (const std::string& token : tokens) out += token;
  return out;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->added_by_content.find(token);
  if (it != impl_->added_by_content.end()) return impl_->added_tokens[it->second].id;
  return impl_->model->token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  const std::string* token = impl_->token_of(id);
  return token == nullptr ? std::string() : *token;
}

const std::string& Tokenizer::sha256() const { return impl_->sha256; }

}  // namespace kvforge
