"""Ring attention over MPI from Python (qkv::ring_attention; docs/distributed.md).

The communicator is an mpi4py one (``from mpi4py import MPI; comm = MPI.COMM_WORLD``); qkv takes
its Fortran handle, so mpi4py must run on the MPI that qkv links (Debian's Open MPI: mpi4py's
wheels load the system's). Every rank calls with its shards of q, k, v (BSHD: (B, L_r, H, D));
``shard(x, rank, ranks)`` cuts them from a whole sequence, ``unshard`` puts rows back. Available
where qkv was built with MPI (``qkv.ring.available``)::

    mpirun -np 4 python -c "
    from mpi4py import MPI; import numpy as np, qkv.ring as ring
    comm = MPI.COMM_WORLD
    q = ring.shard(np.load('q.npy'), comm.rank, comm.size, layout='zigzag')  # likewise k, v
    out, lse = ring.attention(comm, q, k, v, causal=True, layout='zigzag')"
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _qkv, _empty, _framework, _input, _int, _lengths, _result, _shape

__all__ = ["available", "attention", "attention_backward", "segments", "shard", "unshard"]

available: bool = bool(getattr(_qkv, "has_ring", False))


def _require() -> None:
    if not available:
        raise RuntimeError("qkv.ring: this qkv was built without MPI (QKV_BUILD_DISTRIBUTED=OFF, "
                           "or no libopenmpi-dev at build time)")


def _handle(comm: Any) -> int:
    """The communicator's Fortran handle (mpi4py: comm.py2f())."""
    if hasattr(comm, "py2f"):
        return int(comm.py2f())
    raise TypeError(f"comm: expected an mpi4py communicator (with py2f()), got "
                    f"{type(comm).__name__}")


def _lengths_of(comm: Any, rows: int, seq: Optional[int], name: str) -> int:
    """seq, or the sum of every rank's rows (one allreduce)."""
    if seq is not None:
        return _int(name, seq)
    return int(comm.allreduce(rows))


def segments(seq: int, rank: int, ranks: int, layout: str = "contiguous") -> List[Tuple[int, int]]:
    """The (start, length) runs of positions of a sequence of `seq` that `rank` holds, in the
    order its rows hold them (qkv::ring_shard)."""
    _require()
    return _qkv.ring_shard(layout, _int("seq", seq), _int("rank", rank), _int("ranks", ranks))


def shard(x: Any, rank: int, ranks: int, layout: str = "contiguous") -> np.ndarray:
    """This rank's rows (dim 1) of a whole (B, L, H, D) array, as a new numpy array."""
    x = np.asarray(x)
    return np.ascontiguousarray(np.concatenate(
        [x[:, s:s + n] for s, n in segments(x.shape[1], rank, ranks, layout)], axis=1))


def unshard(pieces: Sequence[Any], layout: str = "contiguous") -> np.ndarray:
    """The whole (B, L, H, D) array from every rank's rows (pieces[r]: rank r's, dim 1), e.g.
    comm.gather(out) on rank 0."""
    ranks = len(pieces)
    seq = sum(np.shape(p)[1] for p in pieces)
    first = np.asarray(pieces[0])
    whole = np.empty((first.shape[0], seq) + first.shape[2:], first.dtype)
    for r, piece in enumerate(pieces):
        row = 0
        for s, n in segments(seq, r, ranks, layout):
            whole[:, s:s + n] = np.asarray(piece)[:, row:row + n]
            row += n
    return whole


def attention(comm: Any, q: Any, k: Any, v: Any, *, seq_q: Optional[int] = None,
              seq_kv: Optional[int] = None, layout: str = "contiguous", block_rows: int = 0,
              causal: bool = False, align: str = "bottom_right",
              window: Tuple[int, int] = (-1, -1),
              key_lengths: Optional[Union[Any, Sequence[int]]] = None,
              scale: Optional[float] = None, softcap: float = 0.0, kernel: str = "auto",
              num_threads: int = 0, return_stats: bool = False) -> Any:
    """Ring attention over `comm`, collective: every rank passes its shards q (B, Lq_r, Hq, D),
    k (B, Lk_r, Hkv, D), v (B, Lk_r, Hkv, Dv) and gets its rows (out (B, Lq_r, Hq, Dv), lse
    (B, Hq, Lq_r)), float32 in q's framework. seq_q / seq_kv: the whole lengths (default: the
    sum of every rank's rows). layout: "contiguous" or "zigzag" (causal balance; the shards
    must be cut by the same layout). block_rows: K/V rows per message (0: about 8 MiB).
    causal, align, window, key_lengths (over the whole key sequence), scale, softcap as in
    qkv.attention. Every rank must pass the same shapes and options: otherwise every rank gets
    the same ValueError. return_stats adds a dict of the call's times and messages."""
    _require()
    framework = _framework(q)
    q_shape = _shape("q", q, "(B, Lq_r, Hq, D)")
    v_shape = _shape("v", v, "(B, Lk_r, Hkv, Dv)")
    _shape("k", k, "(B, Lk_r, Hkv, D)")
    out = _empty(framework, q_shape[:3] + (v_shape[3],))
    lse = _empty(framework, (q_shape[0], q_shape[2], q_shape[1]))
    handle = _handle(comm)
    seq_q = _lengths_of(comm, q_shape[1], seq_q, "seq_q")
    seq_kv = _lengths_of(comm, v_shape[1], seq_kv, "seq_kv")
    (q, qb), (k, kb), (v, vb) = _input("q", q), _input("k", k), _input("v", v)
    left, right = (_int("window", w) for w in window)
    stats = _qkv.ring_attention(
        handle, q, k, v, _input("out", out)[0], _input("lse", lse)[0], _lengths(key_lengths),
        None if scale is None else float(scale), float(softcap), bool(causal), align, left,
        right, kernel, _int("num_threads", num_threads), layout, seq_q, seq_kv,
        _int("block_rows", block_rows), qb | (kb << 1) | (vb << 2))
    results = (_result(framework, out), _result(framework, lse))
    return results + (stats,) if return_stats else results


def attention_backward(comm: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, *,
                       seq_q: Optional[int] = None, seq_kv: Optional[int] = None,
                       layout: str = "contiguous", block_rows: int = 0, causal: bool = False,
                       align: str = "bottom_right", window: Tuple[int, int] = (-1, -1),
                       key_lengths: Optional[Union[Any, Sequence[int]]] = None,
                       scale: Optional[float] = None, softcap: float = 0.0,
                       kernel: str = "auto", num_threads: int = 0,
                       return_stats: bool = False) -> Any:
    """The gradients of ring.attention, collective like it: this rank's shards q, k, v, its
    rows of the forward's out and lse, and of dout = dL/d(out) (float32, out's shape) ->
    (dq, dk, dv), this rank's shards, float32 in q's framework. Options: the forward's
    (kernel "auto" or "flash"). Deterministic: the same bits on any num_threads."""
    _require()
    framework = _framework(q)
    shapes = [_shape(name, x, "(B, L_r, H, D)") for name, x in (("q", q), ("k", k), ("v", v))]
    dq, dk, dv = (_empty(framework, shape) for shape in shapes)
    handle = _handle(comm)
    seq_q = _lengths_of(comm, shapes[0][1], seq_q, "seq_q")
    seq_kv = _lengths_of(comm, shapes[1][1], seq_kv, "seq_kv")
    (q, qb), (k, kb), (v, vb) = _input("q", q), _input("k", k), _input("v", v)
    left, right = (_int("window", w) for w in window)
    stats = _qkv.ring_attention_backward(
        handle, q, k, v, _input("out", out)[0], _input("lse", lse)[0], _input("dout", dout)[0],
        _input("dq", dq)[0], _input("dk", dk)[0], _input("dv", dv)[0], _lengths(key_lengths),
        None if scale is None else float(scale), float(softcap), bool(causal), align, left,
        right, kernel, _int("num_threads", num_threads), layout, seq_q, seq_kv,
        _int("block_rows", block_rows), qb | (kb << 1) | (vb << 2))
    results = tuple(_result(framework, x) for x in (dq, dk, dv))
    return results + (stats,) if return_stats else results
