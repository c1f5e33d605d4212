// vocab.txt and WordPiece on arbitrary UTF-8 (and not): the input is a vocabulary, a NUL byte,
// then a text. A vocabulary either loads or throws qkv::Error; a loaded one encodes any text
// into [CLS] .. [SEP] of at most max_length ids, each inside the vocabulary.
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/error.h"
#include "qkv/models/wordpiece_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace qkv::models;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::size_t split = input.find('\0');
  const std::string_view vocab_text = input.substr(0, split);
  const std::string_view text = split == std::string_view::npos ? "" : input.substr(split + 1);
  std::vector<std::string> tokens;
  std::size_t start = 0;
  while (start < vocab_text.size()) {
    std::size_t end = vocab_text.find('\n', start);
    if (end == std::string_view::npos) end = vocab_text.size();
    tokens.emplace_back(vocab_text.substr(start, end - start));
    start = end + 1;
  }
  // The four tokens every BERT vocabulary has, so that most inputs reach the tokenizer.
  for (const char* special : {"[PAD]", "[UNK]", "[CLS]", "[SEP]"}) tokens.emplace_back(special);
  for (const bool lower : {true, false}) {
    try {
      const WordPieceTokenizer t =
          WordPieceTokenizer::from_tokens(tokens, {.lower_case = lower, .strip_accents = lower},
                                          "vocab.txt");
      const std::vector<std::int32_t> ids = t.encode(text, 64);
      if (ids.size() < 2 || ids.size() > 64 || ids.front() != t.cls_id() ||
          ids.back() != t.sep_id()) {
        std::abort();
      }
      for (const std::int32_t id : ids) {
        if (id < 0 || id >= t.vocab_size()) std::abort();
      }
    } catch (const qkv::Error&) {
    }
  }
  return 0;
}
