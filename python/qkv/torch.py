"""qkv.torch: torch.nn.functional.scaled_dot_product_attention, computed by qkv.

    import qkv.torch
    out = qkv.torch.scaled_dot_product_attention(query, key, value, is_causal=True)

Exactly PyTorch's semantics (https://pytorch.org/docs/stable/generated/
torch.nn.functional.scaled_dot_product_attention.html): query (N, ..., Hq, L, E), key
(N, ..., Hkv, S, E), value (N, ..., Hkv, S, Ev) -> (N, ..., Hq, L, Ev) in query's dtype;
attn_mask broadcastable to (N, ..., Hq, L, S), bool (True = takes part) or float (added to the
scores); is_causal is top-left aligned; scale defaults to 1/sqrt(E); enable_gqa lets Hq be a
multiple of Hkv. One difference: a query row that the mask leaves with no key gets zeros from
qkv, where PyTorch's math kernel gives NaN.

It runs on torch.get_num_threads() threads (torch.set_num_threads sets them), as torch's own
does. It is registered as the torch.library custom op torch.ops.qkv.scaled_dot_product_attention with a
fake (meta) implementation, so torch.compile traces it as one node. CPU tensors only; float32,
bfloat16 and float16 (computed with float32 accumulation). Forward only for now: dropout_p must
be 0 and gradients do not flow through it yet.
"""

from __future__ import annotations

from typing import Optional

import torch

import qkv

__all__ = ["scaled_dot_product_attention"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
                            f"float32, bfloat16 or float16")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, "
                        f"{key.dtype} and {value.dtype}")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key and value must have the same number of dims, got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: qkv's attention has no dropout yet (forward only); got "
                         f"{dropout_p}")
    if attn_mask is not None and is_causal:
        raise RuntimeError("scaled_dot_product_attention: explicit attn_mask should not be set "
                           "when is_causal=True (PyTorch's rule)")
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


@torch.library.custom_op("qkv::scaled_dot_product_attention", mutates_args=(),
                         device_types="cpu")
def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool,
          scale: Optional[float], enable_gqa: bool) -> torch.Tensor:
    _check(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
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
    out = qkv.attention(_as_4d(query), _as_4d(key), _as_4d(value), layout="bhsd",
                        causal=is_causal, align="top_left", mask=mask, bias=bias, scale=scale,
                        num_threads=torch.get_num_threads())
    out = out.reshape(*query.shape[:-1], value.shape[-1])
    return out if query.dtype == torch.float32 else out.to(query.dtype)


@_sdpa.register_fake
def _sdpa_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention with PyTorch's semantics, computed by
    qkv (see the module docstring). query (N, ..., Hq, L, E), key (N, ..., Hkv, S, E), value
    (N, ..., Hkv, S, Ev) -> (N, ..., Hq, L, Ev), query's dtype."""
    return _sdpa(query, key, value, attn_mask, float(dropout_p), bool(is_causal),
                 None if scale is None else float(scale), bool(enable_gqa))
