"""End-to-end tests of `qkv attention --linear` (docs/linear-attention.md) against this file's
own numpy implementation of both formulas, in float64 (and float32 to size the tolerance as
DESIGN.md section 5 says), written as the quadratic form

    out_i = sum_{j in J(i)} (phi(q_i) . phi(k_j)) v_j / sum_{j in J(i)} phi(q_i) . phi(k_j)

with elu(x) + 1, or FAVOR+ with the projection the CLI reports through --favor-features-out.
Also: the projection's properties, --kernel reference, `qkv bench --linear`, and every CLI
error (exit 2, one 'qkv: error:' line naming the option, no file written).
"""

import json

import numpy as np
import pytest

import reference as ref


# ---------------------------------------------------------------------------------------------
# The numpy implementation.

def elu_plus_one(x):
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def favor_features(x, w, scale, stabiliser):
    """exp(w_r . x' - |x'|^2 / 2 - c) / sqrt(M), x' = x * sqrt(scale), x: (L, D), w: (M, D).
    stabiliser 'row': c = each row's max (queries); 'all': one max over all rows (keys). Any
    constant per row (queries) or per head (keys) cancels in the normalised output."""
    xp = x * np.sqrt(scale)
    e = xp @ w.T - 0.5 * np.sum(xp * xp, axis=1, keepdims=True)
    c = e.max(axis=1, keepdims=True) if stabiliser == "row" else e.max(initial=-np.inf)
    return np.exp(e - c) / np.sqrt(w.shape[0])


def linear_attention(q, k, v, feature_map, w=None, scale=None, causal=False,
                     align="bottom-right", key_lengths=None, dtype=np.float64):
    """q: (B, Lq, Hq, D), k: (B, Lk, Hkv, D), v: (B, Lk, Hkv, Dv) -> (B, Lq, Hq, Dv)."""
    q, k, v = (np.asarray(x, dtype) for x in (q, k, v))
    batch, seq_q, num_heads_q, head_dim = q.shape
    seq_kv, num_heads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    offset = seq_kv - seq_q if align == "bottom-right" else 0
    out = np.zeros((batch, seq_q, num_heads_q, v.shape[3]), dtype)
    for b in range(batch):
        length = seq_kv if key_lengths is None else int(key_lengths[b])
        for h in range(num_heads_q):
            kv = h // (num_heads_q // num_heads_kv)
            keys, values = k[b, :length, kv], v[b, :length, kv]
            if feature_map == "elu":
                phi_q, phi_k = elu_plus_one(q[b, :, h]), elu_plus_one(keys)
            else:
                w_ = np.asarray(w, dtype)
                phi_q = favor_features(q[b, :, h], w_, scale, "row")
                phi_k = favor_features(keys, w_, scale, "all")
            weights = phi_q @ phi_k.T  # (Lq, length)
            if causal:
                allowed = np.arange(length)[None, :] <= np.arange(seq_q)[:, None] + offset
                weights = np.where(allowed, weights, 0)
            num, den = weights @ values, weights.sum(axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                out[b, :, h] = np.where(den[:, None] > 0, num / den[:, None], 0)
    return out


def softmax_attention(q, k, v):
    return ref.attention(q, k, v, dtype=np.float64)[0]


# ---------------------------------------------------------------------------------------------
# Running the CLI.

def make_inputs(rng, batch=2, seq_q=9, seq_kv=11, num_heads_q=4, num_heads_kv=2, head_dim=8,
                head_dim_v=None, data_scale=1.0):
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    def normal(*shape):
        return (rng.standard_normal(shape) * data_scale).astype(np.float32)
    return (normal(batch, seq_q, num_heads_q, head_dim), normal(batch, seq_kv, num_heads_kv, head_dim),
            normal(batch, seq_kv, num_heads_kv, head_dim_v))


def run_linear(cli, q, k, v, spec, *options, layout="bshd", features=False):
    """Runs `qkv attention --linear spec`; returns out in BSHD (and the projection)."""
    def to_file(x):
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if layout == "bhsd" else x
    args = ["attention", "--linear", spec, "--layout", layout, "--out", "o.npy",
            "--q", cli.save("q.npy", to_file(q)), "--k", cli.save("k.npy", to_file(k)),
            "--v", cli.save("v.npy", to_file(v)), *options]
    if features:
        args += ["--favor-features-out", "f.npy"]
    assert cli.ok(*args) == ""
    out = to_file(cli.load("o.npy"))
    assert out.dtype == np.float32 and not np.isnan(out).any()
    return (out, cli.load("f.npy")) if features else out


def check_close(actual, ref64, ref32, what):
    assert actual.shape == ref64.shape, f"{what}: shape {actual.shape} != {ref64.shape}"
    error = float(np.max(np.abs(actual.astype(np.float64) - ref64)))
    tolerance = ref.tolerance(ref64, ref32)
    assert error <= tolerance, f"{what}: max abs error {error:.3g} > tolerance {tolerance:.3g}"


CASES = {
    "plain": dict(),
    "gqa_lq_lt_lk": dict(seq_q=7, seq_kv=70),
    "mqa_dv": dict(num_heads_q=3, num_heads_kv=1, head_dim=16, head_dim_v=5),
    "long": dict(batch=1, seq_q=300, seq_kv=300, num_heads_q=2, num_heads_kv=2, head_dim=32),
    "d1": dict(head_dim=1, head_dim_v=3),
}
OPTIONS = {
    "noncausal": ([], {}),
    "causal": (["--causal"], dict(causal=True)),
    "causal_top_left": (["--causal", "--align", "top-left"], dict(causal=True, align="top-left")),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("feature_map", ["elu", "favor"])
def test_matches_numpy(cli, rng, case, options, feature_map):
    q, k, v = make_inputs(rng, **CASES[case])
    args, kwargs = OPTIONS[options]
    if feature_map == "elu":
        out = run_linear(cli, q, k, v, "elu", *args)
        w = None
    else:
        out, w = run_linear(cli, q, k, v, "favor:features=64,seed=5", *args, features=True)
        assert w.shape == (64, q.shape[3]) and w.dtype == np.float32
    ref64 = linear_attention(q, k, v, feature_map, w, **kwargs)
    ref32 = linear_attention(q, k, v, feature_map, w, dtype=np.float32, **kwargs)
    check_close(out, ref64, ref32, f"{feature_map} {case} {options}")


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_key_lengths_scale_layout_and_reference_kernel(cli, rng, layout):
    q, k, v = make_inputs(rng, seq_q=8, seq_kv=12)
    lengths = np.array([5, 0], np.int32)
    k[1, :] = np.nan  # batch 1 has no keys: none may be read
    v[1, :] = np.nan
    kl = cli.save("kl.npy", lengths)
    for kernel in ("auto", "reference"):
        out, w = run_linear(cli, q, k, v, "favor:seed=2", "--causal", "--key-lengths", kl,
                            "--scale", "0.25", "--kernel", kernel, layout=layout, features=True)
        assert w.shape == (256, 8)
        args = dict(scale=0.25, causal=True, key_lengths=lengths)
        ref64 = linear_attention(q, k, v, "favor", w, **args)
        ref32 = linear_attention(q, k, v, "favor", w, dtype=np.float32, **args)
        check_close(out, ref64, ref32, f"favor key lengths {kernel}")
        assert np.all(out[1] == 0)
        out = run_linear(cli, q, k, v, "elu", "--key-lengths", kl, "--kernel", kernel,
                         layout=layout)
        ref64 = linear_attention(q, k, v, "elu", key_lengths=lengths)
        ref32 = linear_attention(q, k, v, "elu", key_lengths=lengths, dtype=np.float32)
        check_close(out, ref64, ref32, f"elu key lengths {kernel}")


def test_projection_is_seeded_orthogonal_and_redrawn(cli, rng):
    q, k, v = make_inputs(rng, head_dim=8)
    _, w1 = run_linear(cli, q, k, v, "favor:features=20,seed=9", features=True)
    _, w2 = run_linear(cli, q, k, v, "favor:seed=9,features=20", features=True)
    _, w3 = run_linear(cli, q, k, v, "favor:features=20,seed=10", features=True)
    assert np.array_equal(w1, w2)
    assert not np.allclose(w1, w3)
    for block in (w1[0:8], w1[8:16], w1[16:20]):
        unit = block / np.linalg.norm(block, axis=1, keepdims=True)
        assert np.allclose(unit @ unit.T, np.eye(len(block)), atol=1e-6)


def test_favor_approaches_softmax_as_features_grow(cli, rng):
    q, k, v = make_inputs(rng, batch=1, seq_q=64, seq_kv=64, num_heads_q=2, num_heads_kv=2,
                          head_dim=16, data_scale=0.5)
    exact = softmax_attention(q, k, v)
    errors = []
    for features in (16, 256, 4096):
        error = 0.0
        for seed in (1, 2):
            out = run_linear(cli, q, k, v, f"favor:features={features},seed={seed}")
            error += float(np.mean(np.abs(out - exact))) / 2
        errors.append(error)
    assert errors[0] > 2 * errors[1] > 4 * errors[2], errors


def test_bench_reports_linear_flops(cli):
    result = cli.run("bench", "--json", "--linear", "favor:features=32", "--shape",
                     "1,4,2,200,300,16", "--causal", "--threads", "1", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    assert "favor-32 (1,4,2,200,300,16) causal" in result.stderr  # the progress line
    row = json.loads(result.stdout.strip().splitlines()[-1])
    assert row["kernel"] == "favor-32"
    assert row["causal"] is True
    flops = 2 * 32 * (16 + 16 + 1) * (1 * 2 * 300 + 1 * 4 * 200)
    assert row["gflops"] == pytest.approx(flops / row["seconds"] / 1e9, rel=1e-4)
    assert row["effective_gflops"] == row["gflops"]


# ---------------------------------------------------------------------------------------------
# Errors: exit 2, one line naming the option, no output file.

ERRORS = {
    "unknown_map": (["--linear", "softmax"], ["--linear", "unknown feature map 'softmax'"]),
    "elu_params": (["--linear", "elu:features=3"], ["--linear", "elu takes no parameters"]),
    "bad_key": (["--linear", "favor:depth=3"], ["--linear", "unknown key 'depth'"]),
    "no_value": (["--linear", "favor:features"], ["--linear", "'features' is not key=value"]),
    "features_zero": (["--linear", "favor:features=0"], ["--linear", "features must be in"]),
    "features_text": (["--linear", "favor:features=many"], ["--linear features", "'many'"]),
    "seed_negative": (["--linear", "favor:seed=-1"], ["--linear", "seed must be >= 0"]),
    "twice": (["--linear", "favor:seed=1,seed=2"], ["--linear", "seed given twice"]),
    "missing": (["--linear"], ["--linear: missing value"]),
    "window": (["--linear", "elu", "--window", "4,0"], ["--window", "cannot express"]),
    "softcap": (["--linear", "favor", "--softcap", "5"], ["--softcap", "cannot express"]),
    "elu_scale": (["--linear", "elu", "--scale", "0.5"], ["--scale", "elu+1", "no score scale"]),
    "favor_scale": (["--linear", "favor", "--scale", "-1"], ["--scale", "finite and > 0"]),
    "lse": (["--linear", "elu", "--lse", "l.npy"], ["--lse l.npy", "no softmax normaliser"]),
    "weights": (["--linear", "elu", "--weights", "w.npy"], ["--weights w.npy", "never forms"]),
    "kernel_flash": (["--linear", "elu", "--kernel", "flash"], ["--kernel", "exact-attention"]),
    "kernel_chunked": (["--linear", "favor", "--kernel", "chunked"], ["--kernel", "chunked"]),
    "features_out_elu": (["--linear", "elu", "--favor-features-out", "f.npy"],
                         ["--favor-features-out", "needs --linear favor"]),
    "features_out_plain": (["--favor-features-out", "f.npy"], ["--favor-features-out"]),
    "sparse": (["--linear", "elu", "--sparse", "longformer:w=4"], ["--sparse", "--linear"]),
    "features_out_same": (["--linear", "favor", "--favor-features-out", "o.npy"],
                          ["--favor-features-out o.npy", "same file as --out"]),
}


@pytest.mark.parametrize("name", ERRORS)
def test_errors(cli, rng, name):
    q, k, v = make_inputs(rng)
    args, expect = ERRORS[name]
    cli.save("q.npy", q)
    cli.save("k.npy", k)
    cli.save("v.npy", v)
    cli.fails("attention", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy",
              *args, expect=expect)


@pytest.mark.parametrize("mask_kind", ["mask", "bias"])
def test_mask_and_bias_rejected(cli, rng, mask_kind):
    q, k, v = make_inputs(rng)
    for name, x in (("q", q), ("k", k), ("v", v)):
        cli.save(f"{name}.npy", x)
    extra = np.ones((1, 11), bool) if mask_kind == "mask" else np.zeros((1, 11), np.float32)
    cli.save("m.npy", extra)
    cli.fails("attention", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy",
              "--linear", "elu", f"--{mask_kind}", "m.npy",
              expect=[f"--{mask_kind} m.npy", "cannot express"])


def test_bench_rejects_bad_spec(cli):
    cli.fails("bench", "--linear", "favor:features=0", expect=["--linear", "features"])
