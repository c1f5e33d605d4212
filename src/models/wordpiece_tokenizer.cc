#include "qkv/models/wordpiece_tokenizer.h"

#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "io/input_file.h"
#include "models/unicode_text.h"
#include "qkv/error.h"

namespace qkv::models {
namespace {

using unicode::CharClass;

constexpr std::string_view kContinuationPrefix = "##";
constexpr std::string_view kUnkToken = "[UNK]";
constexpr std::string_view kClsToken = "[CLS]";
constexpr std::string_view kSepToken = "[SEP]";
constexpr std::string_view kPadToken = "[PAD]";
// The special tokens BertTokenizer registers; those in the vocabulary are matched verbatim in
// input text (tokenizers' added tokens with normalized=false) and never split.
constexpr std::string_view kSpecialTokens[] = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};

// vocab.txt files are a few MB (BERT's: 230 KB); a larger one is not a vocabulary.
constexpr std::uint64_t kMaxVocabBytes = 256ull << 20;

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw Error(where + ": " + what);
}

// \t \n \r and the Unicode space separators (Zs, Zl, Zp). The other White_Space code points
// (U+000B, U+000C, U+0085) are controls and are removed before anyone asks.
bool is_whitespace(char32_t cp) {
  return cp == '\t' || cp == '\n' || cp == '\r' ||
         unicode::char_class(cp) == CharClass::kWhitespace;
}

bool is_control(char32_t cp) {
  if (cp == '\t' || cp == '\n' || cp == '\r') return false;
  return unicode::char_class(cp) == CharClass::kControl;
}

// ASCII punctuation (which includes symbols such as $ + < = > ^ ` | ~) or category P*.
bool is_punctuation(char32_t cp) {
  if ((cp >= 33 && cp <= 47) || (cp >= 58 && cp <= 64) || (cp >= 91 && cp <= 96) ||
      (cp >= 123 && cp <= 126)) {
    return true;
  }
  return unicode::char_class(cp) == CharClass::kPunctuation;
}

// The CJK Unified Ideographs blocks BERT treats as one word per character. These are the ranges
// of tokenizers' BertNormalizer, which starts Extension E at U+2B920 where Google's original
// BERT and the Python BertTokenizer start it at U+2B820; we follow tokenizers.
bool is_cjk_ideograph(char32_t cp) {
  return (cp >= 0x4E00 && cp <= 0x9FFF) || (cp >= 0x3400 && cp <= 0x4DBF) ||
         (cp >= 0x20000 && cp <= 0x2A6DF) || (cp >= 0x2A700 && cp <= 0x2B73F) ||
         (cp >= 0x2B740 && cp <= 0x2B81F) || (cp >= 0x2B920 && cp <= 0x2CEAF) ||
         (cp >= 0xF900 && cp <= 0xFAFF) || (cp >= 0x2F800 && cp <= 0x2FA1F);
}

// BertNormalizer, in its order: clean, CJK spacing, strip accents, lower-case.
std::u32string normalize_text(std::string_view text, const WordPieceOptions& options) {
  std::u32string cleaned;
  for (const char32_t cp : unicode::decode_utf8(text)) {
    if (cp == 0 || cp == unicode::kReplacementChar || is_control(cp)) continue;
    if (is_whitespace(cp)) {
      cleaned.push_back(' ');
    } else if (options.split_cjk && is_cjk_ideograph(cp)) {
      cleaned.append({U' ', cp, U' '});
    } else {
      cleaned.push_back(cp);
    }
  }
  if (options.strip_accents) {
    std::u32string decomposed = unicode::nfd(cleaned);
    std::erase_if(decomposed, [](char32_t cp) {
      return unicode::char_class(cp) == CharClass::kNonspacingMark;
    });
    cleaned = std::move(decomposed);
  }
  if (!options.lower_case) return cleaned;
  std::u32string lowered;
  lowered.reserve(cleaned.size());
  for (const char32_t cp : cleaned) unicode::append_lowercase(cp, lowered);
  return lowered;
}

// BertPreTokenizer: words separated by whitespace, each punctuation character a word of its own.
std::vector<std::u32string> split_words(const std::u32string& text) {
  std::vector<std::u32string> words;
  std::u32string word;
  const auto flush = [&] {
    if (!word.empty()) words.push_back(std::move(word));
    word.clear();
  };
  for (const char32_t cp : text) {
    if (is_whitespace(cp)) {
      flush();
    } else if (is_punctuation(cp)) {
      flush();
      words.emplace_back(1, cp);
    } else {
      word.push_back(cp);
    }
  }
  flush();
  return words;
}

}  // namespace

WordPieceTokenizer WordPieceTokenizer::from_file(const std::string& path,
                                                 WordPieceOptions options) {
  const std::string content = io::InputFile(path, path).read_all(kMaxVocabBytes, "a vocabulary");
  if (content.empty()) fail(path, "empty file; expected one token per line");

  std::vector<std::string> tokens;
  std::size_t start = 0;
  while (start < content.size()) {
    std::size_t end = content.find('\n', start);
    if (end == std::string::npos) end = content.size();
    std::size_t stop = end;
    if (stop > start && content[stop - 1] == '\r') --stop;
    tokens.emplace_back(content, start, stop - start);
    start = end + 1;
  }
  return from_tokens(std::move(tokens), options, path);
}

WordPieceTokenizer WordPieceTokenizer::from_tokens(std::vector<std::string> tokens,
                                                   WordPieceOptions options,
                                                   const std::string& source) {
  if (tokens.empty()) fail(source, "empty vocabulary; expected one token per line");
  if (options.max_chars_per_word < 1) {
    fail(source, "max_chars_per_word: " + std::to_string(options.max_chars_per_word) +
                     " must be at least 1");
  }
  if (tokens.size() > static_cast<std::size_t>(INT32_MAX)) {
    fail(source, std::to_string(tokens.size()) + " tokens do not fit int32 ids");
  }
  WordPieceTokenizer tokenizer;
  tokenizer.options_ = options;
  tokenizer.ids_.reserve(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::string line = "line " + std::to_string(i + 1);
    if (tokens[i].empty()) fail(source, line + ": empty token");
    const auto [it, inserted] = tokenizer.ids_.emplace(tokens[i], static_cast<std::int32_t>(i));
    if (!inserted) {
      fail(source, line + ": duplicate token '" + tokens[i] + "' (first on line " +
                       std::to_string(it->second + 1) + ")");
    }
  }
  tokenizer.tokens_ = std::move(tokens);

  const auto required = [&](std::string_view token) {
    const std::int32_t id = tokenizer.token_to_id(token);
    if (id < 0) fail(source, "missing token '" + std::string(token) + "'");
    return id;
  };
  tokenizer.unk_id_ = required(kUnkToken);
  tokenizer.cls_id_ = required(kClsToken);
  tokenizer.sep_id_ = required(kSepToken);
  tokenizer.pad_id_ = required(kPadToken);
  for (const std::string_view token : kSpecialTokens) {
    if (tokenizer.token_to_id(token) >= 0) tokenizer.special_tokens_.emplace_back(token);
  }
  return tokenizer;
}

std::int32_t WordPieceTokenizer::token_to_id(std::string_view token) const {
  const auto it = ids_.find(token);
  return it == ids_.end() ? -1 : it->second;
}

const std::string& WordPieceTokenizer::id_to_token(std::int32_t id) const {
  if (id < 0 || id >= vocab_size()) {
    throw Error("id: " + std::to_string(id) + " is outside the vocabulary [0, " +
                std::to_string(vocab_size()) + ")");
  }
  return tokens_[static_cast<std::size_t>(id)];
}

std::string WordPieceTokenizer::normalize(std::string_view text) const {
  return unicode::encode_utf8(normalize_text(text, options_));
}

std::vector<std::int32_t> WordPieceTokenizer::encode(std::string_view text, int max_length) const {
  if (max_length < 2) {
    throw Error("max_length: " + std::to_string(max_length) +
                " is less than 2, the room [CLS] and [SEP] need");
  }
  std::vector<std::int32_t> ids{cls_id_};
  const auto max_content = static_cast<std::size_t>(max_length) - 1;  // room for [SEP]
  append_ids(text, ids, max_content);
  if (ids.size() > max_content) ids.resize(max_content);
  ids.push_back(sep_id_);
  return ids;
}

std::vector<std::string> WordPieceTokenizer::tokenize(std::string_view text) const {
  std::vector<std::int32_t> ids;
  append_ids(text, ids, std::numeric_limits<std::size_t>::max());
  std::vector<std::string> pieces;
  pieces.reserve(ids.size());
  for (const std::int32_t id : ids) pieces.push_back(tokens_[static_cast<std::size_t>(id)]);
  return pieces;
}

void WordPieceTokenizer::append_ids(std::string_view text, std::vector<std::int32_t>& ids,
                                    std::size_t limit) const {
  // Leftmost special token first; none is a prefix of another, so leftmost is unambiguous.
  // Each token's next occurrence is remembered and searched again only once the text has
  // passed it, so that a line of 200k "[PAD]" is one pass per token, not one per match.
  std::vector<std::size_t> next(special_tokens_.size(), 0);
  std::vector<bool> searched(special_tokens_.size(), false);
  std::size_t pos = 0;
  while (pos < text.size() && ids.size() < limit) {
    std::size_t found_at = std::string_view::npos, found = 0;
    for (std::size_t t = 0; t < special_tokens_.size(); ++t) {
      if (!searched[t] || (next[t] != std::string_view::npos && next[t] < pos)) {
        next[t] = text.find(special_tokens_[t], pos);
        searched[t] = true;
      }
      if (next[t] < found_at) {
        found_at = next[t];
        found = t;
      }
    }
    if (found_at == std::string_view::npos) break;
    append_segment_ids(text.substr(pos, found_at - pos), ids, limit);
    ids.push_back(token_to_id(special_tokens_[found]));
    pos = found_at + special_tokens_[found].size();
  }
  if (pos < text.size()) append_segment_ids(text.substr(pos), ids, limit);
}

void WordPieceTokenizer::append_segment_ids(std::string_view segment,
                                            std::vector<std::int32_t>& ids,
                                            std::size_t limit) const {
  // In pieces of about kPieceBytes cut just after an ASCII space, tab, CR or LF: normalisation
  // and word splitting never look across whitespace, so the ids are those of the whole
  // segment, and a long text stops being read (and held as UTF-32) once the limit is reached.
  constexpr std::size_t kPieceBytes = 1 << 16;
  while (!segment.empty() && ids.size() < limit) {
    std::size_t cut = segment.size();
    if (segment.size() > kPieceBytes) {
      const std::size_t space = segment.find_first_of(" \t\r\n", kPieceBytes);
      if (space != std::string_view::npos) cut = space + 1;
    }
    for (const std::u32string& word : split_words(normalize_text(segment.substr(0, cut), options_))) {
      append_word_ids(word, ids);
      if (ids.size() >= limit) return;
    }
    segment.remove_prefix(cut);
  }
}

void WordPieceTokenizer::append_word_ids(const std::u32string& word,
                                         std::vector<std::int32_t>& ids) const {
  if (word.size() > static_cast<std::size_t>(options_.max_chars_per_word)) {
    ids.push_back(unk_id_);
    return;
  }
  // UTF-8 of the word and the byte offset of each code point (plus the end).
  std::string utf8;
  std::vector<std::size_t> offsets;
  offsets.reserve(word.size() + 1);
  for (const char32_t cp : word) {
    offsets.push_back(utf8.size());
    unicode::append_utf8(cp, utf8);
  }
  offsets.push_back(utf8.size());

  // Greedy longest match first: at each position take the longest vocabulary piece; pieces
  // after the first carry the "##" prefix. One position with no match makes the word [UNK].
  const std::size_t first_piece = ids.size();
  std::string candidate;
  std::size_t start = 0;
  while (start < word.size()) {
    std::int32_t piece_id = -1;
    std::size_t end = word.size();
    for (; end > start; --end) {
      candidate.assign(start > 0 ? kContinuationPrefix : std::string_view());
      candidate.append(utf8, offsets[start], offsets[end] - offsets[start]);
      piece_id = token_to_id(candidate);
      if (piece_id >= 0) break;
    }
    if (piece_id < 0) {
      ids.resize(first_piece);
      ids.push_back(unk_id_);
      return;
    }
    ids.push_back(piece_id);
    start = end;
  }
}

}  // namespace qkv::models
