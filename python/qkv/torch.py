"""qkv.torch: torch.nn.functional.scaled_dot_product_attention, computed by qkv.

    import qkv.torch
    out = qkv.torch.scaled_dot_product_attention(query, key, value, is_causal=True)

Exactly PyTorch's semantics (https://pytorch.org/docs/stable/generated/
torch.nn.functional.scaled_dot_product_attention.html): query (N, ..., Hq, L, E), key
(N, ..., Hkv, S, E), value (N, ..., Hkv, S, Ev) -> (N, ..., Hq, L, Ev) in query's dtype;
attn_mask broadcastable to (N, ..., Hq, L, S), bool (True = takes part) or float (added to the
scores), or torch's causal bias (torch.nn.attention.bias.causal_lower_right / causal_upper_left:
the causal mask aligned at the bottom right or the top left, computed from positions as
is_causal is, no mask array); is_causal is top-left aligned; scale defaults to 1/sqrt(E);
enable_gqa lets Hq be a multiple of Hkv; sizes of 0 (an empty batch, L = 0, S = 0) give what
torch's gives (S = 0: zeros; gradients 0). Two differences: a query row that the mask leaves
with no key gets zeros from qkv, where PyTorch's math kernel gives NaN; and a head dim E of 0
(with keys) is refused. scale may be negative or 0, as in torch.

It runs on torch.get_num_threads() threads (torch.set_num_threads sets them), as torch's own
does. It is the torch.library custom op torch.ops.qkv.sdpa_forward (out and the log-sum-exp)
with a fake (meta) implementation, so torch.compile traces it as one node, and an autograd
formula: loss.backward() flows through qkv's attention backward (torch.ops.qkv.sdpa_backward:
grads for query, key, value and a float attn_mask). A call that nothing records (no input that
requires grad under grad mode, no torch.compile, torch function or dispatch mode, functorch
transform or tensor subclass: inference) runs the op's computation without its dispatch.
CPU tensors only; float32, bfloat16 and
float16 (computed with float32 accumulation; gradients come back in the inputs' dtype), and
float64, computed in float64 by qkv's reference kernel, so torch.autograd.gradcheck works (an
attn_mask's gradient stays float32-precise: qkv's bias is float32).
dropout_p > 0 drops probabilities by qkv's counter-based mask (docs/training.md), keyed by a
seed drawn from torch's default generator per call (torch.manual_seed makes it repeatable) and
reused by the backward; the mask is not torch's own (no CPU kernel shares one).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

import qkv

__all__ = ["scaled_dot_product_attention"]

try:  # torch >= 2.3: the causal biases that torch's SDPA takes as attn_mask
    from torch.nn.attention.bias import CausalBias, CausalVariant
except ImportError:  # pragma: no cover (older torch: no such attn_mask to accept)
    CausalBias = CausalVariant = None

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The dtypes whose out qkv writes as float32 / float64 (bfloat16 and float16 get out in their
# own dtype, rounded by the kernel: qkv.attention's out_dtype).
_NATIVE_OUT = (torch.float32, torch.float64)


def _mask_with_causal() -> RuntimeError:
    """The error for PyTorch's rule: no attn_mask (a causal bias included) with is_causal."""
    return RuntimeError("scaled_dot_product_attention: explicit attn_mask should not be set when "
                        "is_causal=True (PyTorch's rule)")


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
           enable_gqa: bool) -> None:
    """PyTorch's argument rules, with qkv's limits; raises before anything is computed."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 3:
            raise ValueError(f"{name}: shape {tuple(t.shape)} has {t.dim()} dims; expected at "
                             f"least 3: (N, ..., H, L, E)")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported by qkv; expected "
                            f"float32, bfloat16, float16 or float64")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, "
                        f"{key.dtype} and {value.dtype}")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key and value must have the same number of dims, got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}")
    if attn_mask is not None and is_causal:
        raise _mask_with_causal()
    heads_q, heads_kv = query.shape[-3], key.shape[-3]
    if heads_q != heads_kv and not enable_gqa:
        raise ValueError(f"query has {heads_q} heads and key {heads_kv}: pass enable_gqa=True "
                         f"for grouped-query attention (query shape {tuple(query.shape)}, key "
                         f"shape {tuple(key.shape)})")


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(N, ..., H, L, E) as (B, H, L, E): 3-D gets a batch of 1, more than 4 dims fold into B."""
    if t.dim() == 3:
        return t.unsqueeze(0)
    if t.dim() > 4:
        return t.reshape(-1, *t.shape[-3:])
    return t


def _result_shapes(query: torch.Tensor, value: torch.Tensor):
    """(out's shape, lse's shape, lse's dtype) of the op: out (N, ..., Hq, L, Ev); lse (B, Hq, L)
    over the inputs folded to 4-D, float32 (float64 for float64 inputs). B is _as_4d's, taken
    without its reshape, which a tensor of 0 elements cannot take."""
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return ((*query.shape[:-1], value.shape[-1]),
            (math.prod(query.shape[:-3]), query.shape[-3], query.shape[-2]), lse_dtype)


def _causal_from_bias(query: torch.Tensor, key: torch.Tensor, attn_mask, is_causal: bool):
    """attn_mask as (attn_mask, is_causal, lower_right): a torch CausalBias becomes the causal
    mask qkv computes from positions (lower_right: aligned at the bottom right, i' = i + S - L);
    any other attn_mask passes as it is."""
    if CausalBias is None or not isinstance(attn_mask, CausalBias):
        return attn_mask, is_causal, False
    if is_causal:
        raise _mask_with_causal()
    seq_q, seq_kv = query.shape[-2], key.shape[-2]
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (seq_q, seq_kv):
        raise ValueError(f"attn_mask: a causal bias of {attn_mask.seq_len_q} x "
                         f"{attn_mask.seq_len_kv} does not match query's {seq_q} rows and key's "
                         f"{seq_kv} (query shape {tuple(query.shape)}, key shape "
                         f"{tuple(key.shape)})")
    return None, True, attn_mask.variant == CausalVariant.LOWER_RIGHT


def _mask_and_bias(query, key, attn_mask):
    """attn_mask as qkv's (mask, bias): bool -> mask, float -> bias (float32), both 4-D when the
    inputs have more than 4 dims."""
    mask = bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        elif attn_mask.is_floating_point():
            bias = attn_mask.to(torch.float32)  # a no-op (no copy) for float32 masks
        else:
            raise TypeError(f"attn_mask: dtype {attn_mask.dtype} is not supported; expected "
                            f"bool or a float dtype")
        if query.dim() > 4 and attn_mask.dim() > 3:
            mask_shape = (*query.shape[:-1], key.shape[-2])
            full = attn_mask.expand(mask_shape).reshape(-1, *mask_shape[-3:])
            mask, bias = (full, None) if mask is not None else (None, full)
    return mask, bias


def _is_empty(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether a size is 0 (qkv's kernels take sizes >= 1; torch's SDPA takes 0 too)."""
    return 0 in (*query.shape, *key.shape, *value.shape)


def _empty_forward(query, key, value, attn_mask):
    """(out, lse) for inputs with a size of 0, as torch's SDPA gives them: out has a size of 0,
    or (S = 0) its rows see no key, so they are zeros (qkv's rule, and torch's too here); lse is
    -inf. Checks first what qkv would check on inputs of sizes >= 1. A head dim E of 0 with
    rows that see keys is refused (torch averages V there: scores of no dims are all 0)."""
    shapes = (f"(query shape {tuple(query.shape)}, key shape {tuple(key.shape)}, value shape "
              f"{tuple(value.shape)})")
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-1] != value.shape[:-1] or \
            query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query, key and value do not match: batch dims, key and value heads "
                         f"and lengths, and query and key head dims must agree {shapes}")
    heads_q, heads_kv = query.shape[-3], key.shape[-3]
    if (heads_kv == 0 and heads_q != 0) or (heads_kv != 0 and heads_q % heads_kv != 0):
        raise ValueError(f"query has {heads_q} heads, not a multiple of key's {heads_kv} "
                         f"{shapes}")
    out_shape, lse_shape, lse_dtype = _result_shapes(query, value)
    if attn_mask is not None:
        try:
            torch.broadcast_shapes(attn_mask.shape, (*query.shape[:-1], key.shape[-2]))
        except RuntimeError:
            raise ValueError(f"attn_mask: shape {tuple(attn_mask.shape)} is not broadcastable "
                             f"to (N, ..., Hq, L, S) = {(*query.shape[:-1], key.shape[-2])}") \
                from None
    if query.shape[-1] == 0 and key.shape[-2] != 0 and 0 not in out_shape:
        raise ValueError(f"query: head dim E = 0 is not supported by qkv {shapes}")
    return query.new_zeros(out_shape), query.new_full(lse_shape, float("-inf"), dtype=lse_dtype)


def _align(lower_right: bool) -> str:
    return "bottom_right" if lower_right else "top_left"


def _forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
             lower_right, return_lse):
    """out in query's dtype (and, with return_lse, lse (B, Hq, L) over the inputs folded to
    4-D: float32, float64 for float64 inputs)."""
    _check(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if _is_empty(query, key, value):
        out, lse = _empty_forward(query, key, value, attn_mask)
        return (out, lse) if return_lse else out
    mask, bias = _mask_and_bias(query, key, attn_mask)
    # bfloat16 / float16 out straight from the kernel (the float32 result rounded to nearest
    # even, as .to(query.dtype) would give): no float32 buffer to fault in, no copy.
    result = qkv.attention(_as_4d(query), _as_4d(key), _as_4d(value), layout="bhsd",
                           causal=is_causal, align=_align(lower_right), mask=mask, bias=bias,
                           scale=scale, num_threads=torch.get_num_threads(),
                           dropout_p=dropout_p, seed=seed, return_lse=return_lse,
                           out_dtype=None if query.dtype in _NATIVE_OUT else query.dtype)
    out = result[0] if return_lse else result
    out = out.reshape(*query.shape[:-1], value.shape[-1])
    return (out, result[1]) if return_lse else out


@torch.library.custom_op("qkv::sdpa_forward", mutates_args=(), device_types="cpu")
def _sdpa_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
                  scale: Optional[float], enable_gqa: bool, seed: int,
                  lower_right: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out in query's dtype, lse (B, Hq, L) over the inputs folded to 4-D: float32, float64
    for float64 inputs). lower_right: is_causal aligned at the bottom right (torch's
    causal_lower_right) instead of the top left."""
    return _forward(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed,
                    lower_right, return_lse=True)


@_sdpa_forward.register_fake
def _sdpa_forward_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       seed, lower_right=False):
    out_shape, lse_shape, lse_dtype = _result_shapes(query, value)
    return query.new_empty(out_shape), query.new_empty(lse_shape, dtype=lse_dtype)


@torch.library.custom_op("qkv::sdpa_backward", mutates_args=(), device_types="cpu")
def _sdpa_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attn_mask: Optional[torch.Tensor], out: torch.Tensor,
                   lse: torch.Tensor, is_causal: bool, scale: Optional[float],
                   dropout_p: float, seed: int, mask_grad: bool,
                   lower_right: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor]:
    """(d query, d key, d value in their dtypes, d attn_mask: its shape and dtype when
    mask_grad, else an empty tensor)."""
    if _is_empty(query, key, value):  # nothing reaches out: every gradient is 0
        dmask = torch.zeros_like(attn_mask) if mask_grad else query.new_empty((0,))
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value), dmask
    mask, bias = _mask_and_bias(query, key, attn_mask)
    # out and grad_out as qkv reads them: float32, or float64 for float64 inputs.
    as32 = lambda t: t if t.dtype in _NATIVE_OUT else t.to(torch.float32)  # noqa: E731
    grads = qkv.attention_backward(
        _as_4d(query), _as_4d(key), _as_4d(value), _as_4d(as32(out)), lse,
        _as_4d(as32(grad_out)).contiguous(), layout="bhsd", causal=is_causal,
        align=_align(lower_right),
        mask=mask, bias=bias, scale=scale, num_threads=torch.get_num_threads(),
        dropout_p=dropout_p, seed=seed, return_dbias=mask_grad)
    dq, dk, dv = (g.reshape(t.shape).to(t.dtype) for g, t in zip(grads[:3], (query, key, value)))
    dmask = query.new_empty((0,))
    if mask_grad:
        # dbias has the bias's shape; with more than 4 input dims the bias was expanded to the
        # full 4-D shape first: sum it back down to attn_mask's.
        dbias = grads[3].reshape(*query.shape[:-1], key.shape[-2]) if query.dim() > 4 and \
            attn_mask.dim() > 3 else grads[3]
        dmask = dbias.sum_to_size(attn_mask.shape).to(attn_mask.dtype)
    return dq, dk, dv, dmask


@_sdpa_backward.register_fake
def _sdpa_backward_fake(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale,
                        dropout_p, seed, mask_grad, lower_right=False):
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad else query.new_empty((0,))
    return (query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape),
            dmask)


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, dropout_p, is_causal, scale, _, seed, lower_right = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, attn_mask, out, lse)
    ctx.is_causal = is_causal
    ctx.scale = scale
    ctx.dropout_p = dropout_p
    ctx.seed = seed
    ctx.lower_right = lower_right
    ctx.mask_grad = (attn_mask is not None and attn_mask.is_floating_point()
                     and attn_mask.requires_grad)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, attn_mask, out, lse = ctx.saved_tensors
    dq, dk, dv, dmask = torch.ops.qkv.sdpa_backward(grad_out, query, key, value, attn_mask, out,
                                                    lse, ctx.is_causal, ctx.scale, ctx.dropout_p,
                                                    ctx.seed, ctx.mask_grad, ctx.lower_right)
    return dq, dk, dv, (dmask if ctx.mask_grad else None), None, None, None, None, None, None


_sdpa_forward.register_autograd(_backward, setup_context=_setup_context)


def _no_tracing_or_modes() -> bool:
    """No torch function or dispatch mode and no functorch transform is active (private torch
    functions; where this torch lacks one, the answer is False)."""
    try:
        return (torch._C._len_torch_dispatch_stack() == 0
                and torch._C._len_torch_function_stack() == 0
                and not torch._C._are_functorch_transforms_active())
    except AttributeError:
        return False


def _direct(tensors) -> bool:
    """Whether a call may go to qkv without the custom op: plain CPU tensors, nothing that
    records the call (autograd on an input that requires grad, torch.compile, a torch function
    or dispatch mode, a functorch transform, a tensor subclass) and so nothing that would see a
    difference. The op's dispatch costs 11-58 us a call (docs/python.md, "Performance")."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or t.device.type != "cpu" or (grad and t.requires_grad):
            return False
    return _no_tracing_or_modes()


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention with PyTorch's semantics, computed by
    qkv (see the module docstring). query (N, ..., Hq, L, E), key (N, ..., Hkv, S, E), value
    (N, ..., Hkv, S, Ev) -> (N, ..., Hq, L, Ev), query's dtype. attn_mask may be torch's
    causal_lower_right(L, S) or causal_upper_left(L, S)."""
    attn_mask, is_causal, lower_right = _causal_from_bias(query, key, attn_mask, is_causal)
    if scale is not None and scale <= 0.0:  # torch takes any scale, qkv's kernels one > 0:
        # q . k * s = (-q) . k * (-s); with s = 0 every score is 0, as (0 * q) . k * 1 gives
        # (autograd sees the negation or the product, so the query's gradient follows).
        query, scale = (query.neg(), -float(scale)) if scale < 0.0 else (query.mul(0.0), 1.0)
    seed = 0
    if dropout_p > 0.0:  # a fresh mask per call, from torch's default generator
        seed = int(torch.randint(0, 2**62, (1,)).item())
    args = (query, key, value, attn_mask, float(dropout_p), bool(is_causal),
            None if scale is None else float(scale), bool(enable_gqa), seed, lower_right)
    if _direct((query, key, value, attn_mask)):  # the op's own computation, without its dispatch
        return _forward(*args, return_lse=False)
    return _sdpa_forward(*args)[0]
