#!/usr/bin/env python3
"""Times a whole training step of `qkv train-demo`'s model against the same model in PyTorch.

    python3 scripts/bench_train_peers.py [--threads 2] [--rounds 3]
        [--embed 512] [--heads 8] [--ff 2048] [--layers 2] [--seq 128] [--batch 16]
        [--impls torch-f32,torch-bf16,qkv-f32,qkv-bf16]

The model (qkv::TokenTagger, include/qkv/models/token_tagger.h): token + position embeddings,
Pre-LN encoder layers (fused QKV projection with biases, GELU erf, LayerNorm eps 1e-5, no
dropout), a final LayerNorm, a linear head over 10 classes; cross-entropy over every position;
AdamW (lr 0.002, weight decay 0.01). A step is forward, loss, backward and the optimizer's
update, on a batch of --batch sequences of --seq tokens.

  torch-f32    the model as torch.nn modules (nn.TransformerEncoderLayer(norm_first=True,
               activation="gelu", batch_first=True, dropout=0)), torch.optim.AdamW
  torch-bf16   the same under torch.autocast("cpu", dtype=torch.bfloat16): bf16 matmuls and
               SDPA, f32 weights and optimizer (torch's mixed precision)
  qkv-f32      `qkv train-demo --dtype f32 ...` (its own process; the step times it prints)
  qkv-bf16     `qkv train-demo --dtype bf16 ...` (qkv's mixed precision: docs/training.md)

Method: each round runs the four in a fresh seeded order; each times --steps steps after 2
warm-up steps (qkv: it prints every step's tokens/s; the first two are dropped) and reports the
median step; the table gives the median over rounds, in tokens/s (batch * seq / step time) and
ms per step, and qkv / torch per dtype (> 1: qkv faster). Same thread count for all
(torch.set_num_threads, qkv --threads).
"""

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import time

from host_cpu import cpu_name  # scripts/host_cpu.py (this folder is on sys.path)
from peers_env import ensure_venv  # scripts/peers_env.py

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torch_step_seconds(args, bf16):
    import torch
    import torch.nn as nn

    torch.manual_seed(1)
    E, L, B = args.embed, args.seq, args.batch

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, E)
            self.pos = nn.Embedding(L, E)
            layer = nn.TransformerEncoderLayer(E, args.heads, args.ff, dropout=0.0,
                                               activation="gelu", batch_first=True,
                                               norm_first=True)
            self.layers = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(E)
            self.head = nn.Linear(E, 10)

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos(torch.arange(L))
            return self.head(self.norm(self.layers(x)))

    model = Tagger()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.002, weight_decay=0.01)
    generator = torch.Generator().manual_seed(2)
    times = []
    for step in range(args.steps + 2):
        tokens = torch.randint(0, 10, (B, L), generator=generator)
        targets = torch.sort(tokens, dim=1).values
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, 10), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if step >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def qkv_step_seconds(args, dtype):
    cmd = [args.qkv, "train-demo", "--dtype", dtype, "--threads", str(args.threads),
           "--seq", str(args.seq), "--batch", str(args.batch), "--embed", str(args.embed),
           "--heads", str(args.heads), "--ff", str(args.ff), "--layers", str(args.layers),
           "--steps", str(args.steps + 2), "--eval-every", "1000000", "--eval-size", "16"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rates = [float(m.group(1)) for m in re.finditer(r"^step +\d+ .* (\d+) tokens/s", out, re.M)]
    if len(rates) != args.steps + 2:
        sys.exit(f"bench_train_peers: could not read the step lines of {' '.join(cmd)}:\n{out}")
    return statistics.median(args.batch * args.seq / r for r in rates[2:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--embed", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ff", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--qkv", default=os.path.join(REPO, "build", "release", "qkv"))
    parser.add_argument("--impls", default="torch-f32,torch-bf16,qkv-f32,qkv-bf16",
                        help="comma list of the implementations to time (default all four; "
                             "torch-bf16 took 45 s a step on a CPU without bf16 instructions)")
    args = parser.parse_args()
    runs = {
        "torch-f32": lambda: torch_step_seconds(args, False),
        "torch-bf16": lambda: torch_step_seconds(args, True),
        "qkv-f32": lambda: qkv_step_seconds(args, "f32"),
        "qkv-bf16": lambda: qkv_step_seconds(args, "bf16"),
    }
    impls = args.impls.split(",")
    unknown = [name for name in impls if name not in runs]
    if unknown:
        parser.error(f"--impls: unknown {', '.join(repr(n) for n in unknown)}; "
                     f"choose from {', '.join(runs)}")
    runs = {name: run for name, run in runs.items() if name in impls}
    ensure_venv(__file__, ["torch"])
    import torch

    torch.set_num_threads(args.threads)
    print(f"{cpu_name()}; {args.threads} threads; torch {torch.__version__}; model: "
          f"{args.layers} layers, embed {args.embed}, {args.heads} heads, d_ff {args.ff}; "
          f"batch {args.batch} x seq {args.seq}; {args.rounds} rounds of {args.steps} steps",
          flush=True)
    seconds = {name: [] for name in runs}
    order = random.Random(7)
    for r in range(args.rounds):
        names = list(runs)
        order.shuffle(names)
        for name in names:
            seconds[name].append(runs[name]())
        print(f"round {r + 1}: " + ", ".join(f"{n} {seconds[n][-1] * 1e3:.1f} ms" for n in runs),
              flush=True)
    tokens = args.batch * args.seq
    print(f"\n{'':12}{'ms/step':>10}{'tokens/s':>11}")
    median = {name: statistics.median(s) for name, s in seconds.items()}
    for name, s in median.items():
        print(f"{name:12}{s * 1e3:10.1f}{tokens / s:11.0f}")
    for dtype in ("f32", "bf16"):
        if f"torch-{dtype}" in median and f"qkv-{dtype}" in median:
            print(f"qkv / torch {dtype}: "
                  f"{median['torch-' + dtype] / median['qkv-' + dtype]:.2f}x")
    for lib in ("qkv", "torch"):
        if f"{lib}-f32" in median and f"{lib}-bf16" in median:
            print(f"{lib} bf16 / f32: {median[lib + '-f32'] / median[lib + '-bf16']:.2f}x")


if __name__ == "__main__":
    main()
