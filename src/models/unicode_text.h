// The Unicode operations the WordPiece tokenizer needs, on UTF-32 strings: UTF-8 decoding and
// encoding, general-category lookups, canonical decomposition (NFD) and full lowercase mapping.
// Data: models/unicode_tables.h (Unicode version in unicode::kUnicodeVersion).
#pragma once

#include <string>
#include <string_view>

#include "models/unicode_tables.h"

namespace qkv::models::unicode {

constexpr char32_t kReplacementChar = 0xFFFD;

// Decodes UTF-8. Each maximal invalid subsequence (stray continuation byte, truncated or
// overlong sequence, surrogate, value above U+10FFFF) becomes one U+FFFD, the same substitution
// as Python's bytes.decode("utf-8", errors="replace").
std::u32string decode_utf8(std::string_view text);
// Appends the UTF-8 encoding of `cp` (a valid scalar value) to `out`.
void append_utf8(char32_t cp, std::string& out);
std::string encode_utf8(std::u32string_view text);

CharClass char_class(char32_t cp);
std::uint8_t combining_class(char32_t cp);

// Canonical decomposition (Unicode Normalization Form D): full recursive decomposition,
// algorithmic Hangul decomposition, then canonical reordering of combining marks.
std::u32string nfd(std::u32string_view text);

// Appends the full lowercase mapping of `cp` (one code point, or two for U+0130), per code
// point and without context: U+03A3 always gives U+03C3, never the final sigma U+03C2.
void append_lowercase(char32_t cp, std::u32string& out);

}  // namespace qkv::models::unicode
