#!/usr/bin/env python3
"""What the Python module costs on top of the C++ library, measured in one process.

    python3 scripts/bench_python.py [--calls 1000] [--json FILE]

1. Overhead per call at B=1, H=1, Lq=Lk=1, D=64 (the work itself is ~100 ns): the median of
   --calls timed calls of
     C++                 qkv::attention on views made once (_qkv._time_attention: the loop
                         and the clock are in C++)
     qkv.attention       from numpy (a new out per call; and with out= given), from torch
                         tensors, and qkv.torch.scaled_dot_product_attention (torch.library
                         dispatch included); torch's own SDPA at the same shape for scale
   and the overhead = median(Python call) - median(C++ call).
2. Zero copy: peak RSS (VmHWM, reset through /proc/self/clear_refs) of a qkv.attention call
   on 1 GiB float32 inputs, above the RSS before the call, less the output's bytes (the first
   and the second call of each case, in a process that made no other calls of that shape):
     k = v = one 1 GiB numpy array (decode: Lq=1, Lk=262144, H=8, D=128), BSHD and as a
     transposed BHSD view; the same as torch tensors; q of 1 GiB (Lq=262144) with a 1 GiB out.

Runs in the test venv (.cache/venv-test: numpy, torch; scripts/python_env.sh) on the build
tree's module (build/release/python: scripts/test.sh builds it); re-executes itself there.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from host_cpu import cpu_name  # scripts/host_cpu.py (this folder is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
MODULE_DIR = ROOT / "build" / "release" / "python"


def ensure_environment():
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
        sys.path.insert(0, str(MODULE_DIR))
        import qkv  # noqa: F401
    except ImportError:
        if os.environ.get("QKV_BENCH_PYTHON_REEXEC"):
            raise
        python = subprocess.run(["bash", str(ROOT / "scripts" / "python_env.sh")], check=True,
                                capture_output=True, text=True).stdout.strip().splitlines()[-1]
        os.environ["QKV_BENCH_PYTHON_REEXEC"] = "1"
        os.execv(python, [python, __file__, *sys.argv[1:]])


def median_us(call, calls):
    """Median of `calls` single-call timings, in microseconds (after 50 warm-up calls)."""
    for _ in range(50):
        call()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        start = clock()
        call()
        samples.append(clock() - start)
    return statistics.median(samples) / 1e3


def overhead(calls):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import qkv
    import qkv.torch as qt
    from qkv import _qkv

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 1, 64), dtype=np.float32) for _ in range(3))
    out = np.empty_like(q)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    bq, bk, bv = (x.transpose(1, 2) for x in (tq, tk, tv))  # (B, H, L, D) views
    cxx = statistics.median(_qkv._time_attention(q, k, v, out, calls)) * 1e6
    rows = {
        "C++ qkv::attention": cxx,
        "qkv.attention(numpy)": median_us(lambda: qkv.attention(q, k, v), calls),
        "qkv.attention(numpy, out=)": median_us(lambda: qkv.attention(q, k, v, out=out), calls),
        "qkv.attention(torch)": median_us(lambda: qkv.attention(tq, tk, tv), calls),
        "qkv.torch.scaled_dot_product_attention": median_us(
            lambda: qt.scaled_dot_product_attention(bq, bk, bv), calls),
        "torch SDPA (for scale)": median_us(lambda: F.scaled_dot_product_attention(bq, bk, bv),
                                            calls),
    }
    return cxx, rows


def vm_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_above_current(call):
    """(peak RSS during call() - RSS before it) in bytes, and call()'s result."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS
    before = vm_kib("VmRSS")
    result = call()
    return (vm_kib("VmHWM") - before) * 1024, result


def zero_copy():
    import numpy as np
    import torch
    import qkv

    gib_keys = (1, 262144, 8, 128)  # 1 GiB of float32
    big = np.empty(gib_keys, np.float32)
    big[...] = 0.01
    big[:, ::7] = -0.02
    q = np.random.default_rng(1).standard_normal((1, 1, 8, 128), dtype=np.float32)
    big_bhsd = np.ascontiguousarray(big.transpose(0, 2, 1, 3))  # (1, 8, 262144, 128)
    cases = {
        "numpy k=v 1 GiB (BSHD)": lambda: qkv.attention(q, big, big),
        "numpy k=v 1 GiB (BHSD transposed view)": lambda: qkv.attention(
            q.transpose(0, 2, 1, 3), big_bhsd, big_bhsd, layout="bhsd"),
    }
    t_big = torch.from_numpy(big)  # shares numpy's memory: no second GiB
    tq = torch.from_numpy(q)
    cases["torch k=v 1 GiB (BSHD)"] = lambda: qkv.attention(tq, t_big, t_big)
    big_q = big  # 1 GiB of queries against 16 keys: out is 1 GiB too
    small_kv = np.ascontiguousarray(big[:, :16])
    cases["numpy q 1 GiB, out 1 GiB"] = lambda: qkv.attention(big_q, small_kv, small_kv)
    rows = {}
    for name, call in cases.items():
        row = {}
        # The first call of a case also sizes the kernel's per-thread scratch for its shape.
        for when in ("first", "second"):
            extra, out = peak_above_current(call)
            out_bytes = out.numel() * 4 if hasattr(out, "numel") else out.nbytes
            row[when] = {"peak_above_before_mib": extra / 2**20, "output_mib": out_bytes / 2**20,
                         "beyond_output_mib": (extra - out_bytes) / 2**20}
            del out
        rows[name] = row
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="timed calls per row")
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args()
    ensure_environment()
    import torch
    import qkv

    cpu = cpu_name()
    print(f"{cpu}; qkv from {Path(qkv.__file__).parent}; torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs", flush=True)
    cxx, rows = overhead(args.calls)
    print(f"\nPer-call time at B=1, H=1, Lq=Lk=1, D=64, median of {args.calls} calls:")
    print(f"  {'call':<44} {'median us':>10} {'above C++ us':>13}")
    for name, us in rows.items():
        print(f"  {name:<44} {us:10.2f} {us - cxx:13.2f}")
    memory = zero_copy()
    print("\nPeak RSS of a call above the RSS before it (VmHWM), 1 GiB float32 inputs, first "
          "and second call of each case:")
    print(f"  {'case':<44} {'call':<7} {'peak MiB':>9} {'out MiB':>8} {'beyond out MiB':>15}")
    for name, row in memory.items():
        for when, r in row.items():
            print(f"  {name:<44} {when:<7} {r['peak_above_before_mib']:9.2f} "
                  f"{r['output_mib']:8.2f} {r['beyond_output_mib']:15.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"cpu": cpu, "calls": args.calls, "overhead_us": rows, "memory": memory},
            indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
