"""End-to-end tests of `qkv embed` (DESIGN.md section 4).

1. A tiny random BERT written here (config.json, vocab.txt, model.safetensors, pooling and
   modules files) against this file's own float64 numpy BERT: pooling modes, normalisation,
   batching with padding (texts of different lengths in one batch), truncation, --input files.
2. The real all-MiniLM-L6-v2 (QKV_MODEL_DIR, set by scripts/test.sh) against the reference
   embeddings that scripts/gen_embedding_fixture.py made with sentence-transformers + torch.
3. Broken model folders and bad options: exit 2, one 'qkv: error:' line, no output file.
"""

import json
import math
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "embeddings_minilm.json"

# ---------------------------------------------------------------------------------------------
# A tiny BERT

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away", "big", "small",
         "red", "blue", "house", "tree", "sun", "moon", "star", "sky"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","] + WORDS + ["##s", "##ing"]
CONFIG = dict(vocab_size=len(VOCAB), hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=12, max_position_embeddings=16, type_vocab_size=2,
              layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0,
              position_embedding_type="absolute", model_type="bert")


def tiny_weights(rng, config):
    e, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    def normal(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    w = {"embeddings.word_embeddings.weight": normal(v, e),
         "embeddings.position_embeddings.weight": normal(config["max_position_embeddings"], e),
         "embeddings.token_type_embeddings.weight": normal(config["type_vocab_size"], e),
         "embeddings.LayerNorm.weight": 1 + normal(e, scale=0.1),
         "embeddings.LayerNorm.bias": normal(e, scale=0.1)}
    for i in range(config["num_hidden_layers"]):
        at = f"encoder.layer.{i}."
        for name in ["query", "key", "value"]:
            w[at + f"attention.self.{name}.weight"] = normal(e, e)
            w[at + f"attention.self.{name}.bias"] = normal(e, scale=0.1)
        w[at + "attention.output.dense.weight"] = normal(e, e)
        w[at + "attention.output.dense.bias"] = normal(e, scale=0.1)
        w[at + "attention.output.LayerNorm.weight"] = 1 + normal(e, scale=0.1)
        w[at + "attention.output.LayerNorm.bias"] = normal(e, scale=0.1)
        w[at + "intermediate.dense.weight"] = normal(f, e)
        w[at + "intermediate.dense.bias"] = normal(f, scale=0.1)
        w[at + "output.dense.weight"] = normal(e, f)
        w[at + "output.dense.bias"] = normal(e, scale=0.1)
        w[at + "output.LayerNorm.weight"] = 1 + normal(e, scale=0.1)
        w[at + "output.LayerNorm.bias"] = normal(e, scale=0.1)
    return w


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        dtype = {np.float32: "F32", np.int64: "I64"}[array.dtype.type]
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def make_model(directory, rng, pooling=("mean",), normalize=True, config=None):
    config = dict(CONFIG if config is None else config)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    weights = tiny_weights(rng, config)
    write_safetensors(directory / "model.safetensors", weights)
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": config["hidden_size"],
        "pooling_mode_cls_token": "cls" in pooling, "pooling_mode_max_tokens": "max" in pooling,
        "pooling_mode_mean_tokens": "mean" in pooling}))
    modules = [{"type": "sentence_transformers.models.Transformer"},
               {"type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    return weights


def token_ids(text, max_length):
    """The tiny vocabulary's WordPiece ids for texts of lower-case vocabulary words, '.' and
    ',' separated by spaces, and words ending in a '##' suffix (cats, running)."""
    ids = []
    for word in text.split():
        if word in VOCAB:
            ids.append(VOCAB.index(word))
        else:
            for suffix in ["s", "ing"]:
                if word.endswith(suffix) and word[:-len(suffix)] in VOCAB:
                    ids += [VOCAB.index(word[:-len(suffix)]), VOCAB.index("##" + suffix)]
                    break
            else:
                ids.append(VOCAB.index("[UNK]"))
    return [2] + ids[:max_length - 2] + [3]


def layer_norm(x, gamma, beta, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def bert_reference(weights, config, ids):
    """float64 BERT forward of one text (no padding): token vectors [L, E]."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    e, h = config["hidden_size"], config["num_attention_heads"]
    d = e // h
    eps = config["layer_norm_eps"]
    n = len(ids)
    x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][0]
         + w["embeddings.position_embeddings.weight"][:n])
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    for i in range(config["num_hidden_layers"]):
        at = f"encoder.layer.{i}."
        def linear(t, name):
            return t @ w[at + name + ".weight"].T + w[at + name + ".bias"]
        q = linear(x, "attention.self.query").reshape(n, h, d).transpose(1, 0, 2)
        k = linear(x, "attention.self.key").reshape(n, h, d).transpose(1, 0, 2)
        v = linear(x, "attention.self.value").reshape(n, h, d).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        ctx = (p @ v).transpose(1, 0, 2).reshape(n, e)
        x = layer_norm(x + linear(ctx, "attention.output.dense"),
                       w[at + "attention.output.LayerNorm.weight"],
                       w[at + "attention.output.LayerNorm.bias"], eps)
        ff = linear(gelu(linear(x, "intermediate.dense")), "output.dense")
        x = layer_norm(x + ff, w[at + "output.LayerNorm.weight"], w[at + "output.LayerNorm.bias"],
                       eps)
    return x


def embed_reference(weights, config, texts, max_length, pooling=("mean",), normalize=True):
    rows = []
    for text in texts:
        tokens = bert_reference(weights, config, token_ids(text, max_length))
        parts = []
        if "cls" in pooling:
            parts.append(tokens[0])
        if "max" in pooling:
            parts.append(tokens.max(0))
        if "mean" in pooling:
            parts.append(tokens.mean(0))
        row = np.concatenate(parts)
        if normalize:
            row = row / max(np.linalg.norm(row), 1e-12)
        rows.append(row)
    return np.array(rows)


TEXTS = ["the cat sat on the mat .", "a dog", "", "big red house , small blue tree", "sky",
         "the sun and the moon", "cats running far away", "star star star star star star",
         "the dog ran away , far far away , and the cat sat on a big red mat ."]


def check_close(actual, expected):
    assert actual.shape == expected.shape
    err = np.abs(actual - expected).max()
    assert err <= 2e-5 * max(1.0, np.abs(expected).max()), f"max abs error {err}"


# ---------------------------------------------------------------------------------------------
# Tiny model against the numpy reference

@pytest.mark.parametrize("pooling,normalize", [
    (("mean",), True), (("mean",), False), (("cls",), False), (("max",), True),
    (("cls", "max", "mean"), False)])
def test_tiny_model_matches_numpy(cli, rng, pooling, normalize):
    weights = make_model(cli.dir / "model", rng, pooling, normalize)
    args = []
    for text in TEXTS:
        args += ["--text", text]
    # Batch size 4: batches mix texts of different lengths, so padding is exercised.
    cli.ok("embed", "--model", "model", *args, "--out", "e.npy", "--batch-size", "4")
    expected = embed_reference(weights, CONFIG, TEXTS, 16, pooling, normalize)
    check_close(cli.load("e.npy"), expected)


def test_batch_size_and_threads_do_not_change_results(cli, rng):
    make_model(cli.dir / "model", rng)
    (cli.dir / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    results = []
    for batch, threads in [(1, 1), (3, 2), (32, 2)]:
        cli.ok("embed", "--model", "model", "--input", "texts.txt", "--out", "e.npy",
               "--batch-size", batch, "--threads", threads)
        results.append(cli.load("e.npy"))
    assert results[0].shape == (len(TEXTS), 8)
    for other in results[1:]:
        np.testing.assert_allclose(other, results[0], rtol=0, atol=2e-6)


def test_input_file_lines_and_truncation(cli, rng):
    weights = make_model(cli.dir / "model", rng)
    # CRLF line ends, an empty line in the middle, no final line end.
    (cli.dir / "texts.txt").write_bytes(b"the cat sat\r\n\r\nred sun red moon red star red sky")
    cli.ok("embed", "--model", "model", "--input", "texts.txt", "--out", "e.npy",
           "--max-length", "5", "--no-normalize")
    texts = ["the cat sat", "", "red sun red moon red star red sky"]
    check_close(cli.load("e.npy"), embed_reference(weights, CONFIG, texts, 5, normalize=False))


def test_default_max_length_from_sentence_bert_config(cli, rng):
    weights = make_model(cli.dir / "model", rng)
    (cli.dir / "model" / "sentence_bert_config.json").write_text('{"max_seq_length": 6}')
    text = "the dog ran away , far far away"
    cli.ok("embed", "--model", "model", "--text", text, "--out", "e.npy")
    check_close(cli.load("e.npy"), embed_reference(weights, CONFIG, [text], 6))


def test_progress_output_for_many_texts(cli, rng):
    make_model(cli.dir / "model", rng)
    (cli.dir / "texts.txt").write_text("\n".join(TEXTS * 30) + "\n")
    result = cli.run("embed", "--model", "model", "--input", "texts.txt", "--out", "e.npy",
                     "--batch-size", "8")
    assert result.returncode == 0, result.stderr
    assert "270/270 texts" in result.stderr
    assert cli.load("e.npy").shape == (270, 8)
    quiet = cli.run("embed", "--model", "model", "--input", "texts.txt", "--out", "e.npy",
                    "--batch-size", "8", "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_help(cli):
    out = cli.ok("embed", "--help")
    for option in ["--model", "--text", "--input", "--out", "--max-length", "--batch-size",
                   "--normalize", "--no-normalize", "--dtype", "--threads", "--quiet"]:
        assert option in out


# ---------------------------------------------------------------------------------------------
# Broken folders and bad options

@pytest.fixture
def model_dir(cli, rng):
    make_model(cli.dir / "model", rng)
    return cli.dir / "model"


def test_truncated_safetensors(cli, model_dir):
    data = (model_dir / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").write_bytes(data[:len(data) - 100])
    cli.fails("embed", "--model", "model", "--text", "a", "--out", "e.npy",
              expect=["model.safetensors"])


def test_corrupt_safetensors_header(cli, model_dir):
    data = bytearray((model_dir / "model.safetensors").read_bytes())
    data[8:20] = b"\x00garbage!!\x01\x02"
    (model_dir / "model.safetensors").write_bytes(bytes(data))
    cli.fails("embed", "--model", "model", "--text", "a", "--out", "e.npy",
              expect=["model.safetensors", "JSON"])


def test_huge_header_length(cli, model_dir):
    data = (model_dir / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").write_bytes(struct.pack("<Q", 2**63) + data[8:])
    cli.fails("embed", "--model", "model", "--text", "a", "--out", "e.npy",
              expect=["model.safetensors"])


def test_missing_tensor_and_wrong_shape(cli, rng, model_dir):
    weights = tiny_weights(rng, CONFIG)
    del weights["encoder.layer.1.output.dense.bias"]
    write_safetensors(model_dir / "model.safetensors", weights)
    cli.fails("embed", "--model", "model", "--text", "a", "--out", "e.npy",
              expect=["encoder.layer.1.output.dense.bias"])
    weights = tiny_weights(rng, CONFIG)
    weights["encoder.layer.0.intermediate.dense.weight"] = np.zeros((12, 9), np.float32)
    write_safetensors(model_dir / "model.safetensors", weights)
    cli.fails("embed", "--model", "model", "--text", "a", "--out", "e.npy",
              expect=["encoder.layer.0.intermediate.dense.weight", "(12, 9)", "(12, 8)"])


@pytest.mark.parametrize("name", ["config.json", "vocab.txt", "model.safetensors",
                                  "tokenizer_config.json", "modules.json",
                                  "sentence_bert_config.json", "1_Pooling/config.json"])
def test_model_file_that_is_a_fifo_is_refused(cli, model_dir, name):
    # A named pipe with no writer: refused at once, not read forever nor skipped as absent
    # (issue 18).
    path = model_dir / name
    path.parent.mkdir(exist_ok=True)
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    cli.fails("embed", "--model", "model", "--text", "a", "--out", "e.npy",
              expect=[name, "not a regular file"])


def test_header_of_one_huge_array_is_refused_in_bounded_memory(cli, model_dir):
    # A 20 MB header of one JSON array: the parser stops at its value limit instead of building
    # 10M values (issue 18: 99 MiB took 6.7 GB).
    header = b"[" + b"0," * (10 * 1024 * 1024) + b"0]"
    (model_dir / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    cli.fails("embed", "--model", "model", "--text", "a", "--out", "e.npy",
              expect=["model.safetensors", "more than 1048576 values"])


def test_config_with_many_keys_is_linear(cli, model_dir):
    # 200k keys: the duplicate check is a hash set past 32 keys, not 200k^2 / 2 comparisons.
    config = dict(CONFIG, **{f"extra_{i}": i for i in range(200000)})
    (model_dir / "config.json").write_text(json.dumps(config))
    started = time.monotonic()
    result = cli.run("embed", "--model", "model", "--text", "a", "--out", "e.npy")
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60  # a guard against a hang, not a speed test


def test_config_claiming_two_billion_layers(cli, model_dir):
    # Reported at the first missing layer, without reserving room for 2^31 - 1 (issue 18).
    (model_dir / "config.json").write_text(json.dumps(dict(CONFIG, num_hidden_layers=2**31 - 1)))
    cli.fails("embed", "--model", "model", "--text", "a", "--out", "e.npy",
              expect=["model.safetensors", "encoder.layer.2."])


def test_config_missing_field(cli, model_dir):
    config = dict(CONFIG)
    del config["num_attention_heads"]
    (model_dir / "config.json").write_text(json.dumps(config))
    cli.fails("embed", "--model", "model", "--text", "a", "--out", "e.npy",
              expect=["config.json", "num_attention_heads"])


def test_vocab_without_unk(cli, model_dir):
    (model_dir / "vocab.txt").write_text("\n".join(t for t in VOCAB if t != "[UNK]") + "\n")
    cli.fails("embed", "--model", "model", "--text", "a", "--out", "e.npy",
              expect=["vocab.txt", "[UNK]"])


def test_vocab_size_mismatch(cli, model_dir):
    (model_dir / "vocab.txt").write_text("\n".join(VOCAB + ["extra"]) + "\n")
    cli.fails("embed", "--model", "model", "--text", "a", "--out", "e.npy",
              expect=["vocab.txt", "vocab_size"])


@pytest.mark.parametrize("args,expect", [
    (["--text", "a", "--out", "e.npy"], ["--model"]),
    (["--model", "model", "--out", "e.npy"], ["no texts"]),
    (["--model", "model", "--text", "a"], ["--out"]),
    (["--model", "model", "--text", "a", "--input", "t.txt", "--out", "e.npy"], ["not both"]),
    (["--model", "nowhere", "--text", "a", "--out", "e.npy"], ["nowhere"]),
    (["--model", "model", "--input", "missing.txt", "--out", "e.npy"], ["--input", "missing.txt"]),
    (["--model", "model", "--text", "a", "--out", "e.npy", "--max-length", "17"],
     ["max length 17", "2..16"]),
    (["--model", "model", "--text", "a", "--out", "e.npy", "--max-length", "1"],
     ["--max-length"]),
    (["--model", "model", "--text", "a", "--out", "e.npy", "--batch-size", "0"],
     ["--batch-size"]),
    (["--model", "model", "--text", "a", "--out", "e.npy", "--normalize", "--no-normalize"],
     ["exclude"]),
    (["--model", "model", "--text", "a", "--out", "e.npy", "--bogus"], ["--bogus"]),
    (["--model", "model", "--text", "a", "--out", "e.npy", "--dtype", "f16"],
     ["--dtype", "expected f32 or bf16", "'f16'"]),
    (["--model", "model", "--text", "a", "--out", "."], ["--out", "directory"]),
])
def test_bad_options(cli, model_dir, args, expect):
    cli.fails("embed", *args, expect=expect)


# ---------------------------------------------------------------------------------------------
# The real model against sentence-transformers

def real_model_dir():
    directory = os.environ.get("QKV_MODEL_DIR")
    if not directory:
        pytest.fail("QKV_MODEL_DIR is not set (scripts/test.sh sets it)")
    return directory


def test_minilm_matches_sentence_transformers(cli):
    directory = real_model_dir()
    fixture = json.loads(FIXTURE.read_text())
    texts = fixture["texts"]
    args = []
    for text in texts:
        args += ["--text", text]
    cli.ok("embed", "--model", directory, *args, "--out", "e.npy", "--threads", "2")
    actual = cli.load("e.npy")
    expected = np.array(fixture["embeddings"], np.float64)
    assert actual.shape == expected.shape == (len(texts), 384)
    cosine = (actual * expected).sum(1) / (np.linalg.norm(actual, axis=1)
                                           * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= 0.99999, cosine.min()
    assert np.abs(actual - expected).max() <= 1e-4


def test_minilm_bf16_matmuls_within_cosine_0999(cli):
    directory = real_model_dir()
    fixture = json.loads(FIXTURE.read_text())
    args = []
    for text in fixture["texts"]:
        args += ["--text", text]
    cli.ok("embed", "--model", directory, *args, "--out", "e.npy", "--dtype", "bf16")
    actual = cli.load("e.npy")
    expected = np.array(fixture["embeddings"], np.float64)
    cosine = (actual * expected).sum(1) / (np.linalg.norm(actual, axis=1)
                                           * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= 0.999, cosine.min()
    assert cosine.min() < 0.99999  # the products really ran in bf16
