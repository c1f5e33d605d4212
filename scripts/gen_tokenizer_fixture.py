#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizer_minilm.tsv: all-MiniLM-L6-v2 token ids for varied texts, as
Hugging Face's fast tokenizer (the `tokenizers` package, built from the model's tokenizer.json)
produces them with max_length 128 and truncation on. The C++ WordPiece tokenizer must match
every line exactly (tests/cpp/test_wordpiece_tokenizer.cc).

    python3 scripts/gen_tokenizer_fixture.py                 # (re)writes the fixture
    python3 scripts/gen_tokenizer_fixture.py --unicode-diff  # also counts code points on which
                                                             # tokenizers and our Unicode 14
                                                             # tables disagree

Needs nothing installed: it fetches the model with scripts/fetch_model.sh, creates the venv
.cache/venv-fixtures with `tokenizers` (no torch) and re-runs itself there.

Fixture format (tab-separated, UTF-8, one case per line, lines starting with '#' are comments):
    ids<TAB>text
ids are decimal, space-separated, [CLS] and [SEP] included; text is a JSON string literal with
non-ASCII and control characters written as \\uXXXX escapes (surrogate pairs above U+FFFF), so
the file is pure ASCII and a tab or newline in a text never breaks the line format.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".cache" / "venv-fixtures"
OUT = ROOT / "tests" / "fixtures" / "tokenizer_minilm.tsv"
TOKENIZERS_VERSION = "0.23.3"
MAX_LENGTH = 128

LONG_TEXT = (
    "Attention is all you need: the Transformer replaces recurrence with self-attention, "
    "letting every position look at every other one in a single step. Sentence embedding "
    "models such as all-MiniLM-L6-v2 average the final hidden states into one vector per "
    "sentence, and those vectors are compared with cosine similarity for semantic search, "
    "clustering and deduplication. Because the model was trained with sequences of at most "
    "128 word pieces, longer inputs are truncated, which is what this deliberately long "
    "paragraph checks: everything after the limit must disappear, and the final [SEP] must "
    "still be there at position 127.")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé",
    "Straße Größe Fußball STRASSE",
    "ΑΘΗΝΑ Ελληνικά γλώσσα",
    "Москва — столица России. Йогурт и ёж.",
    "我爱北京天安门",
    "日本語のテキスト、カタカナとひらがな。ガギグゲゴ",
    "한국어 텍스트입니다",
    "I \u2764\ufe0f emoji \U0001F600\U0001F389\U0001F44D\U0001F3FD",
    "!!!???...",
    "https://example.com/path/to/page?query=1&x=y#fragment",
    "user.name+tag@example.org",
    "3.14159 1,000,000 42% $19.99 12:30pm 2024-01-15T10:30:00Z",
    "MiXeD CaSe WoRdS iPhone McDonald's",
    "tabs\tand\nnewlines\r\nhere",
    "\x00\x01control\x07chars\x1b[0m\x7fend",
    "zero\u200bwidth\u200cjoiner\u200d and soft\u00adhyphen",
    LONG_TEXT,
    "a" * 101,
    "supercalifragilistic" * 5,
    "",
    "     ",
    "\t\n  \u3000\u00a0",
    "hello [SEP] world [MASK] and [CLS][PAD]",
    "[cls] [unk] lowercase are not special",
    "don't won't it's",
    "\u00abGuillemets\u00bb \u201eAnf\u00fchrungszeichen\u201c \u201cquotes\u201d \u2018single\u2019",
    "em\u2014dash en\u2013dash ellipsis\u2026 bullet\u2022",
    "\u0130stanbul \u0131i",
    "\u03a3\u038a\u03a3\u03a5\u03a6\u039f\u03a3",
    "\u01c5 \u01c8 \u01cb \ufb01 \ufb00",
    "\u00c5ngstr\u00f6m \u00d8re \u00c6sir \u0152uvre",
    "x\u00b2 H\u2082O \u00bd \u2460 \u2122 \u00a9",
    "\uff26\uff55\uff4c\uff4c\uff57\uff49\uff44\uff54\uff48\u3000\uff54\uff45\uff58\uff54",
    "\u05e2\u05d1\u05e8\u05d9\u05ea \u0627\u0644\u0639\u064e\u0631\u064e\u0628\u0650\u064a\u0651\u0629",
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u092d\u093e\u0937\u093e",
    "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22",
    "unaffable unbelievable antidisestablishmentarianism",
    "C++ & C# are languages; so is F#.",
    "e-mail self-driving state-of-the-art",
    "\u0301\u0300 combining marks alone and e\u0301 decomposed",
    "CJK compatibility \U0002F800 \uf900 and extension B \U00020000\U00020001",
    "extension E \U0002B820\U0002B821 and \U0002B920",
    "tab\u000bvertical\u000cform\u0085next\u2028line\u2029para",
    "\ufffd replacement char and \ue000 private use",
    "\u00dcn\u00efc\u00f6d\u00e9 \u00dcBER-TEST \u00fcber",
    "ThisIsAVeryLongCamelCaseIdentifierWithoutSpaces",
    "#hashtag @mention $TICKER ^caret `tick` |pipe| ~tilde {brace}",
    "\u6f22\u5b57" * 80,
    "word " * 200,
]


def ensure_venv():
    """Re-runs this script inside .cache/venv-fixtures (created on first use)."""
    try:
        import tokenizers  # noqa: F401
        return
    except ImportError:
        pass
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet",
                    f"tokenizers=={TOKENIZERS_VERSION}"], check=True)
    os.execv(str(python), [str(python), __file__, *sys.argv[1:]])


def model_dir():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_model.sh")], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()
    return Path(out[-1])


def unicode_diff():
    """Code points where tokenizers' normaliser or punctuation test differs from what our Unicode
    tables (Python's unicodedata) predict. Prints counts by general category."""
    import collections
    import unicodedata as ud
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    pre_tokenizer = BertPreTokenizer()
    cjk = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
           (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)]

    def expected(c):
        cat = ud.category(c)
        if c in "\x00\ufffd" or (c not in "\t\n\r" and cat in ("Cc", "Cf", "Co", "Cs")):
            return ""
        if c in "\t\n\r" or cat in ("Zs", "Zl", "Zp"):
            return " "
        if any(lo <= ord(c) <= hi for lo, hi in cjk):
            c = f" {c} "
        s = "".join(x for x in ud.normalize("NFD", c) if ud.category(x) != "Mn")
        return "".join(x.lower() for x in s)

    def is_punct(c):
        o = ord(c)
        return (33 <= o <= 47 or 58 <= o <= 64 or 91 <= o <= 96 or 123 <= o <= 126
                or ud.category(c).startswith("P"))

    norm_diff, punct_diff = collections.Counter(), collections.Counter()
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        e = expected(c)
        if normalizer.normalize_str(c) != e:
            norm_diff[ud.category(c)] += 1
        if len(e) == 1 and e != " ":
            split = len(pre_tokenizer.pre_tokenize_str("a" + e + "b")) == 3
            if split != is_punct(e):
                punct_diff[ud.category(e)] += 1
    print(f"Unicode {ud.unidata_version} vs tokenizers: normaliser differs on "
          f"{sum(norm_diff.values())} code points {dict(norm_diff)}; punctuation differs on "
          f"{sum(punct_diff.values())} {dict(punct_diff)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unicode-diff", action="store_true")
    args = parser.parse_args()
    ensure_venv()
    import tokenizers

    directory = model_dir()
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=MAX_LENGTH)
    lines = [
        "# all-MiniLM-L6-v2 token ids from tokenizers " + tokenizers.__version__ +
        f" (tokenizer.json, max_length {MAX_LENGTH}, truncation on, no padding).",
        "# Written by scripts/gen_tokenizer_fixture.py; format: ids<TAB>text as a JSON string.",
    ]
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        lines.append(" ".join(map(str, ids)) + "\t" + json.dumps(text, ensure_ascii=True))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n", encoding="ascii")
    print(f"wrote {OUT}: {len(TEXTS)} texts (tokenizers {tokenizers.__version__})")
    if args.unicode_diff:
        unicode_diff()


if __name__ == "__main__":
    main()
