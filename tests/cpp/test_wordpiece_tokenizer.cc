// Tests of the WordPiece tokenizer (src/models/wordpiece_tokenizer.h) and its Unicode helpers
// (src/models/unicode_text.h): unit tests on a tiny inline vocabulary, and a parity test against
// Hugging Face's fast tokenizer for all-MiniLM-L6-v2 (tests/fixtures/tokenizer_minilm.tsv,
// written by scripts/gen_tokenizer_fixture.py), which needs the model's vocab.txt:
//   QKV_MODEL_DIR=$(scripts/fetch_model.sh) build/tests/qkv_tests --gtest_filter='*WordPiece*'
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "models/unicode_text.h"
#include "qkv/models/wordpiece_tokenizer.h"
#include "qkv/error.h"

namespace qkv::models {
namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;
using Strings = std::vector<std::string>;

const Strings kTinyVocab = {
    "[PAD]", "[UNK]",  "[CLS]",    "[SEP]", "[MASK]", "un",       "##aff", "##able", "aff",
    "able",  "hello",  "world",    "cafe",  "naive",  "resume",   ",",     "!",      ".",
    "$",     "\u00ab", "\u00bb",   "[",     "]",      "sep",      "a",     "##a",    "##aa",
    "中",    "国",     "istanbul", "ß",     "\u03c3", "##\u03c3",
};

WordPieceTokenizer tiny(WordPieceOptions options = {}) {
  return WordPieceTokenizer::from_tokens(kTinyVocab, options, "tiny");
}

// The exception message `fn` throws as qkv::Error ("" if it throws nothing).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(WordPieceTokenizer, GreedyLongestMatchFirst) {
  const WordPieceTokenizer t = tiny();
  EXPECT_EQ(t.tokenize("unaffable"), (Strings{"un", "##aff", "##able"}));
  EXPECT_EQ(t.tokenize("affable able"), (Strings{"aff", "##able", "able"}));
  // Longest piece first: "aaaa" is a ##aa ##a, not a ##a ##a ##a.
  EXPECT_EQ(t.tokenize("aaaa"), (Strings{"a", "##aa", "##a"}));
  EXPECT_EQ(t.tokenize("aaa"), (Strings{"a", "##aa"}));
}

TEST(WordPieceTokenizer, UnknownWordIsOneUnk) {
  const WordPieceTokenizer t = tiny();
  // "un" matches but the rest does not: the whole word is [UNK], no partial pieces.
  EXPECT_EQ(t.tokenize("unxyz"), (Strings{"[UNK]"}));
  EXPECT_EQ(t.tokenize("hello xyz world"), (Strings{"hello", "[UNK]", "world"}));
  // A continuation piece is never matched without its "##": "affaff" has no "##aff" + "aff".
  EXPECT_EQ(t.tokenize("ableaff"), (Strings{"able", "##aff"}));
  EXPECT_EQ(t.tokenize("affun"), (Strings{"[UNK]"}));
}

TEST(WordPieceTokenizer, WordLongerThanLimitIsUnk) {
  const WordPieceTokenizer t = tiny();
  const std::vector<std::string> hundred = t.tokenize(std::string(100, 'a'));
  ASSERT_EQ(hundred.size(), 51u);  // a, 49 x ##aa, ##a
  EXPECT_EQ(hundred.front(), "a");
  EXPECT_EQ(hundred.back(), "##a");
  EXPECT_EQ(t.tokenize(std::string(101, 'a')), (Strings{"[UNK]"}));
  // The limit counts code points, not bytes: 60 two-byte characters are within 100.
  std::string sigmas;
  for (int i = 0; i < 60; ++i) sigmas += "\u03c3";
  EXPECT_EQ(t.tokenize(sigmas).size(), 60u);
  EXPECT_EQ(tiny({.max_chars_per_word = 3}).tokenize("aaaa"), (Strings{"[UNK]"}));
}

TEST(WordPieceTokenizer, PunctuationIsSplitOff) {
  const WordPieceTokenizer t = tiny();
  EXPECT_EQ(t.tokenize("hello,world!"), (Strings{"hello", ",", "world", "!"}));
  EXPECT_EQ(t.tokenize("...$"), (Strings{".", ".", ".", "$"}));  // '$' is ASCII punctuation
  EXPECT_EQ(t.tokenize("\u00abhello\u00bb"), (Strings{"\u00ab", "hello", "\u00bb"}));  // Pi, Pf
}

TEST(WordPieceTokenizer, CjkIdeographsAreSeparateWords) {
  const WordPieceTokenizer t = tiny();
  EXPECT_EQ(t.tokenize("中国hello"), (Strings{"中", "国", "hello"}));
  EXPECT_EQ(tiny({.split_cjk = false}).tokenize("中国"), (Strings{"[UNK]"}));
  // CJK compatibility ideograph U+F9B2 decomposes (NFD) to U+96F6, not in the vocabulary.
  EXPECT_EQ(t.normalize("\uf9b2"), " \u96f6 ");
}

TEST(WordPieceTokenizer, LowerCaseAndStripAccents) {
  const WordPieceTokenizer t = tiny();
  EXPECT_EQ(t.tokenize("Café NAÏVE résumé"), (Strings{"cafe", "naive", "resume"}));
  // Accents are stripped before lower-casing (tokenizers' order): U+0130 -> I -> i.
  EXPECT_EQ(t.tokenize("\u0130STANBUL"), (Strings{"istanbul"}));
  EXPECT_EQ(t.tokenize("\u00df"), (Strings{"ß"}));  // no case folding: ß stays ß
  // Per-code-point lower-casing: a final capital sigma gives σ, not ς.
  EXPECT_EQ(t.normalize("\u03a3\u03a3"), "\u03c3\u03c3");
  const WordPieceTokenizer cased = tiny({.lower_case = false, .strip_accents = false});
  EXPECT_EQ(cased.tokenize("Café hello"), (Strings{"[UNK]", "hello"}));
  EXPECT_EQ(cased.normalize("Café"), "Café");
  const WordPieceTokenizer lower_only = tiny({.lower_case = true, .strip_accents = false});
  EXPECT_EQ(lower_only.normalize("CAFÉ"), "café");
  EXPECT_EQ(tiny({.lower_case = false}).normalize("CAFÉ"), "CAFE");
}

TEST(WordPieceTokenizer, WhitespaceAndControlCleanup) {
  const WordPieceTokenizer t = tiny();
  // Controls (Cc, Cf) vanish even inside a word; \t \n \r and Unicode spaces separate words.
  EXPECT_EQ(t.tokenize("\0hel\x01lo\u200b\t\nwor\u00adld\u00a0!\u3000"s),
            (Strings{"hello", "world", "!"}));
  EXPECT_EQ(t.normalize("a\u2028b\x0b"), "a b");
  EXPECT_TRUE(t.tokenize("").empty());
  EXPECT_TRUE(t.tokenize(" \t\r\n ").empty());
  // Invalid UTF-8 decodes to U+FFFD, which cleaning removes.
  EXPECT_EQ(t.tokenize("hel\xfflo wor\xe0\x80ld"), (Strings{"hello", "world"}));
}

TEST(WordPieceTokenizer, SpecialTokensInTextAreKept) {
  const WordPieceTokenizer t = tiny();
  EXPECT_EQ(t.tokenize("hello[SEP]world [MASK]"), (Strings{"hello", "[SEP]", "world", "[MASK]"}));
  // Matched verbatim only: the lower-case spelling is ordinary text.
  EXPECT_EQ(t.tokenize("[sep]"), (Strings{"[", "sep", "]"}));
}

TEST(WordPieceTokenizer, EncodeAddsSpecialsAndTruncates) {
  const WordPieceTokenizer t = tiny();
  const std::int32_t cls = t.cls_id(), sep = t.sep_id();
  const std::int32_t hello = t.token_to_id("hello"), world = t.token_to_id("world");
  EXPECT_EQ(cls, 2);
  EXPECT_EQ(sep, 3);
  EXPECT_EQ(t.encode("", 8), (std::vector<std::int32_t>{cls, sep}));
  EXPECT_EQ(t.encode("hello world", 8), (std::vector<std::int32_t>{cls, hello, world, sep}));
  EXPECT_EQ(t.encode("hello world hello", 4), (std::vector<std::int32_t>{cls, hello, world, sep}));
  EXPECT_EQ(t.encode("hello world", 2), (std::vector<std::int32_t>{cls, sep}));
  EXPECT_EQ(error_of([&] { t.encode("hello", 1); }),
            "max_length: 1 is less than 2, the room [CLS] and [SEP] need");
}

TEST(WordPieceTokenizer, ArbitraryBytesAreSafe) {
  // Random bytes (mostly invalid UTF-8) never throw and always give [CLS] .. [SEP].
  const WordPieceTokenizer t = tiny();
  std::uint32_t state = 12345;
  for (int round = 0; round < 2000; ++round) {
    std::string bytes;
    const int length = round % 67;
    for (int i = 0; i < length; ++i) {
      state = state * 1664525u + 1013904223u;  // LCG; any fixed sequence will do
      bytes.push_back(static_cast<char>(state >> 24));
    }
    const std::vector<std::int32_t> ids = t.encode(bytes, 16);
    ASSERT_GE(ids.size(), 2u);
    ASSERT_LE(ids.size(), 16u);
    ASSERT_EQ(ids.front(), t.cls_id());
    ASSERT_EQ(ids.back(), t.sep_id());
  }
}

// Texts longer than the 64 KiB pieces the tokenizer normalises at a time (cut after ASCII
// whitespace): the ids are those of each line tokenised on its own, in order, whatever falls
// on a cut; and encode() stops reading at its limit (issue 18: a 200 MB line took 3.4 GB).
TEST(WordPieceTokenizer, LongTextsAreTokenisedPieceByPiece) {
  const WordPieceTokenizer t = tiny();
  const Strings lines = {"Hello, world! ", "unaffable caf\u00e9\t", "\u4e2d\u56fd naive. ",
                         "aaaaa [SEP] resume\n", "ISTANBUL \u00df\u03a3 "};
  std::string text;
  Strings expected;
  for (int i = 0; text.size() < 3 * (1 << 16) + 123; ++i) {
    const std::string& line = lines[i % lines.size()];
    text += line;
    for (std::string& piece : t.tokenize(line)) expected.push_back(std::move(piece));
  }
  EXPECT_EQ(t.tokenize(text), expected);
  // A run longer than a piece without whitespace is still one word.
  const std::string run(100000, 'a');
  EXPECT_EQ(t.tokenize("hello " + run + " world"), (Strings{"hello", "[UNK]", "world"}));
  // encode() truncates to the same ids as the text's first pieces give.
  std::string huge;
  while (huge.size() < (64u << 20)) huge += "hello world ";
  const std::vector<std::int32_t> ids = t.encode(huge, 9);
  EXPECT_EQ(ids, t.encode("hello world hello world hello world hello", 9));
}

TEST(WordPieceTokenizer, SpecialTokenRunsAreLinear) {
  // 200k "[PAD]" and a token that never occurs ("[MASK]"): each token is searched for once
  // per occurrence, not once per match of another (issue 18: 28 s for 256 KB).
  const WordPieceTokenizer t = tiny();
  std::string pads;
  for (int i = 0; i < 200000; ++i) pads += "[PAD]";
  const std::vector<std::string> pieces = t.tokenize(pads + "hello");
  ASSERT_EQ(pieces.size(), 200001u);
  EXPECT_EQ(pieces.front(), "[PAD]");
  EXPECT_EQ(pieces.back(), "hello");
  EXPECT_EQ(t.encode(pads, 4).size(), 4u);
}

TEST(WordPieceTokenizer, TokenIdLookups) {
  const WordPieceTokenizer t = tiny();
  EXPECT_EQ(t.vocab_size(), static_cast<int>(kTinyVocab.size()));
  EXPECT_EQ(t.token_to_id("##aff"), 6);
  EXPECT_EQ(t.token_to_id("missing"), -1);
  EXPECT_EQ(t.id_to_token(6), "##aff");
  EXPECT_EQ(t.unk_id(), 1);
  EXPECT_EQ(t.pad_id(), 0);
  EXPECT_EQ(error_of([&] { t.id_to_token(-1); }), "id: -1 is outside the vocabulary [0, 33)");
}

TEST(WordPieceTokenizer, VocabErrorsNameTheProblem) {
  Strings no_unk = kTinyVocab;
  no_unk.erase(no_unk.begin() + 1);
  EXPECT_EQ(error_of([&] { WordPieceTokenizer::from_tokens(no_unk, {}, "vocab.txt"); }),
            "vocab.txt: missing token '[UNK]'");
  Strings duplicate = kTinyVocab;
  duplicate.push_back("hello");
  EXPECT_EQ(error_of([&] { WordPieceTokenizer::from_tokens(duplicate, {}, "vocab.txt"); }),
            "vocab.txt: line 34: duplicate token 'hello' (first on line 11)");
  Strings blank = kTinyVocab;
  blank.insert(blank.begin() + 5, "");
  EXPECT_EQ(error_of([&] { WordPieceTokenizer::from_tokens(blank, {}, "vocab.txt"); }),
            "vocab.txt: line 6: empty token");
  EXPECT_EQ(error_of([&] { WordPieceTokenizer::from_tokens({}, {}, "vocab.txt"); }),
            "vocab.txt: empty vocabulary; expected one token per line");
  EXPECT_EQ(error_of([&] { tiny({.max_chars_per_word = 0}); }),
            "tiny: max_chars_per_word: 0 must be at least 1");
}

class WordPieceFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("qkv_wordpiece_test_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& content) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << content;
    return path;
  }
  fs::path dir_;
};

TEST_F(WordPieceFileTest, ReadsLfAndCrlfFiles) {
  std::string lf, crlf;
  for (const std::string& token : kTinyVocab) {
    lf += token + "\n";
    crlf += token + "\r\n";
  }
  for (const std::string& content : {lf, crlf, lf.substr(0, lf.size() - 1)}) {
    const WordPieceTokenizer t = WordPieceTokenizer::from_file(write("vocab.txt", content));
    EXPECT_EQ(t.vocab_size(), static_cast<int>(kTinyVocab.size()));
    EXPECT_EQ(t.tokenize("unaffable!"), (Strings{"un", "##aff", "##able", "!"}));
    EXPECT_EQ(t.id_to_token(t.vocab_size() - 1), "##\u03c3");
  }
}

TEST_F(WordPieceFileTest, FileErrorsNameThePath) {
  const std::string empty = write("vocab.txt", "");
  EXPECT_EQ(error_of([&] { WordPieceTokenizer::from_file(empty); }),
            empty + ": empty file; expected one token per line");
  const std::string missing = (dir_ / "nope.txt").string();
  EXPECT_EQ(error_of([&] { WordPieceTokenizer::from_file(missing); }),
            missing + ": cannot open: No such file or directory");
  // A FIFO without a writer is refused at once, not waited on (issue 18).
  const std::string fifo = (dir_ / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(error_of([&] { WordPieceTokenizer::from_file(fifo); }),
            fifo + ": not a regular file");
  const std::string no_pad = write("vocab.txt", "[UNK]\n[CLS]\n[SEP]\nhello\n");
  EXPECT_EQ(error_of([&] { WordPieceTokenizer::from_file(no_pad); }),
            no_pad + ": missing token '[PAD]'");
}

TEST(UnicodeText, DecodeUtf8ReplacesInvalidSequencesLikePython) {
  using unicode::decode_utf8;
  EXPECT_EQ(decode_utf8("a\u00e9\u4e2d\U0001F600"), U"a\u00e9\u4e2d\U0001F600");
  // Each maximal invalid subsequence is one U+FFFD (Python's errors="replace").
  EXPECT_EQ(decode_utf8("\xe0\x80"), U"\ufffd\ufffd");  // overlong lead + stray byte
  EXPECT_EQ(decode_utf8("\xf0\x9f\x98"), U"\ufffd");    // truncated 4-byte sequence
  EXPECT_EQ(decode_utf8("\xf0\x9f\x98x"), U"\ufffdx");
  EXPECT_EQ(decode_utf8("\xed\xa0\x80"), U"\ufffd\ufffd\ufffd");            // surrogate U+D800
  EXPECT_EQ(decode_utf8("\xf4\x90\x80\x80"), U"\ufffd\ufffd\ufffd\ufffd");  // > U+10FFFF
  EXPECT_EQ(decode_utf8("\xc0\xaf\xff"), U"\ufffd\ufffd\ufffd");
  EXPECT_EQ(unicode::encode_utf8(U"a\u00e9\u4e2d\U0001F600"), "a\u00e9\u4e2d\U0001F600");
}

TEST(UnicodeText, NfdAndLowercase) {
  EXPECT_EQ(unicode::nfd(U"\u00e9"), U"e\u0301");
  EXPECT_EQ(unicode::nfd(U"\u1e69"), U"s\u0323\u0307");       // recursive: ṩ -> ṡ + dot below
  EXPECT_EQ(unicode::nfd(U"\ud55c"), U"\u1112\u1161\u11ab");  // Hangul 한, algorithmic
  EXPECT_EQ(unicode::nfd(U"\uac00"), U"\u1100\u1161");        // 가: no trailing consonant
  // Canonical ordering: dot below (ccc 220) before acute (ccc 230).
  EXPECT_EQ(unicode::nfd(U"a\u0301\u0323"), U"a\u0323\u0301");
  std::u32string lower;
  for (const char32_t cp : U"AZ\u00c0\u0130\u03a3\u0410\u1e9e\uff21\U00010400") {
    if (cp != 0) unicode::append_lowercase(cp, lower);
  }
  EXPECT_EQ(lower, U"az\u00e0i\u0307\u03c3\u0430\u00df\uff41\U00010428");
  EXPECT_EQ(unicode::char_class(U'\u0301'), unicode::CharClass::kNonspacingMark);
  EXPECT_EQ(unicode::char_class(U'\u00bf'), unicode::CharClass::kPunctuation);
  EXPECT_EQ(unicode::char_class(U'\u200b'), unicode::CharClass::kControl);
  EXPECT_EQ(unicode::char_class(U'\u3000'), unicode::CharClass::kWhitespace);
  EXPECT_EQ(unicode::char_class(U'\u0378'), unicode::CharClass::kOther);  // unassigned
}

// ---------------------------------------------------------------------------------------------
// Parity with Hugging Face's fast tokenizer on the committed fixture.

// Decodes the JSON string literal `json` (quotes included) as the fixture writes it: ASCII with
// \uXXXX escapes, surrogate pairs above U+FFFF.
std::string parse_json_string(const std::string& json) {
  if (json.size() < 2 || json.front() != '"' || json.back() != '"') {
    throw Error("fixture: not a JSON string: " + json);
  }
  std::string out;
  const auto hex4 = [&](std::size_t at) {
    if (at + 4 > json.size() - 1) throw Error("fixture: short \\u escape in " + json);
    return static_cast<char32_t>(std::stoul(json.substr(at, 4), nullptr, 16));
  };
  for (std::size_t i = 1; i + 1 < json.size(); ++i) {
    if (json[i] != '\\') {
      out.push_back(json[i]);
      continue;
    }
    const char e = json[++i];
    switch (e) {
      case 'n':
        out.push_back('\n');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'u': {
        char32_t cp = hex4(i + 1);
        i += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF && json.compare(i + 1, 2, "\\u") == 0) {
          cp = 0x10000 + ((cp - 0xD800) << 10) + (hex4(i + 3) - 0xDC00);
          i += 6;
        }
        unicode::append_utf8(cp, out);
        break;
      }
      default:
        out.push_back(e);  // \" \\ \/
    }
  }
  return out;
}

TEST(WordPieceTokenizerParity, MatchesHuggingFaceFastTokenizerOnMiniLM) {
  const char* model_dir = std::getenv("QKV_MODEL_DIR");
  if (model_dir == nullptr || *model_dir == '\0') {
    GTEST_SKIP() << "set QKV_MODEL_DIR=$(scripts/fetch_model.sh) to run the parity test";
  }
  const WordPieceTokenizer t =
      WordPieceTokenizer::from_file((fs::path(model_dir) / "vocab.txt").string());
  ASSERT_EQ(t.vocab_size(), 30522);

  const fs::path fixture = fs::path(QKV_SOURCE_DIR) / "tests/fixtures/tokenizer_minilm.tsv";
  std::ifstream in(fixture);
  ASSERT_TRUE(in) << "cannot open " << fixture;
  int cases = 0, matches = 0;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::size_t tab = line.find('\t');
    ASSERT_NE(tab, std::string::npos) << "fixture line without a tab: " << line;
    std::vector<std::int32_t> expected;
    std::istringstream ids(line.substr(0, tab));
    for (std::int32_t id; ids >> id;) expected.push_back(id);
    const std::string text = parse_json_string(line.substr(tab + 1));
    const std::vector<std::int32_t> actual = t.encode(text, 128);
    ++cases;
    if (actual == expected) {
      ++matches;
    } else {
      ADD_FAILURE() << "text " << line.substr(tab + 1) << "\n  expected "
                    << ::testing::PrintToString(expected) << "\n  actual   "
                    << ::testing::PrintToString(actual);
    }
  }
  EXPECT_GE(cases, 40);
  EXPECT_EQ(matches, cases);
  std::printf("[ parity   ] %d of %d fixture texts match exactly\n", matches, cases);
}

}  // namespace
}  // namespace qkv::models
