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
    with pytest.raises(ValueError, match="no chunked kernel"):
        qkv.attention_backward(q, k, v, out, lse, dout, kernel="chunked")
    with pytest.raises(TypeError, match="dout"):
        qkv.attention_backward(q, k, v, out, lse, dout.astype(np.float64))
