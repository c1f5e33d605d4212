#!/usr/bin/env bash
# Creates (or refreshes) the virtual environment .cache/venv-peers that the peer benchmarks and
# the embedding fixture generator run in, and prints its python. Idempotent: when every module
# already imports, it installs nothing and only prints the path.
#
#   PEERS_PY=$(scripts/peers_venv.sh)
#
# Packages come from PyPI: torch, onnxruntime, onnx, sentence-transformers, matplotlib, numpy.
# Not part of the test suite and not a dependency of qkv itself (DESIGN.md section 7): only the
# scripts bench_attention_peers.py, bench_embed_peers.py and gen_embedding_fixture.py use it.
# Set PEERS_PIP_ARGS to pass extra pip options (for example a local wheel cache).
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo_root/.cache/venv-peers"
python="$venv/bin/python"
packages=(torch onnxruntime onnx sentence-transformers matplotlib numpy)
check='import torch, onnxruntime, onnx, sentence_transformers, matplotlib, numpy'

if [[ -x "$python" ]] && "$python" -c "$check" >/dev/null 2>&1; then
  echo "$python"
  exit 0
fi

if [[ ! -x "$python" ]]; then
  echo "peers_venv.sh: creating $venv" >&2
  mkdir -p "$repo_root/.cache"
  # /usr/bin/python3 first: the pyenv python3 on some machines lacks the venv module's ensurepip.
  base=${PEERS_BASE_PYTHON:-/usr/bin/python3}
  [[ -x "$base" ]] || base=python3
  "$base" -m venv "$venv" >&2
fi

echo "peers_venv.sh: installing ${packages[*]} into $venv (a few GB, several minutes)" >&2
# shellcheck disable=SC2086  # PEERS_PIP_ARGS is a list of words on purpose
"$python" -m pip install --quiet ${PEERS_PIP_ARGS:-} "${packages[@]}" >&2
if ! "$python" -c "$check" >&2; then
  echo "peers_venv.sh: the modules still do not import after installing" >&2
  exit 1
fi
echo "$python"
