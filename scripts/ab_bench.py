#!/usr/bin/env python3
"""Alternating A/B runs of `qkv bench`: which of two or more builds, environments or options is
faster, measured the way docs/benchmarks.md quotes it (the variants take turns within each round,
medians over rounds, ratios against the first variant, all in one run on one CPU).

    python3 scripts/ab_bench.py --rounds 5 --args "--shape 1,8,8,4096,4096,128 --threads 2" \\
        old="/tmp/old/qkv bench" new="build/release/qkv bench" \\
        bhsd="build/release/qkv bench --layout bhsd" env="QKV_SOMETHING=1 build/release/qkv bench"

Each variant is NAME=COMMAND: a `qkv bench` command line, optionally led by VAR=VALUE
environment settings; `--args` is appended to every command, then `--json`. Every round runs
each variant once as its own process, starting at a different variant each round so that drift
spreads over all of them. A command that prints several rows (`--products all`) gives one
result per row. See docs/benchmarks.md, "A/B runs".
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

from host_cpu import cpu_name  # scripts/host_cpu.py (this folder is on sys.path)


def parse_variant(text):
    """NAME=COMMAND -> (name, env dict, argv list)."""
    name, sep, command = text.partition("=")
    if not sep or not name or not command.strip():
        raise ValueError(f"variant {text!r}: expected NAME=COMMAND")
    words = shlex.split(command)
    env = {}
    while words:
        key, sep, value = words[0].partition("=")
        if not sep or not key or key[0].isdigit() or not key.replace("_", "").isalnum():
            break
        env[key] = value
        words.pop(0)
    if not words:
        raise ValueError(f"variant {name!r}: no command after the environment settings")
    return name, env, words


def row_label(row, rows):
    """A name for one JSON row of a variant's output; empty when the command prints one row."""
    if rows == 1:
        return ""
    return f"{row.get('kernel', '?')}/{row.get('products', '?')}"


def run_once(env, argv, timeout):
    """One process: the JSON rows `qkv bench --json` prints (lines starting with '{')."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{shlex.join(argv)} exited {proc.returncode}: {tail[0]}")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"{shlex.join(argv)} printed no JSON row (is it `qkv bench`?)")
    return rows


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", metavar="NAME=COMMAND",
                        help="a `qkv bench` command line per variant, led by VAR=VALUE settings "
                             "if any; the first is the baseline of the ratios")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--args", default="", help="arguments appended to every command")
    parser.add_argument("--metric", default="gflops",
                        help="the JSON field compared (default gflops; higher is better for "
                             "rates, and the ratio is variant / baseline either way)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per process")
    parser.add_argument("--json", metavar="FILE", help="also write every value to FILE")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        variants = [parse_variant(v) for v in args.variants]
    except ValueError as e:
        parser.error(str(e))
    names = [name for name, _, _ in variants]
    if len(set(names)) != len(names):
        parser.error(f"variant names must differ: {names}")
    extra = shlex.split(args.args) + ["--json"]

    cpu = f"{cpu_name()}, {os.cpu_count()} CPUs"
    print(f"ab_bench: {len(variants)} variants x {args.rounds} rounds on {cpu}; "
          f"metric {args.metric}", flush=True)
    values = {}  # (variant, row label) -> [value per round]
    for r in range(args.rounds):
        for i in range(len(variants)):
            name, env, argv = variants[(r + i) % len(variants)]
            try:
                rows = run_once(env, argv + extra, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
                print(f"ab_bench: error: variant {name}: {e}", file=sys.stderr)
                return 2
            for row in rows:
                if args.metric not in row:
                    print(f"ab_bench: error: variant {name}: no field {args.metric!r} in its "
                          f"JSON row", file=sys.stderr)
                    return 2
                values.setdefault((name, row_label(row, len(rows))), []).append(
                    float(row[args.metric]))
        print(f"ab_bench: round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    labels = sorted({label for _, label in values})
    width = max(len(f"{n} {l}".strip()) for n, l in values)
    print(f"{'variant':<{width}}  {'median':>10}  {'ratio':>6}  {'min':>10}  {'max':>10}  values")
    for label in labels:
        base = values.get((names[0], label))
        for name in names:
            v = values.get((name, label))
            if v is None:
                continue
            med = statistics.median(v)
            ratio = f"{med / statistics.median(base):6.3f}" if base else "     -"
            shown = " ".join(f"{x:.4g}" for x in v)
            print(f"{(name + ' ' + label).strip():<{width}}  {med:10.4g}  {ratio}  "
                  f"{min(v):10.4g}  {max(v):10.4g}  {shown}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cpu": cpu, "rounds": args.rounds, "metric": args.metric,
                       "args": args.args,
                       "variants": {n: {"env": e, "command": shlex.join(a)}
                                    for n, e, a in variants},
                       "values": [{"variant": n, "row": l, "values": v}
                                  for (n, l), v in sorted(values.items())]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
