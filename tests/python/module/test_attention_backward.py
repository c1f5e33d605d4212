"""qkv.attention_backward from Python against the float64 numpy backward (reference.py): the
case table through the flash and reference kernels and both layouts, torch inputs, dbias,
and the errors."""

import numpy as np
import pytest
import torch

import qkv
import reference as ref
from cases import CASES, check_close

OPTIONS = ("scale", "softcap", "causal", "window", "key_lengths", "mask", "bias")


def options_of(problem):
    options = {key: problem[key] for key in OPTIONS if key in problem}
    if "align" in problem:
        options["align"] = problem["align"].replace("-", "_")
    return options


def numpy_grads(problem, dout, dtype):
    options = {key: problem[key] for key in OPTIONS + ("align",) if key in problem}
    return ref.attention_backward(problem["q"], problem["k"], problem["v"], dout=dout,
                                  **options, dtype=dtype)


def bhsd(x):
    return x.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("kernel", ["flash", "reference"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_numpy_backward(rng, case, kernel):
    problem = CASES[case](rng)
    options = options_of(problem)
    q, k, v = problem["q"], problem["k"], problem["v"]
    out, lse = qkv.attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    with_dbias = problem.get("bias") is not None
    grads = qkv.attention_backward(q, k, v, out, lse, dout, kernel=kernel,
                                   return_dbias=with_dbias, **options)
    g64 = numpy_grads(problem, dout, np.float64)
    g32 = numpy_grads(problem, dout, np.float32)
    for name, a, r64, r32 in zip(("dq", "dk", "dv", "dbias"), grads, g64, g32):
        check_close(a, r64, r32, name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_float64_matches_numpy_float64(rng, case):
    """float64 inputs: the reference kernel in float64 end to end, against the float64 numpy
    forward and backward to 1e-12 (the float32 path is ~1e-6 off)."""
    problem = CASES[case](rng)
    options = options_of(problem)
    q, k, v = (problem[name].astype(np.float64) for name in ("q", "k", "v"))
    out, lse = qkv.attention(q, k, v, return_lse=True, **options)
    assert out.dtype == lse.dtype == np.float64
    numpy_options = {key: problem[key] for key in OPTIONS + ("align",) if key in problem}
    out64, lse64, _ = ref.attention(q, k, v, **numpy_options, dtype=np.float64)
    np.testing.assert_allclose(out, out64, rtol=0, atol=1e-12)
    finite = np.isfinite(lse64)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse64[finite], rtol=0, atol=1e-12)
    dout = rng.standard_normal(out.shape)
    grads = qkv.attention_backward(q, k, v, out, lse, dout, **options)
    want = ref.attention_backward(q, k, v, dout=dout, **numpy_options, dtype=np.float64)
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want[:3]):
        assert got.dtype == np.float64, name
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-11, err_msg=name)


def test_float64_errors(rng):
    q = rng.standard_normal((1, 3, 2, 4))
    with pytest.raises(ValueError, match="f64 inputs run on the reference kernel only"):
        qkv.attention(q, q, q, kernel="flash")
    with pytest.raises(ValueError, match="out: dtype f32"):
        qkv.attention(q, q, q, out=np.empty((1, 3, 2, 4), np.float32))
    with pytest.raises(ValueError, match="differs from q's f64"):
        qkv.attention(q, q.astype(np.float32), q)
    out, lse = qkv.attention(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="dout: dtype f32"):
        qkv.attention_backward(q, q, q, out, lse, np.ones((1, 3, 2, 4), np.float32))


def test_bhsd_and_torch(rng):
    problem = CASES["combined"](rng)
    options = options_of(problem)
    options.pop("key_lengths")
    q, k, v = (torch.from_numpy(bhsd(problem[n])) for n in ("q", "k", "v"))  # strided views
    out, lse = qkv.attention(q, k, v, layout="bhsd", return_lse=True, **options)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dq, dk, dv = qkv.attention_backward(q, k, v, out, lse, dout, layout="bhsd", **options)
    assert all(isinstance(g, torch.Tensor) for g in (dq, dk, dv))
    problem.pop("key_lengths")
    g64 = numpy_grads(problem, bhsd(dout.numpy()), np.float64)
    g32 = numpy_grads(problem, bhsd(dout.numpy()), np.float32)
    for name, a, r64, r32 in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, g32):
        check_close(bhsd(a.numpy()), r64, r32, name)


def test_errors(rng):
    problem = CASES["plain"](rng)
    q, k, v = problem["q"], problem["k"], problem["v"]
    out, lse = qkv.attention(q, k, v, return_lse=True)
    dout = np.zeros_like(out)
    with pytest.raises(ValueError, match=r"dout: shape \(2, 5, 4, 4\)"):
        qkv.attention_backward(q, k, v, out, lse, dout[..., :4])
    with pytest.raises(ValueError, match="return_dbias: needs a bias"):
        qkv.attention_backward(q, k, v, out, lse, dout, return_dbias=True)
    with pytest.raises(TypeError, match="bias: expected an array"):
        qkv.attention_backward(q, k, v, out, lse, dout, bias=(1.0, 2.0), return_dbias=True)
    with pytest.raises(ValueError, match="no chunked kernel"):
        qkv.attention_backward(q, k, v, out, lse, dout, kernel="chunked")
    with pytest.raises(ValueError, match="dout: dtype f64 is not supported .expected f32."):
        qkv.attention_backward(q, k, v, out, lse, dout.astype(np.float64))
