"""qkv.SentenceEmbedder on all-MiniLM-L6-v2 against sentence-transformers' own embeddings (the
committed fixture), batch sizes, one embedder shared by threads, and bad input."""

import json
import threading
from pathlib import Path

import numpy as np
import pytest

import qkv

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "embeddings_minilm.json"


@pytest.fixture(scope="module")
def embedder(model_dir):
    return qkv.SentenceEmbedder(model_dir)


@pytest.fixture(scope="module")
def fixture():
    return json.loads(FIXTURE.read_text())


def test_matches_sentence_transformers(embedder, fixture):
    texts = fixture["texts"]
    actual = embedder.encode(texts)
    expected = np.array(fixture["embeddings"], np.float64)
    assert actual.dtype == np.float32 and actual.shape == expected.shape == (len(texts), 384)
    assert embedder.dimension == 384 and embedder.normalize and embedder.max_length == 256
    cosine = (actual * expected).sum(1) / (np.linalg.norm(actual, axis=1)
                                           * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= 0.99999, cosine.min()
    assert np.abs(actual - expected).max() <= 1e-4


def test_bf16_matmuls_within_cosine_0999(model_dir, fixture):
    texts = fixture["texts"]
    actual = qkv.SentenceEmbedder(model_dir, dtype="bf16").encode(texts)
    expected = np.array(fixture["embeddings"], np.float64)
    cosine = (actual * expected).sum(1) / (np.linalg.norm(actual, axis=1)
                                           * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= 0.999, cosine.min()
    assert cosine.min() < 0.99999  # the products really ran in bf16
    with pytest.raises(ValueError, match="dtype: expected 'f32' or 'bf16', got 'f16'"):
        qkv.SentenceEmbedder(model_dir, dtype="f16")


def test_one_text_and_batch_sizes(embedder, fixture):
    texts = fixture["texts"]
    batched = embedder.encode(texts)
    one = embedder.encode(texts[2])
    assert one.shape == (384,)
    np.testing.assert_allclose(one, batched[2], atol=1e-5)
    np.testing.assert_allclose(embedder.encode(texts, batch_size=1), batched, atol=1e-5)
    assert embedder.encode([]).shape == (0, 384)


def test_one_embedder_shared_by_threads(embedder, fixture):
    texts = fixture["texts"]
    expected = embedder.encode(texts)
    results = [None] * 4

    def work(index):
        results[index] = [embedder.encode(texts) for _ in range(3)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for runs in results:
        for run in runs:
            np.testing.assert_array_equal(run, expected)


def test_bad_input(embedder, tmp_path):
    with pytest.raises(TypeError, match=r"texts\[1\]: expected str, got int"):
        embedder.encode(["fine", 3])
    with pytest.raises(ValueError, match="batch_size: must be >= 1"):
        embedder.encode(["fine"], batch_size=0)
    with pytest.raises(ValueError, match="not a directory"):
        qkv.SentenceEmbedder(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="config.json"):
        qkv.SentenceEmbedder(tmp_path)
