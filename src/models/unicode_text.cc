#include "models/unicode_text.h"

#include <algorithm>

namespace qkv::models::unicode {
namespace {

// Hangul syllable decomposition constants (Unicode 14.0, section 3.12).
constexpr char32_t kHangulSBase = 0xAC00;
constexpr char32_t kHangulLBase = 0x1100;
constexpr char32_t kHangulVBase = 0x1161;
constexpr char32_t kHangulTBase = 0x11A7;
constexpr char32_t kHangulTCount = 28;
constexpr char32_t kHangulNCount = 21 * kHangulTCount;
constexpr char32_t kHangulSCount = 19 * kHangulNCount;

// The row of a sorted range table that contains `cp`, or nullptr.
template <typename Range>
const Range* find_range(std::span<const Range> table, char32_t cp) {
  const auto it = std::upper_bound(table.begin(), table.end(), cp,
                                   [](char32_t c, const Range& r) { return c < r.first; });
  if (it == table.begin()) return nullptr;
  const Range& range = *(it - 1);
  return cp <= range.last ? &range : nullptr;
}

const Decomposition* find_decomposition(std::span<const Decomposition> table, char32_t cp) {
  const auto it =
      std::lower_bound(table.begin(), table.end(), cp,
                       [](const Decomposition& d, char32_t c) { return d.code_point < c; });
  return it != table.end() && it->code_point == cp ? &*it : nullptr;
}

void append_decomposition(char32_t cp, std::u32string& out) {
  if (cp >= kHangulSBase && cp < kHangulSBase + kHangulSCount) {
    const char32_t index = cp - kHangulSBase;
    out.push_back(kHangulLBase + index / kHangulNCount);
    out.push_back(kHangulVBase + (index % kHangulNCount) / kHangulTCount);
    if (index % kHangulTCount != 0) out.push_back(kHangulTBase + index % kHangulTCount);
    return;
  }
  const Decomposition* d = find_decomposition(decompositions(), cp);
  if (d == nullptr) {
    out.push_back(cp);
    return;
  }
  append_decomposition(d->first, out);
  if (d->second != 0) append_decomposition(d->second, out);
}

}  // namespace

std::u32string decode_utf8(std::string_view text) {
  std::u32string out;
  out.reserve(text.size());
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  std::size_t i = 0;
  while (i < text.size()) {
    const unsigned char lead = byte(i);
    if (lead < 0x80) {
      out.push_back(lead);
      ++i;
      continue;
    }
    // Sequence length and the allowed range of the second byte (which rules out overlong
    // forms, surrogates and values above U+10FFFF), per Unicode Table 3-7.
    int length = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      length = 3;
      if (lead == 0xE0) lo = 0xA0;
      if (lead == 0xED) hi = 0x9F;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      length = 4;
      if (lead == 0xF0) lo = 0x90;
      if (lead == 0xF4) hi = 0x8F;
    }
    if (length == 0) {  // continuation byte without a lead, or C0, C1, F5..FF
      out.push_back(kReplacementChar);
      ++i;
      continue;
    }
    char32_t cp = lead & (0xFF >> (length + 1));
    std::size_t n = 1;
    for (; n < static_cast<std::size_t>(length) && i + n < text.size(); ++n) {
      const unsigned char b = byte(i + n);
      if (n == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) break;
      cp = (cp << 6) | (b & 0x3F);
    }
    // A truncated sequence is one maximal invalid subsequence: one U+FFFD for all its bytes.
    out.push_back(n == static_cast<std::size_t>(length) ? cp : kReplacementChar);
    i += n;
  }
  return out;
}

void append_utf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string encode_utf8(std::u32string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char32_t cp : text) append_utf8(cp, out);
  return out;
}

CharClass char_class(char32_t cp) {
  const ClassRange* range = find_range(class_ranges(), cp);
  return range == nullptr ? CharClass::kOther : range->char_class;
}

std::uint8_t combining_class(char32_t cp) {
  const CombiningRange* range = find_range(combining_ranges(), cp);
  return range == nullptr ? 0 : range->ccc;
}

std::u32string nfd(std::u32string_view text) {
  std::u32string out;
  out.reserve(text.size());
  for (const char32_t cp : text) append_decomposition(cp, out);
  // Canonical ordering: within each run of nonzero combining classes, a stable sort by class.
  std::size_t i = 0;
  while (i < out.size()) {
    if (combining_class(out[i]) == 0) {
      ++i;
      continue;
    }
    std::size_t end = i + 1;
    while (end < out.size() && combining_class(out[end]) != 0) ++end;
    std::stable_sort(out.data() + i, out.data() + end, [](char32_t a, char32_t b) {
      return combining_class(a) < combining_class(b);
    });
    i = end;
  }
  return out;
}

void append_lowercase(char32_t cp, std::u32string& out) {
  if (cp < 0x80) {
    out.push_back(cp >= 'A' && cp <= 'Z' ? cp + ('a' - 'A') : cp);
    return;
  }
  const LowercaseRange* range = find_range(lowercase_ranges(), cp);
  if (range != nullptr && (cp - range->first) % range->stride == 0) {
    out.push_back(static_cast<char32_t>(static_cast<std::int32_t>(cp) + range->delta));
    return;
  }
  const Decomposition* special = find_decomposition(lowercase_special(), cp);
  if (special != nullptr) {
    out.push_back(special->first);
    out.push_back(special->second);
    return;
  }
  out.push_back(cp);
}

}  // namespace qkv::models::unicode
