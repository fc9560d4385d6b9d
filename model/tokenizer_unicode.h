#pragma once
// Unicode helpers for the tokenizer: UTF-8 decoding and validation, Rust's
// String::from_utf8_lossy, the GPT-2 byte <-> unicode table of ByteLevel,
// White_Space, and the normal forms and lowercase mapping of the
// normalizers (through ICU, when kvforge is built with it).
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace kvforge::tokenizer_detail {

// Byte length of the UTF-8 sequence that starts with `lead` (1 for a stray
// continuation or invalid byte, so that loops always advance).
size_t utf8_sequence_length(unsigned char lead);
// Decodes the code point at `pos` of valid UTF-8 and advances `pos`.
char32_t next_code_point(std::string_view text, size_t& pos);
void append_utf8(std::string& out, char32_t code_point);
// Length of the well-formed UTF-8 sequence at `pos`, 0 if it is ill-formed.
size_t utf8_valid_length_at(std::string_view bytes, size_t pos);
// Offset of the first byte that is not part of well-formed UTF-8, if any.
std::optional<size_t> first_invalid_utf8(std::string_view bytes);
// Rust's String::from_utf8_lossy: every maximal invalid subpart becomes one
// U+FFFD.
std::string utf8_lossy(std::string_view bytes);

// GPT-2 bytes_to_unicode: the code point that stands for `byte` in
// byte-level vocabularies, and the inverse (nullopt for other code points).
char32_t byte_to_unicode(unsigned char byte);
std::optional<unsigned char> unicode_to_byte(char32_t code_point);
// Every byte of `bytes` replaced by its byte-level code point, as UTF-8.
std::string bytes_to_byte_level(std::string_view bytes);

// Rust's char::is_whitespace: the Unicode White_Space property.
bool is_whitespace(char32_t code_point);

// Whether unicode_normalize and unicode_lowercase are available (kvforge
// was built with ICU, Debian package libicu-dev); they throw
// std::logic_error otherwise.
bool have_unicode_tables();
enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
// `text` (valid UTF-8) in the given Unicode normal form.
std::string unicode_normalize(std::string_view text, NormalForm form);
// Every code point replaced by its full lowercase mapping, without context
// (Rust's char::to_lowercase, which HF's Lowercase applies per character:
// no final-sigma rule).
std::string unicode_lowercase(std::string_view text);

}  // namespace kvforge::tokenizer_detail
