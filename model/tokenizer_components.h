#pragma once
// The pipeline stages of tokenizer.json other than the model: normalizer,
// pre_tokenizer, decoder and post_processor. Each parse_* function reads one
// (non-null) JSON component and throws InputError naming the field for an
// unsupported type or a bad parameter.
//
// Supported types:
//   normalizer:     Sequence, Prepend, Replace, NFC, NFD, NFKC, NFKD, Lowercase, Strip
//   pre_tokenizer:  Sequence, Split, ByteLevel, Metaspace, Digits
//   decoder:        Sequence, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip
//   post_processor: Sequence, TemplateProcessing (single sequences), ByteLevel
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/tokenizer_json.h"

namespace kvforge::tokenizer_detail {

// A piece of the input on its way through the pipeline.
struct Piece {
  std::string text;
  // Whether the piece starts at offset 0 of the original input (what
  // Metaspace's prepend_scheme "first" looks at).
  bool at_origin = false;
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // `text` is valid, non-empty UTF-8; the result is valid UTF-8.
  virtual std::string normalize(std::string text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits and rewrites the pieces in place; never leaves an empty piece.
  virtual void pre_tokenize(std::vector<Piece>& pieces) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  // HF's Decoder::decode_chain: token strings in, (fewer) strings out.
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Adds the special tokens of a single-sequence encoding when asked to.
  virtual void process(std::vector<int32_t>& ids, bool add_special_tokens) const = 0;
};

std::unique_ptr<Normalizer> parse_normalizer(const Field& field);
std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const Field& field);
std::unique_ptr<Decoder> parse_decoder(const Field& field);
std::unique_ptr<PostProcessor> parse_post_processor(const Field& field);

// Shared by the components: a pattern object {"String": s} or {"Regex": r};
// a single-character string field.
class Pattern;
Pattern parse_pattern(const Field& field);
char32_t parse_char(const Field& field);
// The "type" member of a component, checked against the supported names.
std::string component_type(const Field& field, const std::vector<std::string>& supported);
// Whether a Metaspace component (pre-tokenizer or decoder) prepends the
// replacement: prepend_scheme other than "never" (or legacy add_prefix_space).
bool metaspace_prepends(const Field& field);

}  // namespace kvforge::tokenizer_detail
