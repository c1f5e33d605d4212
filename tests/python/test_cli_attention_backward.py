"""End-to-end tests of `qkv attention-backward` (qkv/attention_backward.h) against the float64
numpy backward in reference.py, over the whole attention case table (every mask kind alone and
combined), both layouts, --dtype rounding, thread counts; and its usage errors.

The numpy backward is checked on its own against central finite differences of the numpy
forward (test_numpy_backward_matches_finite_differences), so the two implementations are
tied to the definition, not to each other.
"""

import numpy as np
import pytest

import reference as ref
from cases import CASES, check_close, cli_options, make_problem

OPTIONS = ("scale", "softcap", "causal", "align", "window", "key_lengths", "mask", "bias")


def to_file_layout(array, layout):
    return np.ascontiguousarray(array.transpose(0, 2, 1, 3)) if layout == "bhsd" else array


def grads_cli(cli, problem, dout, layout="bshd", dtype=None, threads=None, extra=()):
    """Runs `qkv attention-backward`; returns (dq, dk, dv, dbias or None) in BSHD order."""
    args = ["attention-backward", "--layout", layout, "--dq", "dq.npy", "--dk", "dk.npy",
            "--dv", "dv.npy", "--dout", cli.save("dout.npy", to_file_layout(dout, layout))]
    for name in ("q", "k", "v"):
        args += [f"--{name}", cli.save(f"{name}.npy", to_file_layout(problem[name], layout))]
    args += cli_options(problem, cli.save)
    if problem.get("bias") is not None:
        args += ["--dbias", "dbias.npy"]
    if dtype:
        args += ["--dtype", dtype]
    if threads is not None:
        args += ["--threads", threads]
    assert cli.ok(*args, *extra) == ""
    grads = [to_file_layout(cli.load(f"{name}.npy"), layout) for name in ("dq", "dk", "dv")]
    dbias = cli.load("dbias.npy") if problem.get("bias") is not None else None
    return (*grads, dbias)


def numpy_grads(problem, dout, dtype, round_fn=None, store=None):
    inputs = {name: problem[name] for name in ("q", "k", "v")}
    if round_fn is not None:
        inputs = {name: round_fn(value) for name, value in inputs.items()}
    options = {key: problem[key] for key in OPTIONS if key in problem}
    return ref.attention_backward(**inputs, dout=dout, **options, dtype=dtype, store=store)


def check_grads(actual, problem, dout, round_fn=None):
    """DESIGN.md section 5's check: against float64, within 4x the error of a plain float32
    backward (for bf16/f16 inputs one that also stores scores and probabilities in that type,
    as the forward's yardstick does)."""
    g64 = numpy_grads(problem, dout, np.float64, round_fn)
    g32 = numpy_grads(problem, dout, np.float32, round_fn, store=round_fn)
    for name, a, r64, r32 in zip(("dq", "dk", "dv", "dbias"), actual, g64, g32):
        if r64 is None:
            assert a is None
            continue
        assert a.shape == r64.shape, (name, a.shape, r64.shape)
        check_close(a, r64, r32, name)


def random_dout(rng, problem):
    b, lq, hq, _ = problem["q"].shape
    return rng.standard_normal((b, lq, hq, problem["v"].shape[3])).astype(np.float32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_backward(cli, rng, case):
    problem = CASES[case](rng)
    dout = random_dout(rng, problem)
    check_grads(grads_cli(cli, problem, dout), problem, dout)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_layouts(cli, rng, layout):
    problem = CASES["combined"](rng)
    dout = random_dout(rng, problem)
    check_grads(grads_cli(cli, problem, dout, layout=layout), problem, dout)


@pytest.mark.parametrize("dtype,round_fn", [("bf16", ref.round_bf16), ("f16", ref.round_f16)])
def test_dtype_grads_are_those_of_the_rounded_inputs(cli, rng, dtype, round_fn):
    problem = CASES["causal_bottom_right"](rng)
    dout = random_dout(rng, problem)
    check_grads(grads_cli(cli, problem, dout, dtype=dtype), problem, dout, round_fn)


def test_same_bits_on_any_thread_count(cli, rng):
    problem = CASES["combined"](rng)
    dout = random_dout(rng, problem)
    one = grads_cli(cli, problem, dout, threads=1)
    for threads in (2, 3):
        many = grads_cli(cli, problem, dout, threads=threads)
        for a, b in zip(one, many):
            assert a.tobytes() == b.tobytes()


def test_nan_past_key_lengths_is_never_read(cli, rng):
    problem = make_problem(rng, key_lengths=np.array([3, 0], np.int64))
    for name in ("k", "v"):
        problem[name][0, 3:] = np.nan
        problem[name][1, :] = np.nan
    dout = random_dout(rng, problem)
    dq, dk, dv, _ = grads_cli(cli, problem, dout)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert (dk[0, 3:] == 0).all() and (dv[1] == 0).all() and (dq[1] == 0).all()


def test_also_writes_the_forward(cli, rng):
    problem = CASES["plain"](rng)
    dout = random_dout(rng, problem)
    grads_cli(cli, problem, dout, extra=("--out", "o.npy", "--lse", "lse.npy"))
    out64, lse64, _ = ref.attention(problem["q"], problem["k"], problem["v"])
    assert np.abs(cli.load("o.npy") - out64).max() < 1e-5
    assert np.abs(cli.load("lse.npy") - lse64).max() < 1e-5


def test_numpy_backward_matches_finite_differences(rng):
    """The oracle's own check: <grad, r> against the central difference of sum(dout * out)."""
    problem = CASES["combined"](rng)
    problem["bias"] = problem["bias"].astype(np.float64)
    dout = random_dout(rng, problem).astype(np.float64)
    options = {key: problem[key] for key in OPTIONS if key in problem}
    inputs = {name: problem[name].astype(np.float64) for name in ("q", "k", "v")}
    grads = ref.attention_backward(**inputs, dout=dout, **options)

    def loss(**changed):
        merged = {**inputs, **options, **changed}
        return float((ref.attention(**merged)[0] * dout).sum())

    for index, name in enumerate(("q", "k", "v", "bias")):
        base = inputs[name] if name != "bias" else options["bias"]
        r = rng.standard_normal(base.shape)
        eps = 1e-6
        numeric = (loss(**{name: base + eps * r}) - loss(**{name: base - eps * r})) / (2 * eps)
        analytic = float((grads[index] * r).sum())
        assert abs(numeric - analytic) <= 1e-6 * (np.linalg.norm(grads[index]) + 1), name


@pytest.mark.parametrize("args,message", [
    (["--dk", "dk.npy", "--dv", "dv.npy", "--dout", "dout.npy", "--dq", "dq.npy"],
     "missing required option --q"),
    (["--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--dout", "dout.npy", "--dq", "dq.npy",
      "--dk", "dk.npy"], "missing required option --dv"),
    (["--dbias", "db.npy"], "--dbias: needs --bias"),
    (["--weights", "w.npy"], "--weights: not available for attention-backward"),
    (["--kernel", "chunked"], "--kernel: the backward has no chunked kernel"),
    (["--dout", "small.npy"], "--dout small.npy: shape (1, 1, 1, 4)"),
    (["--dq", "dk.npy"], "--dk dk.npy: same file as --dq dk.npy"),
])
def test_errors(cli, rng, args, message):
    problem = make_problem(rng)
    for name in ("q", "k", "v"):
        cli.save(f"{name}.npy", problem[name])
    cli.save("dout.npy", random_dout(rng, problem))
    cli.save("small.npy", np.zeros((1, 1, 1, 4), np.float32))
    cli.save("bias.npy", np.zeros((5, 7), np.float32))
    base = {"--q": "q.npy", "--k": "k.npy", "--v": "v.npy", "--dout": "dout.npy",
            "--dq": "dq.npy", "--dk": "dk.npy", "--dv": "dv.npy"}
    if args[0] in ("--dbias", "--weights", "--kernel", "--dout", "--dq"):
        given = dict(base)
        given.update(dict(zip(args[::2], args[1::2])))
        args = [x for pair in given.items() for x in pair]
    before = cli.files()
    result = cli.run("attention-backward", *args)
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert result.stderr.startswith("qkv: error: ") and message in result.stderr, result.stderr
    assert cli.files() == before  # nothing written


def test_help(cli):
    text = cli.ok("attention-backward", "--help")
    for option in ("--dout", "--dq", "--dk", "--dv", "--dbias", "--causal", "--window"):
        assert option in text


@pytest.mark.parametrize("case", ["plain", "causal_bottom_right", "combined", "gqa"])
def test_dropout_matches_numpy(cli, rng, case):
    """--dropout: the forward and the gradients of the mask reference.py derives from the same
    definition (seed, offset, b, h, i, j), against float64."""
    problem = CASES[case](rng)
    b, lq, hq, _ = problem["q"].shape
    lk = problem["k"].shape[1]
    keep = ref.dropout_keep(11, 2, b, hq, lq, lk, 0.3)
    dout = random_dout(rng, problem)
    grads = grads_cli(cli, problem, dout,
                      extra=("--dropout", "0.3", "--seed", "11", "--offset", "2", "--out", "o.npy"))
    inputs = {name: problem[name] for name in ("q", "k", "v")}
    options = {key: problem[key] for key in OPTIONS if key in problem}
    out64 = ref.attention(**inputs, **options, dropout=(keep, 0.3))[0]
    out32 = ref.attention(**inputs, **options, dtype=np.float32, dropout=(keep, 0.3))[0]
    check_close(cli.load("o.npy"), out64, out32, "out")
    g64 = ref.attention_backward(**inputs, dout=dout, **options, dropout=(keep, 0.3))
    g32 = ref.attention_backward(**inputs, dout=dout, **options, dtype=np.float32,
                                 dropout=(keep, 0.3))
    for name, a, r64, r32 in zip(("dq", "dk", "dv", "dbias"), grads, g64, g32):
        if r64 is not None:
            check_close(a, r64, r32, name)
    keep_rate = keep.mean()
    assert abs(keep_rate - 0.7) < 0.1, keep_rate
