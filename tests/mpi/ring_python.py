"""qkv.ring (python/qkv/ring.py) under mpirun -np 2 and 3 with an mpi4py communicator
(tests/CMakeLists.txt: ring_python_np2, ring_python_np3): every rank builds the same whole
problem, cuts its shards with qkv.ring.shard, and compares the ring's out, lse and gradients
with the float64 numpy reference (tests/python/reference.py); shard/unshard round trips;
errors. Exits nonzero on any rank's failure (every rank reports its own)."""
import os
import sys

import numpy as np

try:
    from mpi4py import MPI
except ImportError:
    sys.exit("ring_python: needs mpi4py (scripts/python_env.sh installs it into the test venv)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import reference  # noqa: E402

import qkv  # noqa: E402
import qkv.ring as ring  # noqa: E402

comm = MPI.COMM_WORLD
rank, ranks = comm.rank, comm.size
failures = []


def check(condition, what):
    if not condition:
        failures.append(what)
        print(f"ring_python: rank {rank}: FAILED: {what}", flush=True)


def case(name, batch, seq_q, seq_kv, heads_q, heads_kv, dim, layout="contiguous", **options):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((batch, seq_q, heads_q, dim)).astype(np.float32)
    k = rng.standard_normal((batch, seq_kv, heads_kv, dim)).astype(np.float32)
    v = rng.standard_normal((batch, seq_kv, heads_kv, dim)).astype(np.float32)
    dout = rng.standard_normal((batch, seq_q, heads_q, dim)).astype(np.float32)
    ref_options = {key: options[key] for key in ("causal", "window", "key_lengths")
                   if key in options}
    out64, lse64, _ = reference.attention(q, k, v, **ref_options)
    dq64, dk64, dv64, _ = reference.attention_backward(q, k, v, dout, **ref_options)

    mine = lambda x: ring.shard(x, rank, ranks, layout)  # noqa: E731
    out, lse = ring.attention(comm, mine(q), mine(k), mine(v), layout=layout, block_rows=7,
                              **options)
    lse_rows = ring.shard(lse64.transpose(0, 2, 1)[..., None], rank, ranks, layout)
    check(np.abs(out - mine(out64)).max() < 2e-5 * max(1, np.abs(out64).max()), f"{name}: out")
    expected_lse = lse_rows[..., 0].transpose(0, 2, 1)
    check(np.array_equal(np.isinf(lse), np.isinf(expected_lse)), f"{name}: lse -inf rows")
    finite = np.isfinite(expected_lse)
    check(np.abs(lse[finite] - expected_lse[finite]).max(initial=0) < 1e-4, f"{name}: lse")
    dq, dk, dv = ring.attention_backward(comm, mine(q), mine(k), mine(v), out, lse, mine(dout),
                                         layout=layout, block_rows=7, **options)
    for grad, want, what in ((dq, dq64, "dq"), (dk, dk64, "dk"), (dv, dv64, "dv")):
        want = mine(want)
        check(np.abs(grad - want).max() < 1e-4 * max(1, np.abs(want).max()), f"{name}: {what}")
    # The whole out from every rank's rows, on rank 0.
    pieces = comm.gather(out, root=0)
    if rank == 0:
        whole = ring.unshard(pieces, layout)
        check(np.abs(whole - out64).max() < 2e-5 * max(1, np.abs(out64).max()),
              f"{name}: unshard")


L = 31  # divisible by neither 2 nor 3 (nor 2P)
case("non-causal GQA", 2, L, L, 4, 2, 16)
case("causal zigzag", 1, L, L, 2, 1, 8, layout="zigzag", causal=True)
case("window", 1, 40, 40, 2, 2, 8, window=(5, 2))
case("key lengths", 2, L, L, 2, 2, 8, key_lengths=[0, 20])
case("cross attention causal", 1, 13, 29, 2, 1, 8, causal=True)

# Errors: not a communicator; ranks that disagree get the same ValueError.
try:
    ring.attention("world", *(np.zeros((1, 4, 1, 8), np.float32),) * 3)
    check(False, "a string for comm raises TypeError")
except TypeError as e:
    check("mpi4py communicator" in str(e), f"TypeError names mpi4py: {e}")
rows = ring.segments(L, rank, ranks)[0][1]
x = np.zeros((1, rows, 2, 8), np.float32)
try:
    ring.attention(comm, x, x, x, causal=(rank == ranks - 1), seq_q=L, seq_kv=L)
    check(False, "ranks with different causal raise")
except ValueError as e:
    message = comm.bcast(str(e), root=0)
    check(str(e) == message and "has causal = 1 but rank 0 has 0" in str(e), f"same error: {e}")

total = comm.allreduce(len(failures))
if rank == 0:
    print(f"ring_python: {ranks} ranks, {'all passed' if total == 0 else f'{total} failures'}")
sys.exit(1 if total else 0)
