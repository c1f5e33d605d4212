"""scripts/ab_bench.py: alternating A/B runs of `qkv bench`. A fake bench with known values checks
the turns, medians and ratios exactly; one run of the real `qkv bench` checks that its JSON
rows are read."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ab_bench.py"

# Prints one JSON row (or two with FAKE_ROWS=2) whose gflops is the next of FAKE_VALUES for this
# variant, and logs which variant ran, so the test knows the order of turns.
FAKE = """
import json, os, sys
name = sys.argv[1]
log = os.environ["FAKE_LOG"]
with open(log, "a") as f:
    f.write(name + "\\n")
turn = sum(1 for line in open(log) if line.strip() == name) - 1
value = float(os.environ["FAKE_VALUES"].split(",")[turn]) * float(os.environ.get("FAKE_SCALE", "1"))
assert sys.argv[-1] == "--json", sys.argv
for r in range(int(os.environ.get("FAKE_ROWS", "1"))):
    print(json.dumps({"kernel": "flash", "products": f"p{r}", "gflops": value * (r + 1)}))
"""


def run(args, tmp_path, **env):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ, **env})


def table(stdout):
    """{variant label: (median, ratio, values)} from the printed table."""
    rows = {}
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("variant"))
    for line in lines[start + 1:]:
        words = line.split()
        # name [row label] median ratio min max values...
        label_words = 2 if not words[1][0].isdigit() else 1
        name = " ".join(words[:label_words])
        median, ratio = float(words[label_words]), float(words[label_words + 1])
        rows[name] = (median, ratio, [float(x) for x in words[label_words + 4:]])
    return rows


def test_turns_medians_and_ratios(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE)
    log = tmp_path / "log"
    result = run(["--rounds", "3", "--args", "--shape 1,1,1,1,1,1", "--json", "out.json",
                  f"a={sys.executable} {fake} a",
                  f"b=FAKE_SCALE=2 {sys.executable} {fake} b",
                  f"c=FAKE_SCALE=0.5 {sys.executable} {fake} c"],
                 tmp_path, FAKE_LOG=str(log), FAKE_VALUES="100,400,200")
    assert result.returncode == 0, result.stderr
    assert "3 variants x 3 rounds on " in result.stdout
    # Each round starts at the next variant.
    assert log.read_text().split() == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    rows = table(result.stdout)
    assert rows["a"] == (200.0, 1.0, [100.0, 400.0, 200.0])  # median, not mean
    assert rows["b"][:2] == (400.0, 2.0)
    assert rows["c"][:2] == (100.0, 0.5)
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["variants"]["b"]["env"] == {"FAKE_SCALE": "2"}
    assert {v["variant"]: v["values"] for v in saved["values"]}["c"] == [50.0, 200.0, 100.0]


def test_several_rows_per_command(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text(FAKE)
    result = run(["--rounds", "2", f"a={sys.executable} {fake} a",
                  f"b=FAKE_SCALE=3 {sys.executable} {fake} b"],
                 tmp_path, FAKE_LOG=str(tmp_path / "log"), FAKE_VALUES="10,20", FAKE_ROWS="2")
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    assert rows["a flash/p0"][:2] == (15.0, 1.0)
    assert rows["a flash/p1"][:2] == (30.0, 1.0)
    assert rows["b flash/p1"][:2] == (90.0, 3.0)


def test_errors(tmp_path):
    bad = run(["no-equals-sign"], tmp_path)
    assert bad.returncode == 2 and "expected NAME=COMMAND" in bad.stderr
    same = run(["a=true", "a=true"], tmp_path)
    assert same.returncode == 2 and "variant names must differ" in same.stderr
    rounds = run(["--rounds", "0", "a=true"], tmp_path)
    assert rounds.returncode == 2 and "--rounds must be >= 1" in rounds.stderr
    failing = run(["a=false"], tmp_path)
    assert failing.returncode == 2 and "variant a:" in failing.stderr and "exited 1" in failing.stderr
    silent = run(["a=true"], tmp_path)
    assert silent.returncode == 2 and "printed no JSON row" in silent.stderr


def test_real_bench(tmp_path, qkv_bin):
    result = run(["--rounds", "2", "--args", "--shape 1,2,2,64,64,32 --threads 1 --repeats 1",
                  f"bshd={qkv_bin} bench", f"bhsd={qkv_bin} bench --layout bhsd"], tmp_path)
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    assert set(rows) == {"bshd", "bhsd"}
    assert rows["bshd"][1] == 1.0
    assert all(len(v) == 2 and min(v) > 0 for _, _, v in rows.values())
