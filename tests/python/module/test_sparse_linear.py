"""Block-sparse attention (qkv.longformer, qkv.bigbird, qkv.block_layout) and linear attention
(qkv.linear_attention) from Python, against float64 numpy: sparse attention equals dense
attention with the pattern's own mask, written out here in numpy from the pattern's definition;
elu+1 linear attention equals its quadratic formula."""

import numpy as np
import pytest
import torch

import qkv
from cases import check_close, make_problem, references


def longformer_mask(seq_q, seq_kv, window, dilation, global_, align="bottom_right"):
    """docs/sparse.md: i' in G or j in G or (|i' - j| <= w and (i' - j) % d == 0)."""
    i = np.arange(seq_q)[:, None] + (seq_kv - seq_q if align == "bottom_right" else 0)
    j = np.arange(seq_kv)[None, :]
    band = (np.abs(i - j) <= window) & ((i - j) % dilation == 0)
    g = np.asarray(global_, np.int64)
    return band | np.isin(i, g) | np.isin(j, g)


def block_mask(layout, seq_q, seq_kv, block_q, block_k):
    """(H, Lq, Lk) from a (H, query blocks, key blocks) layout."""
    return np.repeat(np.repeat(layout, block_q, axis=1), block_k, axis=2)[:, :seq_q, :seq_kv]


def check_sparse(problem, sparsity, dense_mask, kernel="flash"):
    out, lse = qkv.attention(problem["q"], problem["k"], problem["v"], sparsity=sparsity,
                             kernel=kernel, return_lse=True,
                             causal=problem.get("causal", False))
    dense = dict(problem, mask=dense_mask)
    (out64, lse64, _), (out32, lse32, _) = references(dense)
    check_close(out, out64, out32, "out")
    check_close(lse, lse64, lse32, "lse")


@pytest.mark.parametrize("kernel", ["flash", "chunked", "reference"])
@pytest.mark.parametrize("window,dilation,global_,causal", [
    (3, 1, [], False), (2, 2, [0], False), (5, 1, [0, 17], True), (0, 1, [4], False)])
def test_longformer_matches_its_dense_mask(rng, kernel, window, dilation, global_, causal):
    problem = make_problem(rng, seq_q=37, seq_kv=37, causal=causal)
    sparsity = qkv.longformer(window=window, dilation=dilation, global_=global_)
    check_sparse(problem, sparsity, longformer_mask(37, 37, window, dilation, global_), kernel)
    np.testing.assert_array_equal(sparsity.mask(37, 37, 1)[0],
                                  longformer_mask(37, 37, window, dilation, global_))


def test_longformer_cross_lengths_follow_the_alignment(rng):
    problem = make_problem(rng, seq_q=9, seq_kv=30)
    sparsity = qkv.longformer(window=4)
    check_sparse(problem, sparsity, longformer_mask(9, 30, 4, 1, []))


@pytest.mark.parametrize("block,random_blocks,global_blocks", [(4, 1, 1), (8, 2, 0), (5, 0, 2)])
def test_bigbird_matches_its_block_layout(rng, block, random_blocks, global_blocks):
    problem = make_problem(rng, seq_q=43, seq_kv=43)
    options = dict(block=block, num_random_blocks=random_blocks, num_global_blocks=global_blocks,
                   seed=7)
    layout = qkv.bigbird_layout(43, 43, 4, **options)
    blocks = -(-43 // block)
    assert layout.shape == (4, blocks, blocks) and layout.dtype == bool
    # ITC structure: global blocks see everything and are seen by all; the diagonal band is in.
    assert layout[:, :global_blocks].all() and layout[:, :, :global_blocks].all()
    for qb in range(blocks):
        assert layout[:, qb, max(0, qb - 1):qb + 2].all()
    check_sparse(problem, qkv.bigbird(**options), block_mask(layout, 43, 43, block, block)[None])


def test_block_layout_of_each_framework(rng):
    problem = make_problem(rng, seq_q=20, seq_kv=30)
    layout = rng.random((4, 3, 4)) < 0.5
    layout[:, :, 0] = True
    dense = block_mask(layout, 20, 30, 8, 8)[None]
    for convert in (lambda x: x, torch.from_numpy, lambda x: x.astype(np.uint8)):
        check_sparse(problem, qkv.block_layout(convert(layout), block_q=8, block_k=8), dense)
    shared = qkv.block_layout(layout[0], block_q=8, block_k=8)  # (query blocks, key blocks)
    check_sparse(problem, shared, block_mask(layout[:1], 20, 30, 8, 8)[None])


def test_sparsity_errors_name_the_field(rng):
    p = make_problem(rng)
    with pytest.raises(ValueError, match="sparsity"):
        qkv.attention(p["q"], p["k"], p["v"], sparsity=qkv.bigbird(block=0))
    with pytest.raises(ValueError, match="sparsity"):
        qkv.attention(p["q"], p["k"], p["v"],
                      sparsity=qkv.block_layout(np.ones((9, 9), bool), block_q=1, block_k=1))
    with pytest.raises(TypeError, match="layout: dtype float32"):
        qkv.block_layout(np.ones((2, 2), np.float32))
    with pytest.raises(TypeError, match="global_: expected an integer"):
        qkv.longformer(global_=[0.5])
    assert "window=3" in repr(qkv.longformer(window=3))


# ---------------------------------------------------------------------------------------------
# Linear attention

def elu_linear_reference(q, k, v, causal=False, key_lengths=None):
    """out_i = sum_j (phi(q_i).phi(k_j)) v_j / sum_j phi(q_i).phi(k_j), phi = elu + 1, float64,
    bottom-right causal; (B, L, H, D) arrays."""
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    fq = phi(q).transpose(0, 2, 1, 3)
    fk = np.repeat(phi(k).transpose(0, 2, 1, 3), group, axis=1)
    vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1)
    scores = fq @ fk.swapaxes(-1, -2)  # (B, Hq, Lq, Lk)
    seq_q, seq_kv = q.shape[1], k.shape[1]
    allowed = np.ones((q.shape[0], 1, seq_q, seq_kv), bool)
    if causal:
        allowed &= np.arange(seq_kv)[None, :] <= np.arange(seq_q)[:, None] + seq_kv - seq_q
    if key_lengths is not None:
        allowed &= np.arange(seq_kv)[None, None, None, :] < np.asarray(key_lengths)[:, None, None, None]
    scores = np.where(allowed, scores, 0.0)
    total = scores.sum(-1, keepdims=True)
    out = np.where(total > 0, (scores @ vh) / np.where(total > 0, total, 1), 0.0)
    return out.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("kernel", ["cpu", "reference"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_elu_linear_attention_matches_its_formula(rng, kernel, causal, layout):
    p = make_problem(rng, seq_q=70, seq_kv=90, num_heads_q=4, num_heads_kv=2, head_dim=16)
    lengths = np.array([90, 61])
    views = [p[n] if layout == "bshd" else p[n].transpose(0, 2, 1, 3) for n in ("q", "k", "v")]
    out = qkv.linear_attention(*views, layout=layout, causal=causal, key_lengths=lengths,
                               kernel=kernel)
    if layout == "bhsd":
        out = out.transpose(0, 2, 1, 3)
    expected = elu_linear_reference(p["q"], p["k"], p["v"], causal, lengths)
    assert np.abs(out - expected).max() <= 2e-5 * max(1, np.abs(expected).max())


def test_favor_cpu_matches_its_reference_and_tracks_softmax(rng):
    p = make_problem(rng, batch=1, seq_q=64, seq_kv=64, num_heads_q=2, num_heads_kv=2,
                     head_dim=16, data_scale=0.5)
    options = dict(feature_map="favor", nb_features=2048, seed=3, causal=True)
    cpu = qkv.linear_attention(p["q"], p["k"], p["v"], kernel="cpu", **options)
    oracle = qkv.linear_attention(p["q"], p["k"], p["v"], kernel="reference", **options)
    assert np.abs(cpu - oracle).max() <= 1e-4
    exact = qkv.attention(p["q"], p["k"], p["v"], causal=True)
    assert np.abs(cpu - exact).max() < 0.1  # an approximation, close with many features


def test_linear_attention_errors(rng):
    p = make_problem(rng)
    with pytest.raises(ValueError, match="feature_map: expected 'elu' or 'favor'"):
        qkv.linear_attention(p["q"], p["k"], p["v"], feature_map="relu")
    with pytest.raises(ValueError, match="scale"):
        qkv.linear_attention(p["q"], p["k"], p["v"], scale=0.5)  # elu has no scale
    with pytest.raises(ValueError, match="q: dtype f64 is not supported .linear attention computes f32."):
        qkv.linear_attention(p["q"].astype(np.float64), p["k"], p["v"])
