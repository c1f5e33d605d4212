"""`qkv train-demo`: the model learns both tasks past the target within a few hundred steps,
prints a line per step and per evaluation, logs a CSV, saves weights that --load --eval-only
evaluates to the same accuracy; --dtype bf16 (mixed precision) learns both tasks too; bad
options fail per DESIGN.md section 4."""

import csv
import re


def final_accuracy(stdout):
    match = re.search(r"after (\d+) steps, [\d.]+ s: token accuracy ([\d.]+)", stdout)
    assert match, stdout
    return int(match.group(1)), float(match.group(2))


def test_sort_learns_saves_and_reloads(cli):
    out = cli.ok("train-demo", "--task", "sort", "--steps", "400", "--time-limit", "100",
                 "--target", "0.9", "--threads", "2", "--log", "log.csv",
                 "--save", "sorter.safetensors")
    steps, accuracy = final_accuracy(out)
    assert "reached the target" in out and accuracy >= 0.9, out
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == steps  # a progress line per step
    assert re.match(r"step +1  loss [\d.]+  batch acc [\d.]+ +\d+ tokens/s +[\d.]+ s", step_lines[0])
    losses = [float(line.split()[3]) for line in step_lines]
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])
    with open(cli.path("log.csv")) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == steps and rows[-1]["eval_accuracy"] != ""
    assert abs(float(rows[-1]["eval_accuracy"]) - accuracy) < 1e-3
    # The saved model evaluates to the same accuracy on the same held-out sequences.
    again = cli.ok("train-demo", "--load", "sorter.safetensors", "--eval-only")
    assert f"token accuracy {accuracy:.4f}" in again, again


def test_copy_under_a_causal_mask_learns(cli):
    out = cli.ok("train-demo", "--task", "copy", "--seq", "8", "--steps", "400",
                 "--time-limit", "100", "--quiet")
    _, accuracy = final_accuracy(out)
    assert "reached the target" in out and accuracy >= 0.95, out
    assert not any(line.startswith("step ") for line in out.splitlines())  # --quiet


def test_bf16_products_learn_both_tasks(cli):
    """--dtype bf16 (mixed precision) reaches the targets too, and says so in its header; a
    model saved from it loads as f32 or bf16 to accuracies within a few hundredths."""
    out = cli.ok("train-demo", "--dtype", "bf16", "--task", "sort", "--steps", "400",
                 "--time-limit", "100", "--target", "0.9", "--threads", "2", "--quiet",
                 "--save", "bf16.safetensors")
    assert "bf16 products" in out.splitlines()[0], out
    _, accuracy = final_accuracy(out)
    assert "reached the target" in out and accuracy >= 0.9, out
    as_f32 = cli.ok("train-demo", "--load", "bf16.safetensors", "--eval-only")
    again = float(re.search(r"token accuracy ([\d.]+)", as_f32).group(1))
    assert abs(again - accuracy) < 0.03, (again, accuracy)
    as_bf16 = cli.ok("train-demo", "--load", "bf16.safetensors", "--eval-only", "--dtype", "bf16")
    assert f"token accuracy {accuracy:.4f}" in as_bf16, as_bf16
    out = cli.ok("train-demo", "--dtype", "bf16", "--task", "copy", "--seq", "8", "--steps",
                 "400", "--time-limit", "100", "--quiet")
    _, accuracy = final_accuracy(out)
    assert "reached the target" in out and accuracy >= 0.95, out


def test_bad_options(cli):
    cli.fails("train-demo", "--task", "reverse", expect=["--task: expected sort or copy"])
    cli.fails("train-demo", "--eval-only", expect=["--eval-only: needs --load FILE"])
    cli.fails("train-demo", "--embed", "100", "--heads", "3",
              expect=["--embed 100 is not a multiple of --heads 3"])
    cli.fails("train-demo", "--load", "missing.safetensors", expect=["missing.safetensors"])
    cli.fails("train-demo", "--lr", "2", expect=["--lr"])
    cli.fails("train-demo", "--dtype", "f16", expect=["--dtype: expected f32 or bf16, got 'f16'"])
    assert "usage: qkv train-demo" in cli.ok("train-demo", "--help")
