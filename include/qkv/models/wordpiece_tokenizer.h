// The BERT WordPiece tokenizer (vocab.txt), matching Hugging Face's BertTokenizerFast
// (tokenizers' BertNormalizer + BertPreTokenizer + WordPiece + [CLS] $A [SEP]) for
// bert-base-uncased style models such as all-MiniLM-L6-v2. Written from the tokenizers
// documentation and behaviour; no code is shared. Details and deviations: docs/tokenizer.md.
//
//   text (UTF-8) -> split off special tokens ("[CLS]" etc. written in the text stay one token)
//                -> clean: drop NUL, U+FFFD and control characters (Cc, Cf, Co, Cs but not
//                   \t \n \r); whitespace (\t \n \r, Zs, Zl, Zp) -> ' '
//                -> CJK ideographs get a space either side
//                -> strip accents: NFD, then drop nonspacing marks (Mn)
//                -> lower-case (full per-code-point mapping)
//                -> words: split on whitespace, every punctuation character its own word
//                -> WordPiece: greedy longest match first, "##" on continuation pieces; a word
//                   longer than 100 code points or with no match is one [UNK]
//                -> [CLS] ids [SEP], truncated to max_length (specials included)
//
// Invalid UTF-8 is decoded as Python's errors="replace" would; the U+FFFD it produces is then
// removed by the cleaning step, so invalid bytes simply disappear.
//
// Errors throw qkv::Error naming the file or argument, e.g. "vocab.txt: missing token '[UNK]'".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace qkv::models {

struct WordPieceOptions {
  bool lower_case = true;     // do_lower_case
  bool strip_accents = true;  // HF's strip_accents=None means "same as lower_case"
  bool split_cjk = true;      // tokenize_chinese_chars
  int max_chars_per_word = 100;
};

class WordPieceTokenizer {
 public:
  // Reads vocab.txt: one token per line, id = line number (0-based). `\n` or `\r\n` line ends;
  // a final line end is optional. Throws qkv::Error (message starts with the path) if the file
  // cannot be read, is empty, has an empty or duplicate token, or lacks [UNK], [CLS], [SEP] or
  // [PAD].
  static WordPieceTokenizer from_file(const std::string& path, WordPieceOptions options = {});
  // Same checks on tokens already in memory; `source` names them in error messages.
  static WordPieceTokenizer from_tokens(std::vector<std::string> tokens,
                                        WordPieceOptions options = {},
                                        const std::string& source = "vocab");

  // ids: [CLS] t_1 .. t_n [SEP] with n <= max_length - 2 (the first tokens are kept).
  // Throws qkv::Error if max_length < 2.
  std::vector<std::int32_t> encode(std::string_view text, int max_length) const;
  // The WordPiece tokens of `text` as strings, without [CLS]/[SEP] and without truncation.
  std::vector<std::string> tokenize(std::string_view text) const;

  // The text after BertNormalizer (cleaning, CJK spacing, accents, case), as UTF-8.
  std::string normalize(std::string_view text) const;

  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  // -1 when `token` is not in the vocabulary.
  std::int32_t token_to_id(std::string_view token) const;
  // Throws qkv::Error if `id` is out of range.
  const std::string& id_to_token(std::int32_t id) const;
  std::int32_t unk_id() const { return unk_id_; }
  std::int32_t cls_id() const { return cls_id_; }
  std::int32_t sep_id() const { return sep_id_; }
  std::int32_t pad_id() const { return pad_id_; }

 private:
  WordPieceTokenizer() = default;
  // Appends the ids of `text` (special tokens written in it included) to `ids`, stopping once
  // `ids` holds `limit` entries: the rest of a text that truncation drops is never tokenised.
  // Linear in the part of the text it reads.
  void append_ids(std::string_view text, std::vector<std::int32_t>& ids, std::size_t limit) const;
  // Appends the ids of a text segment without special tokens, up to `limit` as above.
  void append_segment_ids(std::string_view segment, std::vector<std::int32_t>& ids,
                          std::size_t limit) const;
  // Appends the WordPiece ids of one word (UTF-8, already normalised).
  void append_word_ids(const std::u32string& word, std::vector<std::int32_t>& ids) const;

  struct StringHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };

  WordPieceOptions options_;
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, std::int32_t, StringHash, std::equal_to<>> ids_;
  std::vector<std::string> special_tokens_;  // matched verbatim in input text
  std::int32_t unk_id_ = -1;
  std::int32_t cls_id_ = -1;
  std::int32_t sep_id_ = -1;
  std::int32_t pad_id_ = -1;
};

}  // namespace qkv::models
