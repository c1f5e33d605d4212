#!/usr/bin/env python3
"""Draws `qkv train-demo --log FILE`'s CSV: the training loss per step (log scale) and the
token accuracy, per batch and on the held-out evaluation sequences, against the step.

    qkv train-demo --log train.csv
    python3 scripts/plot_train_demo.py train.csv train.png

Needs matplotlib (pip install matplotlib)."""
import argparse
import csv
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="the file qkv train-demo --log wrote")
    parser.add_argument("png", help="the picture to write")
    args = parser.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_train_demo.py: needs matplotlib (pip install matplotlib)")
    with open(args.csv) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"plot_train_demo.py: {args.csv} has no rows")
    step = [int(r["step"]) for r in rows]
    loss = [float(r["loss"]) for r in rows]
    batch = [float(r["batch_accuracy"]) for r in rows]
    evals = [(int(r["step"]), float(r["eval_accuracy"])) for r in rows if r["eval_accuracy"]]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    top.semilogy(step, loss)
    top.set_ylabel("cross-entropy loss")
    top.set_title(f"qkv train-demo ({rows[-1]['seconds']} s, {len(rows)} steps)")
    bottom.plot(step, batch, alpha=0.5, label="batch")
    if evals:
        bottom.plot(*zip(*evals), "o-", label="held-out sequences")
    bottom.set_ylabel("token accuracy")
    bottom.set_xlabel("step")
    bottom.set_ylim(0, 1)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
