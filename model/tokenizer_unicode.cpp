#include "model/tokenizer_unicode.h"

#if KVFORGE_HAVE_ICU
#include <unicode/unorm2.h>
#include <unicode/ustring.h>
#endif

#include <algorithm>
#include <stdexcept>
#include <vector>

namespace kvforge::tokenizer_detail {
namespace {

// Bytes that bytes_to_unicode maps to themselves: '!'..'~', '¡'..'¬', '®'..'ÿ'.
bool is_printable_byte(unsigned byte) {
  return (byte >= 0x21 && byte <= 0x7E) || (byte >= 0xA1 && byte <= 0xAC) ||
         (byte >= 0xAE && byte <= 0xFF);
}

// The other 68 bytes, in increasing order, map to U+0100 + their rank:
// 0x00..0x20 (33 bytes), 0x7F..0xA0 (34 bytes), 0xAD (1 byte).
constexpr char32_t kShiftedBase = 0x100;

// Length of the well-formed UTF-8 sequence at `pos` (Unicode table 3-7), or 0
// when it is ill-formed; `valid_prefix` receives how many of its leading
// bytes form a valid prefix (the "maximal subpart" that from_utf8_lossy
// replaces by one U+FFFD).
size_t well_formed_length(std::string_view bytes, size_t pos, size_t& valid_prefix) {
  const auto lead = static_cast<unsigned char>(bytes[pos]);
  valid_prefix = 1;
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char second_lo = 0x80, second_hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) second_lo = 0xA0;
    if (lead == 0xED) second_hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) second_lo = 0x90;
    if (lead == 0xF4) second_hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k < length; ++k) {
    if (pos + k >= bytes.size()) return 0;
    const auto byte = static_cast<unsigned char>(bytes[pos + k]);
    const unsigned char lo = k == 1 ? second_lo : 0x80;
    const unsigned char hi = k == 1 ? second_hi : 0xBF;
    if (byte < lo || byte > hi) return 0;
    valid_prefix = k + 1;
  }
  return length;
}

#if KVFORGE_HAVE_ICU
std::u16string to_utf16(std::string_view text) {
  UErrorCode status = U_ZERO_ERROR;
  int32_t length = 0;
  u_strFromUTF8(nullptr, 0, &length, text.data(), static_cast<int32_t>(text.size()), &status);
  std::u16string out(static_cast<size_t>(length), u'\0');
  status = U_ZERO_ERROR;
  u_strFromUTF8(reinterpret_cast<UChar*>(out.data()), length, nullptr, text.data(),
                static_cast<int32_t>(text.size()), &status);
  if (U_FAILURE(status)) throw std::runtime_error(std::string("ICU u_strFromUTF8: ") + u_errorName(status));
  return out;
}

std::string to_utf8(const std::u16string& text) {
  UErrorCode status = U_ZERO_ERROR;
  int32_t length = 0;
  u_strToUTF8(nullptr, 0, &length, reinterpret_cast<const UChar*>(text.data()),
              static_cast<int32_t>(text.size()), &status);
  std::string out(static_cast<size_t>(length), '\0');
  status = U_ZERO_ERROR;
  u_strToUTF8(out.data(), length, nullptr, reinterpret_cast<const UChar*>(text.data()),
              static_cast<int32_t>(text.size()), &status);
  if (U_FAILURE(status)) throw std::runtime_error(std::string("ICU u_strToUTF8: ") + u_errorName(status));
  return out;
}

const UNormalizer2* normalizer_instance(NormalForm form) {
  UErrorCode status = U_ZERO_ERROR;
  const UNormalizer2* instance = nullptr;
  switch (form) {
    case NormalForm::kNfc: instance = unorm2_getNFCInstance(&status); break;
    case NormalForm::kNfd: instance = unorm2_getNFDInstance(&status); break;
    case NormalForm::kNfkc: instance = unorm2_getNFKCInstance(&status); break;
    case NormalForm::kNfkd: instance = unorm2_getNFKDInstance(&status); break;
  }
  if (U_FAILURE(status)) throw std::runtime_error(std::string("ICU normalizer: ") + u_errorName(status));
  return instance;
}

#endif  // KVFORGE_HAVE_ICU

}  // namespace

size_t utf8_sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xF0 && lead <= 0xF7) return 4;
  if (lead >= 0xE0) return lead <= 0xEF ? 3 : 1;
  if (lead >= 0xC0) return 2;
  return 1;
}

char32_t next_code_point(std::string_view text, size_t& pos) {
  const auto lead = static_cast<unsigned char>(text[pos]);
  const size_t length = std::min(utf8_sequence_length(lead), text.size() - pos);
  char32_t cp = length == 1 ? lead : (length == 2 ? lead & 0x1F : (length == 3 ? lead & 0x0F : lead & 0x07));
  for (size_t k = 1; k < length; ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[pos + k]) & 0x3F);
  pos += length;
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t utf8_valid_length_at(std::string_view bytes, size_t pos) {
  size_t prefix = 0;
  return well_formed_length(bytes, pos, prefix);
}

std::optional<size_t> first_invalid_utf8(std::string_view bytes) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    // ASCII fast path.
    if (static_cast<unsigned char>(bytes[pos]) < 0x80) {
      ++pos;
      continue;
    }
    size_t prefix = 0;
    const size_t length = well_formed_length(bytes, pos, prefix);
    if (length == 0) return pos;
    pos += length;
  }
  return std::nullopt;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    size_t prefix = 0;
    const size_t length = well_formed_length(bytes, pos, prefix);
    if (length == 0) {
      out += "\xEF\xBF\xBD";
      pos += prefix;
    } else {
      out.append(bytes.substr(pos, length));
      pos += length;
    }
  }
  return out;
}

char32_t byte_to_unicode(unsigned char byte) {
  if (is_printable_byte(byte)) return byte;
  if (byte <= 0x20) return kShiftedBase + byte;
  if (byte <= 0xA0) return kShiftedBase + 33 + (byte - 0x7F);
  return kShiftedBase + 67;  // 0xAD, the only one left
}

std::optional<unsigned char> unicode_to_byte(char32_t cp) {
  if (cp <= 0xFF) {
    if (is_printable_byte(cp)) return static_cast<unsigned char>(cp);
    return std::nullopt;
  }
  if (cp < kShiftedBase || cp > kShiftedBase + 67) return std::nullopt;
  const unsigned rank = cp - kShiftedBase;
  if (rank <= 32) return static_cast<unsigned char>(rank);
  if (rank <= 66) return static_cast<unsigned char>(0x7F + (rank - 33));
  return static_cast<unsigned char>(0xAD);
}

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) append_utf8(out, byte_to_unicode(static_cast<unsigned char>(c)));
  return out;
}

bool is_whitespace(char32_t cp) {
  // White_Space has been this set since Unicode 6.3.
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

#if KVFORGE_HAVE_ICU

bool have_unicode_tables() { return true; }

std::string unicode_normalize(std::string_view text, NormalForm form) {
  const UNormalizer2* normalizer = normalizer_instance(form);
  const std::u16string source = to_utf16(text);
  UErrorCode status = U_ZERO_ERROR;
  // Quick check first: most text is already normalized.
  if (unorm2_isNormalized(normalizer, reinterpret_cast<const UChar*>(source.data()),
                          static_cast<int32_t>(source.size()), &status) &&
      U_SUCCESS(status)) {
    return std::string(text);
  }
  status = U_ZERO_ERROR;
  const int32_t length = unorm2_normalize(normalizer, reinterpret_cast<const UChar*>(source.data()),
                                          static_cast<int32_t>(source.size()), nullptr, 0, &status);
  std::u16string out(static_cast<size_t>(length), u'\0');
  status = U_ZERO_ERROR;
  unorm2_normalize(normalizer, reinterpret_cast<const UChar*>(source.data()), static_cast<int32_t>(source.size()),
                   reinterpret_cast<UChar*>(out.data()), length, &status);
  if (U_FAILURE(status)) throw std::runtime_error(std::string("ICU unorm2_normalize: ") + u_errorName(status));
  return to_utf8(out);
}

std::string unicode_lowercase(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t begin = pos;
    const char32_t cp = next_code_point(text, pos);
    if (cp < 0x80) {
      out += static_cast<char>(cp >= 'A' && cp <= 'Z' ? cp + ('a' - 'A') : cp);
      continue;
    }
    // One code point at a time, so that ICU sees no context (a lone sigma
    // is never word-final).
    const std::u16string source = to_utf16(text.substr(begin, pos - begin));
    UChar lowered[16];
    UErrorCode status = U_ZERO_ERROR;
    const int32_t length = u_strToLower(lowered, 16, reinterpret_cast<const UChar*>(source.data()),
                                        static_cast<int32_t>(source.size()), "", &status);
    if (U_FAILURE(status)) throw std::runtime_error(std::string("ICU u_strToLower: ") + u_errorName(status));
    out += to_utf8(std::u16string(reinterpret_cast<const char16_t*>(lowered), static_cast<size_t>(length)));
  }
  return out;
}

#else  // KVFORGE_HAVE_ICU

bool have_unicode_tables() { return false; }

std::string unicode_normalize(std::string_view, NormalForm) {
  throw std::logic_error("Unicode normal forms need kvforge built with ICU (libicu-dev)");
}

std::string unicode_lowercase(std::string_view) {
  throw std::logic_error("Unicode lowercase needs kvforge built with ICU (libicu-dev)");
}

#endif  // KVFORGE_HAVE_ICU

}  // namespace kvforge::tokenizer_detail
