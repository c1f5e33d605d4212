"""qkv.torch.scaled_dot_product_attention against torch's own SDPA on the same inputs: PyTorch's
semantics (BHSD, bool mask True = takes part, float mask added, is_causal top-left, scale,
enable_gqa), dtypes, shapes of 3 to 5 dims, errors, and torch.compile / torch.library checks."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
import qkv.torch as qt


def tensors(seed, batch=2, heads_q=4, heads_kv=4, seq_q=37, seq_kv=53, head_dim=16,
            head_dim_v=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q = torch.randn(batch, heads_q, seq_q, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, heads_kv, seq_kv, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, heads_kv, seq_kv, head_dim_v, generator=g).to(dtype)
    return q, k, v


def torch_reference(q, k, v, **options):
    """torch's SDPA in float64 (its math kernel): the oracle for both."""
    mask = options.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        options = dict(options, attn_mask=mask.double())
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **options)


def check(q, k, v, atol=2e-5, **options):
    ours = qt.scaled_dot_product_attention(q, k, v, **options)
    theirs = F.scaled_dot_product_attention(q, k, v, **options)
    assert ours.dtype == q.dtype and ours.shape == theirs.shape
    expected = torch_reference(q, k, v, **options)
    # qkv within the tolerance of float64, and no further from it than torch's own f32/bf16.
    ours_error = (ours.double() - expected).abs().max().item()
    theirs_error = (theirs.double() - expected).abs().max().item()
    assert ours_error <= max(atol, 4 * theirs_error), (ours_error, theirs_error)


CASES = {
    "plain": ({}, {}),
    "causal": ({}, {"is_causal": True}),
    "causal_lq_lt_lk": ({"seq_q": 11, "seq_kv": 40}, {"is_causal": True}),
    "causal_lq_gt_lk": ({"seq_q": 40, "seq_kv": 11}, {"is_causal": True}),
    "scale": ({}, {"scale": 0.3}),
    "gqa": ({"heads_q": 6, "heads_kv": 2}, {"enable_gqa": True}),
    "mqa_causal": ({"heads_q": 5, "heads_kv": 1}, {"enable_gqa": True, "is_causal": True}),
    "dv_ne_d": ({"head_dim": 24, "head_dim_v": 9}, {}),
    "decode": ({"seq_q": 1, "seq_kv": 77}, {}),
    "odd": ({"batch": 1, "heads_q": 3, "heads_kv": 3, "seq_q": 65, "seq_kv": 129,
             "head_dim": 7}, {"is_causal": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_sdpa(case):
    shape, options = CASES[case]
    check(*tensors(1, **shape), **options)


@pytest.mark.parametrize("mask_shape", [(2, 4, 37, 53), (37, 53), (1, 53), (2, 1, 1, 53),
                                        (4, 37, 53), (1, 1, 37, 1)])
def test_bool_mask_true_takes_part(mask_shape):
    q, k, v = tensors(2)
    mask = torch.rand(mask_shape, generator=torch.Generator().manual_seed(3)) < 0.7
    # Keep at least one key per row, where torch's math kernel would give NaN.
    mask = mask | (torch.arange(53) == 0)
    check(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("mask_shape", [(2, 4, 37, 53), (37, 53), (2, 1, 37, 53)])
def test_float_mask_is_added(mask_shape):
    q, k, v = tensors(4)
    bias = torch.randn(mask_shape, generator=torch.Generator().manual_seed(5))
    bias[..., 7] = float("-inf")
    check(q, k, v, attn_mask=bias)


def causal_bias(variant, seq_q, seq_kv):
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left
    return (causal_lower_right if variant == "lower_right" else causal_upper_left)(seq_q, seq_kv)


def causal_mask(variant, seq_q, seq_kv):
    """The bool mask the bias stands for: key j <= i + (S - L) (lower right) or j <= i."""
    shift = seq_kv - seq_q if variant == "lower_right" else 0
    return torch.ones(seq_q, seq_kv, dtype=torch.bool).tril(diagonal=shift)


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("variant", ["lower_right", "upper_left"])
@pytest.mark.parametrize("shape", [{"seq_q": 4, "seq_kv": 53, "heads_q": 8, "heads_kv": 2},
                                   {"seq_q": 37, "seq_kv": 53}, {"seq_q": 1, "seq_kv": 77},
                                   {"seq_q": 19, "seq_kv": 19, "heads_q": 6, "heads_kv": 3},
                                   {"seq_q": 30, "seq_kv": 11}])
def test_causal_bias_is_the_causal_mask_it_stands_for(variant, shape):
    """torch's causal_lower_right / causal_upper_left as attn_mask: computed as qkv's causal
    mask aligned there, against torch's own SDPA with the same bias and float64 on the bool mask
    it stands for; rows with no key (lower right, L > S) are zeros, as for any mask."""
    q, k, v = tensors(30, **shape)
    seq_q, seq_kv = shape["seq_q"], shape["seq_kv"]
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    ours = qt.scaled_dot_product_attention(q, k, v, attn_mask=causal_bias(variant, seq_q, seq_kv),
                                           **gqa)
    mask = causal_mask(variant, seq_q, seq_kv)
    expected = torch.nan_to_num(torch_reference(q, k, v, attn_mask=mask, **gqa))
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_bias(variant, seq_q, seq_kv),
                                            **gqa)
    theirs_error = torch.nan_to_num((theirs.double() - expected).abs().max(), nan=0.0).item()
    assert ours.shape == theirs.shape and ours.dtype == q.dtype
    assert (ours.double() - expected).abs().max().item() <= max(2e-5, 4 * theirs_error)
    empty = ~mask.any(dim=1)
    assert (ours[:, :, empty] == 0).all()
    # The explicit mask's values (another code path: the mask read, not computed), and
    # is_causal's bits where both alignments agree.
    explicit = qt.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
    assert (ours - explicit).abs().max().item() <= 2e-6
    if variant == "upper_left" or seq_q == seq_kv:
        assert torch.equal(ours, qt.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa))


@pytest.mark.parametrize("variant", ["lower_right", "upper_left"])
def test_causal_bias_gradients_match_torch(variant):
    q, k, v = tensors(31, seq_q=11, seq_kv=40, heads_q=6, heads_kv=3)
    bias = causal_bias(variant, 11, 40)
    ours = grads_of(lambda *x, attn_mask: qt.scaled_dot_product_attention(
        *x, attn_mask=bias, enable_gqa=True), q, k, v)
    expected = grads_of(f64, q, k, v, causal_mask(variant, 11, 40), enable_gqa=True)
    for name, a, e in zip(("out", "dq", "dk", "dv"), ours, expected):
        assert a.shape == e.shape, name
        assert (a.double() - e).abs().max().item() <= 2e-5 * max(1.0, e.abs().max().item()), name


def test_causal_bias_errors():
    q, k, v = tensors(32, seq_q=4, seq_kv=53)
    with pytest.raises(ValueError, match="causal bias of 4 x 52 does not match"):
        qt.scaled_dot_product_attention(q, k, v, attn_mask=causal_bias("lower_right", 4, 52))
    with pytest.raises(RuntimeError, match="should not be set when is_causal=True"):
        qt.scaled_dot_product_attention(q, k, v, attn_mask=causal_bias("lower_right", 4, 53),
                                        is_causal=True)


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = tensors(6)
    mask = torch.ones(37, 53, dtype=torch.bool)
    mask[3] = False
    out = qt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert not out.isnan().any()
    assert (out[:, :, 3] == 0).all()
    others = torch.arange(37) != 3
    expected = torch_reference(q, k, v, attn_mask=mask)
    assert (out[:, :, others].double() - expected[:, :, others]).abs().max() < 2e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_half_dtypes_match_torch(dtype, is_causal):
    # bf16/f16 inputs: qkv accumulates in f32 and rounds the output once; torch's kernels round
    # more often. Both are compared with float64 on the same rounded inputs.
    q, k, v = tensors(7, dtype=dtype)
    check(q, k, v, atol=2e-2 if dtype == torch.bfloat16 else 2e-3, is_causal=is_causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_out_is_the_float32_result_rounded_once(dtype):
    # The kernel writes out in the inputs' dtype (qkv.attention's out_dtype): the same bits as
    # rounding its float32 out, with no float32 tensor in between.
    q, k, v = tensors(13, dtype=dtype)
    out = qt.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == dtype
    out32 = qkv.attention(q, k, v, layout="bhsd", causal=True, align="top_left")
    assert out32.dtype == torch.float32
    assert torch.equal(out.view(torch.int16), out32.to(dtype).view(torch.int16))


def test_bf16_float_mask():
    q, k, v = tensors(8, dtype=torch.bfloat16)
    bias = torch.randn(37, 53, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    check(q, k, v, atol=2e-2, attn_mask=bias)


def test_three_and_five_dims():
    q, k, v = tensors(10)
    check(q[0], k[0], v[0], is_causal=True)  # (H, L, E)
    q5, k5, v5 = (x.reshape(1, 2, *x.shape[1:]) for x in (q, k, v))  # (1, 2, H, L, E)
    check(q5, k5, v5)
    mask = torch.rand(1, 2, 4, 37, 53, generator=torch.Generator().manual_seed(11)) < 0.8
    check(q5, k5, v5, attn_mask=mask | (torch.arange(53) == 0))


def test_non_contiguous_inputs_are_read_in_place():
    # (B, L, H, E) memory viewed as (B, H, L, E): the layout many models keep.
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in tensors(12))
    assert not q.is_contiguous()
    check(q, k, v, is_causal=True)


@pytest.mark.parametrize("kwargs,error,fragment", [
    ({"dropout_p": 1.0}, ValueError, "dropout_p: must be in [0, 1)"),
    ({"is_causal": True, "attn_mask": torch.ones(37, 53, dtype=torch.bool)}, RuntimeError,
     "attn_mask should not be set when is_causal=True"),
    ({"attn_mask": torch.ones(37, 53, dtype=torch.int32)}, TypeError, "attn_mask: dtype"),
    ({"attn_mask": torch.ones(37, 52, dtype=torch.bool)}, ValueError, "not broadcastable"),
])
def test_bad_arguments(kwargs, error, fragment):
    q, k, v = tensors(13)
    with pytest.raises(error, match=None) as info:
        qt.scaled_dot_product_attention(q, k, v, **kwargs)
    assert fragment in str(info.value)


def test_bad_tensors():
    q, k, v = tensors(14, heads_q=6, heads_kv=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        qt.scaled_dot_product_attention(q, k, v)
    with pytest.raises(TypeError, match="int32 is not supported"):
        qt.scaled_dot_product_attention(q.int(), k.int(), v.int(), enable_gqa=True)
    with pytest.raises(TypeError, match="share one dtype"):
        qt.scaled_dot_product_attention(q, k.half(), v, enable_gqa=True)
    with pytest.raises(ValueError, match="at least 3"):
        qt.scaled_dot_product_attention(q[0, 0], k[0, 0], v[0, 0])
    with pytest.raises(ValueError, match="does not match"):
        qt.scaled_dot_product_attention(q, k[..., :5], v, enable_gqa=True)


EMPTY_SHAPES = {  # query, key, value shapes with a size of 0 (qkv's kernels take sizes >= 1)
    "batch_0": ((0, 2, 3, 8), (0, 2, 4, 8), (0, 2, 4, 5)),
    "keys_0": ((1, 2, 3, 8), (1, 2, 0, 8), (1, 2, 0, 5)),
    "queries_0": ((1, 2, 0, 8), (1, 2, 4, 8), (1, 2, 4, 5)),
    "value_dim_0_gqa": ((1, 4, 3, 8), (1, 2, 4, 8), (1, 2, 4, 0)),
    "five_dims_queries_0": ((2, 3, 4, 0, 6), (2, 3, 2, 5, 6), (2, 3, 2, 5, 6)),
    "five_dims_heads_0": ((2, 0, 4, 3, 6), (2, 0, 2, 5, 6), (2, 0, 2, 5, 6)),
    "three_dims_keys_0": ((3, 1, 8), (3, 0, 8), (3, 0, 8)),
}


@pytest.mark.parametrize("case", sorted(EMPTY_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sizes_of_zero_give_what_torch_gives(case, dtype):
    """out (zeros where rows see no key) and gradients (all 0) as torch's SDPA gives them, by the
    direct call and through the op with autograd."""
    g = torch.Generator().manual_seed(30)
    ours, theirs = ([torch.randn(s, generator=g).to(dtype).requires_grad_() for s in
                     EMPTY_SHAPES[case]] for _ in range(2))
    with torch.no_grad():
        direct = qt.scaled_dot_product_attention(*ours, enable_gqa=True, is_causal=True)
    out = qt.scaled_dot_product_attention(*ours, enable_gqa=True, is_causal=True)
    expected = F.scaled_dot_product_attention(*theirs, enable_gqa=True, is_causal=True)
    for got in (direct, out):
        assert got.dtype == dtype and got.shape == expected.shape
        assert torch.equal(got, expected.detach())
    grad = torch.randn(expected.shape, generator=g).to(dtype)
    out.backward(grad)
    expected.backward(grad)
    for mine, torchs in zip(ours, theirs):
        assert mine.grad.shape == torchs.grad.shape and torch.equal(mine.grad, torchs.grad)


def test_sizes_of_zero_with_a_float_mask_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = tensors(31, seq_kv=0)
    bias = torch.randn(37, 0, requires_grad=True)
    out = qt.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert out.shape == (2, 4, 37, 16) and not out.any()
    out.sum().backward()
    assert bias.grad.shape == bias.shape
    with FakeTensorMode() as mode:  # 5-D: the batch dims fold into one, of 0 elements here
        fake = [mode.from_tensor(x.unsqueeze(1)) for x in tensors(31, seq_q=0)]
        out = qt.scaled_dot_product_attention(*fake)
    assert out.shape == (2, 1, 4, 0, 16)


def test_sizes_of_zero_still_check_shapes():
    q, k, v = tensors(32, seq_kv=0)
    with pytest.raises(ValueError, match="do not match"):
        qt.scaled_dot_product_attention(q, k[..., :5], v[..., :5])
    with pytest.raises(ValueError, match="do not match"):
        qt.scaled_dot_product_attention(q, k, v[:1])
    with pytest.raises(ValueError, match="not a multiple"):
        qt.scaled_dot_product_attention(q, k[:, :3], v[:, :3], enable_gqa=True)
    with pytest.raises(ValueError, match="not broadcastable"):
        qt.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(36, 0, dtype=torch.bool))
    with pytest.raises(ValueError, match="head dim E = 0"):
        qt.scaled_dot_product_attention(*tensors(33, head_dim=0, head_dim_v=4))


def test_is_a_torch_library_op_that_compiles():
    q, k, v = tensors(15)
    op = torch.ops.qkv.sdpa_forward.default
    torch.library.opcheck(op, (q, k, v, None, 0.0, True, None, False, 0))
    # With inputs that require grad, opcheck also checks the autograd registration.
    leaves = [x.requires_grad_() for x in tensors(15)]
    bias = torch.randn(37, 53, requires_grad=True)
    torch.library.opcheck(op, (*leaves, bias, 0.0, False, None, False, 0))
    torch.library.opcheck(op, (*leaves, None, 0.25, True, None, False, 12345))

    def f(q, k, v):
        return qt.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    np.testing.assert_array_equal(compiled(q, k, v).numpy(), f(q, k, v).numpy())


def test_calls_nothing_records_skip_the_op_and_give_its_bits(monkeypatch):
    """Without autograd, tracing or modes the call runs the op's computation without its
    dispatch (qt._direct); with an input that requires grad it goes through the op."""
    calls = []
    op = qt._sdpa_forward

    def counted(*args):
        calls.append(args)
        return op(*args)

    monkeypatch.setattr(qt, "_sdpa_forward", counted)
    q, k, v = tensors(21, heads_q=6, heads_kv=2, seq_q=1, seq_kv=300, head_dim=64,
                      dtype=torch.bfloat16)
    mask = torch.rand(1, 6, 1, 300, generator=torch.Generator().manual_seed(2)) < 0.8
    for options in ({}, {"attn_mask": mask}, {"attn_mask": torch.randn(300)},
                    {"is_causal": True, "scale": 0.2}, {"dropout_p": 0.3}):
        torch.manual_seed(5)
        direct = qt.scaled_dot_product_attention(q, k, v, enable_gqa=True, **options)
        torch.manual_seed(5)
        seed = int(torch.randint(0, 2**62, (1,)).item()) if "dropout_p" in options else 0
        through = torch.ops.qkv.sdpa_forward(
            q, k, v, options.get("attn_mask"), float(options.get("dropout_p", 0.0)),
            options.get("is_causal", False), options.get("scale"), True, seed)[0]
        assert direct.dtype == torch.bfloat16 and direct.shape == through.shape
        assert torch.equal(direct.view(torch.int16), through.view(torch.int16)), options
    assert calls == []
    leaf = q.clone().requires_grad_()
    qt.scaled_dot_product_attention(leaf, k, v, enable_gqa=True)
    assert len(calls) == 1
    with torch.no_grad():
        qt.scaled_dot_product_attention(leaf, k, v, enable_gqa=True)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="enable_gqa=True"):  # the op's checks, unchanged
        qt.scaled_dot_product_attention(q, k, v)


def test_modes_and_fake_tensors_still_see_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = tensors(22)
    expected = qt.scaled_dot_product_attention(q, k, v, is_causal=True)
    with Record() as record:
        out = qt.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert any("qkv.sdpa_forward" in name for name in record.ops), record.ops
    assert torch.equal(out, expected)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in (q, k, v)]
        out = qt.scaled_dot_product_attention(*fake, is_causal=True)
    assert out.shape == expected.shape and out.dtype == expected.dtype


def test_tensors_that_require_grad_are_read():
    q, k, v = (x.requires_grad_() for x in tensors(16))
    with torch.no_grad():
        expected = F.scaled_dot_product_attention(q, k, v)
    out = qt.scaled_dot_product_attention(q, k, v)
    assert (out.detach() - expected).abs().max() < 2e-5


# ---------------------------------------------------------------------------------------------
# Gradients: loss.backward() through qkv against torch's own SDPA backward in float64.

def grads_of(fn, q, k, v, mask=None, **options):
    """(out, dq, dk, dv, dmask) of sum(out * w) for a fixed random w, through `fn`."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    m = None
    if mask is not None:
        m = mask.detach().clone()
        if m.is_floating_point():
            m.requires_grad_()
    out = fn(*leaves, attn_mask=m, **options)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out.dtype)
    (out * w).sum().backward()
    return [out] + [x.grad for x in leaves] + [m.grad if m is not None and m.is_floating_point()
                                               else None]


def test_negative_scale_with_is_causal_is_the_softmax():
    """torch 2.15's SDPA gives NaN here (float32 and float64); qkv.torch the plain softmax of
    the scaled scores, masked causally (top left)."""
    q, k, v = tensors(24, seq_q=37, seq_kv=53)
    out = qt.scaled_dot_product_attention(q, k, v, scale=-0.3, is_causal=True)
    scores = (q.double() @ k.double().transpose(-1, -2)) * -0.3
    allowed = torch.ones(37, 53, dtype=torch.bool).tril()
    expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.double()
    assert (out.double() - expected).abs().max().item() < 2e-5


def f64(q, k, v, attn_mask=None, **options):
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.double()
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                          attn_mask=attn_mask, **options)


@pytest.mark.parametrize("case", ["plain", "causal", "gqa", "bool_mask", "float_mask", "scale",
                                  "negative_scale", "zero_scale", "causal_lq_gt_lk", "five_dims"])
def test_gradients_match_torch(case):
    q, k, v = tensors(20, seq_q=37, seq_kv=53)
    mask, options = None, {}
    if case == "causal":
        options = dict(is_causal=True)
    elif case == "gqa":
        q, k, v = tensors(21, heads_q=6, heads_kv=2)
        options = dict(enable_gqa=True)
    elif case == "bool_mask":
        mask = torch.rand(37, 53, generator=torch.Generator().manual_seed(3)) < 0.7
    elif case == "float_mask":
        mask = torch.randn(4, 37, 53, generator=torch.Generator().manual_seed(4))
    elif case == "scale":
        options = dict(scale=0.3)
    elif case == "negative_scale":  # torch takes any scale; qkv.torch negates q for it
        # (with is_causal, torch 2.15 gives NaN for a negative scale; a bool mask it takes)
        mask = torch.rand(37, 53, generator=torch.Generator().manual_seed(7)) < 0.7
        options = dict(scale=-0.3)
    elif case == "zero_scale":  # every score 0: V averaged over the keys the mask allows
        mask = torch.randn(4, 37, 53, generator=torch.Generator().manual_seed(6))
        options = dict(scale=0.0)
    elif case == "causal_lq_gt_lk":
        q, k, v = tensors(22, seq_q=53, seq_kv=37)
        options = dict(is_causal=True)
    elif case == "five_dims":
        q, k, v = (x.reshape(1, *x.shape) for x in tensors(23))
        mask = torch.randn(1, 2, 4, 37, 53, generator=torch.Generator().manual_seed(5))
    ours = grads_of(qt.scaled_dot_product_attention, q, k, v, mask, **options)
    expected = grads_of(f64, q, k, v, mask, **options)
    theirs = grads_of(F.scaled_dot_product_attention, q, k, v, mask, **options)
    for name, a, e, t in zip(("out", "dq", "dk", "dv", "dmask"), ours, expected, theirs):
        if e is None:
            assert a is None, name
            continue
        assert a.dtype == t.dtype and a.shape == e.shape, name
        error = (a.double() - e).abs().max().item()
        torch_error = (t.double() - e).abs().max().item()
        # Rows that see no key (causal with Lq > Lk): torch gives NaN, qkv zeros.
        if not np.isfinite(torch_error):
            torch_error = 0.0
            e = torch.nan_to_num(e)
            error = (a.double() - e).abs().max().item()
        assert error <= max(2e-5 * max(1.0, e.abs().max().item()), 4 * torch_error), \
            (name, error, torch_error)


def test_bf16_gradients_are_bf16_and_close():
    q, k, v = tensors(24, dtype=torch.bfloat16)
    ours = grads_of(qt.scaled_dot_product_attention, q, k, v, is_causal=True)
    expected = grads_of(f64, q, k, v, is_causal=True)
    theirs = grads_of(F.scaled_dot_product_attention, q, k, v, is_causal=True)
    for name, a, e, t in zip(("out", "dq", "dk", "dv"), ours, expected, theirs):
        assert a.dtype == torch.bfloat16, name
        error = (a.double() - e).abs().max().item()
        torch_error = (t.double() - e).abs().max().item()
        assert error <= max(1e-2, 4 * torch_error), (name, error, torch_error)


def test_gradcheck_in_float32():
    """torch.autograd.gradcheck needs float64 for its default tolerances; qkv computes in
    float32, so the finite differences run with eps 1e-3 and matching tolerances."""
    q, k, v = (x.requires_grad_() for x in tensors(25, batch=1, heads_q=2, heads_kv=1,
                                                       seq_q=5, seq_kv=7, head_dim=4))
    bias = torch.randn(5, 7, requires_grad=True)

    def fn(q, k, v, bias):
        return qt.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not a double precision floating point"
        assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-3, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("case", ["causal_gqa", "bool_mask", "float_mask", "dv_ne_d_5d"])
def test_gradcheck_in_float64(case):
    """torch.autograd.gradcheck with its default (float64) tolerances: float64 tensors run on
    qkv's reference kernel in float64, forward and backward."""
    torch.manual_seed(30)
    heads_q, heads_kv = (4, 2) if case == "causal_gqa" else (2, 2)
    shape_q = (2, heads_q, 5, 4) if case != "dv_ne_d_5d" else (2, 1, heads_q, 5, 4)
    shape_k = (*shape_q[:-3], heads_kv, 7, 4)
    shape_v = (*shape_q[:-3], heads_kv, 7, 3 if case == "dv_ne_d_5d" else 4)
    q, k, v = (torch.randn(s, dtype=torch.float64, requires_grad=True)
               for s in (shape_q, shape_k, shape_v))
    options = {"enable_gqa": True}
    if case == "causal_gqa":
        options["is_causal"] = True
    elif case == "bool_mask":
        mask = torch.rand(5, 7) > 0.4
        mask[:, 0] = True
        options["attn_mask"] = mask
    elif case == "float_mask":  # (float32-exact values: qkv's bias is float32)
        options["attn_mask"] = torch.randn(heads_q, 5, 7).double()

    def fn(q, k, v):
        return qt.scaled_dot_product_attention(q, k, v, **options)

    assert fn(q, k, v).dtype == torch.float64
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, **options)
    assert (fn(q, k, v) - reference).abs().max().item() < 1e-12  # float32 is ~1e-7 off
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_in_float64_with_dropout():
    """Dropout's mask is a hash of the seed: with the op's seed fixed, forward and backward see
    one mask and gradcheck holds."""
    torch.manual_seed(31)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        return torch.ops.qkv.sdpa_forward(q, k, v, None, 0.3, False, None, False, 12345)[0]

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_backward_compiles():
    def f(q, k, v):
        return qt.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    leaves = [x.requires_grad_() for x in tensors(26)]
    compiled(*leaves).backward()
    compiled_grads = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    f(*leaves).backward()
    for a, b in zip(compiled_grads, (x.grad for x in leaves)):
        assert torch.equal(a, b)


def test_dropout_gradients_are_those_of_its_mask():
    """With dropout, the same seed gives the same mask: the forward equals qkv.attention with
    that seed, and the gradients equal float64 finite-difference-free ones computed through
    qkv.attention_backward with the seed the op drew."""
    q, k, v = tensors(27, seq_q=33, seq_kv=41)
    torch.manual_seed(0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = qt.scaled_dot_product_attention(*leaves, dropout_p=0.3, is_causal=True)
    torch.manual_seed(0)
    seed = int(torch.randint(0, 2**62, (1,)).item())  # what the op drew
    ref_out, lse = qkv.attention(q, k, v, layout="bhsd", causal=True, align="top_left",
                                 dropout_p=0.3, seed=seed, return_lse=True)
    assert torch.equal(out.detach(), ref_out)
    plain = qt.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out.detach() - plain).abs().max() > 1e-2  # dropout did something
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * w).sum().backward()
    dq, dk, dv = qkv.attention_backward(q, k, v, ref_out, lse, w, layout="bhsd", causal=True,
                                        align="top_left", dropout_p=0.3, seed=seed)
    for a, b in zip((x.grad for x in leaves), (dq, dk, dv)):
        assert torch.equal(a, b)
    # And those gradients are right: the reference kernel in float64 agrees.
    ref = qkv.attention_backward(q, k, v, ref_out, lse, w, layout="bhsd", causal=True,
                                 align="top_left", dropout_p=0.3, seed=seed, kernel="reference")
    for a, b in zip((dq, dk, dv), ref):
        assert (a - b).abs().max() <= 2e-5 * max(1.0, b.abs().max().item())
