"""qkv: exact transformer attention on the CPU.

    import qkv
    out = qkv.attention(q, k, v, causal=True)            # numpy, torch or jax arrays
    out, lse = qkv.attention(q, k, v, window=(256, 0), return_lse=True)
    emb = qkv.SentenceEmbedder(model_dir).encode(["a sentence", "another"])
    import qkv.torch                                      # PyTorch's SDPA, computed by qkv
    layer = qkv.EncoderLayer(weights, num_heads=8)        # train an encoder layer from numpy

Arrays go in as zero-copy views with their own strides (DLPack or the buffer protocol): f32, and
bf16/f16 where the framework has them (torch.bfloat16, jax bfloat16, numpy with ml_dtypes).
Results come back in the caller's framework (numpy in, numpy out; torch in, torch out; jax in,
jax out), float32, or are written into `out=`. The GIL is released while qkv computes. Errors
raise TypeError (not an array, wrong dtype) or ValueError (shapes, options: the library's
message, naming the argument and the shapes). docs/python.md has the details.
"""

from __future__ import annotations

import operator
import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _qkv
from ._qkv import EncoderLayerTape, Sparsity

__all__ = ["attention", "attention_backward", "linear_attention", "longformer", "bigbird", "block_layout",
           "bigbird_layout", "Sparsity", "SentenceEmbedder", "EncoderLayer", "EncoderLayerTape",
           "cross_entropy", "AdamW", "product_path"]
__version__ = "0.1.0"

try:  # numpy has no bfloat16 of its own; ml_dtypes' is the one JAX and others use.
    import ml_dtypes as _ml_dtypes
    _NUMPY_BF16: Optional[np.dtype] = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is optional
    _NUMPY_BF16 = None

Array = Any  # numpy.ndarray, torch.Tensor, jax.Array or anything with DLPack / a buffer


def _framework(x: Any) -> str:
    """'torch', 'jax' or 'numpy': the framework results are returned in."""
    module = type(x).__module__
    if module.startswith("torch"):
        return "torch"
    if module.startswith("jax"):
        return "jax"
    return "numpy"


def _array_shape(name: str, x: Any) -> Tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{name}: expected an array (numpy, torch or jax: DLPack or the buffer "
                        f"protocol), got {type(x).__name__}")
    return tuple(shape)


def _shape(name: str, x: Any, expected: str) -> Tuple[int, ...]:
    shape = _array_shape(name, x)
    if len(shape) != 4:
        raise ValueError(f"{name}: shape {tuple(shape)} has {len(shape)} dims; expected 4: "
                         f"{expected}")
    return tuple(shape)


_to_dlpack = None  # torch.utils.dlpack.to_dlpack, once torch tensors come in


def _input(name: str, x: Any) -> Tuple[Any, bool]:
    """The array as _qkv imports it, and whether it is bf16 held as uint16 words. Torch tensors
    go as DLPack capsules (torch.utils.dlpack.to_dlpack: 0.3 us, where Tensor.__dlpack__ takes
    2.4 us); numpy arrays of ml_dtypes.bfloat16 as uint16 views."""
    global _to_dlpack
    if type(x).__module__.startswith("torch"):
        if x.requires_grad:  # DLPack refuses tensors that require grad; qkv only reads them
            x = x.detach()
        if x.device.type != "cpu":
            raise ValueError(f"{name}: the tensor is on device '{x.device}'; qkv computes on "
                             f"the CPU (move it with .cpu())")
        if _to_dlpack is None:
            from torch.utils.dlpack import to_dlpack as _to_dlpack
        return _to_dlpack(x), False
    if _NUMPY_BF16 is not None and isinstance(x, np.ndarray) and x.dtype == _NUMPY_BF16:
        return x.view(np.uint16), True
    return x, False


def _empty(framework: str, shape: Tuple[int, ...], f64: bool = False,
           half: Optional[str] = None) -> Any:
    """An output array: float32 (float64 with f64; bfloat16 or float16 with half = "bf16" or
    "f16", numpy's bfloat16 being ml_dtypes'), torch for torch inputs, else numpy (jax converts
    after)."""
    if framework == "torch":
        import torch
        return torch.empty(shape, dtype={"bf16": torch.bfloat16, "f16": torch.float16}.get(
            half, torch.float64 if f64 else torch.float32))
    if half == "bf16" and _NUMPY_BF16 is None:  # pragma: no cover - comes with bf16 inputs
        raise ValueError("out_dtype: bfloat16 numpy outputs need ml_dtypes (pip install "
                         "ml_dtypes)")
    return np.empty(shape, {"bf16": _NUMPY_BF16, "f16": np.float16}.get(
        half, np.float64 if f64 else np.float32))


_DTYPE_KEYS = {"float32": "f32", "f32": "f32", "bfloat16": "bf16", "bf16": "bf16",
               "float16": "f16", "f16": "f16", "half": "f16"}


def _dtype_key(name: str, dtype: Any) -> str:
    """"f32", "bf16" or "f16" for a dtype name ("float32", "bfloat16", "float16", "f32", "bf16",
    "f16") or a numpy / torch / JAX dtype; ValueError naming `name` for anything else."""
    text = str(dtype).replace("torch.", "")
    if text not in _DTYPE_KEYS:
        try:
            text = np.dtype(dtype).name
        except TypeError:
            pass
    if text not in _DTYPE_KEYS:
        raise ValueError(f"{name}: expected float32, bfloat16 or float16, got {dtype!r}")
    return _DTYPE_KEYS[text]


def _is_f64(x: Any) -> bool:
    """Whether x holds float64 (the reference kernel's gradient-check path: float64 outputs)."""
    return str(getattr(x, "dtype", "")) in ("float64", "torch.float64")


def _result(framework: str, x: Any) -> Any:
    if framework == "jax":
        import jax.numpy as jnp
        return jnp.asarray(x)
    return x


def _int(name: str, value: Any) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None


def _seed(name: str, value: Any) -> int:
    """A dropout seed or offset: an integer in [0, 2**64)."""
    value = _int(name, value)
    if not 0 <= value < 2**64:
        raise ValueError(f"{name}: expected an integer in [0, 2**64), got {value}")
    return value


def _lengths(key_lengths: Any) -> Any:
    """key_lengths as an int array _qkv reads (lists and tuples are converted)."""
    if key_lengths is None or hasattr(key_lengths, "shape"):
        return key_lengths
    array = np.asarray(key_lengths)
    if array.dtype.kind not in "iu":
        raise TypeError(f"key_lengths: expected integers, got {array.dtype}")
    return array.astype(np.int64)


def _shared(q: Any, k: Any, v: Any, mask: Any, bias: Any, sparsity: Any,
            window: Any) -> Tuple[Any, Any, Any, int, Any, Any, int, int]:
    """The arguments attention() and attention_backward() share, as _qkv takes them: q, k, v,
    their bf16-as-uint16 bits, mask, bias, and the window's two sides (sparsity checked)."""
    q, q_bits = _input("q", q)
    k, k_bits = _input("k", k)
    v, v_bits = _input("v", v)
    if mask is not None:
        mask = _input("mask", mask)[0]
    if bias is not None:
        bias = _input("bias", bias)[0]
    if sparsity is not None and not isinstance(sparsity, Sparsity):
        raise TypeError(f"sparsity: expected qkv.longformer(...), qkv.bigbird(...) or "
                        f"qkv.block_layout(...), got {type(sparsity).__name__}")
    try:
        window_left, window_right = window
    except (TypeError, ValueError):
        raise TypeError(f"window: expected (left, right), got {window!r}") from None
    return (q, k, v, q_bits | (k_bits << 1) | (v_bits << 2), mask, bias,
            _int("window", window_left), _int("window", window_right))


def attention(q: Array, k: Array, v: Array, *, layout: str = "bshd", causal: bool = False,
              align: str = "bottom_right", window: Tuple[int, int] = (-1, -1),
              key_lengths: Optional[Union[Array, Sequence[int]]] = None,
              mask: Optional[Array] = None, bias: Optional[Array] = None,
              scale: Optional[float] = None, softcap: float = 0.0,
              sparsity: Optional[Sparsity] = None, kernel: str = "auto", num_threads: int = 0,
              dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
              return_lse: bool = False, return_weights: bool = False,
              out: Optional[Array] = None, out_dtype: Any = None) -> Any:
    """Exact scaled dot-product attention (qkv::attention; docs/semantics.md).

    Shapes with layout="bshd" (default; with "bhsd" each of q, k, v, out is (B, H, L, D)):
        q: (B, Lq, Hq, D)   k: (B, Lk, Hkv, D)   v: (B, Lk, Hkv, Dv)   ->  out: (B, Lq, Hq, Dv)
        lse: (B, Hq, Lq)    weights: (B, Hq, Lq, Lk)
    Hq must be a multiple of Hkv (GQA / MQA: query head h reads kv head h // (Hq // Hkv)).
    q, k, v: float32, bfloat16 or float16 (one dtype), any strides; accumulation is float32.
    float64 q, k, v run on the reference kernel (kernel "auto" or "reference") and give float64
    outputs: the gradient-check path (docs/training.md).

    For query row i and key j:  s = (q_i . k_j) * scale  (scale: 1/sqrt(D) by default);
    if softcap > 0: s = softcap * tanh(s / softcap);  s += bias;  s = -inf where not allowed;
    out_i = softmax_j(s) v;  lse_i = log(sum_j exp(s_ij)). A row with no allowed key gives
    out 0 and lse -inf, never NaN.

    Allowed pairs (all must hold):
        causal: j <= i'; window=(left, right): i' - left <= j <= i' + right (-1: unbounded),
            with i' = i + Lk - Lq for align="bottom_right" (default) or i' = i ("top_left",
            PyTorch's is_causal);
        key_lengths: (B,) ints, j < key_lengths[b] (padding);
        mask: bool/uint8 broadcastable to (B, Hq, Lq, Lk), TRUE MEANS MAY ATTEND;
        sparsity: qkv.longformer(...), qkv.bigbird(...) or qkv.block_layout(...).
    bias: float32 broadcastable to (B, Hq, Lq, Lk) (-inf allowed).

    kernel: "auto" (flash; chunked when weights are asked for), "flash", "chunked",
    "reference". num_threads: 0 = OpenMP's default; results do not depend on it.

    dropout_p in [0, 1): each probability is dropped before it weights v, the kept ones scaled
    by 1 / (1 - dropout_p), by a mask that is a hash of (seed, offset, b, h, i, j): the same in
    every kernel, in attention_backward and on any thread count (lse and weights stay the
    softmax's; docs/training.md). Not from kernel "chunked".

    Returns out, or a tuple (out, lse), (out, weights) or (out, lse, weights) as asked, in q's
    framework: lse and weights float32, out float32 unless out_dtype or out= say otherwise.
    out_dtype: float32 (None, the default) or, for bfloat16 / float16 q, k and v, their dtype
    (a name or a numpy / torch / JAX dtype): out is then the float32 result rounded to nearest
    even, written by the kernel (no float32 copy; half the memory). out=: a writable array of
    out's shape to write into, float32 or q's bfloat16 / float16 (nothing is written when an
    error is raised); not with out_dtype.
    """
    framework = _framework(q)
    f64 = _is_f64(q)
    bhsd = layout == "bhsd"
    q_shape = _shape("q", q, "(B, Hq, Lq, D) for layout 'bhsd'" if bhsd else "(B, Lq, Hq, D)")
    v_shape = _shape("v", v, "(B, Hkv, Lk, Dv) for layout 'bhsd'" if bhsd else "(B, Lk, Hkv, Dv)")
    batch, seq_q, heads_q = (q_shape[0], q_shape[2], q_shape[1]) if bhsd else q_shape[:3]
    half = None  # "bf16" / "f16": out in the inputs' dtype
    if out_dtype is not None:
        if out is not None:
            raise ValueError("out_dtype: give out= or out_dtype, not both (out= has its dtype)")
        want = _dtype_key("out_dtype", out_dtype)
        have = "f64" if f64 else _dtype_key("q", getattr(q, "dtype", None))
        if want != "f32" or f64:
            if want != have:
                raise ValueError(f"out_dtype: {out_dtype!r} is neither float32 nor q's dtype "
                                 f"({getattr(q, 'dtype', None)}); out is float32 or the "
                                 f"inputs' bfloat16 / float16")
            half = want
    if out is None:
        out_shape = ((batch, heads_q, seq_q, v_shape[3]) if bhsd
                     else (batch, seq_q, heads_q, v_shape[3]))
        out = _empty(framework, out_shape, f64, half)
    lse = _empty(framework, (batch, heads_q, seq_q), f64) if return_lse else None
    weights = None
    if return_weights:
        k_shape = _shape("k", k, "(B, Hkv, Lk, D)" if bhsd else "(B, Lk, Hkv, D)")
        weights = _empty(framework, (batch, heads_q, seq_q, k_shape[2] if bhsd else k_shape[1]),
                         f64)
    q, k, v, bits, mask, bias, left, right = _shared(q, k, v, mask, bias, sparsity, window)
    out_array, out_bits = _input("out", out)
    bits |= out_bits << 3
    _qkv.attention(q, k, v, out_array, None if lse is None else _input("lse", lse)[0],
                   None if weights is None else _input("weights", weights)[0], mask, bias,
                   _lengths(key_lengths), sparsity,
                   None if scale is None else float(scale), float(softcap), bool(causal), align,
                   left, right, kernel, _int("num_threads", num_threads), float(dropout_p),
                   _seed("seed", seed), _seed("offset", offset), layout, bits)
    if not (return_lse or return_weights):
        return _result(framework, out)
    results = [out] + ([lse] if return_lse else []) + ([weights] if return_weights else [])
    return tuple(_result(framework, x) for x in results)


def attention_backward(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array, *,
                       layout: str = "bshd", causal: bool = False, align: str = "bottom_right",
                       window: Tuple[int, int] = (-1, -1),
                       key_lengths: Optional[Union[Array, Sequence[int]]] = None,
                       mask: Optional[Array] = None, bias: Optional[Array] = None,
                       scale: Optional[float] = None, softcap: float = 0.0,
                       sparsity: Optional[Sparsity] = None, kernel: str = "auto",
                       num_threads: int = 0, dropout_p: float = 0.0, seed: int = 0,
                       offset: int = 0, return_dbias: bool = False) -> Any:
    """The gradients of attention() (qkv::attention_backward; docs/training.md).

    q, k, v and every option: as given to attention(); out, lse: what it returned for them
    (float32; lse (B, Hq, Lq)); dout: dL/d(out), float32, out's shape. Returns (dq, dk, dv),
    float32 in q's framework and layout (dk, dv summed over the query heads of each kv head),
    and dbias (the bias's shape, summed over the dimensions it broadcasts over) as a fourth
    when return_dbias. float64 q, k, v (with float64 out, lse, dout) give float64 dq, dk, dv from
    the reference kernel (dbias stays float32, as the bias). kernel: "auto" (flash; the reference when dbias is asked for),
    "flash" or "reference" (the float64 oracle). Same bits on any num_threads. dropout_p,
    seed, offset: the forward's (the same mask).
    """
    framework = _framework(q)
    shapes = [_shape(name, x, "(B, L, H, D)" if layout != "bhsd" else "(B, H, L, D)")
              for name, x in (("q", q), ("k", k), ("v", v))]
    dq, dk, dv = (_empty(framework, shape, _is_f64(q)) for shape in shapes)
    dbias = None
    if return_dbias:
        if bias is None:
            raise ValueError("return_dbias: needs a bias")
        dbias = _empty(framework, _array_shape("bias", bias))
    q, k, v, bits, mask, bias, left, right = _shared(q, k, v, mask, bias, sparsity, window)
    _qkv.attention_backward(
        q, k, v, _input("out", out)[0], _input("lse", lse)[0], _input("dout", dout)[0],
        _input("dq", dq)[0], _input("dk", dk)[0], _input("dv", dv)[0],
        None if dbias is None else _input("dbias", dbias)[0], mask, bias, _lengths(key_lengths),
        sparsity, None if scale is None else float(scale), float(softcap), bool(causal), align,
        left, right, kernel, _int("num_threads", num_threads), float(dropout_p),
        _seed("seed", seed), _seed("offset", offset), layout, bits)
    results = (dq, dk, dv) + ((dbias,) if return_dbias else ())
    return tuple(_result(framework, x) for x in results)


def linear_attention(q: Array, k: Array, v: Array, *, layout: str = "bshd",
                     feature_map: str = "elu", nb_features: int = 256, seed: int = 1,
                     scale: Optional[float] = None, causal: bool = False,
                     align: str = "bottom_right",
                     key_lengths: Optional[Union[Array, Sequence[int]]] = None,
                     kernel: str = "auto", num_threads: int = 0, chunk_size: int = 64,
                     out: Optional[Array] = None) -> Any:
    """Linear attention in O(N) (qkv::linear_attention; docs/linear-attention.md): an
    approximation of softmax attention, phi(q) . phi(k) in place of exp(q . k).

    Shapes as attention(): q (B, Lq, Hq, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, Dv) -> out
    (B, Lq, Hq, Dv), or each (B, H, L, D) with layout="bhsd".
    feature_map: "elu" (Linear Transformer, elu(x) + 1; no scale) or "favor" (Performer
    FAVOR+ with nb_features random features drawn from seed; scale: the softmax temperature
    it approximates, 1/sqrt(D) by default). causal / align / key_lengths as in attention().
    kernel: "auto", "cpu" or "reference". Returns out (float32, q's framework).
    """
    framework = _framework(q)
    bhsd = layout == "bhsd"
    q_shape = _shape("q", q, "(B, Hq, Lq, D) for layout 'bhsd'" if bhsd else "(B, Lq, Hq, D)")
    v_shape = _shape("v", v, "(B, Hkv, Lk, Dv) for layout 'bhsd'" if bhsd else "(B, Lk, Hkv, Dv)")
    if out is None:
        out = _empty(framework, q_shape[:3] + (v_shape[3],))
    q, q_bits = _input("q", q)
    k, k_bits = _input("k", k)
    v, v_bits = _input("v", v)
    _qkv.linear_attention(q, k, v, _input("out", out)[0], _lengths(key_lengths), feature_map,
                          _int("nb_features", nb_features), _int("seed", seed),
                          None if scale is None else float(scale), bool(causal), align, kernel,
                          _int("num_threads", num_threads), _int("chunk_size", chunk_size),
                          layout, q_bits | (k_bits << 1) | (v_bits << 2))
    return _result(framework, out)


def product_path(dtype: Any = "float32") -> str:
    """The instructions qkv's flash kernel multiplies q, k and v of this dtype with on this CPU
    (the products the `qkv bench` rows name): "f32-fma"; "bf16-amx" (AMX tiles, a CPU with
    AMX-BF16), "bf16-vdpbf16ps" (AMD CPUs with AVX512-BF16) or "bf16-widened-fma"; "f16-amx-split"
    or "f16-widened-fma". dtype: a name ("float32", "bfloat16", "float16", "f32", "bf16", "f16")
    or a numpy / torch / JAX dtype."""
    return _qkv._product_path(_dtype_key("dtype", dtype))


def longformer(window: int = 256, dilation: int = 1, global_: Sequence[int] = ()) -> Sparsity:
    """Longformer's pattern (qkv::LongformerSparsity; docs/sparse.md): query i (at i') may
    attend key j when i' or j is a global position, or |i' - j| <= window and
    (i' - j) % dilation == 0. `global_` (trailing _: `global` is a Python keyword) lists the
    global positions."""
    return _qkv.longformer(_int("window", window), _int("dilation", dilation),
                           [_int("global_", g) for g in global_])


def bigbird(block: int = 64, num_random_blocks: int = 3, num_global_blocks: int = 2,
            seed: int = 0) -> Sparsity:
    """BigBird's ITC pattern (qkv::BigBirdSparsity; docs/sparse.md): blocks of `block` queries
    and keys; the first num_global_blocks are global, each query block sees its neighbours and
    num_random_blocks random blocks drawn from `seed` (reproducible)."""
    return _qkv.bigbird(_int("block", block), _int("num_random_blocks", num_random_blocks),
                        _int("num_global_blocks", num_global_blocks), _int("seed", seed))


def block_layout(layout: Array, block_q: int = 64, block_k: int = 64) -> Sparsity:
    """A block matrix of your own (qkv::BlockSparsity): query block qb may attend key block kb
    where layout[..., qb, kb] is true. layout: bool/uint8, (ceil(Lq / block_q),
    ceil(Lk / block_k)), or with a leading head dim (Hq or 1). The Sparsity keeps a reference
    to the array (not a copy): do not change it while the Sparsity is in use."""
    return _qkv.block_layout(layout, _int("block_q", block_q), _int("block_k", block_k))


def bigbird_layout(seq_q: int, seq_kv: int, num_heads_q: int = 1, *, block: int = 64,
                   num_random_blocks: int = 3, num_global_blocks: int = 2,
                   seed: int = 0) -> np.ndarray:
    """The block matrix qkv.bigbird(...) resolves to for these sizes: bool
    (num_heads_q, ceil(seq_q / block), ceil(seq_kv / block))."""
    return _qkv.bigbird_layout(_int("block", block), _int("num_random_blocks", num_random_blocks),
                               _int("num_global_blocks", num_global_blocks), _int("seed", seed),
                               _int("seq_q", seq_q), _int("seq_kv", seq_kv),
                               _int("num_heads_q", num_heads_q))


class SentenceEmbedder:
    """Sentence embeddings from a sentence-transformers / Hugging Face BERT folder
    (config.json, model.safetensors, vocab.txt, ...), computed as sentence-transformers does:
    WordPiece, the BERT encoder on qkv's layers, pooling, normalisation (docs/cli-embed.md).

        embedder = qkv.SentenceEmbedder(".cache/models/.../model")
        vectors = embedder.encode(["first text", "second text"])   # (2, 384) float32

    max_length: tokens per text with [CLS]/[SEP] (0: the model's own setting); batch_size:
    texts per forward pass; normalize: None = as modules.json says; dtype: "f32" or "bf16",
    the encoder's matrix products (as `qkv embed --dtype`; LayerNorm, softmax and every sum stay
    float32). One embedder may be shared by threads: calls run at once, without the GIL.
    """

    def __init__(self, model_dir: Union[str, os.PathLike], *, max_length: int = 0,
                 batch_size: int = 32, normalize: Optional[bool] = None, dtype: str = "f32"):
        if dtype not in ("f32", "bf16"):
            raise ValueError(f"dtype: expected 'f32' or 'bf16', got {dtype!r}")
        self._impl = _qkv.SentenceEmbedder(os.fspath(model_dir), _int("max_length", max_length),
                                           _int("batch_size", batch_size), normalize,
                                           dtype == "bf16")

    @property
    def dimension(self) -> int:
        """The embedding size (hidden size x pooling modes)."""
        return self._impl.dimension

    @property
    def max_length(self) -> int:
        return self._impl.max_length

    @property
    def normalize(self) -> bool:
        return self._impl.normalize

    def encode(self, texts: Union[str, Sequence[str]],
               batch_size: Optional[int] = None) -> np.ndarray:
        """Embeds `texts`: (N, dimension) float32 in input order, or (dimension,) for one str
        (as sentence-transformers' encode). batch_size: None = the embedder's."""
        single = isinstance(texts, str)
        items = [texts] if single else list(texts)
        for i, text in enumerate(items):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}]: expected str, got {type(text).__name__}")
        size = 0 if batch_size is None else _int("batch_size", batch_size)
        if batch_size is not None and size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {size}")
        vectors = self._impl.encode(items, size)
        return vectors[0] if single else vectors


# ---------------------------------------------------------------------------------------------
# Training (src/python/layers.cc; docs/python.md, "Training an encoder layer"). numpy in,
# numpy out: every array is copied in (any strides) and every result is a new float32 array.

def _float(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}") from None


def _dict(name: str, value: Any) -> Dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}: expected a dict of name -> float32 array, got "
                        f"{type(value).__name__}")
    return dict(value)


class EncoderLayer:
    """One transformer encoder layer that trains (qkv::EncoderLayer; docs/training.md):

        Post-LN (norm_first=False):  x = LN1(x + Drop(MHA(x)));  x = LN2(x + Drop(FFN(x)))
        Pre-LN  (norm_first=True):   x = x + Drop(MHA(LN1(x)));  x = x + Drop(FFN(LN2(x)))
        FFN(h) = ff2(Drop(act(ff1(h))))

        layer = qkv.EncoderLayer(weights, num_heads=4)
        y, tape = layer.forward_train(x)                  # x: (B, L, E) float32
        dx, grads = layer.backward(tape, dy)              # dy = dL/dy; grads: {name: array}

    weights: {name: float32 array} in torch's [out, in] layout (E = embed_dim, hd = E //
    num_heads, Hkv = num_kv_heads or num_heads):
        attention.q_weight (E, E)   attention.k_weight, attention.v_weight (Hkv * hd, E)
        attention.out_weight (E, E)  norm1_gamma, norm1_beta, norm2_gamma, norm2_beta (E,)
        ff1_weight (d_ff, E)  ff2_weight (E, d_ff)
    and, each optional (left out: the layer has no such bias), attention.q_bias (E,),
    attention.k_bias, attention.v_bias (Hkv * hd,), attention.out_bias (E,), ff1_bias (d_ff,),
    ff2_bias (E,). With qkv_packing="fused_blocks" the three projections are one
    attention.qkv_weight (E + 2 Hkv hd, E) = [Wq; Wk; Wv] (torch.nn.MultiheadAttention's
    in_proj_weight) and attention.qkv_bias; "fused_per_head" (Hkv == num_heads) has its rows
    per head [q_h; k_h; v_h]. embed_dim and d_ff come from norm1_gamma and ff1_weight; every
    other shape is checked against them. The arrays are copied.

    num_kv_heads: 0 = num_heads (GQA when smaller; it must divide num_heads). activation:
    "gelu" (erf), "gelu_tanh" or "relu". eps: LayerNorm's. dropout in [0, 1): after the
    attention, the activation and the FFN, and on the attention probabilities, in training
    mode only, from a counter-based mask keyed by (seed, step, site, element): the same seed
    gives the same masks, on any thread count. The layer starts in training mode (as torch
    modules do); eval() turns dropout off, train() turns it on again and restarts the steps.

    matmul_dtype: "f32", or "bf16" for mixed precision (torch's bf16 autocast on a CPU; also
    "float32" / "bfloat16" or a numpy / torch dtype): every matrix product, forward and
    backward, on operands rounded to bf16 (AMX where the CPU has it), with f32 weights,
    gradients, LayerNorm, softmax and sums (docs/training.md, "Mixed precision").
    """

    def __init__(self, weights: Mapping[str, Array], *, num_heads: int, num_kv_heads: int = 0,
                 activation: str = "gelu", norm_first: bool = False, eps: float = 1e-5,
                 dropout: float = 0.0, seed: int = 0, qkv_packing: str = "separate",
                 matmul_dtype: Any = "f32"):
        self._seed = _seed("seed", seed)
        self._impl = _qkv.EncoderLayer(_dict("weights", weights), _int("num_heads", num_heads),
                                       _int("num_kv_heads", num_kv_heads), activation,
                                       bool(norm_first), _float("eps", eps),
                                       _float("dropout", dropout), self._seed, qkv_packing,
                                       _dtype_key("matmul_dtype", matmul_dtype))

    @property
    def embed_dim(self) -> int:
        return self._impl.embed_dim

    @property
    def num_heads(self) -> int:
        return self._impl.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self._impl.num_kv_heads

    @property
    def d_ff(self) -> int:
        return self._impl.d_ff

    @property
    def norm_first(self) -> bool:
        return self._impl.norm_first

    @property
    def activation(self) -> str:
        return self._impl.activation

    @property
    def dropout(self) -> float:
        return self._impl.dropout

    @property
    def qkv_packing(self) -> str:
        return self._impl.qkv_packing

    @property
    def matmul_dtype(self) -> str:
        """"f32" or "bf16"."""
        return self._impl.matmul_dtype

    @property
    def training(self) -> bool:
        """Whether dropout applies (forward and forward_train advance its step)."""
        return self._impl.training

    def train(self, seed: Optional[int] = None) -> "EncoderLayer":
        """Training mode: dropout on, its step counter back at 0, with `seed` (None: the last
        one given). Returns the layer."""
        if seed is not None:
            self._seed = _seed("seed", seed)
        self._impl.set_training(True, self._seed)
        return self

    def eval(self) -> "EncoderLayer":
        """Inference mode: no dropout. Returns the layer."""
        self._impl.set_training(False, self._seed)
        return self

    def forward(self, x: Array, *, causal: bool = False,
                key_lengths: Optional[Union[Array, Sequence[int]]] = None) -> np.ndarray:
        """y = layer(x): x (B, L, E) float32 (not modified) -> y (B, L, E) float32.

        causal: token i attends tokens <= i. key_lengths: (B,) ints, the valid tokens of each
        sequence (padding is never attended; padded rows are computed but meaningless). In
        training mode with dropout > 0 this applies dropout too (call eval() first for
        inference)."""
        return self._impl.forward(x, bool(causal), _lengths(key_lengths))

    def forward_train(self, x: Array, *, causal: bool = False,
                      key_lengths: Optional[Union[Array, Sequence[int]]] = None
                      ) -> Tuple[np.ndarray, EncoderLayerTape]:
        """forward() that also returns the tape backward needs: (y, tape). The tape belongs
        to this layer and to its current parameters (set_parameters makes it stale)."""
        return self._impl.forward_train(x, bool(causal), _lengths(key_lengths))

    def backward(self, tape: EncoderLayerTape, dy: Array) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
        """Given forward_train's tape and dy = dL/dy (B, L, E) float32: (dx, grads), dx =
        dL/dx (B, L, E) and grads {name: dL/d(parameter)} with parameters()'s names and
        shapes (new arrays each call: nothing accumulates). Dropout replays the tape's
        masks."""
        return self._impl.backward(tape, dy)

    def parameters(self) -> Dict[str, np.ndarray]:
        """{name: float32 array}: copies of the current parameters, with the names the layer
        was built with (weights' names; fused packings keep attention.qkv_*)."""
        return self._impl.parameters()

    def set_parameters(self, params: Mapping[str, Array]) -> None:
        """Replaces every parameter: params has exactly parameters()'s names and shapes
        (float32; copied). Tapes made before it can no longer be used by backward."""
        self._impl.set_parameters(_dict("params", params))


def cross_entropy(logits: Array, targets: Array, *, ignore_index: int = -100
                  ) -> Tuple[float, np.ndarray]:
    """Mean cross-entropy over class logits (qkv::cross_entropy; torch.nn.functional.
    cross_entropy with reduction="mean"): logits (rows, classes) float32, targets (rows,)
    int32 or int64, each in [0, classes) or ignore_index (such a row counts for nothing).
    Returns (loss, dlogits): loss = mean over counted rows of -log softmax(logits)[target] (0
    when none counts), computed in float64; dlogits = dloss/dlogits (rows, classes) float32
    ((softmax - onehot) / count, 0 on ignored rows)."""
    return _qkv.cross_entropy(logits, targets, _int("ignore_index", ignore_index))


class AdamW:
    """AdamW (torch.optim.AdamW's update; qkv::AdamW) over a dict of float32 arrays:

        p -= lr * weight_decay * p
        m = beta1 m + (1 - beta1) g        v = beta2 v + (1 - beta2) g^2
        p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)      (t = steps)

        optimizer = qkv.AdamW(lr=1e-3)
        params = layer.parameters()
        ...; dx, grads = layer.backward(tape, dy)
        optimizer.step(params, grads)          # updates params' arrays in place
        layer.set_parameters(params)

    The moments are kept per name; every step must have the names and shapes of the first.
    """

    def __init__(self, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        try:
            beta1, beta2 = betas
        except (TypeError, ValueError):
            raise TypeError(f"betas: expected (beta1, beta2), got {betas!r}") from None
        self._impl = _qkv.AdamW(_float("lr", lr), _float("betas", beta1), _float("betas", beta2),
                                _float("eps", eps), _float("weight_decay", weight_decay))

    @property
    def lr(self) -> float:
        return self._impl.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._impl.lr = _float("lr", value)

    @property
    def betas(self) -> Tuple[float, float]:
        return (self._impl.beta1, self._impl.beta2)

    @property
    def eps(self) -> float:
        return self._impl.eps

    @property
    def weight_decay(self) -> float:
        return self._impl.weight_decay

    @property
    def steps(self) -> int:
        """The steps taken (t of the bias corrections)."""
        return self._impl.steps

    def step(self, params: Mapping[str, Array], grads: Mapping[str, Array]) -> None:
        """One step: every array of params (writable float32, any shape and strides) is
        updated IN PLACE from grads[name] (float32, the same shape; grads must have exactly
        params' names). Names are taken in sorted order. Everything is checked before any
        array changes (TypeError for dtypes, ValueError for names, shapes, read-only arrays).
        Returns None."""
        self._impl.step(_dict("params", params), _dict("grads", grads))
