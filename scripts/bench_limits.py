#!/usr/bin/env python3
"""Time and peak memory of `qkv` on hostile inputs of growing size (issue 18; docs/limits.md).

    python3 scripts/bench_limits.py [--qkv build/release/qkv] [--model DIR] [--quick]

For each case it writes the input at a few sizes S into a temporary folder, runs the command
once, and prints S, the exit status, the wall time and the peak RSS of the child (getrusage),
and the ratio peak RSS / S (GNU time measures the child: Debian's package "time"). The contract (docs/limits.md): no input of size S makes qkv use
more than max(256 MiB, 8 x S) of memory, or more than time linear in S.

Cases: a safetensors header of one JSON array; safetensors with N tensors; config.json with N
keys; a line of repeated "[PAD]"; a one-line text of S bytes (needs the MiniLM model: --model,
default: scripts/fetch_model.sh); a .npy whose header claims 64 GiB.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = dict(vocab_size=5, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=8, max_position_embeddings=16, type_vocab_size=2,
              layer_norm_eps=1e-12, hidden_act="gelu")
VOCAB = "[PAD]\n[UNK]\n[CLS]\n[SEP]\na\n"


def model_folder(where, config=CONFIG, safetensors=None):
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(config))
    (where / "vocab.txt").write_text(VOCAB)
    if safetensors is not None:
        (where / "model.safetensors").write_bytes(safetensors)
    return where


def run(args):
    """(exit status, seconds, peak RSS bytes, stderr) of one command, measured by GNU time
    (/usr/bin/time: a small parent, so that the child's peak is its own and not this Python's,
    which a fork would hand down)."""
    with tempfile.NamedTemporaryFile("r") as stats, tempfile.TemporaryFile() as err:
        result = subprocess.run(["/usr/bin/time", "-q", "-f", "%e %M", "-o", stats.name, *args],
                                stdout=subprocess.DEVNULL, stderr=err)
        seconds, kib = stats.read().split()[-2:]
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return result.returncode, float(seconds), int(kib) * 1024, stderr


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--qkv", default=str(ROOT / "build" / "release" / "qkv"))
    parser.add_argument("--model", help="all-MiniLM-L6-v2 folder (default: fetch_model.sh)")
    parser.add_argument("--quick", action="store_true", help="the smaller sizes only")
    args = parser.parse_args()
    model = args.model or subprocess.run(["bash", str(ROOT / "scripts" / "fetch_model.sh")],
                                         check=True, capture_output=True,
                                         text=True).stdout.strip().splitlines()[-1]
    qkv = args.qkv
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def case(name, size, make, command):
            path = make(tmp / f"{name}-{size}")
            status, seconds, peak, stderr = run(command(path))
            input_bytes = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) \
                if Path(path).is_dir() else Path(path).stat().st_size
            rows.append((name, size, input_bytes, status, seconds, peak,
                         stderr.strip().splitlines()[-1][:90] if stderr.strip() else ""))
            print(f"{name:<28} {size:>10} {input_bytes / 2**20:9.1f} MiB  exit {status}  "
                  f"{seconds:7.2f} s  peak "
                  + f"{peak / 2**20:8.1f} MiB  x{peak / max(input_bytes, 1):6.2f}", flush=True)

        def embed(path):
            return [qkv, "embed", "--model", str(path), "--text", "a", "--out", str(tmp / "e.npy")]

        scale = [1, 4] if args.quick else [1, 4, 16]
        for mib in [5 * s for s in scale]:
            def header_array(where, mib=mib):
                header = b"[" + b"0," * (mib * 2**19) + b"0]"
                return model_folder(where, safetensors=struct.pack("<Q", len(header)) + header)
            case("safetensors: one array", f"{mib} MiB", header_array, embed)
        for n in [20000 * s for s in scale]:
            def many_tensors(where, n=n):
                header = json.dumps({f"t{i}": {"dtype": "F32", "shape": [1],
                                               "data_offsets": [4 * i, 4 * i + 4]}
                                     for i in range(n)}).encode()
                return model_folder(where, safetensors=struct.pack("<Q", len(header)) + header
                                    + bytes(4 * n))
            case("safetensors: N tensors", n, many_tensors, embed)
        for n in [20000 * s for s in scale]:
            def many_keys(where, n=n):
                return model_folder(where, config=dict(CONFIG, **{f"k{i}": i for i in range(n)}))
            case("config.json: N keys", n, many_keys, embed)
        for kib in [256 * s for s in scale]:
            def pads(where, kib=kib):
                where.write_text("[PAD]" * (kib * 1024 // 5) + "\n")
                return where
            case("text: one line of [PAD]", f"{kib} KiB", pads,
                 lambda p: [qkv, "embed", "--model", model, "--input", str(p), "--out",
                            str(tmp / "e.npy")])
        for mib in [12 * s for s in scale]:
            def one_line(where, mib=mib):
                where.write_text("the quick brown fox jumps over the lazy dog " *
                                 (mib * 2**20 // 44) + "\n")
                return where
            case("text: one line", f"{mib} MiB", one_line,
                 lambda p: [qkv, "embed", "--model", model, "--input", str(p), "--out",
                            str(tmp / "e.npy")])

        def npy_claim(where):
            header = repr({"descr": "<f4", "fortran_order": False, "shape": (1, 2**34, 1, 1)})
            header = header.encode() + b" " * (-(10 + len(header) + 1) % 64) + b"\n"
            where.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
            return where
        case(".npy claiming 64 GiB", "128 B", npy_claim,
             lambda p: [qkv, "attention", "--q", str(p), "--k", str(p), "--v", str(p), "--out",
                        str(tmp / "o.npy")])
    worst = [r for r in rows if r[5] and r[5] > max(256 * 2**20, 8 * r[2])]
    print("contract max(256 MiB, 8 x S):", "held" if not worst else f"BROKEN by {worst}")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
