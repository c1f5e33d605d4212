"""End-to-end tests of `qkv attention` (DESIGN.md sections 3-5) against the float64 numpy
reference in reference.py: every mask kind alone and combined, both layouts, every kernel,
--lse and --weights, --dtype rounding, odd sizes, and every validation error.

Shapes are (B, Lq, Hq, D) etc. as in DESIGN.md; `problem` dicts hold the inputs and options.
"""

import os
import subprocess

import numpy as np
import pytest

import reference as ref
from cases import CASES, random_mask, check_close, cli_options, make_problem, references

KERNELS = ["reference", "chunked", "flash", "auto"]


# ---------------------------------------------------------------------------------------------
# Helpers

def cpu_vendor():
    """The CPU's vendor_id as /proc/cpuinfo lists it (e.g. GenuineIntel, AuthenticAMD)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return ""


def cpu_flags():
    """The CPU's feature flags as /proc/cpuinfo lists them."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def to_file_layout(array, layout):
    # (B, L, H, D) <-> (B, H, L, D): the same transpose both ways.
    return np.ascontiguousarray(array.transpose(0, 2, 1, 3)) if layout == "bhsd" else array


def run_cli(cli, problem, kernel="auto", layout="bshd", lse=True, weights=None, dtype=None,
            threads=None):
    """Runs `qkv attention` on `problem`; returns (out in BSHD, lse or None, weights or None)."""
    if weights is None:
        # auto with --weights resolves to chunked; without (the bhsd runs) to flash.
        weights = kernel in ("reference", "chunked") or (kernel == "auto" and layout == "bshd")
    args = ["attention", "--kernel", kernel, "--layout", layout, "--out", "o.npy"]
    for name in ("q", "k", "v"):
        cli.save(f"{name}.npy", to_file_layout(problem[name], layout))
        args += [f"--{name}", f"{name}.npy"]
    args += cli_options(problem, cli.save)
    if lse:
        args += ["--lse", "lse.npy"]
    if weights:
        args += ["--weights", "w.npy"]
    if dtype:
        args += ["--dtype", dtype]
    if threads is not None:
        args += ["--threads", threads]
    assert cli.ok(*args) == ""
    out = cli.load("o.npy")
    assert out.dtype == np.float32 and out.flags.c_contiguous
    return (to_file_layout(out, layout), cli.load("lse.npy") if lse else None,
            cli.load("w.npy") if weights else None)


def check_against_reference(cli, problem, kernel="auto", layout="bshd", dtype=None):
    out, lse, weights = run_cli(cli, problem, kernel, layout, dtype=dtype)
    round_fn = {"bf16": ref.round_bf16, "f16": ref.round_f16}.get(dtype)
    (out64, lse64, w64), (out32, lse32, w32) = references(problem, round_fn)
    check_close(out, out64, out32, "out")
    check_close(lse, lse64, lse32, "lse")
    if weights is not None:
        check_close(weights, w64, w32, "weights")
    return out, lse, weights


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(cli, rng, case, kernel, layout):
    check_against_reference(cli, CASES[case](rng), kernel, layout)


@pytest.mark.parametrize("kernel", ["reference", "chunked", "flash"])
@pytest.mark.parametrize("seq_q,seq_kv,head_dim", [
    (1, 1, 1), (1, 3, 7), (3, 1, 3), (7, 7, 65), (65, 65, 16), (63, 130, 64), (64, 64, 64),
    (1, 129, 32), (130, 65, 7), (129, 257, 8)])
@pytest.mark.parametrize("masks", ["none", "causal_mask_lengths"])
def test_odd_sizes(cli, rng, kernel, seq_q, seq_kv, head_dim, masks):
    options = {}
    if masks != "none":
        options = dict(causal=True, key_lengths=np.array([seq_kv, max(1, seq_kv - 2)]),
                       mask=random_mask(rng, (seq_q, seq_kv), 0.9))
    problem = make_problem(rng, seq_q=seq_q, seq_kv=seq_kv, num_heads_q=2, num_heads_kv=1,
                           head_dim=head_dim, **options)
    check_against_reference(cli, problem, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_fully_masked_rows_are_zero_with_lse_minus_inf(cli, rng, kernel):
    mask = np.ones((2, 1, 5, 7), bool)
    mask[0, 0, 1] = False
    problem = make_problem(rng, mask=mask, key_lengths=np.array([7, 0]))
    out, lse, weights = check_against_reference(cli, problem, kernel)
    assert np.all(out[0, 1] == 0) and np.all(out[1] == 0)
    assert np.all(np.isneginf(lse[0, :, 1])) and np.all(np.isneginf(lse[1]))
    assert np.isfinite(lse[0, :, 0]).all()
    if weights is not None:
        assert np.all(weights[0, :, 1] == 0) and np.all(weights[1] == 0)
        np.testing.assert_allclose(weights[0, :, 0].sum(-1), 1, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_past_key_lengths_is_never_read(cli, rng, kernel):
    lengths = np.array([4, 7, 1], np.int32)
    problem = make_problem(rng, batch=3, seq_q=6, seq_kv=7, key_lengths=lengths, causal=True)
    for b, length in enumerate(lengths):
        problem["k"][b, length:] = np.nan
        problem["v"][b, length:] = np.nan
    out, lse, _ = check_against_reference(cli, problem, kernel)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_dtype_matches_reference_on_rounded_inputs(cli, rng, kernel, dtype):
    problem = make_problem(rng, seq_q=9, seq_kv=13, causal=True, mask=random_mask(rng, (9, 13), 0.9))
    out, _, _ = check_against_reference(cli, problem, kernel, dtype=dtype)
    # The rounding must matter: unrounded inputs give a reference that is measurably different.
    unrounded = ref.attention(problem["q"], problem["k"], problem["v"], causal=True,
                              mask=problem["mask"])[0]
    assert np.max(np.abs(out - unrounded)) > 1e-4


@pytest.mark.parametrize("dtype,round_fn", [("bf16", ref.round_bf16), ("f16", ref.round_f16),
                                            ("f32", lambda x: x)])
def test_dtype_rounding_is_exact(cli, rng, dtype, round_fn):
    # With one key, softmax is exactly 1 and out == v, so out shows the rounded v bit for bit.
    # Ties (round to even), f16 subnormals and the largest finite values are included.
    ties = [1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-25, 3 * 2.0**-25,
            2.0**-24, 1e-7, 65519.0, -65519.0, 3.0e38, -1 - 2.0**-8, 0.1, -0.0, 1e-30]
    values = np.concatenate([np.array(ties), rng.standard_normal(64) * 10.0 ** rng.integers(
        -6, 5, 64)]).astype(np.float32)
    v = values.reshape(1, 1, 1, -1)
    q = rng.standard_normal((1, 1, 1, 4)).astype(np.float32)
    k = rng.standard_normal((1, 1, 1, 4)).astype(np.float32)
    out, _, _ = run_cli(cli, dict(q=q, k=k, v=v), "reference", lse=False, weights=False,
                        dtype=dtype)
    expected = round_fn(values)
    if dtype == "f16":
        expected = np.where(np.abs(values) > 65519, np.nan, expected)  # 3e38 -> inf, skip
    keep = ~np.isnan(expected)
    np.testing.assert_array_equal(out.ravel()[keep], expected[keep])


@pytest.mark.parametrize("kernel", ["reference", "chunked", "flash"])
def test_results_do_not_depend_on_thread_count(cli, rng, kernel):
    problem = make_problem(rng, batch=2, seq_q=70, seq_kv=131, num_heads_q=4, num_heads_kv=2,
                           head_dim=16, causal=True, key_lengths=np.array([131, 90]))
    results = [run_cli(cli, problem, kernel, threads=threads) for threads in (1, 2, 3)]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            if a is not None:
                np.testing.assert_array_equal(a, b)


def test_bhsd_output_is_in_bhsd_order(cli, rng):
    problem = make_problem(rng, batch=2, seq_q=3, seq_kv=5, num_heads_q=4, num_heads_kv=2,
                           head_dim=8, head_dim_v=6)
    run_cli(cli, problem, "flash", "bhsd", lse=False)
    assert cli.load("o.npy").shape == (2, 4, 3, 6)
    run_cli(cli, problem, "flash", "bshd", lse=True)
    assert cli.load("o.npy").shape == (2, 3, 4, 6)
    assert cli.load("lse.npy").shape == (2, 4, 3)


def test_reads_npy_format_2_and_writes_aligned_files(cli, rng):
    problem = make_problem(rng)
    for name in ("q", "k", "v"):
        with open(cli.path(f"{name}.npy"), "wb") as f:
            np.lib.format.write_array(f, problem[name], version=(2, 0))
    cli.ok("attention", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy",
           "--lse", "lse.npy", "--weights", "w.npy")
    (out64, lse64, w64), (out32, lse32, w32) = references(problem)
    check_close(cli.load("o.npy"), out64, out32, "out")
    for name in ("o.npy", "lse.npy", "w.npy"):
        data = (cli.dir / name).read_bytes()
        assert data[:8] == b"\x93NUMPY\x01\x00"
        header_len = int.from_bytes(data[8:10], "little")
        assert (10 + header_len) % 64 == 0
    assert cli.files() == ["k.npy", "lse.npy", "o.npy", "q.npy", "v.npy", "w.npy"]


def test_output_through_a_symlink_keeps_the_link(cli, rng):
    (cli.dir / "results").mkdir()
    (cli.dir / "o.npy").symlink_to("results/out.npy")
    run_cli(cli, make_problem(rng), "flash", lse=False)
    assert (cli.dir / "o.npy").is_symlink()
    assert np.load(cli.path("results/out.npy")).shape == (2, 5, 4, 8)


def test_success_replaces_existing_outputs(cli, rng):
    (cli.dir / "o.npy").write_bytes(b"stale")
    run_cli(cli, make_problem(rng), "flash", lse=False)
    assert cli.load("o.npy").shape == (2, 5, 4, 8)


def test_help(cli):
    for args in (["attention", "--help"], ["attention", "--q", "x.npy", "-h"]):
        text = cli.ok(*args)
        assert text.startswith("usage: qkv attention")
        for option in ("--q", "--k", "--v", "--out", "--layout", "bshd", "bhsd", "--scale",
                       "--softcap", "--causal", "--align", "bottom-right", "top-left",
                       "--window", "--key-lengths", "--mask", "--bias", "--lse", "--weights",
                       "--kernel", "reference", "chunked", "flash", "--dtype", "bf16", "f16",
                       "--threads", "--help", "MAY ATTEND"):
            assert option in text, option
    assert cli.files() == []


# ---------------------------------------------------------------------------------------------
# Errors: exit 2, one line "qkv: error: ..." naming the argument (and both shapes for shape
# mismatches), no output or temporary file left behind, no existing file touched.

BASE = ["attention", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy"]
Q_SHAPE, K_SHAPE, V_SHAPE = (2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 6)


@pytest.fixture
def inputs(cli, rng):
    """q (2, 5, 4, 8), k (2, 7, 2, 8), v (2, 7, 2, 6) in the test directory."""
    for name, shape in (("q", Q_SHAPE), ("k", K_SHAPE), ("v", V_SHAPE)):
        cli.save(f"{name}.npy", rng.standard_normal(shape).astype(np.float32))
    return cli


def _save(name, array):
    return lambda cli: cli.save(name, array)


def _write(name, data):
    return lambda cli: (cli.dir / name).write_bytes(data)


def _truncate(name):
    return lambda cli: (cli.dir / name).write_bytes((cli.dir / name).read_bytes()[:-3])


def _npy_bytes(descr, shape, data=b""):
    """A version 1.0 .npy file with this header and these data bytes."""
    header = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + data


def _mkdir(name):
    return lambda cli: (cli.dir / name).mkdir()


F32 = np.float32
ERRORS = {
    # option syntax
    "no_arguments": (None, ["attention"], ["missing required option --q"]),
    "missing_q": (None, ["attention", "--k", "k.npy", "--v", "v.npy", "--out", "o.npy"],
                  ["missing required option --q"]),
    "missing_out": (None, BASE[:-2], ["missing required option --out"]),
    "missing_value": (None, BASE + ["--scale"], ["--scale: missing value"]),
    "option_as_path": (None, ["attention", "--q", "--k", "k.npy"], ["--q: missing value"]),
    "unknown_option": (None, BASE + ["--foo", "1"], ["unknown option '--foo'"]),
    "stray_argument": (None, BASE + ["extra"], ["unknown option 'extra'"]),
    "given_twice": (None, BASE + ["--causal", "--causal"], ["--causal: given more than once"]),
    "bad_layout": (None, BASE + ["--layout", "bsdh"], ["--layout: expected bshd or bhsd",
                                                       "bsdh"]),
    "bad_kernel": (None, BASE + ["--kernel", "fast"], ["--kernel: expected auto", "fast"]),
    "bad_align": (None, BASE + ["--align", "bottom"], ["--align: expected bottom-right"]),
    "bad_dtype": (None, BASE + ["--dtype", "f64"], ["--dtype: expected f32, bf16 or f16"]),
    "bad_threads": (None, BASE + ["--threads", "-1"], ["--threads: expected 0"]),
    "threads_not_int": (None, BASE + ["--threads", "two"], ["--threads: expected an integer"]),
    "scale_zero": (None, BASE + ["--scale", "0"], ["--scale: must be finite and > 0"]),
    "scale_negative": (None, BASE + ["--scale", "-0.5"], ["--scale: must be finite and > 0"]),
    "scale_nan": (None, BASE + ["--scale", "nan"], ["--scale"]),
    "scale_text": (None, BASE + ["--scale", "big"], ["--scale: expected a number", "big"]),
    "scale_too_large": (None, BASE + ["--scale", "1e300"], ["--scale: 1e300 is out of float32"]),
    "softcap_negative": (None, BASE + ["--softcap", "-1"], ["--softcap: must be finite and >= 0"]),
    "window_minus_2": (None, BASE + ["--window", "-2,0"], ["--window", "(-2, 0)", "below -1"]),
    "window_right_minus_2": (None, BASE + ["--window", "3,-2"], ["--window", "below -1"]),
    "window_one_value": (None, BASE + ["--window", "3"], ["--window: expected L,R"]),
    "window_not_int": (None, BASE + ["--window", "a,1"], ["--window: expected an integer"]),
    "weights_with_flash": (None, BASE + ["--kernel", "flash", "--weights", "w.npy"],
                           ["--weights: not available from --kernel flash"]),
    # files
    "nonexistent_file": (None, ["attention", "--q", "nothere.npy", "--k", "k.npy", "--v",
                                "v.npy", "--out", "o.npy"], ["--q nothere.npy: cannot open"]),
    "corrupt_npy": (_write("k.npy", b"this is not an npy file"), BASE,
                    ["--k k.npy: not a .npy file"]),
    "truncated_npy": (_truncate("v.npy"), BASE, ["--v v.npy: truncated data"]),
    # A 128-byte file whose header claims 64 GiB: refused from the file's size, before any
    # allocation (issue 18: it first tried to allocate the 64 GiB).
    "npy_claims_64_gib": (_write("k.npy", _npy_bytes("<f4", (1, 2**34, 1, 1))), BASE,
                          ["--k k.npy: truncated data", "needs 68719476736 data bytes",
                           "the file has 0"]),
    # A FIFO with no writer is refused at once instead of blocking forever (issue 18).
    "q_is_fifo": (lambda cli: os.mkfifo(cli.path("fifo.npy")),
                  ["attention", "--q", "fifo.npy", "--k", "k.npy", "--v", "v.npy", "--out",
                   "o.npy"], ["--q fifo.npy: not a regular file"]),
    "float64_input": (_save("q.npy", np.zeros(Q_SHAPE)), BASE,
                      ["--q q.npy: unsupported dtype '<f8' (float64)"]),
    "int32_input": (_save("v.npy", np.zeros(V_SHAPE, np.int32)), BASE,
                    ["--v v.npy: dtype int32 is not supported; expected float32"]),
    "fortran_order": (_save("q.npy", np.asfortranarray(np.zeros(Q_SHAPE, F32))), BASE,
                      ["--q q.npy: array is in Fortran order"]),
    "rank3_input": (_save("q.npy", np.zeros((2, 5, 4), F32)), BASE,
                    ["--q q.npy: shape (2, 5, 4) is not 4-D"]),
    "rank5_input": (_save("k.npy", np.zeros((1, 2, 7, 2, 8), F32)), BASE,
                    ["--k k.npy: rank 5 is not supported"]),
    "empty_dim": (_save("q.npy", np.zeros((2, 0, 4, 8), F32)), BASE,
                  ["--q q.npy: shape (2, 0, 4, 8)", "size 0"]),
    # shapes
    "head_dim_mismatch": (_save("k.npy", np.zeros((2, 7, 2, 6), F32)), BASE,
                          ["--q q.npy: shape (2, 5, 4, 8)", "--k k.npy: shape (2, 7, 2, 6)",
                           "head_dim"]),
    "heads_not_multiple": (_save("q.npy", np.zeros((2, 5, 3, 8), F32)), BASE,
                           ["--q q.npy: shape (2, 5, 3, 8)", "--k k.npy: shape (2, 7, 2, 8)"]),
    "seq_kv_mismatch": (_save("v.npy", np.zeros((2, 6, 2, 6), F32)), BASE,
                        ["--k k.npy: shape (2, 7, 2, 8)", "--v v.npy: shape (2, 6, 2, 6)"]),
    "batch_mismatch": (_save("k.npy", np.zeros((3, 7, 2, 8), F32)), BASE,
                       ["(2, 5, 4, 8)", "(3, 7, 2, 8)", "batch"]),
    "bhsd_heads_not_multiple": (None, BASE + ["--layout", "bhsd"],
                                ["--q q.npy", "--k k.npy", "--layout bhsd"]),
    # masks and bias
    "mask_not_broadcastable": (_save("m.npy", np.ones((5, 6), bool)), BASE + ["--mask", "m.npy"],
                               ["--mask m.npy: shape (5, 6) is not broadcastable to "
                                "(B, Hq, Lq, Lk) = (2, 4, 5, 7)"]),
    "mask_heads_not_broadcastable": (_save("m.npy", np.ones((2, 1, 7), bool)),
                                     BASE + ["--mask", "m.npy"], ["--mask m.npy: shape (2, 1, 7)",
                                                                 "(2, 4, 5, 7)"]),
    "mask_float": (_save("m.npy", np.ones((5, 7), F32)), BASE + ["--mask", "m.npy"],
                   ["--mask m.npy: dtype float32 is not supported; expected bool or uint8"]),
    "mask_rank5": (_save("m.npy", np.ones((1, 2, 4, 5, 7), bool)), BASE + ["--mask", "m.npy"],
                   ["--mask m.npy: rank 5 is not supported"]),
    "bias_bool": (_save("b.npy", np.ones((5, 7), bool)), BASE + ["--bias", "b.npy"],
                  ["--bias b.npy: dtype bool is not supported; expected float32"]),
    "bias_not_broadcastable": (_save("b.npy", np.ones((3, 5, 7), F32)), BASE + ["--bias", "b.npy"],
                               ["--bias b.npy: shape (3, 5, 7)", "(2, 4, 5, 7)"]),
    "key_length_negative": (_save("kl.npy", np.array([-1, 3], np.int32)),
                            BASE + ["--key-lengths", "kl.npy"],
                            ["--key-lengths kl.npy: entry 0 is -1"]),
    "key_length_too_large": (_save("kl.npy", np.array([3, 8], np.int64)),
                             BASE + ["--key-lengths", "kl.npy"],
                             ["--key-lengths kl.npy: entry 1 is 8", "7"]),
    "key_lengths_wrong_shape": (_save("kl.npy", np.array([3, 3, 3], np.int64)),
                                BASE + ["--key-lengths", "kl.npy"],
                                ["--key-lengths kl.npy: shape (3,) does not match (B,) = (2,)",
                                 "(2, 5, 4, 8)"]),
    "key_lengths_2d": (_save("kl.npy", np.array([[3], [3]], np.int64)),
                       BASE + ["--key-lengths", "kl.npy"],
                       ["--key-lengths kl.npy: shape (2, 1) does not match (B,)"]),
    "key_lengths_float": (_save("kl.npy", np.array([3.0, 3.0], F32)),
                          BASE + ["--key-lengths", "kl.npy"],
                          ["--key-lengths kl.npy: dtype float32 is not supported; expected "
                           "int32 or int64"]),
    # outputs
    "out_directory_missing": (None, BASE[:-1] + ["nodir/o.npy"],
                              ["--out nodir/o.npy: directory 'nodir' does not exist"]),
    "lse_directory_missing": (None, BASE + ["--lse", "nodir/l.npy"],
                              ["--lse nodir/l.npy: directory 'nodir' does not exist"]),
    "out_is_directory": (_mkdir("od"), BASE[:-1] + ["od"], ["--out od: is a directory"]),
    "out_is_fifo": (lambda cli: os.mkfifo(cli.path("fifo")), BASE[:-1] + ["fifo"],
                    ["--out fifo: exists and is not a regular file"]),
    "lse_same_as_out": (None, BASE + ["--lse", "./o.npy"], ["--lse ./o.npy: same file as --out"]),
    "existing_output_untouched": (_write("o.npy", b"keep me"), BASE + ["--scale", "0"],
                                  ["--scale"]),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_error(inputs, case):
    setup, args, expect = ERRORS[case]
    if setup is not None:
        setup(inputs)
    inputs.fails(*args, expect=expect)


def test_no_partial_output_when_a_later_output_fails(inputs):
    # --out is staged first; --lse goes to a directory that exists but cannot be written, so it
    # fails only when the outputs are written: --out must not appear either. A read-only
    # directory stops everyone but root; /proc refuses new files to root too.
    read_only = inputs.dir / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        lse = "ro/l.npy" if not os.access(read_only, os.W_OK) else "/proc/qkv-l.npy"
        inputs.fails(*BASE, "--lse", lse, "--weights", "w.npy",
                     expect=[f"--lse {lse}: cannot create output file"])
        assert list(read_only.iterdir()) == []
    finally:
        read_only.chmod(0o755)


def test_outputs_are_committed_all_or_none(inputs):
    # The --lse name is too long for the file system (> 255 bytes). Its temporary file has a
    # shortened name and is written fine; renaming it into place fails after --out was already
    # renamed, so the command must remove --out again.
    long_name = "l" * 300 + ".npy"
    inputs.fails(*BASE, "--lse", long_name, expect=[f"--lse {long_name}: cannot rename"])


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_bench_dtype(cli, dtype):
    import json
    result = cli.run("bench", "--json", "--shape", "1,2,1,70,90,16", "--repeats", "1",
                     "--threads", "1", "--dtype", dtype)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["dtype"] == dtype
    assert record["gflops"] > 0 and record["fp32_peak_gflops"] > 0
    # The product path that ran (kernel auto = flash here): vdpbf16ps pairs for bf16 on an AMD
    # CPU with AVX512-BF16 (bf16dot::preferred: slower than FMA on Intel's), AMX tiles on a CPU
    # with AMX-BF16 (f16 as bf16 hi + lo parts), else f32 FMA on the operands widened.
    flags = cpu_flags()
    pairs = dtype == "bf16" and "avx512_bf16" in flags and cpu_vendor() == "AuthenticAMD"
    amx = dtype != "f32" and not pairs and {"amx_bf16", "amx_tile", "avx512_bf16"} <= flags
    if dtype == "f32":
        assert record["products"] == "f32-fma"
        # f32 runs no AMX probe: its field reads exactly 0, not whatever the memory held.
        assert record["amx_peak_gflops"] == 0
        assert record["amx_softmax_together_over_sum"] == 0
    elif pairs:
        assert record["products"] == "bf16-vdpbf16ps"
    elif amx:
        assert record["products"] == ("bf16-amx" if dtype == "bf16" else "f16-amx-split")
        assert record["amx_peak_gflops"] > 0
        # Whether the tiles run beside the softmax is the CPU's business; that it was measured
        # (three positive times) is the test's.
        assert record["amx_softmax_together_over_sum"] > 0
    else:
        assert record["products"] == f"{dtype}-widened-fma"
    # %peak divides by the peak of the instructions that ran: the vdpbf16ps probe for the pairs,
    # the tdpbf16ps probe for the tiles, else the fp32 FMA probe. How fast the probes are is the
    # machine's business, not the test's.
    assert record["peak_gflops"] > 0
    assert record["fraction_of_peak"] == pytest.approx(
        record["gflops"] / record["peak_gflops"], rel=1e-3)
    if pairs:
        assert record["hwy_target"] == "AVX512_BF16"
    elif amx:
        assert record["hwy_target"] == "AMX_BF16"
        assert record["peak_gflops"] == record["amx_peak_gflops"]
    else:
        assert record["hwy_target"] not in ("AVX512_BF16", "AMX_BF16")
        assert record["peak_gflops"] == record["fp32_peak_gflops"]
    # K/V bytes follow the storage: 2 * Lk * D elements of 4 or 2 bytes.
    element = 4 if dtype == "f32" else 2
    assert record["kv_gbytes_per_second"] == pytest.approx(
        2 * 90 * 16 * element / record["seconds"] / 1e9, rel=1e-3)
    # Not a decode shape: no read sweeps between the repeats.
    assert record["read_gbytes_per_second_between_repeats"] == 0
    assert record["kv_fraction_of_read_between_repeats"] == 0
    assert record["kv_arrays_read_gbytes_per_second"] == 0
    assert record["kv_fraction_of_kv_arrays_read"] == 0


PRODUCT_PATHS = ["f32-fma", "bf16-widened-fma", "bf16-vdpbf16ps", "bf16-amx", "f16-widened-fma",
                 "f16-amx-split"]


def flash_paths(dtype):
    """The product paths the flash kernel can take for dtype on this CPU, from its flags."""
    flags = cpu_flags()
    pairs = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= flags
    amx = pairs and {"amx_bf16", "amx_tile"} <= flags
    if dtype == "f32":
        return {"f32-fma"}
    if dtype == "bf16":
        return ({"bf16-widened-fma"} | ({"bf16-vdpbf16ps"} if pairs else set())
                | ({"bf16-amx"} if amx else set()))
    return {"f16-widened-fma"} | ({"f16-amx-split"} if amx else set())


@pytest.mark.parametrize("path", PRODUCT_PATHS)
def test_bench_products_pins_the_path(cli, path):
    # Every path this CPU runs can be pinned and is the one that ran (the JSON's products, and
    # the peak it is measured against); any other is refused, naming the ones it can run.
    import json
    dtype = path.split("-")[0]
    args = ["bench", "--json", "--shape", "1,2,1,70,90,16", "--repeats", "1", "--threads", "1",
            "--dtype", dtype, "--products", path]
    available = flash_paths(dtype)
    if path not in available:
        message = cli.fails(*args, expect=[f"--products {path}: not available on this CPU"])
        listed = message.split(f"({dtype} runs on: ", 1)[1].rstrip(")").split(", ")
        assert set(listed) == available
        return
    result = cli.run(*args)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["products"] == path
    assert record["gflops"] > 0
    if path == "bf16-vdpbf16ps":
        assert record["hwy_target"] == "AVX512_BF16"
    elif path in ("bf16-amx", "f16-amx-split"):
        assert record["peak_gflops"] == record["amx_peak_gflops"] > 0
    else:
        assert record["peak_gflops"] == record["fp32_peak_gflops"]


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_bench_products_all_gives_a_row_per_path(cli, dtype):
    # --products all: one row per path this CPU runs for the dtype, each the path it names, the
    # CPU's own choice (a run without --products) first; a list gives its paths in its order.
    import json
    args = ["bench", "--json", "--shape", "1,2,1,70,90,16", "--repeats", "2", "--threads", "1",
            "--dtype", dtype]
    auto = cli.run(*args)
    assert auto.returncode == 0, auto.stderr
    result = cli.run(*args, "--products", "all")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    paths = [r["products"] for r in records]
    assert paths[0] == json.loads(auto.stdout)["products"]
    assert sorted(paths) == sorted(flash_paths(dtype))
    for r in records:
        assert (r["B"], r["Hq"], r["Hkv"], r["Lq"], r["Lk"], r["D"]) == (1, 2, 1, 70, 90, 16)
        assert r["repeats"] == 2 and r["gflops"] > 0
    listed = list(reversed(paths))
    result = cli.run(*args, "--products", ",".join(listed))
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["products"] for line in result.stdout.splitlines()] == listed


def backward_paths(dtype):
    """The product paths the flash backward can take for dtype on this CPU (docs/kernels.md,
    "Backward"): bf16 on vdpbf16ps pairs where lscpu has avx512_bf16, on AMX tiles where it has
    amx_bf16 and amx_tile too, and widened."""
    flags = cpu_flags()
    pairs = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= flags
    amx = pairs and {"amx_bf16", "amx_tile"} <= flags
    if dtype == "bf16":
        return ({"bf16-widened-fma"} | ({"bf16-vdpbf16ps"} if pairs else set())
                | ({"bf16-amx"} if amx else set()))
    return {f"{dtype}-widened-fma" if dtype != "f32" else "f32-fma"}


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_bench_backward_products_pins_the_backward_path(cli, dtype):
    # --products with --backward: the backward's own paths, one row each, each the path that ran
    # (bf16: the pairs, the tiles where the CPU has AMX and the widened FMA products, to compare
    # on one CPU).
    import json
    args = ["bench", "--json", "--backward", "--shape", "1,2,1,70,90,16", "--repeats", "1",
            "--threads", "1", "--dtype", dtype]
    result = cli.run(*args, "--products", "all")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(r["products"] for r in records) == sorted(backward_paths(dtype))
    assert all(r["kernel"] == "flash-backward" and r["gflops"] > 0 for r in records)
    for path in backward_paths(dtype):
        one = cli.run(*args, "--products", path)
        assert one.returncode == 0, one.stderr
        assert json.loads(one.stdout)["products"] == path


BENCH_PRODUCTS_ERRORS = {
    "unknown": (["--products", "fma"],
                ["--products: unknown path 'fma' (expected auto, all, f32-fma"]),
    "twice": (["--products", "f32-fma,f32-fma"], ["--products: f32-fma listed twice"]),
    "auto in a list": (["--products", "f32-fma,auto"],
                       ["--products: auto stands alone, not in a list ('f32-fma,auto')"]),
    "dtype": (["--products", "bf16-widened-fma"],
              ["--products bf16-widened-fma: a bf16 path, but --dtype is f32"]),
    "chunked": (["--products", "f32-fma", "--kernel", "flash,chunked"],
                ["--products: pins the flash kernel's products; --kernel chunked"]),
    "backward, a forward path": (["--products", "f16-amx-split", "--backward", "--dtype",
                                  "f16"],
                                 ["--products f16-amx-split: not available on this CPU "
                                  "(f16's backward runs on: f16-widened-fma)"]),
    "linear": (["--products", "f32-fma", "--linear", "elu"], ["not with --linear"]),
}


@pytest.mark.parametrize("case", sorted(BENCH_PRODUCTS_ERRORS))
def test_bench_products_errors(cli, case):
    args, expect = BENCH_PRODUCTS_ERRORS[case]
    cli.fails("bench", "--shape", "1,2,1,70,90,16", "--repeats", "1", *args, expect=expect)


@pytest.mark.parametrize("dtype,out_dtype", [("bf16", "input"), ("f16", "input"),
                                             ("bf16", "f32"), ("f32", "input")])
def test_bench_out_dtype(cli, dtype, out_dtype):
    import json
    result = cli.run("bench", "--json", "--shape", "1,2,1,70,90,16", "--repeats", "1",
                     "--threads", "1", "--dtype", dtype, "--out-dtype", out_dtype)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["dtype"] == dtype
    assert record["out_dtype"] == (dtype if out_dtype == "input" else "f32")
    assert record["gflops"] > 0


@pytest.mark.parametrize("args,expect", [
    (["--out-dtype", "bf16"], ["--out-dtype: expected f32 or input, got 'bf16'"]),
    (["--out-dtype", "input", "--backward"],
     ["--out-dtype input: attention's forward only (--backward writes f32)"]),
    (["--out-dtype", "input", "--linear", "elu"],
     ["--out-dtype input: attention's forward only (--linear writes f32)"]),
])
def test_bench_out_dtype_errors(cli, args, expect):
    cli.fails("bench", "--shape", "1,2,1,70,90,16", "--repeats", "1", *args, expect=expect)


@pytest.mark.parametrize("extra", [[], ["--backward"], ["--linear", "elu"],
                                   ["--kernel", "chunked"], ["--dtype", "bf16", "--causal"]])
def test_bench_layout_bhsd(cli, extra):
    import json
    args = ["bench", "--json", "--shape", "1,4,2,70,90,16", "--repeats", "1", "--threads", "1"]
    result = cli.run(*args, "--layout", "bhsd", *extra)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["layout"] == "bhsd" and record["gflops"] > 0
    assert (record["B"], record["Hq"], record["Hkv"], record["Lq"], record["Lk"],
            record["D"]) == (1, 4, 2, 70, 90, 16)
    assert " bhsd ..." in result.stderr
    default = cli.run(*args, *extra)
    assert default.returncode == 0, default.stderr
    assert json.loads(default.stdout)["layout"] == "bshd"


def test_bench_reports_the_head_major_kv_copy(cli):
    """kv_head_major_copy: whether the flash walk read a head-major copy of K and V (taken for
    BSHD K/V whose kv heads' rows are read by many tasks: 8 tasks a head in f32 here, 1 MiB of
    K and V a head), with its bytes in the scratch; not for the same arrays in BHSD."""
    import json
    args = ["bench", "--json", "--shape", "1,32,2,512,8192,16", "--repeats", "1", "--threads", "2"]
    records = {}
    for layout in ("bshd", "bhsd"):
        result = cli.run(*args, "--layout", layout)
        assert result.returncode == 0, result.stderr
        records[layout] = json.loads(result.stdout)
    assert records["bshd"]["kv_head_major_copy"] is True
    assert records["bhsd"]["kv_head_major_copy"] is False
    kv_bytes = 2 * 2 * 8192 * 16 * 4
    assert (records["bshd"]["scratch_peak_bytes"] - records["bhsd"]["scratch_peak_bytes"]
            >= kv_bytes)
    table = cli.run(*args[:1], *args[2:])
    assert table.returncode == 0, table.stderr
    assert "K/V walked from a head-major copy" in table.stdout


def test_bench_layout_errors(cli):
    cli.fails("bench", "--shape", "1,2,1,70,90,16", "--repeats", "1", "--layout", "bsdh",
              expect=["--layout: expected bshd or bhsd, got 'bsdh'"])


def test_bench_decode_sweeps_read_probe_between_repeats(cli):
    import json
    result = cli.run("bench", "--json", "--shape", "1,4,2,1,3000,32", "--repeats", "3",
                     "--threads", "1", "--dtype", "bf16")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    between = record["read_gbytes_per_second_between_repeats"]
    assert between > 0
    assert record["kv_fraction_of_read_between_repeats"] == pytest.approx(
        record["kv_gbytes_per_second"] / between, rel=1e-4)
    assert record["kv_fraction_of_read_bandwidth"] == pytest.approx(
        record["kv_gbytes_per_second"] / record["read_gbytes_per_second"], rel=1e-4)
    # And a plain read of the K and V arrays themselves after each repeat.
    arrays = record["kv_arrays_read_gbytes_per_second"]
    assert arrays > 0
    assert record["kv_fraction_of_kv_arrays_read"] == pytest.approx(
        record["kv_gbytes_per_second"] / arrays, rel=1e-4)
    # The probe sweeps max(256 MiB, twice the last-level cache), at most a quarter of the memory
    # (but never under 256), so that a sweep evicts K and V (glibc's cache sizes, as getconf
    # reads them).
    def getconf(name):
        out = subprocess.run(["getconf", name], capture_output=True, text=True).stdout.strip()
        return int(out) if out.lstrip("-").isdigit() else 0
    cache = getconf("LEVEL3_CACHE_SIZE")
    if cache <= 0:
        cache = getconf("LEVEL2_CACHE_SIZE")
    memory_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    expected = min(max(256.0, 2 * max(cache, 0) / 2**20), max(256.0, memory_mib / 4))
    assert record["read_buffer_mib"] == pytest.approx(expected, rel=1e-6)
    # The probe's buffer (and the operands) advised onto huge pages wherever the kernel has
    # transparent huge pages (core/huge_pages.h).
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert record["read_huge_pages"] is True
