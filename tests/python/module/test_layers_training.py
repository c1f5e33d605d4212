"""One training step of qkv.EncoderLayer (forward_train -> qkv.cross_entropy over a linear
readout -> backward -> qkv.AdamW.step) against the same step written here in float64 numpy:
the layer's forward (Post-LN and Pre-LN; multi-head attention softmax(q k^T / sqrt(hd)) v with
GQA, causal and key-length masks; LayerNorm; GELU erf / tanh, ReLU; residuals), its backward by
hand, the cross-entropy and AdamW's update (include/qkv/layers/adamw.h). Dropout cases rebuild
qkv's masks from their definitions (qkv/layers/dropout.h, src/kernels/dropout_mask.h), so they
are compared the same way. Then the API's contracts: parameters / set_parameters, stale tapes,
dropout seeds and steps, threads, and the errors (each naming its argument)."""

import math
import threading

import numpy as np
import pytest

import qkv
import reference as ref

# Tolerance: max|qkv - numpy64| <= RTOL * scale, per tensor; scale = max|numpy64| of the tensor.
# For a gradient the scale is at least GRAD_FLOOR x the step's largest gradient: some exact
# gradients are 0 (the key bias's, as softmax ignores a constant added to a row's scores; q's and
# k's with one token), and float32 leaves them the rounding of the sums they come from (measured
# up to 2e-7 of the largest gradient). Every other tensor is measured within about 1e-6 of its
# scale (docs/training.md): 1/20 of RTOL, while a gradient with one wrong term misses by far more.
RTOL = 2e-5
GRAD_FLOOR = 0.05

E, D_FF, CLASSES = 24, 40, 5


# ---------------------------------------------------------------------------------------------
# float64 numpy: the layer, its backward, the loss and the optimizer.

_erf = np.vectorize(math.erf, otypes=[np.float64])


def act_forward(name, h):
    if name == "gelu":
        return 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h**3)))
    return np.maximum(h, 0.0)


def act_grad(name, h):
    if name == "gelu":  # Phi(h) + h phi(h)
        return 0.5 * (1.0 + _erf(h / math.sqrt(2.0))) + h * np.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)
    if name == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        t = np.tanh(c * (h + 0.044715 * h**3))
        return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * h * h)
    return (h > 0).astype(np.float64)


def layer_norm(z, gamma, beta, eps):
    mean = z.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((z - mean) ** 2).mean(-1, keepdims=True) + eps)
    zhat = (z - mean) * rstd
    return zhat * gamma + beta, (zhat, rstd)


def layer_norm_backward(dy, cache, gamma):
    """dL/dz, dL/dgamma, dL/dbeta for y = LN(z)."""
    zhat, rstd = cache
    g = dy * gamma
    dz = rstd * (g - g.mean(-1, keepdims=True) - zhat * (g * zhat).mean(-1, keepdims=True))
    return dz, (dy * zhat).reshape(-1, dy.shape[-1]).sum(0), dy.reshape(-1, dy.shape[-1]).sum(0)


def linear(x, w, b):
    return x @ w.T + b


def linear_backward(x, dy, w):
    """dx, dW, db for y = x W^T + b over the last dim."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    return dy @ w, dy2.T @ x2, dy2.sum(0)


class Config:
    def __init__(self, batch=2, seq=7, num_heads=4, num_kv_heads=0, activation="gelu",
                 norm_first=False, causal=False, key_lengths=None, biases=True,
                 packing="separate", dropout=0.0, seed=0, eps=1e-5):
        self.batch, self.seq, self.num_heads = batch, seq, num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.activation, self.norm_first, self.causal = activation, norm_first, causal
        self.key_lengths, self.biases, self.packing = key_lengths, biases, packing
        self.dropout, self.seed, self.eps = dropout, seed, eps
        self.head_dim = E // num_heads
        self.kv_width = self.num_kv_heads * self.head_dim

    def layer(self, weights):
        return qkv.EncoderLayer(weights, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                activation=self.activation, norm_first=self.norm_first,
                                eps=self.eps, dropout=self.dropout, seed=self.seed,
                                qkv_packing=self.packing)


def attention_forward(c, p, x, keep):
    """Self-attention of x [B, L, E]; keep: None or the (B, H, L, L) dropout factors."""
    B, L, H, Hkv, hd = c.batch, c.seq, c.num_heads, c.num_kv_heads, c.head_dim
    q = linear(x, p["q_w"], p["q_b"]).reshape(B, L, H, hd)
    k = np.repeat(linear(x, p["k_w"], p["k_b"]).reshape(B, L, Hkv, hd), H // Hkv, axis=2)
    v = np.repeat(linear(x, p["v_w"], p["v_b"]).reshape(B, L, Hkv, hd), H // Hkv, axis=2)
    scale = 1.0 / math.sqrt(hd)
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    allowed = np.ones((B, 1, L, L), dtype=bool)
    if c.causal:
        allowed &= np.tri(L, dtype=bool)
    if c.key_lengths is not None:
        allowed &= np.arange(L)[None, None, None, :] < np.asarray(c.key_lengths)[:, None, None, None]
    s = np.where(allowed, s, -np.inf)
    probs = np.exp(s - s.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    used = probs if keep is None else probs * keep
    ctx = np.einsum("bhij,bjhd->bihd", used, v).reshape(B, L, E)
    out = linear(ctx, p["o_w"], p["o_b"])
    return out, (x, q, k, v, probs, used, ctx, keep)


def attention_backward(c, p, d_out, cache):
    B, L, H, Hkv, hd = c.batch, c.seq, c.num_heads, c.num_kv_heads, c.head_dim
    x, q, k, v, probs, used, ctx, keep = cache
    g = {}
    d_ctx, g["o_w"], g["o_b"] = linear_backward(ctx, d_out, p["o_w"])
    d_ctx = d_ctx.reshape(B, L, H, hd)
    d_used = np.einsum("bihd,bjhd->bhij", d_ctx, v)
    dv = np.einsum("bhij,bihd->bjhd", used, d_ctx)
    dp = d_used if keep is None else d_used * keep
    ds = probs * (dp - (dp * probs).sum(-1, keepdims=True))
    scale = 1.0 / math.sqrt(hd)
    dq = np.einsum("bhij,bjhd->bihd", ds, k).reshape(B, L, E) * scale
    dk = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    # Query head h read kv head h // (H / Hkv): sum each kv head's group.
    dk = dk.reshape(B, L, Hkv, H // Hkv, hd).sum(3).reshape(B, L, c.kv_width)
    dv = dv.reshape(B, L, Hkv, H // Hkv, hd).sum(3).reshape(B, L, c.kv_width)
    dx = 0
    for part, d in (("q", dq), ("k", dk), ("v", dv)):
        dx_part, g[part + "_w"], g[part + "_b"] = linear_backward(x, d, p[part + "_w"])
        dx = dx + dx_part
    return dx, g


def layer_forward(c, p, x, masks):
    """The encoder layer on x [B, L, E]; masks: {site: dropout factors} (empty: none)."""
    drop = lambda site, t: t * masks[site] if site in masks else t
    cache = {}

    def ffn(n):
        h = linear(n, p["f1_w"], p["f1_b"])
        g = drop("activation", act_forward(c.activation, h))
        cache["ffn"] = (n, h, g)
        return drop("ffn", linear(g, p["f2_w"], p["f2_b"]))

    if not c.norm_first:
        a, cache["attention"] = attention_forward(c, p, x, masks.get("probs"))
        x1, cache["ln1"] = layer_norm(drop("attention", a) + x, p["g1"], p["b1"], c.eps)
        y, cache["ln2"] = layer_norm(ffn(x1) + x1, p["g2"], p["b2"], c.eps)
    else:
        n1, cache["ln1"] = layer_norm(x, p["g1"], p["b1"], c.eps)
        a, cache["attention"] = attention_forward(c, p, n1, masks.get("probs"))
        x1 = x + drop("attention", a)
        n2, cache["ln2"] = layer_norm(x1, p["g2"], p["b2"], c.eps)
        y = x1 + ffn(n2)
    return y, cache


def layer_backward(c, p, dy, cache, masks):
    drop = lambda site, t: t * masks[site] if site in masks else t
    g = {}

    def ffn_backward(d_f):
        n, h, act = cache["ffn"]
        d_act, g["f2_w"], g["f2_b"] = linear_backward(act, drop("ffn", d_f), p["f2_w"])
        d_h = drop("activation", d_act) * act_grad(c.activation, h)
        d_n, g["f1_w"], g["f1_b"] = linear_backward(n, d_h, p["f1_w"])
        return d_n

    if not c.norm_first:
        dz2, g["g2"], g["b2"] = layer_norm_backward(dy, cache["ln2"], p["g2"])
        dx1 = dz2 + ffn_backward(dz2)
        dz1, g["g1"], g["b1"] = layer_norm_backward(dx1, cache["ln1"], p["g1"])
        dx_attention, ga = attention_backward(c, p, drop("attention", dz1), cache["attention"])
        dx = dz1 + dx_attention
    else:
        dx1 = dy + 0.0
        dn2 = ffn_backward(dy)
        dz2, g["g2"], g["b2"] = layer_norm_backward(dn2, cache["ln2"], p["g2"])
        dx1 = dx1 + dz2
        dn1, ga = attention_backward(c, p, drop("attention", dx1), cache["attention"])
        dz1, g["g1"], g["b1"] = layer_norm_backward(dn1, cache["ln1"], p["g1"])
        dx = dx1 + dz1
    g.update(ga)
    return dx, g


def cross_entropy64(logits, targets, ignore_index=-100):
    counted = targets != ignore_index
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    rows = np.nonzero(counted)[0]
    count = max(len(rows), 1)
    loss = -log_probs[rows, targets[rows]].sum() / count if len(rows) else 0.0
    dlogits = np.exp(log_probs)
    dlogits[rows, targets[rows]] -= 1.0
    dlogits[~counted] = 0.0
    return loss, dlogits / count


def adamw64(params, grads, state, lr, betas, eps, weight_decay):
    """One step of adamw.h's update in float64 on {name: array}; state: {name: (m, v)}, t."""
    state["t"] = t = state.get("t", 0) + 1
    beta1, beta2 = betas
    out = {}
    for name, p in params.items():
        g = grads[name]
        m, v = state.get(name, (np.zeros_like(p), np.zeros_like(p)))
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        state[name] = (m, v)
        p = p * (1 - lr * weight_decay)
        out[name] = p - lr * (m / (1 - beta1**t)) / (np.sqrt(v / (1 - beta2**t)) + eps)
    return out


# ---------------------------------------------------------------------------------------------
# qkv's dropout masks, from their definitions.

def _mix64(z):
    """splitmix64's finaliser on a uint64 array (array arithmetic wraps modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def layer_dropout_factors(seed, stream, shape, p):
    """qkv::dropout's kept / (1 - p) for element i of `stream` (src/layers/dropout.cc):
    key = mix(seed ^ mix(stream + gamma)), kept iff mix(key + i * C) >> 40 >= ceil(p * 2^24)."""
    mix = ref._splitmix64_mix  # on Python ints
    key = mix(seed ^ mix((stream + 0x9E3779B97F4A7C15) & ref.M64))
    i = np.arange(int(np.prod(shape)), dtype=np.uint64)
    bits = _mix64(np.uint64(key) + i * np.uint64(0xD1B54A32D192ED03))
    threshold = math.ceil(float(np.float32(p)) * (1 << 24))
    keep = (bits >> np.uint64(40)) >= threshold
    return (keep / (1.0 - float(np.float32(p)))).reshape(shape)


def dropout_masks(c, step):
    """{site: factors} of forward call `step` (src/layers/encoder_layer_impl.h: stream = step * 3
    + site; the attention's offset is the step)."""
    if c.dropout == 0:
        return {}
    p = float(np.float32(c.dropout))
    B, L = c.batch, c.seq
    keep = ref.dropout_keep(c.seed, step, B, c.num_heads, L, L, p)
    return {"attention": layer_dropout_factors(c.seed, step * 3 + 0, (B, L, E), p),
            "activation": layer_dropout_factors(c.seed, step * 3 + 1, (B, L, D_FF), p),
            "ffn": layer_dropout_factors(c.seed, step * 3 + 2, (B, L, E), p),
            "probs": keep / (1.0 - p)}


# ---------------------------------------------------------------------------------------------
# Parameters: numpy's canonical names <-> qkv's names in each packing.

CANONICAL = {"o_w": "attention.out_weight", "o_b": "attention.out_bias", "g1": "norm1_gamma",
             "b1": "norm1_beta", "f1_w": "ff1_weight", "f1_b": "ff1_bias", "f2_w": "ff2_weight",
             "f2_b": "ff2_bias", "g2": "norm2_gamma", "b2": "norm2_beta"}
BIASES = ("q_b", "k_b", "v_b", "o_b", "f1_b", "f2_b")


def random_canonical(c, rng):
    """float64 parameters that are float32 numbers (qkv gets the same values exactly)."""
    normal = lambda *shape, s=1.0: rng.standard_normal(shape) * s
    p = {"q_w": normal(E, E, s=E**-0.5), "k_w": normal(c.kv_width, E, s=E**-0.5),
         "v_w": normal(c.kv_width, E, s=E**-0.5), "o_w": normal(E, E, s=E**-0.5),
         "q_b": normal(E, s=0.1), "k_b": normal(c.kv_width, s=0.1), "v_b": normal(c.kv_width, s=0.1),
         "o_b": normal(E, s=0.1), "g1": 1 + normal(E, s=0.1), "b1": normal(E, s=0.1),
         "f1_w": normal(D_FF, E, s=E**-0.5), "f1_b": normal(D_FF, s=0.1),
         "f2_w": normal(E, D_FF, s=D_FF**-0.5), "f2_b": normal(E, s=0.1),
         "g2": 1 + normal(E, s=0.1), "b2": normal(E, s=0.1)}
    if not c.biases:
        p.update({name: np.zeros_like(p[name]) for name in BIASES})
    return {name: value.astype(np.float32).astype(np.float64) for name, value in p.items()}


def packed(c, p):
    """{qkv name: array} of canonical {name: array} (parameters or their gradients)."""
    out = {qkv_name: p[name] for name, qkv_name in CANONICAL.items()}
    H, hd = c.num_heads, c.head_dim
    if c.packing == "separate":
        out.update({f"attention.{x}_weight": p[f"{x}_w"] for x in "qkv"})
        out.update({f"attention.{x}_bias": p[f"{x}_b"] for x in "qkv"})
    elif c.packing == "fused_blocks":  # [Wq; Wk; Wv]
        out["attention.qkv_weight"] = np.concatenate([p["q_w"], p["k_w"], p["v_w"]])
        out["attention.qkv_bias"] = np.concatenate([p["q_b"], p["k_b"], p["v_b"]])
    else:  # per head h: rows [q_h; k_h; v_h]
        out["attention.qkv_weight"] = np.stack(
            [p[f"{x}_w"].reshape(H, hd, E) for x in "qkv"], axis=1).reshape(3 * E, E)
        out["attention.qkv_bias"] = np.stack(
            [p[f"{x}_b"].reshape(H, hd) for x in "qkv"], axis=1).reshape(3 * E)
    if not c.biases:
        out = {name: value for name, value in out.items() if "bias" not in name}
    return out


def check(what, actual, expected, scale=None, tolerance=None):
    """max|actual - expected| <= tolerance (default RTOL * scale; scale default max|expected|);
    returns error / tolerance."""
    actual = np.asarray(actual, dtype=np.float64)
    assert actual.shape == np.shape(expected), f"{what}: shape {actual.shape} != {np.shape(expected)}"
    assert np.isfinite(actual).all(), f"{what}: not finite"
    if tolerance is None:
        tolerance = RTOL * (float(np.max(np.abs(expected))) if scale is None else scale)
    error = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
    assert error <= tolerance, f"{what}: max abs error {error:.3g} > tolerance {tolerance:.3g}"
    return error / tolerance


CASES = {
    "post_ln": dict(),
    "pre_ln": dict(norm_first=True),
    "post_ln_gqa_key_lengths": dict(num_kv_heads=2, key_lengths=[7, 5]),
    "pre_ln_mqa_relu_causal_key_lengths": dict(norm_first=True, num_heads=3, num_kv_heads=1,
                                               activation="relu", causal=True, key_lengths=[4, 7]),
    "post_ln_gelu_tanh_no_biases": dict(num_heads=3, activation="gelu_tanh", biases=False),
    "pre_ln_fused_blocks_gqa": dict(norm_first=True, num_kv_heads=2, packing="fused_blocks",
                                    key_lengths=[6, 7]),
    "post_ln_fused_per_head_causal": dict(packing="fused_per_head", causal=True),
    "pre_ln_one_token": dict(norm_first=True, batch=3, seq=1, num_heads=2),
    "post_ln_dropout_gqa": dict(num_kv_heads=2, dropout=0.2, seed=7, key_lengths=[7, 6]),
    "pre_ln_dropout": dict(norm_first=True, dropout=0.25, seed=3),
}

# eps = 1e-3, not torch's 1e-8: the update lr * g / (|g| + eps) (at step 1) moves by lr / eps
# per unit of gradient error where |g| << eps, so with eps 1e-8 a float32 gradient that is 1e-9
# where the exact one is 0 (the key bias) moves its parameter by lr / 10, and no float32 step
# could match. test_adamw_matches_numpy_over_steps checks the defaults on shared gradients.
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-3, weight_decay=0.1)


def f32(value):
    return float(np.float32(value))


def training_step(c, rng):
    """Both steps; returns {what: (qkv's, numpy's, scale or None)}."""
    canonical = random_canonical(c, rng)
    weights = {name: value.astype(np.float32) for name, value in packed(c, canonical).items()}
    layer = c.layer(weights)
    B, L = c.batch, c.seq
    x = rng.standard_normal((B, L, E)).astype(np.float32)
    readout = (rng.standard_normal((CLASSES, E)) * E**-0.5).astype(np.float32)
    targets = rng.integers(0, CLASSES, B * L).astype(np.int32)
    if c.key_lengths is not None:  # padding rows count for nothing
        targets[(np.arange(L)[None, :] >= np.asarray(c.key_lengths)[:, None]).reshape(-1)] = -100
    targets[0] = -100

    # qkv, float32.
    params = layer.parameters()
    assert sorted(params) == sorted(weights)
    for name in weights:
        np.testing.assert_array_equal(params[name], weights[name], err_msg=name)
    y, tape = layer.forward_train(x, causal=c.causal, key_lengths=c.key_lengths)
    assert tape.step == 0 and (tape.batch, tape.seq) == (B, L)
    logits = y.reshape(B * L, E) @ readout.T
    loss, dlogits = qkv.cross_entropy(logits, targets)
    dy = (dlogits @ readout).reshape(B, L, E)
    dx, grads = layer.backward(tape, dy)
    assert sorted(grads) == sorted(weights)
    optimizer = qkv.AdamW(**ADAMW)
    optimizer.step(params, grads)
    layer.set_parameters(params)
    after = layer.parameters()
    for name in params:
        np.testing.assert_array_equal(after[name], params[name], err_msg=name)

    # numpy, float64.
    masks = dropout_masks(c, 0)
    y64, cache = layer_forward(c, canonical, x.astype(np.float64), masks)
    logits64 = y64.reshape(B * L, E) @ readout.T.astype(np.float64)
    loss64, dlogits64 = cross_entropy64(logits64, targets)
    dy64 = (dlogits64 @ readout.astype(np.float64)).reshape(B, L, E)
    dx64, grads64 = layer_backward(c, canonical, dy64, cache, masks)
    grads64 = packed(c, grads64)
    adamw = dict(ADAMW, lr=f32(ADAMW["lr"]), betas=tuple(map(f32, ADAMW["betas"])),
                 eps=f32(ADAMW["eps"]), weight_decay=f32(ADAMW["weight_decay"]))
    params64 = adamw64(packed(c, canonical), grads64, {}, **adamw)

    results = {"y": (y, y64, None), "loss": (loss, loss64, max(1.0, abs(loss64))),
               "dlogits": (dlogits, dlogits64, None), "dx": (dx, dx64, None)}
    grad_floor = GRAD_FLOOR * max(float(np.max(np.abs(g))) for g in grads64.values())
    for name in grads64:
        scale = max(float(np.max(np.abs(grads64[name]))), grad_floor)
        results["grad " + name] = (grads[name], grads64[name], scale)
    for name in params64:
        results["param " + name] = (params[name], params64[name], None)
    return results


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_step_matches_numpy_float64(rng, case):
    c = Config(**CASES[case])
    for what, (actual, expected, scale) in training_step(c, rng).items():
        check(f"{case}: {what}", actual, expected, scale)


def test_adamw_matches_numpy_over_steps(rng):
    """AdamW alone, torch's defaults and weight decay, four steps on the same gradients as
    numpy's (the update's bias corrections change with the step)."""
    shapes = {"b": (7,), "a": (5, 3), "c": (2, 3, 4)}
    params = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    params64 = {name: value.astype(np.float64) for name, value in params.items()}
    optimizer = qkv.AdamW(lr=1e-3, weight_decay=0.01)
    assert optimizer.betas == (pytest.approx(0.9), pytest.approx(0.999))
    state = {}
    for step in range(1, 5):
        grads = {name: (rng.standard_normal(shape) * 10.0**-step).astype(np.float32)
                 for name, shape in shapes.items()}
        optimizer.step(params, grads)
        assert optimizer.steps == step
        before = dict(params64)
        params64 = adamw64(params64, {n: g.astype(np.float64) for n, g in grads.items()}, state,
                           lr=f32(1e-3), betas=(f32(0.9), f32(0.999)), eps=f32(1e-8),
                           weight_decay=f32(0.01))
        for name in shapes:
            # The update, at its own scale, plus the float32 roundings of p * (1 - lr wd) and p - step
            # (each at most 2^-24 |p|; and 1 - lr wd itself).
            update64 = params64[name] - before[name]
            tolerance = (RTOL * float(np.max(np.abs(update64)))
                         + 2.0**-22 * float(np.max(np.abs(params64[name]))))
            check(f"step {step} {name}", params[name] - before[name], update64,
                  tolerance=tolerance)
            params64[name] = params[name].astype(np.float64)  # continue from qkv's f32 values


def test_cross_entropy_ignored_rows(rng):
    logits = rng.standard_normal((4, 3)).astype(np.float32)
    loss, dlogits = qkv.cross_entropy(logits, np.full(4, -1, np.int64), ignore_index=-1)
    assert loss == 0.0 and dlogits.dtype == np.float32 and not dlogits.any()
    targets = np.array([2, -100, 0, 1], np.int64)
    loss, dlogits = qkv.cross_entropy(logits, targets)
    loss64, dlogits64 = cross_entropy64(logits.astype(np.float64), targets)
    assert loss == pytest.approx(loss64, rel=1e-12)
    check("dlogits", dlogits, dlogits64)


# ---------------------------------------------------------------------------------------------
# The API's contracts.

def small_layer(rng, **config):
    """(Config, weights, layer) of a layer of Config(**config), separate packing."""
    c = Config(**config)
    weights = {n: v.astype(np.float32) for n, v in packed(c, random_canonical(c, rng)).items()}
    return c, weights, c.layer(weights)


def test_forward_does_not_modify_x_and_matches_forward_train(rng):
    c, weights, layer = small_layer(rng)
    x = rng.standard_normal((2, 7, E)).astype(np.float32)
    keep = x.copy()
    y = layer.forward(x[:, ::-1])  # any strides: copied
    np.testing.assert_array_equal(x, keep)
    y_train, _ = layer.forward_train(np.ascontiguousarray(x[:, ::-1]))
    np.testing.assert_array_equal(x, keep)
    # forward fuses GELU into oneDNN's matmul: rounding apart, the same function.
    check("forward vs forward_train", y, y_train.astype(np.float64))
    y64, _ = layer_forward(c, canonical_of(c, weights), x[:, ::-1].astype(np.float64), {})
    check("forward vs numpy", y, y64)


def test_bf16_matmuls_train_close_to_float32(rng):
    """matmul_dtype="bf16" (mixed precision): the training step's output, dx and every
    parameter's gradient within 5% of the float32 layer's (of each tensor's largest element;
    bf16 operands: measured 0.2-3% in C++, test_encoder_backward.cc), and the weights'
    gradients not its bits (the products did run in bf16)."""
    c = Config(norm_first=True)
    weights = {n: v.astype(np.float32) for n, v in packed(c, random_canonical(c, rng)).items()}
    f32 = c.layer(weights)
    bf16 = qkv.EncoderLayer(weights, num_heads=c.num_heads, norm_first=True,
                            qkv_packing=c.packing, matmul_dtype="bf16")
    assert (f32.matmul_dtype, bf16.matmul_dtype) == ("f32", "bf16")
    x = rng.standard_normal((2, 9, E)).astype(np.float32)
    dy = rng.standard_normal((2, 9, E)).astype(np.float32)
    (y32, t32), (y16, t16) = f32.forward_train(x, causal=True), bf16.forward_train(x, causal=True)
    dx32, g32 = f32.backward(t32, dy)
    dx16, g16 = bf16.backward(t16, dy)
    pairs = [("y", y16, y32), ("dx", dx16, dx32)] + [(n, g16[n], g32[n]) for n in g32]
    for name, got, want in pairs:
        check(f"bf16 {name}", got, want.astype(np.float64),
              tolerance=0.05 * max(1.0, float(np.max(np.abs(want)))))
    for name in g32:
        if name.endswith("weight"):
            assert not np.array_equal(g16[name], g32[name]), name
    with pytest.raises(ValueError, match="matmul_dtype"):
        qkv.EncoderLayer(weights, num_heads=c.num_heads, matmul_dtype="f16")


def canonical_of(c, weights):
    """Canonical float64 parameters from separate-packing qkv weights (zeros for no bias)."""
    p = {name: weights[qkv_name].astype(np.float64) for name, qkv_name in CANONICAL.items()
         if qkv_name in weights}
    for x in "qkv":
        p[f"{x}_w"] = weights[f"attention.{x}_weight"].astype(np.float64)
        bias = weights.get(f"attention.{x}_bias")
        p[f"{x}_b"] = 0.0 if bias is None else bias.astype(np.float64)
    for name in BIASES:
        p.setdefault(name, 0.0)
    return p


def test_parameters_are_copies_and_round_trip(rng):
    c, weights, layer = small_layer(rng)
    x = rng.standard_normal((2, 7, E)).astype(np.float32)
    y = layer.forward(x)
    params = layer.parameters()
    params["ff1_weight"][:] = 0  # a copy: the layer is unchanged
    np.testing.assert_array_equal(layer.forward(x), y)
    layer.set_parameters(layer.parameters())
    np.testing.assert_array_equal(layer.forward(x), y)
    weights["ff1_weight"][:] = 0  # the constructor copied too
    np.testing.assert_array_equal(layer.forward(x), y)
    assert (layer.embed_dim, layer.num_heads, layer.num_kv_heads, layer.d_ff) == (E, 4, 4, D_FF)
    assert (layer.activation, layer.norm_first, layer.qkv_packing) == ("gelu", False, "separate")


def test_backward_returns_fresh_gradients(rng):
    """Each backward's grads are its own (the C++ accumulates into zero_grads()): the same
    tape twice gives the same gradients."""
    _, _, layer = small_layer(rng)
    x = rng.standard_normal((2, 7, E)).astype(np.float32)
    dy = rng.standard_normal((2, 7, E)).astype(np.float32)
    _, tape = layer.forward_train(x)
    dx1, g1 = layer.backward(tape, dy)
    dx2, g2 = layer.backward(tape, dy)
    np.testing.assert_array_equal(dx1, dx2)
    for name in g1:
        np.testing.assert_array_equal(g1[name], g2[name], err_msg=name)


def test_empty_batch(rng):
    _, _, layer = small_layer(rng)
    y, tape = layer.forward_train(np.zeros((0, 7, E), np.float32))
    assert y.shape == (0, 7, E)
    dx, grads = layer.backward(tape, np.zeros((0, 7, E), np.float32))
    assert dx.shape == (0, 7, E) and not any(g.any() for g in grads.values())


def run_once(layer, x, dy):
    y, tape = layer.forward_train(x)
    dx, grads = layer.backward(tape, dy)
    return y, dx, grads, tape.step


def test_dropout_seeds_and_steps(rng):
    _, weights, _ = small_layer(rng)
    x = rng.standard_normal((2, 7, E)).astype(np.float32)
    dy = rng.standard_normal((2, 7, E)).astype(np.float32)
    make = lambda seed: qkv.EncoderLayer(weights, num_heads=4, dropout=0.3, seed=seed)
    first, again, other = make(5), make(5), make(6)
    y1, dx1, g1, step = run_once(first, x, dy)
    y2, dx2, g2, _ = run_once(again, x, dy)
    assert step == 0
    np.testing.assert_array_equal(y1, y2)  # the same seed: the same masks, the same bits
    np.testing.assert_array_equal(dx1, dx2)
    for name in g1:
        np.testing.assert_array_equal(g1[name], g2[name], err_msg=name)
    y3, dx3, _, _ = run_once(other, x, dy)
    assert np.abs(y3 - y1).max() > 0.1 and np.abs(dx3 - dx1).max() > 0.1  # another seed
    y4, _, _, step = run_once(first, x, dy)
    assert step == 1 and np.abs(y4 - y1).max() > 0.1  # the next step draws new masks
    first.train()  # back to step 0
    y5, _, _, step = run_once(first, x, dy)
    assert step == 0
    np.testing.assert_array_equal(y5, y1)
    first.train(seed=6)
    np.testing.assert_array_equal(run_once(first, x, dy)[0], y3)
    # eval(): no dropout, in forward and forward_train alike.
    assert first.eval() is first and not first.training
    plain = qkv.EncoderLayer(weights, num_heads=4)  # dropout 0
    np.testing.assert_array_equal(first.forward(x), plain.forward(x))
    np.testing.assert_array_equal(first.forward_train(x)[0], plain.forward_train(x)[0])
    assert first.train().training


def test_threads_share_an_inference_layer(rng):
    _, _, layer = small_layer(rng)
    layer.eval()
    xs = [rng.standard_normal((2, 7, E)).astype(np.float32) for _ in range(8)]
    expected = [layer.forward(x) for x in xs]
    results = [None] * len(xs)

    def work(i):
        for _ in range(20):
            results[i] = layer.forward(xs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected):
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# Errors: TypeError for dtypes, ValueError for shapes, names and options, each naming the
# argument (and for shapes, both shapes).

def test_constructor_errors(rng):
    _, weights, _ = small_layer(rng)
    build = lambda w, **o: qkv.EncoderLayer(w, **{"num_heads": 4, **o})
    missing = {n: v for n, v in weights.items() if n != "attention.k_weight"}
    with pytest.raises(ValueError, match=r"weights: missing 'attention.k_weight'"):
        build(missing)
    with pytest.raises(ValueError, match=r"weights: unknown name 'attention.kk_weight'"):
        build({**weights, "attention.kk_weight": weights["attention.k_weight"]})
    with pytest.raises(ValueError, match=r"unknown name 'attention.qkv_weight'.*separate"):
        build({**weights, "attention.qkv_weight": weights["attention.k_weight"]})
    bad = {**weights, "ff2_weight": np.zeros((E, D_FF + 1), np.float32)}
    with pytest.raises(ValueError, match=r"weights\['ff2_weight'\]: shape \(24, 41\), "
                                         r"expected \(24, 40\) = \(embed_dim, d_ff\)"):
        build(bad)
    with pytest.raises(ValueError, match=r"weights\['attention.k_weight'\]: shape \(24, 24\), "
                                         r"expected \(12, 24\)"):
        build(weights, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"weights\['norm2_beta'\]: shape \(24, 1\) has 2 dims"):
        build({**weights, "norm2_beta": weights["norm2_beta"][:, None]})
    with pytest.raises(TypeError, match=r"weights\['ff1_bias'\]: dtype float64"):
        build({**weights, "ff1_bias": weights["ff1_bias"].astype(np.float64)})
    with pytest.raises(TypeError, match=r"weights\['ff1_bias'\]: expected an array"):
        build({**weights, "ff1_bias": [1.0] * D_FF})
    with pytest.raises(TypeError, match=r"weights: expected a dict"):
        build(list(weights.values()))
    with pytest.raises(ValueError, match=r"num_heads: 5 must be positive and divide embed_dim = 24"):
        build(weights, num_heads=5)
    with pytest.raises(ValueError, match=r"num_kv_heads: 3 must be positive and divide num_heads = 4"):
        build(weights, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"activation: expected 'gelu', 'gelu_tanh' or 'relu', "
                                         r"got 'swish'"):
        build(weights, activation="swish")
    with pytest.raises(ValueError, match=r"qkv_packing: expected"):
        build(weights, qkv_packing="fused")
    with pytest.raises(ValueError, match=r"dropout = 1\.0+ must be in \[0, 1\)"):
        build(weights, dropout=1.0)
    with pytest.raises(ValueError, match=r"eps"):
        build(weights, eps=0.0)
    with pytest.raises(ValueError, match=r"seed: expected an integer in \[0, 2\*\*64\)"):
        build(weights, seed=-1)


def test_call_errors(rng):
    _, weights, layer = small_layer(rng)
    x = rng.standard_normal((2, 7, E)).astype(np.float32)
    with pytest.raises(TypeError, match=r"^x: dtype float64 is not supported; expected float32"):
        layer.forward(x.astype(np.float64))
    with pytest.raises(ValueError, match=r"^x: shape \(2, 7, 23\) does not match the layer's "
                                         r"embed_dim = 24: expected \(2, 7, 24\)"):
        layer.forward_train(x[:, :, :23])
    with pytest.raises(ValueError, match=r"^x: shape \(14, 24\) has 2 dims; expected 3"):
        layer.forward(x.reshape(14, E))
    with pytest.raises(ValueError, match=r"key_lengths"):
        layer.forward_train(x, key_lengths=[7, 7, 7])
    with pytest.raises(ValueError, match=r"key_lengths"):
        layer.forward(x, key_lengths=[8, 7])
    y, tape = layer.forward_train(x)
    with pytest.raises(ValueError, match=r"^dy: shape \(2, 6, 24\) does not match the tape's "
                                         r"output: shape \(2, 7, 24\)"):
        layer.backward(tape, y[:, :6])
    with pytest.raises(TypeError, match=r"^dy: dtype float64"):
        layer.backward(tape, y.astype(np.float64))
    with pytest.raises(TypeError, match=r"^tape: expected the EncoderLayerTape"):
        layer.backward(None, y)
    other = qkv.EncoderLayer(weights, num_heads=4)
    with pytest.raises(ValueError, match=r"^tape: made by another EncoderLayer"):
        other.backward(tape, y)
    params = layer.parameters()
    with pytest.raises(ValueError, match=r"^params: missing 'norm1_beta'"):
        layer.set_parameters({n: v for n, v in params.items() if n != "norm1_beta"})
    with pytest.raises(ValueError, match=r"^params: unknown name 'bias'; this layer's "
                                         r"parameters are attention.q_weight, "):
        layer.set_parameters({**params, "bias": params["norm1_beta"]})
    with pytest.raises(ValueError, match=r"^params\['ff1_weight'\]: shape \(40, 23\), "
                                         r"expected \(40, 24\)"):
        layer.set_parameters({**params, "ff1_weight": params["ff1_weight"][:, :23]})
    with pytest.raises(TypeError, match=r"^params\['ff1_weight'\]: dtype float64"):
        layer.set_parameters({**params, "ff1_weight": params["ff1_weight"].astype(np.float64)})
    layer.backward(tape, y)  # the failed set_parameters changed nothing: the tape still works
    layer.set_parameters(params)
    with pytest.raises(ValueError, match=r"^tape: the layer's parameters were set"):
        layer.backward(tape, y)
    # A layer built without a bias has no such parameter.
    no_bias = qkv.EncoderLayer({n: v for n, v in weights.items() if n != "ff1_bias"}, num_heads=4)
    assert "ff1_bias" not in no_bias.parameters()
    with pytest.raises(ValueError, match=r"unknown name 'ff1_bias'"):
        no_bias.set_parameters(params)


def test_cross_entropy_errors(rng):
    logits = rng.standard_normal((6, 3)).astype(np.float32)
    targets = np.array([0, 1, 2, 0, 1, 2], np.int32)
    with pytest.raises(TypeError, match=r"^logits: dtype float64"):
        qkv.cross_entropy(logits.astype(np.float64), targets)
    with pytest.raises(TypeError, match=r"^targets: dtype float32 is not supported; expected int32 "
                                        r"or int64"):
        qkv.cross_entropy(logits, targets.astype(np.float32))
    with pytest.raises(ValueError, match=r"^targets: shape \(5,\) does not match logits: shape "
                                         r"\(6, 3\)"):
        qkv.cross_entropy(logits, targets[:5])
    with pytest.raises(ValueError, match=r"targets\[2\] = 3 is outside \[0, 3\)"):
        qkv.cross_entropy(logits, np.array([0, 1, 3, 0, 1, 2], np.int32))
    with pytest.raises(ValueError, match=r"targets\[1\] = 4294967297 is outside \[0, 3\)"):
        qkv.cross_entropy(logits, np.array([0, 2**32 + 1, 0, 0, 1, 2], np.int64))
    bad = logits.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"logits\[1, 2\] = nan is not finite"):
        qkv.cross_entropy(bad, targets)


def test_adamw_errors(rng):
    for options, pattern in ((dict(lr=-1.0), r"lr = -1"), (dict(betas=(0.9, 1.0)), r"betas"),
                             (dict(eps=0.0), r"eps = 0"), (dict(weight_decay=-0.1),
                                                           r"weight_decay = -0\.1")):
        with pytest.raises(ValueError, match=pattern):
            qkv.AdamW(**options)
    with pytest.raises(TypeError, match=r"betas: expected \(beta1, beta2\)"):
        qkv.AdamW(betas=0.9)
    params = {"a": np.ones((2, 3), np.float32), "b": np.ones(4, np.float32)}
    grads = {"a": np.ones((2, 3), np.float32), "b": np.ones(4, np.float32)}
    keep = {n: v.copy() for n, v in params.items()}
    optimizer = qkv.AdamW()
    attempts = [
        ({**grads, "c": grads["b"]}, ValueError, r"^grads: 'c' is not in params"),
        ({"a": grads["a"]}, ValueError, r"^grads: missing 'b' \(params has it\)"),
        ({**grads, "a": grads["a"].T}, ValueError,
         r"^grads\['a'\]: shape \(3, 2\) does not match params\['a'\]: shape \(2, 3\)"),
        ({**grads, "b": grads["b"].astype(np.float64)}, TypeError, r"^grads\['b'\]: dtype float64"),
    ]
    for bad_grads, error, pattern in attempts:
        with pytest.raises(error, match=pattern):
            optimizer.step(params, bad_grads)
    read_only = params["b"].copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match=r"^params\['b'\]: the array is read-only"):
        optimizer.step({**params, "b": read_only}, grads)
    with pytest.raises(TypeError, match=r"^params\['a'\]: dtype float64"):
        optimizer.step({**params, "a": params["a"].astype(np.float64)}, grads)
    for name in params:  # nothing changed, no step counted
        np.testing.assert_array_equal(params[name], keep[name])
    assert optimizer.steps == 0
    optimizer.step(params, grads)
    assert optimizer.steps == 1 and not np.array_equal(params["a"], keep["a"])
    with pytest.raises(ValueError, match=r"^params: names \['a'\] differ from the first step's "
                                         r"\['a', 'b'\]"):
        optimizer.step({"a": params["a"]}, {"a": grads["a"]})
    with pytest.raises(ValueError, match=r"^params\['b'\]: shape \(5,\) differs from the first "
                                         r"step's \(4,\)"):
        optimizer.step({**params, "b": np.ones(5, np.float32)},
                       {**grads, "b": np.ones(5, np.float32)})
    with pytest.raises(ValueError, match=r"^lr: -0\.5"):
        optimizer.lr = -0.5
    optimizer.lr = 0.5
    assert optimizer.lr == 0.5
