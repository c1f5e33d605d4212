"""End-to-end tests of `qkv attention --sparse ...` / `--sparse-layout` (docs/sparse.md) against
this file's own float64 numpy implementation: Longformer (window, dilation, global positions),
BigBird (its layout re-derived here from the documented splitmix64 draw), user block layouts,
combined with causal, key lengths and GQA, on every kernel; and every error case (exit 2, one
'qkv: error:' line naming the option, no output file).

Shapes: q (B, Lq, Hq, D), k/v (B, Lk, Hkv, D), out (B, Lq, Hq, D), lse (B, Hq, Lq).
"""

import numpy as np
import pytest

KERNELS = ["flash", "chunked", "reference"]
MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------------
# The float64 reference and the patterns, written from docs/sparse.md.

def longformer_mask(seq_q, seq_kv, window, dilation=1, global_positions=(), offset=None):
    """(Lq, Lk) bool: i' in G or j in G or (|i' - j| <= w and (i' - j) % d == 0)."""
    offset = seq_kv - seq_q if offset is None else offset
    pos = np.arange(seq_q)[:, None] + offset
    key = np.arange(seq_kv)[None, :]
    dist = pos - key
    allowed = (np.abs(dist) <= window) & (dist % dilation == 0)
    glob = np.array(sorted(set(global_positions)), dtype=np.int64)
    allowed |= np.isin(pos, glob) | np.isin(key, glob)
    return allowed


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def bigbird_layout(seq_q, seq_kv, heads, block, random, num_global, seed):
    """(Hq, nqb, nkb) bool, the draw of docs/sparse.md."""
    nqb, nkb = -(-seq_q // block), -(-seq_kv // block)
    layout = np.zeros((heads, nqb, nkb), dtype=bool)
    for h in range(heads):
        for qb in range(nqb):
            if qb < num_global:
                layout[h, qb, :] = True
                continue
            candidates = []
            for kb in range(nkb):
                if kb < num_global or abs(kb - qb) <= 1:
                    layout[h, qb, kb] = True
                else:
                    candidates.append(kb)
            state = (seed ^ ((h * nqb + qb) * 0xD1B54A32D192ED03)) & MASK64
            for t in range(min(random, len(candidates))):
                state, z = splitmix64(state)
                pick = t + z % (len(candidates) - t)
                candidates[t], candidates[pick] = candidates[pick], candidates[t]
                layout[h, qb, candidates[t]] = True
    return layout


def block_mask(layout, seq_q, seq_kv, block_q, block_k):
    """(Hq or 1, Lq, Lk) bool from a (H, nqb, nkb) block layout."""
    rows = np.arange(seq_q) // block_q
    cols = np.arange(seq_kv) // block_k
    return layout[:, rows][:, :, cols]


def attention(q, k, v, allowed, dtype):
    """out (B, Lq, Hq, Dv), lse (B, Hq, Lq), weights (B, Hq, Lq, Lk); allowed broadcasts to
    (B, Hq, Lq, Lk)."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) * dtype(1.0 / np.sqrt(q.shape[3]))
    allowed = np.broadcast_to(allowed, s.shape)
    s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    safe = np.where(np.isneginf(m), 0, m)
    p = np.where(allowed, np.exp(s - safe), 0)
    total = p.sum(axis=-1, keepdims=True)
    w = np.where(total > 0, p / np.where(total > 0, total, 1), 0)
    out = np.einsum("bhij,bjhd->bihd", w, v)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] > 0, (safe + np.log(np.where(total > 0, total, 1)))[..., 0],
                       -np.inf)
    return out, lse, w


def check(actual, ref64, ref32, what):
    assert actual.shape == ref64.shape and not np.isnan(actual).any(), what
    infinite = np.isneginf(ref64)
    assert np.array_equal(np.isneginf(actual), infinite), f"{what}: -inf entries differ"
    finite = ~infinite
    if not finite.any():
        return
    error = np.max(np.abs(actual[finite] - ref64[finite]))
    plain = np.max(np.abs(ref32[finite] - ref64[finite]))
    tolerance = max(2e-5 * max(1.0, np.max(np.abs(ref64[finite]))), 4 * plain)
    assert error <= tolerance, f"{what}: max abs error {error:.3g} > {tolerance:.3g}"


def problem(rng, batch=2, seq_q=70, seq_kv=70, heads_q=4, heads_kv=2, dim=16):
    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    return (normal(batch, seq_q, heads_q, dim), normal(batch, seq_kv, heads_kv, dim),
            normal(batch, seq_kv, heads_kv, dim))


def run(cli, q, k, v, *options, kernel="auto", weights=False):
    args = ["attention", "--q", cli.save("q.npy", q), "--k", cli.save("k.npy", k),
            "--v", cli.save("v.npy", v), "--out", "o.npy", "--lse", "lse.npy",
            "--kernel", kernel, *options]
    if weights:
        args += ["--weights", "w.npy"]
    assert cli.ok(*args) == ""
    return cli.load("o.npy"), cli.load("lse.npy"), cli.load("w.npy") if weights else None


def check_run(cli, q, k, v, allowed, *options, kernel="auto"):
    with_weights = kernel != "flash"
    out, lse, w = run(cli, q, k, v, *options, kernel=kernel, weights=with_weights)
    out64, lse64, w64 = attention(q, k, v, allowed, np.float64)
    out32, lse32, w32 = attention(q, k, v, allowed, np.float32)
    check(out, out64, out32, "out")
    check(lse, lse64, lse32, "lse")
    if with_weights:
        check(w, w64, w32, "weights")


# ---------------------------------------------------------------------------------------------
# Patterns against the float64 reference.

@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("seq_q,seq_kv,spec,window,dilation,glob", [
    (70, 70, "longformer:w=5", 5, 1, ()),
    (70, 70, "longformer:w=6,dilation=3,global=0,33", 6, 3, (0, 33)),
    (33, 150, "longformer:global=149,2,w=20", 20, 1, (149, 2)),  # bottom-right, list first
    (131, 131, "longformer:w=0,global=5,5,64", 0, 1, (5, 64)),
])
def test_longformer(cli, rng, kernel, seq_q, seq_kv, spec, window, dilation, glob):
    q, k, v = problem(rng, seq_q=seq_q, seq_kv=seq_kv)
    allowed = longformer_mask(seq_q, seq_kv, window, dilation, glob)
    check_run(cli, q, k, v, allowed, "--sparse", spec, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_longformer_causal_key_lengths(cli, rng, kernel):
    q, k, v = problem(rng, seq_q=90, seq_kv=90)
    lengths = np.array([90, 61], np.int64)
    allowed = longformer_mask(90, 90, 10, 1, (0, 50))[None, None]
    causal = np.tril(np.ones((90, 90), bool))[None, None]
    padding = (np.arange(90)[None, :] < lengths[:, None])[:, None, None, :]
    check_run(cli, q, k, v, allowed & causal & padding, "--sparse", "longformer:w=10,global=0,50",
              "--causal", "--key-lengths", cli.save("kl.npy", lengths), kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("seq,block,random,num_global,seed", [
    (200, 16, 3, 2, 1), (200, 16, 3, 2, 7), (97, 8, 2, 1, 0), (64, 64, 3, 2, 1)])
def test_bigbird(cli, rng, kernel, seq, block, random, num_global, seed):
    q, k, v = problem(rng, seq_q=seq, seq_kv=seq)
    layout = bigbird_layout(seq, seq, 4, block, random, num_global, seed)
    allowed = block_mask(layout, seq, seq, block, block)[None]
    spec = f"bigbird:block={block},random={random},global={num_global},seed={seed}"
    check_run(cli, q, k, v, allowed, "--sparse", spec, kernel=kernel)


def test_bigbird_seed_changes_output(cli, rng):
    q, k, v = problem(rng, seq_q=256, seq_kv=256)
    a, _, _ = run(cli, q, k, v, "--sparse", "bigbird:block=16,seed=1")
    b, _, _ = run(cli, q, k, v, "--sparse", "bigbird:block=16,seed=1")
    c, _, _ = run(cli, q, k, v, "--sparse", "bigbird:block=16,seed=2")
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("per_head,dtype", [(False, bool), (True, np.uint8)])
def test_block_layout(cli, rng, kernel, per_head, dtype):
    seq_q, seq_kv, block_q, block_k = 75, 130, 10, 32
    nqb, nkb = 8, 5
    layout = rng.random((4 if per_head else 1, nqb, nkb)) < 0.4
    layout[:, 2, :] = False  # rows 20..29 attend nothing: out 0, lse -inf
    q, k, v = problem(rng, seq_q=seq_q, seq_kv=seq_kv)
    allowed = block_mask(layout, seq_q, seq_kv, block_q, block_k)[None]
    stored = layout.astype(dtype) if per_head else layout[0].astype(dtype)
    check_run(cli, q, k, v, allowed, "--sparse-layout", cli.save("layout.npy", stored),
              "--sparse-block", f"{block_q},{block_k}", kernel=kernel)
    out, lse, _ = run(cli, q, k, v, "--sparse-layout", "layout.npy", "--sparse-block",
                      f"{block_q},{block_k}", kernel=kernel)
    assert np.all(out[:, 20:30] == 0) and np.all(np.isneginf(lse[:, :, 20:30]))


INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("kernel", KERNELS)
def test_blocks_past_the_sequence_up_to_int64_max(cli, rng, kernel):
    # One block covers the whole sequence: BigBird is then dense, and a user layout has one
    # block row. Issue 18: ceil(L / block) overflowed into wrong output and a "(0, 8)" shape.
    q, k, v = problem(rng, seq_q=100, seq_kv=100)
    dense = np.ones((1, 1, 100, 100), bool)
    for block in (100, 101, INT64_MAX):
        check_run(cli, q, k, v, dense, "--sparse", f"bigbird:block={block}", kernel=kernel)
    layout = rng.random((1, 8)) < 0.5
    layout[0, 0] = True
    allowed = block_mask(layout[None], 100, 100, 100, 13)[None]
    for block_q in (100, INT64_MAX):
        check_run(cli, q, k, v, allowed, "--sparse-layout", cli.save("layout.npy", layout),
                  "--sparse-block", f"{block_q},13", kernel=kernel)
    cli.fails("attention", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy",
              "--sparse-layout", cli.save("bad.npy", np.ones((2, 8), bool)), "--sparse-block",
              f"{INT64_MAX},13", expect=["shape (2, 8) does not match", "(1, 8)"])


def test_full_layout_equals_dense(cli, rng):
    q, k, v = problem(rng, seq_q=100, seq_kv=140)
    dense, dense_lse, _ = run(cli, q, k, v, "--causal", kernel="flash")
    full, full_lse, _ = run(cli, q, k, v, "--causal", "--sparse-layout",
                            cli.save("layout.npy", np.ones((2, 3), bool)), "--sparse-block",
                            "64,64", kernel="flash")
    assert np.array_equal(dense, full) and np.array_equal(dense_lse, full_lse)


# ---------------------------------------------------------------------------------------------
# Errors: exit 2, one 'qkv: error:' line naming the option, no output written.

ERRORS = [
    (["--sparse", "banded:w=3"], ["--sparse", "expected longformer"]),
    (["--sparse", "longformer"], ["--sparse", "needs w="]),
    (["--sparse", "longformer:w=3,width=2"], ["--sparse", "unknown key 'width'"]),
    (["--sparse", "longformer:w=-1"], ["--sparse", "w must be >= 0"]),
    (["--sparse", "longformer:w=3,dilation=0"], ["--sparse", "dilation must be >= 1"]),
    (["--sparse", "longformer:w=x"], ["--sparse w", "expected an integer"]),
    (["--sparse", "longformer:w=3,w=4"], ["--sparse", "'w' given more than once"]),
    (["--sparse", "longformer:w=3,global=1,70"],
     ["--sparse longformer:w=3,global=1,70:", "global position 70", "Lk = 70"]),
    (["--sparse", "bigbird:block=0"], ["--sparse", "block must be >= 1"]),
    (["--sparse", "bigbird:random=2,2"], ["--sparse", "random takes one integer"]),
    (["--sparse", "bigbird", "--sparse", "bigbird"], ["--sparse", "given more than once"]),
    (["--sparse-layout", "layout.npy"], ["--sparse-layout", "needs --sparse-block"]),
    (["--sparse-block", "8,8"], ["--sparse-block", "only applies to --sparse-layout"]),
    (["--sparse-layout", "layout.npy", "--sparse-block", "8"], ["--sparse-block", "BQ,BK"]),
    (["--sparse-layout", "layout.npy", "--sparse-block", "8,8", "--sparse", "bigbird"],
     ["--sparse-layout", "cannot be combined"]),
    (["--sparse-layout", "layout.npy", "--sparse-block", "16,16"],
     ["--sparse-layout layout.npy", "shape (9, 9)", "(5, 5)", "--sparse-block 16,16"]),
    (["--sparse-layout", "f32.npy", "--sparse-block", "8,8"],
     ["--sparse-layout f32.npy", "dtype float32"]),
    (["--sparse-layout", "missing.npy", "--sparse-block", "8,8"], ["--sparse-layout missing.npy"]),
    (["--sparse", "bigbird", "--linear", "elu"], ["--sparse bigbird", "--linear"]),
]


@pytest.mark.parametrize("options,expect", ERRORS, ids=[" ".join(e[0]) for e in ERRORS])
def test_errors(cli, rng, options, expect):
    q, k, v = problem(rng, seq_q=70, seq_kv=70)
    for name, array in (("q", q), ("k", k), ("v", v)):
        cli.save(f"{name}.npy", array)
    cli.save("layout.npy", np.ones((9, 9), bool))
    cli.save("f32.npy", np.ones((9, 9), np.float32))
    cli.fails("attention", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy",
              *options, expect=expect)


def test_bench_reports_pairs(cli):
    import json
    result = cli.run("bench", "--json", "--shape", "1,2,2,300,300,16", "--repeats", "1",
                     "--threads", "1", "--sparse", "longformer:w=10,global=0")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    pairs = longformer_mask(300, 300, 10, 1, (0,)).sum()
    assert record["sparse"] == "longformer:w=10,global=0"
    assert record["pairs"] == pairs
    assert record["effective_gflops"] < record["gflops"]
