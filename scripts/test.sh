#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (GoogleTest + pytest through ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --preset release -j2
