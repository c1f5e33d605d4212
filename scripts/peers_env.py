"""Shared by the scripts that run in .cache/venv-peers (bench_attention_peers.py,
bench_train_peers.py, bench_embed_peers.py, gen_embedding_fixture.py): re-running a script inside
that venv, and the model folder."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def ensure_venv(script, modules):
    """Returns if every module in `modules` imports; else re-runs `script` (with the same
    arguments) under the python of .cache/venv-peers, creating it (scripts/peers_venv.sh)."""
    try:
        for module in modules:
            importlib.import_module(module)
        return
    except ImportError:
        pass
    python = subprocess.run(["bash", str(ROOT / "scripts" / "peers_venv.sh")], check=True,
                            capture_output=True, text=True).stdout.strip().splitlines()[-1]
    os.execv(python, [python, script, *sys.argv[1:]])


def model_dir():
    """The all-MiniLM-L6-v2 folder (scripts/fetch_model.sh fetches it once)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_model.sh")], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()
    return Path(out[-1])
