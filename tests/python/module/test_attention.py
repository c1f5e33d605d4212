"""qkv.attention from Python against the float64 numpy reference: the CLI's case table (every
mask, GQA, Lq != Lk, Dv != D) through every kernel and both layouts, numpy / torch / jax inputs,
bf16 and f16, non-contiguous views passed without copies, out=, bad inputs, and threads."""

import sys
import threading
import time

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import qkv
import reference as ref
from cases import CASES, check_close, make_problem, references
from qkv import _qkv

KERNELS = ["reference", "chunked", "flash", "auto"]


def options_of(problem):
    """qkv.attention keyword arguments for a case-table problem."""
    options = {key: problem[key] for key in ("scale", "softcap", "causal", "window",
                                             "key_lengths", "mask", "bias") if key in problem}
    if "align" in problem:
        options["align"] = problem["align"].replace("-", "_")
    return options


def bhsd(x):
    """The (B, H, L, D) view of a (B, L, H, D) array: a transposed view, not a copy."""
    return x.transpose(0, 2, 1, 3)


def check_problem(problem, kernel="auto", layout="bshd", convert=lambda x: x, round_fn=None):
    """Runs qkv.attention on `problem` and checks out, lse (and weights where the kernel gives
    them) against the references."""
    views = {name: problem[name] if layout == "bshd" else bhsd(problem[name])
             for name in ("q", "k", "v")}
    weights_wanted = kernel in ("reference", "chunked")
    results = qkv.attention(convert(views["q"]), convert(views["k"]), convert(views["v"]),
                            layout=layout, kernel=kernel, return_lse=True,
                            return_weights=weights_wanted, **options_of(problem))
    out, lse = (np.asarray(results[0]), np.asarray(results[1]))
    if layout == "bhsd":
        out = bhsd(out)
    (out64, lse64, w64), (out32, lse32, w32) = references(problem, round_fn)
    check_close(out, out64, out32, "out")
    check_close(lse, lse64, lse32, "lse")
    if weights_wanted:
        check_close(np.asarray(results[2]), w64, w32, "weights")


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(rng, case, kernel, layout):
    check_problem(CASES[case](rng), kernel, layout)


def to_torch(x):
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_other_frameworks_match_reference(rng, case, framework):
    problem = CASES[case](rng)
    convert = to_torch if framework == "torch" else jnp.asarray
    check_problem(problem, "auto", "bshd", convert)
    # Masks, biases and key lengths of that framework too.
    for key in ("mask", "bias", "key_lengths"):
        if key in problem:
            problem[key] = convert(problem[key])
    check_problem(problem, "auto", "bshd", convert)


def test_results_come_back_in_the_callers_framework(rng):
    p = make_problem(rng)
    out, lse = qkv.attention(torch.from_numpy(p["q"]), torch.from_numpy(p["k"]),
                             torch.from_numpy(p["v"]), return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.dtype == torch.float32 and tuple(out.shape) == (2, 5, 4, 8)
    out = qkv.attention(jnp.asarray(p["q"]), jnp.asarray(p["k"]), jnp.asarray(p["v"]))
    assert type(out).__module__.startswith("jax") and out.shape == (2, 5, 4, 8)
    out = qkv.attention(p["q"], p["k"], p["v"])
    assert isinstance(out, np.ndarray) and out.dtype == np.float32


@pytest.mark.parametrize("seq_q,seq_kv,head_dim", [(1, 1, 1), (3, 1, 3), (7, 7, 65), (63, 130, 64),
                                                   (65, 65, 16), (130, 65, 7)])
@pytest.mark.parametrize("kernel", ["reference", "chunked", "flash"])
def test_odd_sizes(rng, seq_q, seq_kv, head_dim, kernel):
    problem = make_problem(rng, batch=1, seq_q=seq_q, seq_kv=seq_kv, num_heads_q=2,
                           num_heads_kv=1, head_dim=head_dim, causal=True,
                           key_lengths=np.array([max(1, seq_kv - 2)]))
    check_problem(problem, kernel)


# ---------------------------------------------------------------------------------------------
# Half precision: bf16 and f16 from every framework that has them

HALF = {
    "torch_bf16": (lambda x: torch.from_numpy(x).to(torch.bfloat16), ref.round_bf16),
    "torch_f16": (lambda x: torch.from_numpy(x).to(torch.float16), ref.round_f16),
    "numpy_bf16": (lambda x: x.astype(ml_dtypes.bfloat16), ref.round_bf16),
    "numpy_f16": (lambda x: x.astype(np.float16), ref.round_f16),
    "jax_bf16": (lambda x: jnp.asarray(x, dtype=jnp.bfloat16), ref.round_bf16),
}


@pytest.mark.parametrize("half", sorted(HALF))
@pytest.mark.parametrize("case", ["plain", "causal_bottom_right", "gqa", "combined",
                                  "mask_empty_rows", "dv_ne_d"])
def test_half_inputs_match_reference_on_rounded_inputs(rng, case, half):
    convert, round_fn = HALF[half]
    check_problem(CASES[case](rng), "auto", "bshd", convert, round_fn)


def test_numpy_bf16_views_keep_their_strides(rng):
    p = make_problem(rng, seq_q=9, seq_kv=9)
    q16 = p["q"].astype(ml_dtypes.bfloat16)[:, ::2]  # a strided bf16 view
    out = qkv.attention(q16, p["k"].astype(ml_dtypes.bfloat16), p["v"].astype(ml_dtypes.bfloat16))
    expected = qkv.attention(np.ascontiguousarray(q16), p["k"].astype(ml_dtypes.bfloat16),
                             p["v"].astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("head_dim", [64, 40, 72])
def test_bf16_decode_query_strided_along_head_dim(rng, head_dim):
    """A decode step (one query row per head: the flash kernel's narrow blocks) whose q is a
    view with a stride along head_dim: the narrow blocks read such a q element by element, a
    contiguous one by vectors, and both must give the same bits (the bf16 rows are kept in the
    even/odd order of their products, docs/kernels.md), and the reference's values."""
    p = make_problem(rng, batch=2, seq_q=1, seq_kv=300, num_heads_q=8, num_heads_kv=2,
                     head_dim=head_dim)
    wide = np.repeat(p["q"], 2, axis=-1)  # (B, 1, Hq, 2 D): every element twice
    q16 = wide.astype(ml_dtypes.bfloat16)[..., ::2]  # stride 2 along head_dim
    k16, v16 = (p[name].astype(ml_dtypes.bfloat16) for name in ("k", "v"))
    out = qkv.attention(q16, k16, v16, kernel="flash", return_lse=True)
    contiguous = qkv.attention(np.ascontiguousarray(q16), k16, v16, kernel="flash",
                               return_lse=True)
    for got, expected in zip(out, contiguous):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    check_problem(p, "flash", "bshd", *HALF["numpy_bf16"])


# out in the inputs' dtype: the float32 result rounded to nearest even by the kernel

OUT_HALF = {
    "torch_bf16": (lambda x: torch.from_numpy(x).to(torch.bfloat16), torch.bfloat16,
                   lambda out: out.to(torch.bfloat16)),
    "torch_f16": (lambda x: torch.from_numpy(x).to(torch.float16), torch.float16,
                  lambda out: out.to(torch.float16)),
    "numpy_bf16": (lambda x: x.astype(ml_dtypes.bfloat16), "bfloat16",
                   lambda out: out.astype(ml_dtypes.bfloat16)),
    "numpy_f16": (lambda x: x.astype(np.float16), "f16", lambda out: out.astype(np.float16)),
    "jax_bf16": (lambda x: jnp.asarray(x, dtype=jnp.bfloat16), jnp.bfloat16,
                 lambda out: out.astype(jnp.bfloat16)),
}


def as_bits(x):
    """The 16-bit words of a bf16 / f16 array of any framework, as numpy uint16."""
    if isinstance(x, torch.Tensor):
        return x.contiguous().view(torch.int16).numpy().view(np.uint16)
    return np.asarray(x).view(np.uint16)


@pytest.mark.parametrize("kernel", ["reference", "chunked", "flash"])
@pytest.mark.parametrize("half", sorted(OUT_HALF))
@pytest.mark.parametrize("case", ["plain", "gqa", "mask_empty_rows", "dv_ne_d"])
def test_out_dtype_is_the_float32_out_rounded(rng, case, half, kernel):
    convert, dtype, round_out = OUT_HALF[half]
    problem = CASES[case](rng)
    q, k, v = (convert(problem[name]) for name in ("q", "k", "v"))
    options = options_of(problem)
    out32, lse32 = qkv.attention(q, k, v, kernel=kernel, return_lse=True, **options)
    out16, lse16 = qkv.attention(q, k, v, kernel=kernel, return_lse=True, out_dtype=dtype,
                                 **options)
    assert str(out16.dtype) == str(q.dtype)
    assert type(out16) is type(out32)
    np.testing.assert_array_equal(as_bits(out16), as_bits(round_out(out32)))
    np.testing.assert_array_equal(np.asarray(lse16), np.asarray(lse32))


def test_out_dtype_float32_and_half_out_arrays(rng):
    p = make_problem(rng)
    q, k, v = (torch.from_numpy(p[name]).to(torch.bfloat16) for name in ("q", "k", "v"))
    expected = qkv.attention(q, k, v)
    assert expected.dtype == torch.float32
    np.testing.assert_array_equal(qkv.attention(q, k, v, out_dtype="float32").numpy(),
                                  expected.numpy())
    out = torch.full((2, 5, 4, 8), 7.0, dtype=torch.bfloat16)
    assert qkv.attention(q, k, v, out=out) is out
    np.testing.assert_array_equal(as_bits(out), as_bits(expected.to(torch.bfloat16)))
    # numpy bf16 (ml_dtypes) and a strided half out.
    n = [p[name].astype(ml_dtypes.bfloat16) for name in ("q", "k", "v")]
    big = np.full((2, 10, 4, 8), 7.0, ml_dtypes.bfloat16)
    qkv.attention(*n, out=big[:, ::2])
    np.testing.assert_array_equal(as_bits(big[:, ::2]), as_bits(out))
    assert (big[:, 1::2].astype(np.float32) == 7.0).all()


@pytest.mark.parametrize("inputs,kwargs,error,fragment", [
    ("f32", {"out_dtype": "bfloat16"}, ValueError,
     "out_dtype: 'bfloat16' is neither float32 nor q's dtype"),
    ("bf16", {"out_dtype": torch.float16}, ValueError,
     "out_dtype: torch.float16 is neither float32 nor q's dtype"),
    ("bf16", {"out_dtype": "int8"}, ValueError, "out_dtype: expected float32, bfloat16 or float16"),
    ("bf16", {"out_dtype": "bf16", "out": torch.zeros(2, 5, 4, 8, dtype=torch.bfloat16)},
     ValueError, "out_dtype: give out= or out_dtype, not both"),
    ("f32", {"out": torch.zeros(2, 5, 4, 8, dtype=torch.bfloat16)}, ValueError,
     "out: dtype bf16 is not supported (expected f32)"),
    ("bf16", {"out": torch.zeros(2, 5, 4, 8, dtype=torch.float16)}, ValueError,
     "out: dtype f16 is not supported (expected f32, or bf16 as q, k and v are)"),
])
def test_bad_out_dtype_raises_and_writes_nothing(rng, inputs, kwargs, error, fragment):
    p = make_problem(rng)
    q, k, v = (torch.from_numpy(p[name]) for name in ("q", "k", "v"))
    if inputs == "bf16":
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    if "out" in kwargs:
        kwargs["out"].fill_(7)
    with pytest.raises(error) as info:
        qkv.attention(q, k, v, **kwargs)
    assert fragment in str(info.value)
    if "out" in kwargs:
        assert (kwargs["out"] == 7).all()


def test_backward_refuses_a_half_out(rng):
    p = make_problem(rng)
    q, k, v = (torch.from_numpy(p[name]).bfloat16() for name in ("q", "k", "v"))
    out, lse = qkv.attention(q, k, v, return_lse=True, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out: dtype bf16 is not supported \(expected f32\)"):
        qkv.attention_backward(q, k, v, out, lse, torch.ones(2, 5, 4, 8))


# ---------------------------------------------------------------------------------------------
# Views without copies

def test_strided_views_are_read_in_place(rng):
    base = rng.standard_normal((2, 11, 6, 16), dtype=np.float32)
    views = {
        "sliced_seq": base[:, 1::2],
        "sliced_heads": base[:, :, ::3],
        "reversed_seq": base[:, ::-1],
        "sliced_dim": base[..., 3:11],
        "bhsd_transposed": base.transpose(0, 2, 1, 3),
    }
    for name, view in views.items():
        assert _qkv._data_address(view) == view.ctypes.data, name
        out = qkv.attention(view, view, view, causal=True)
        copy = np.ascontiguousarray(view)
        np.testing.assert_array_equal(out, qkv.attention(copy, copy, copy, causal=True), name)
    t = torch.from_numpy(base).transpose(1, 2)
    assert _qkv._data_address(t) == t.data_ptr()
    j = jnp.asarray(base)
    assert _qkv._data_address(j) == j.unsafe_buffer_pointer()


def test_broadcast_views_with_zero_strides(rng):
    p = make_problem(rng)
    mask = np.broadcast_to(rng.random((1, 1, 5, 7)) < 0.7, (2, 4, 5, 7))  # stride 0 dims
    out = qkv.attention(p["q"], p["k"], p["v"], mask=mask)
    expected = qkv.attention(p["q"], p["k"], p["v"], mask=np.ascontiguousarray(mask))
    np.testing.assert_array_equal(out, expected)


# ---------------------------------------------------------------------------------------------
# out=

def test_out_is_written_in_place_and_returned(rng):
    p = make_problem(rng)
    out = np.full((2, 5, 4, 8), 7.0, np.float32)
    result = qkv.attention(p["q"], p["k"], p["v"], out=out)
    assert result is out
    np.testing.assert_array_equal(out, qkv.attention(p["q"], p["k"], p["v"]))
    # A strided out (every other row of a larger buffer) is written where it points.
    big = np.full((2, 10, 4, 8), 7.0, np.float32)
    qkv.attention(p["q"], p["k"], p["v"], out=big[:, ::2])
    np.testing.assert_array_equal(big[:, ::2], out)
    assert (big[:, 1::2] == 7.0).all()
    t = torch.full((2, 5, 4, 8), 7.0)
    assert qkv.attention(torch.from_numpy(p["q"]), torch.from_numpy(p["k"]),
                         torch.from_numpy(p["v"]), out=t) is t
    np.testing.assert_array_equal(t.numpy(), out)


@pytest.mark.parametrize("bad_out,error,fragment", [
    (np.zeros((2, 5, 4, 7), np.float32), ValueError, "out: shape (2, 5, 4, 7) must be (2, 5, 4, 8)"),
    (np.zeros((2, 5, 4, 8), np.float64), ValueError,
     "out: dtype f64 is not supported (expected f32)"),
    (np.zeros((2, 5, 4, 8), np.int32), TypeError, "out: dtype int32 is not supported"),
    (np.zeros((2, 5, 4), np.float32), ValueError, "out: shape (2, 5, 4) has 3 dims"),
])
def test_bad_out_raises_and_writes_nothing(rng, bad_out, error, fragment):
    p = make_problem(rng)
    bad_out[...] = 7
    with pytest.raises(error, match=None) as info:
        qkv.attention(p["q"], p["k"], p["v"], out=bad_out)
    assert fragment in str(info.value)
    assert (bad_out == 7).all()


def test_errors_after_out_checks_write_nothing(rng):
    p = make_problem(rng)
    out = np.full((2, 5, 4, 8), 7.0, np.float32)
    with pytest.raises(ValueError, match="window"):
        qkv.attention(p["q"], p["k"], p["v"], window=(-2, 0), out=out)
    with pytest.raises(ValueError, match="key_lengths"):
        qkv.attention(p["q"], p["k"], p["v"], key_lengths=[3, 8], out=out)
    assert (out == 7).all()


def test_out_sharing_memory_with_an_input_is_refused(rng):
    p = make_problem(rng, num_heads_q=2, num_heads_kv=2)
    q = p["q"].copy()
    with pytest.raises(ValueError, match="out: its memory overlaps q's"):
        qkv.attention(q, p["k"], p["v"], out=q)  # in place would read overwritten rows
    np.testing.assert_array_equal(q, p["q"])


def test_read_only_out_is_refused(rng):
    p = make_problem(rng)
    out = np.zeros((2, 5, 4, 8), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: the array is read-only"):
        qkv.attention(p["q"], p["k"], p["v"], out=out)


# ---------------------------------------------------------------------------------------------
# Bad input: a clear exception naming the argument and the shapes

def bad_inputs(rng):
    p = make_problem(rng)
    q, k, v = p["q"], p["k"], p["v"]
    return {
        "q_int64": ((q.astype(np.int64), k, v), {}, TypeError,
                    "q: dtype int64 is not supported; expected float32, bfloat16, float16 or "
                    "float64"),
        "mixed_float64": ((q.astype(np.float64), k, v), {}, ValueError,
                          "k: dtype f32 differs from q's f64"),
        "k_int32": ((q, k.astype(np.int32), v), {}, TypeError, "k: dtype int32 is not supported"),
        "mixed_dtypes": ((q, k.astype(np.float16), v), {}, ValueError,
                         "k: dtype f16 differs from q's f32"),
        "q_list": (([1.0], k, v), {}, TypeError, "q: expected an array"),
        "k_none": ((q, None, v), {}, TypeError, "k: expected an array"),
        "q_rank3": ((q[0], k, v), {}, ValueError, "q: shape (5, 4, 8) has 3 dims; expected 4: "
                                                 "(B, Lq, Hq, D)"),
        "v_rank5": ((q, k, v[None]), {}, ValueError, "v: shape (1, 2, 7, 2, 8) has 5 dims"),
        "seq_kv_mismatch": ((q, k[:, :6], v), {}, ValueError,
                            "k: shape (2, 6, 2, 8) does not match v: shape (2, 7, 2, 8)"),
        "head_dim_mismatch": ((q[..., :7], k, v), {}, ValueError,
                              "q: shape (2, 5, 4, 7) does not match k: shape (2, 7, 2, 8)"),
        "heads_not_multiple": ((q[:, :, :3], k, v), {}, ValueError, "not a multiple"),
        "bhsd_hint": ((q, k, v), {"layout": "bhsd"}, ValueError, "with layout='bhsd'"),
        "layout": ((q, k, v), {"layout": "sbhd"}, ValueError, "layout: expected 'bshd' or 'bhsd'"),
        "align": ((q, k, v), {"align": "middle"}, ValueError, "align: expected 'bottom_right'"),
        "kernel": ((q, k, v), {"kernel": "fast"}, ValueError, "kernel: expected 'auto'"),
        "window_tuple": ((q, k, v), {"window": 3}, TypeError, "window: expected (left, right)"),
        "window_float": ((q, k, v), {"window": (1.5, 0)}, TypeError, "window: expected an integer"),
        "window_below": ((q, k, v), {"window": (-2, 0)}, ValueError, "window: (-2, 0)"),
        "scale_zero": ((q, k, v), {"scale": 0.0}, ValueError, "scale: must be finite and > 0"),
        "softcap_negative": ((q, k, v), {"softcap": -1.0}, ValueError, "softcap"),
        "threads_negative": ((q, k, v), {"num_threads": -1}, ValueError, "num_threads"),
        "key_lengths_count": ((q, k, v), {"key_lengths": [3]}, ValueError,
                              "key_lengths: has 1 entries, expected batch = 2"),
        "key_lengths_range": ((q, k, v), {"key_lengths": [3, 8]}, ValueError,
                              "key_lengths: entry 1 is 8, outside [0, seq_kv = 7]"),
        "key_lengths_float": ((q, k, v), {"key_lengths": [3.5, 2.0]}, TypeError,
                              "key_lengths: expected integers"),
        "key_lengths_float_array": ((q, k, v), {"key_lengths": np.array([3.0, 2.0])}, TypeError,
                                    "key_lengths: dtype float64 is not supported"),
        "mask_float": ((q, k, v), {"mask": np.ones((5, 7), np.float32)}, TypeError,
                       "mask: dtype float32 is not supported; expected bool or uint8"),
        "mask_shape": ((q, k, v), {"mask": np.ones((5, 6), bool)}, ValueError,
                       "is not broadcastable to (B, Hq, Lq, Lk) = (2, 4, 5, 7)"),
        "bias_float64": ((q, k, v), {"bias": np.zeros((5, 7))}, TypeError,
                         "bias: dtype float64 is not supported; expected float32"),
        "bias_nan": ((q, k, v), {"bias": np.full((5, 7), np.nan, np.float32)}, ValueError,
                     "bias: element (0, 0, 0, 0)"),
        "weights_from_flash": ((q, k, v), {"kernel": "flash", "return_weights": True}, ValueError,
                               "the flash kernel never materialises probabilities"),
        "torch_meta_device": ((torch.from_numpy(q).to("meta"), torch.from_numpy(k),
                               torch.from_numpy(v)), {}, ValueError,
                              "q: the tensor is on device 'meta'; qkv computes on the CPU"),
        "sparsity_type": ((q, k, v), {"sparsity": "longformer"}, TypeError, "sparsity"),
        "longformer_window": ((q, k, v), {"sparsity": qkv.longformer(window=-1)}, ValueError,
                              "sparsity"),
    }


@pytest.mark.parametrize("case", sorted(bad_inputs(np.random.default_rng(0))))
def test_bad_input_raises_a_clear_error(rng, case):
    args, kwargs, error, fragment = bad_inputs(rng)[case]
    with pytest.raises(error) as info:
        qkv.attention(*args, **kwargs)
    assert fragment in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------
# Threads and the GIL

def test_two_python_threads_at_once_give_correct_results(rng):
    problems = [make_problem(rng, batch=2, seq_q=300, seq_kv=400, num_heads_q=4,
                             num_heads_kv=2, head_dim=32, causal=True) for _ in range(2)]
    expected = [qkv.attention(p["q"], p["k"], p["v"], causal=True) for p in problems]
    results = [[], []]

    def work(index):
        p = problems[index]
        for _ in range(10):
            results[index].append(qkv.attention(p["q"], p["k"], p["v"], causal=True))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for index in range(2):
        assert len(results[index]) == 10
        for out in results[index]:
            np.testing.assert_array_equal(out, expected[index])


def test_the_gil_is_released_while_computing(rng):
    # With a switch interval far longer than the call, the main thread (waiting on an Event)
    # gets the GIL back only when the worker releases it: inside the call if qkv releases it,
    # else only after the call returned.
    p = make_problem(rng, batch=1, seq_q=1024, seq_kv=1024, num_heads_q=8, num_heads_kv=8,
                     head_dim=64)
    started, interval = threading.Event(), []

    def compute():
        started.set()
        start = time.perf_counter()
        qkv.attention(p["q"], p["k"], p["v"], num_threads=1)
        interval.extend([start, time.perf_counter()])

    old = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        worker = threading.Thread(target=compute)
        worker.start()
        started.wait()
        woke = time.perf_counter()
        worker.join()
    finally:
        sys.setswitchinterval(old)
    start, end = interval
    assert start < woke < end, (woke - start, end - start)


def test_results_do_not_depend_on_thread_count(rng):
    p = make_problem(rng, batch=2, seq_q=130, seq_kv=257, num_heads_q=4, num_heads_kv=2,
                     head_dim=64, causal=True)
    results = [qkv.attention(p["q"], p["k"], p["v"], causal=True, num_threads=n)
               for n in (1, 2, 3)]
    for out in results[1:]:
        np.testing.assert_array_equal(out, results[0])


def cpu_flags():
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_vendor():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@pytest.mark.parametrize("dtype, names", [
    ("f32", ["float32", "f32", np.float32, np.dtype(np.float32), torch.float32, jnp.float32]),
    ("bf16", ["bfloat16", "bf16", ml_dtypes.bfloat16, torch.bfloat16, jnp.bfloat16]),
    ("f16", ["float16", "f16", "half", np.float16, torch.float16, jnp.float16]),
])
def test_product_path_names_the_instructions_for_this_cpu(dtype, names):
    # What the flash kernel takes, from the CPU's flags (as qkv bench reports it): vdpbf16ps
    # pairs for bf16 on an AMD CPU with AVX512-BF16, AMX tiles where AMX-BF16 is there (f16 as
    # bf16 hi + lo parts), else f32 FMA on the widened operands.
    flags = cpu_flags()
    avx512_bf16 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= flags
    amx = avx512_bf16 and {"amx_bf16", "amx_tile"} <= flags
    if dtype == "f32":
        expected = "f32-fma"
    elif dtype == "bf16" and avx512_bf16 and cpu_vendor() == "AuthenticAMD":
        expected = "bf16-vdpbf16ps"
    elif amx:
        expected = "bf16-amx" if dtype == "bf16" else "f16-amx-split"
    else:
        expected = f"{dtype}-widened-fma"
    for name in names:
        assert qkv.product_path(name) == expected, name


@pytest.mark.parametrize("bad", ["float64", "int8", "bf8", None, 3])
def test_product_path_refuses_other_dtypes(bad):
    with pytest.raises(ValueError, match="dtype: expected float32, bfloat16 or float16"):
        qkv.product_path(bad)
