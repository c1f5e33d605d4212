// Unicode data tables for the WordPiece tokenizer, generated into unicode_tables.cc by
// scripts/gen_unicode_tables.py from Python's unicodedata (the version is kUnicodeVersion).
// Every table is sorted by code point and meant for binary search; lookups live in
// models/unicode_text.h.
#pragma once

#include <cstdint>
#include <span>

namespace qkv::models::unicode {

// What the BERT normaliser and pre-tokeniser need to know about a code point. Code points in
// no ClassRange are kOther (letters, digits, symbols, spacing marks, unassigned).
enum class CharClass : std::uint8_t {
  kOther,
  kControl,         // general category Cc, Cf, Co or Cs (includes \t \n \r: callers special-case)
  kWhitespace,      // Zs, Zl, Zp
  kPunctuation,     // P*
  kNonspacingMark,  // Mn
};

struct ClassRange {
  char32_t first;
  char32_t last;  // inclusive
  CharClass char_class;
};

// Code points first..last all have canonical combining class `ccc` (nonzero).
struct CombiningRange {
  char32_t first;
  char32_t last;
  std::uint8_t ccc;
};

// One step of a canonical decomposition: code_point -> first, second (second == 0 when the
// decomposition is a single code point). Apply recursively for the full decomposition.
struct Decomposition {
  char32_t code_point;
  char32_t first;
  char32_t second;
};

// Every `stride`-th code point from first to last (inclusive) lowercases to itself + delta.
struct LowercaseRange {
  char32_t first;
  char32_t last;
  std::int32_t delta;
  std::uint8_t stride;
};

extern const char kUnicodeVersion[];
std::span<const ClassRange> class_ranges();
std::span<const CombiningRange> combining_ranges();
std::span<const Decomposition> decompositions();
std::span<const LowercaseRange> lowercase_ranges();
// Code points whose lowercase is two code points, as Decomposition rows (only U+0130).
std::span<const Decomposition> lowercase_special();

}  // namespace qkv::models::unicode
