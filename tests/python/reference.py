"""A plain numpy reference of qkv's attention semantics (DESIGN.md section 3).

    q: (B, Lq, Hq, D)   k: (B, Lk, Hkv, D)   v: (B, Lk, Hkv, Dv)   -> out: (B, Lq, Hq, Dv)
    lse: (B, Hq, Lq)    weights: (B, Hq, Lq, Lk)
    mask (bool, True = may attend) and bias: numpy-broadcastable to (B, Hq, Lq, Lk)

For query row i and key column j of one (batch, head):
    s = (q_i . k_j) * scale            scale defaults to 1 / sqrt(D)
    s = softcap * tanh(s / softcap)    if softcap > 0
    s += bias
    s = -inf where not allowed: causal j <= i'; window i' - left <= j <= i' + right (-1 =
        unbounded); j < key_lengths[b]; mask true. i' = i + Lk - Lq (bottom-right) or i.
    out_i = sum_j softmax_j(s) v_j;  lse_i = log(sum_j exp(s_ij))
A row with no allowed key gets out 0 and lse -inf.

`attention(..., dtype=np.float64)` is the oracle; dtype=np.float32 is the "plain implementation
of the same formula in the same precision" that DESIGN.md section 5 scales the tolerance by.
"""

import numpy as np


def allowed_pairs(batch, num_heads_q, seq_q, seq_kv, causal=False, align="bottom-right",
                  window=(-1, -1), key_lengths=None, mask=None):
    """Boolean (B, Hq, Lq, Lk): True where query i may attend key j."""
    left, right = window
    # Window sides may be any int64 (2**63 - 1 means "unbounded" too): compare with Python's
    # unbounded ints then, where int64 arithmetic would wrap.
    wide = object if max(abs(int(left)), abs(int(right))) > 2**31 else np.int64
    i = np.arange(seq_q).astype(wide)[:, None]
    j = np.arange(seq_kv).astype(wide)[None, :]
    i_diag = i + (seq_kv - seq_q) if align == "bottom-right" else i
    allowed = np.ones((seq_q, seq_kv), dtype=bool)
    if causal:
        allowed &= j <= i_diag
    if left >= 0:
        allowed &= j >= i_diag - left
    if right >= 0:
        allowed &= j <= i_diag + right
    allowed = np.broadcast_to(allowed, (batch, num_heads_q, seq_q, seq_kv))
    if key_lengths is not None:
        lengths = np.asarray(key_lengths, dtype=np.int64)
        allowed = allowed & (np.arange(seq_kv)[None, None, None, :]
                             < lengths[:, None, None, None])
    if mask is not None:
        allowed = allowed & np.broadcast_to(np.asarray(mask).astype(bool), allowed.shape)
    return np.ascontiguousarray(allowed)


M64 = (1 << 64) - 1


def _splitmix64_mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _fmix32(x):
    x = np.asarray(x, dtype=np.uint64)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & np.uint64(0xFFFFFFFF)
    return x ^ (x >> np.uint64(16))


def dropout_keep(seed, offset, batch, num_heads_q, seq_q, seq_kv, dropout_p):
    """Boolean (B, Hq, Lq, Lk): the pairs qkv's dropout keeps (src/kernels/dropout_mask.h,
    written out again here from its definition)."""
    base = _splitmix64_mix((seed + offset * 0x9E3779B97F4A7C15) & M64)
    threshold = min(2**32 - 1, round(dropout_p * 2**32))
    j = np.arange(seq_kv, dtype=np.uint64)
    keep = np.zeros((batch, num_heads_q, seq_q, seq_kv), dtype=bool)
    for b in range(batch):
        for h in range(num_heads_q):
            for i in range(seq_q):
                linear = (b * num_heads_q + h) * seq_q + i
                row = _splitmix64_mix(base ^ ((linear * 0xD1B54A32D192ED03) & M64))
                lo, hi = np.uint64(row & 0xFFFFFFFF), np.uint64(row >> 32)
                keep[b, h, i] = _fmix32(lo ^ _fmix32(j ^ hi)) >= threshold
    return keep


def attention(q, k, v, scale=None, softcap=0.0, causal=False, align="bottom-right",
              window=(-1, -1), key_lengths=None, mask=None, bias=None, dtype=np.float64,
              store=None, dropout=None):
    """Returns (out (B, Lq, Hq, Dv), lse (B, Hq, Lq), weights (B, Hq, Lq, Lk)) in `dtype`.

    store: None, or a rounding function (round_bf16, round_f16) applied to the probabilities
    before they multiply v, as the vdpbf16ps and AMX product paths do (the tolerance yardstick for
    bf16/f16 inputs; the scores stay in `dtype`: rounding them too made the yardstick about
    100x looser than any path's error).
    dropout: None, or (keep (B, Hq, Lq, Lk) bool, dropout_p): the probabilities that weight v
    are weights * keep / (1 - dropout_p); lse and weights stay the softmax's."""
    keep = store if store is not None else (lambda x: x)
    batch, seq_q, num_heads_q, head_dim = q.shape
    _, seq_kv, num_heads_kv, _ = k.shape
    assert num_heads_q % num_heads_kv == 0
    group = num_heads_q // num_heads_kv
    q = q.astype(dtype)
    k = k.astype(dtype)
    v = v.astype(dtype)
    if key_lengths is not None:
        # Keys at or past key_lengths[b] are never read: they may hold NaN, which would
        # otherwise leak through 0 * NaN in the matmuls.
        k = k.copy()
        v = v.copy()
        for b, length in enumerate(np.asarray(key_lengths)):
            k[b, length:] = 0
            v[b, length:] = 0
    if scale is None:
        scale = 1.0 / np.sqrt(dtype(head_dim))
    scale = dtype(scale)
    # Per query head, the kv head h // group (GQA / MQA).
    qh = q.transpose(0, 2, 1, 3)                                   # (B, Hq, Lq, D)
    kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1)         # (B, Hq, Lk, D)
    vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1)         # (B, Hq, Lk, Dv)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        s = (qh @ kh.swapaxes(-1, -2)).astype(dtype) * scale        # (B, Hq, Lq, Lk)
        if softcap > 0:
            cap = dtype(softcap)
            s = cap * np.tanh(s / cap)
        if bias is not None:
            s = s + np.asarray(bias).astype(dtype)
        allowed = allowed_pairs(batch, num_heads_q, seq_q, seq_kv, causal, align, window,
                                key_lengths, mask)
        s = np.where(allowed, s, dtype(-np.inf)).astype(dtype)
        row_max = s.max(axis=-1, keepdims=True)
        # A row of -inf only (nothing allowed): subtract 0 instead of -inf so that
        # exp(-inf - (-inf)) = NaN never happens; the row then sums to 0.
        row_max = np.where(np.isfinite(row_max), row_max, dtype(0))
        e = np.exp(s - row_max)
        total = e.sum(axis=-1, keepdims=True)
        weights = np.where(total > 0, e / np.where(total > 0, total, 1), dtype(0))
        used = weights if dropout is None else weights * dropout[0] / dtype(1 - dropout[1])
        out = keep(used).astype(dtype) @ vh                        # (B, Hq, Lq, Dv)
        lse = np.where(total[..., 0] > 0, np.log(total[..., 0]) + row_max[..., 0],
                       dtype(-np.inf))
    return out.transpose(0, 2, 1, 3).astype(dtype), lse.astype(dtype), weights.astype(dtype)


def attention_backward(q, k, v, dout, scale=None, softcap=0.0, causal=False,
                       align="bottom-right", window=(-1, -1), key_lengths=None, mask=None,
                       bias=None, dtype=np.float64, store=None, dropout=None):
    """The gradients of attention() for dL/d(out) = dout (B, Lq, Hq, Dv), in `dtype`:
    (dq, dk, dv, dbias) with dk, dv summed over the query heads of each kv head and dbias
    (None without a bias) summed down to the bias's own shape. With P the weights:
        dv = P^T dout   dP = dout v^T   D = rowsum(dout * out)   dS = P (dP - D)
        dU = dS (1 - tanh(u / softcap)^2) with softcap (u = scale q.k), else dS
        dq = scale dU k   dk = scale dU^T q   dbias = dS
    (with dropout, z = keep / (1 - p): dv = (P z)^T dout, dS = P (z dP - D)).
    store: as for attention(): a plain low-precision implementation's rounding of the
    probabilities (the forward's out and the P of the products then carry it)."""
    out, _, weights = attention(q, k, v, scale, softcap, causal, align, window, key_lengths,
                                mask, bias, dtype, store, dropout)
    if store is not None:
        weights = store(weights).astype(dtype)
    batch, seq_q, num_heads_q, head_dim = q.shape
    _, seq_kv, num_heads_kv, _ = k.shape
    group = num_heads_q // num_heads_kv
    q, k, v, dout = (np.asarray(x).astype(dtype) for x in (q, k, v, dout))
    if key_lengths is not None:  # never read: zero, as attention() does
        k = k.copy()
        v = v.copy()
        for b, length in enumerate(np.asarray(key_lengths)):
            k[b, length:] = 0
            v[b, length:] = 0
    scale = dtype(1.0 / np.sqrt(head_dim) if scale is None else scale)
    qh = q.transpose(0, 2, 1, 3)
    kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1)
    vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1)
    oh = out.transpose(0, 2, 1, 3)
    doh = dout.transpose(0, 2, 1, 3)
    p = weights
    z = 1 if dropout is None else dropout[0] / dtype(1 - dropout[1])  # dropout's factor
    dvh = (p * z).swapaxes(-1, -2) @ doh                            # (B, Hq, Lk, Dv)
    dp = (doh @ vh.swapaxes(-1, -2)) * z                            # (B, Hq, Lq, Lk)
    delta = (doh * oh).sum(axis=-1, keepdims=True)
    ds = p * (dp - delta)
    du = ds
    if softcap > 0:
        t = np.tanh((qh @ kh.swapaxes(-1, -2)) * scale / dtype(softcap))
        du = ds * (1 - t * t)
    dqh = scale * (du @ kh)
    dkh = scale * (du.swapaxes(-1, -2) @ qh)

    def per_kv_head(x):  # (B, Hq, L, E) -> (B, L, Hkv, E), summed over each group
        return x.reshape(batch, num_heads_kv, group, *x.shape[2:]).sum(axis=2).transpose(0, 2, 1, 3)

    dbias = None
    if bias is not None:
        shape = np.shape(bias)
        padded = (1,) * (4 - len(shape)) + tuple(shape)
        axes = tuple(d for d in range(4) if padded[d] == 1 and ds.shape[d] > 1)
        dbias = ds.sum(axis=axes, keepdims=True).reshape(shape)
    return dqh.transpose(0, 2, 1, 3), per_kv_head(dkh), per_kv_head(dvh), dbias


def round_bf16(x):
    """float32 -> bfloat16 -> float32, round to nearest even (NaN kept)."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, out).astype(np.float32)


def round_f16(x):
    """float32 -> IEEE half -> float32 (numpy rounds to nearest even)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def tolerance(ref64, ref32):
    """DESIGN.md section 5: max(2e-5 * max(1, max|ref|), 4 * error of the float32 version)."""
    finite = np.isfinite(ref64)
    if not finite.any():
        return 2e-5
    scale = max(1.0, float(np.max(np.abs(ref64[finite]))))
    plain_error = float(np.max(np.abs(ref32[finite].astype(np.float64) - ref64[finite])))
    return max(2e-5 * scale, 4.0 * plain_error)
