#!/usr/bin/env bash
# Sets up, builds and runs the main job: qkv demo (extra arguments are passed on).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
exec build/release/qkv demo "$@"
