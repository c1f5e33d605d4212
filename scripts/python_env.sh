#!/usr/bin/env bash
# Creates (or checks) the virtual environment .cache/venv-test that the test suite's Python runs
# in, and prints its python. Idempotent: when every module already imports, it installs nothing.
#
#   QKV_PYTHON=$(scripts/python_env.sh)
#
# From PyPI: numpy and pytest (the CLI tests' float64 reference), nanobind and scikit-build-core
# (the Python module's build, DESIGN.md section 7), torch (qkv.torch is tested against torch's
# own scaled_dot_product_attention), jax and ml_dtypes (arrays of those frameworks go in without
# copies), mpi4py (qkv.ring's communicator; its wheel runs on Debian's Open MPI). torch pulls
# in its CUDA wheels from PyPI (about 3 GB, a few minutes the first time); pip keeps them in
# its own cache for the next venv. Base interpreter: Debian's /usr/bin/python3
# (python3-venv, python3-dev from scripts/setup.sh).
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo_root/.cache/venv-test"
python="$venv/bin/python"
packages=(numpy pytest nanobind scikit-build-core torch jax ml_dtypes mpi4py)
check='import numpy, pytest, nanobind, scikit_build_core, torch, jax, ml_dtypes, mpi4py'

if [[ -x $python ]] && "$python" -c "$check" >/dev/null 2>&1; then
  echo "$python"
  exit 0
fi
if [[ ! -x $python ]]; then
  echo "python_env.sh: creating $venv" >&2
  mkdir -p "$repo_root/.cache"
  /usr/bin/python3 -m venv "$venv" >&2
fi
echo "python_env.sh: installing ${packages[*]} into $venv (torch: about 3 GB the first time)" >&2
"$python" -m pip install --quiet "${packages[@]}" >&2
if ! "$python" -c "$check" >&2; then
  echo "python_env.sh: the modules still do not import after installing" >&2
  exit 1
fi
echo "$python"
