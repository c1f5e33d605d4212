#!/usr/bin/env bash
# `pip install .` as a user does it: a fresh venv from Debian's python3, `pip install SOURCE_DIR`
# (build isolation: scikit-build-core and nanobind from PyPI, the same CMake build), then, from
# another folder, `import qkv` and one attention call checked against float64 numpy. Prints the
# wheel's tag (abi3 on Python >= 3.12, cpXY below).
#
#   check_pip_install.sh SOURCE_DIR
set -euo pipefail
source_dir=$(cd "$1" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

/usr/bin/python3 -m venv venv
started=$(date +%s)
venv/bin/python -m pip install --quiet "$source_dir"
echo "check_pip_install: pip install took $(($(date +%s) - started)) s"
grep -h '^Tag:' venv/lib/python3*/site-packages/qkv-*.dist-info/WHEEL |
  sed 's/^/check_pip_install: wheel /'

venv/bin/python - <<'PY'
from pathlib import Path

import numpy as np
import qkv

package = Path(qkv.__file__).parent
files = sorted(p.name for p in package.iterdir() if p.name != "__pycache__")
print("check_pip_install: package files", files)
for name in ("__init__.py", "torch.py", "py.typed", "_qkv.pyi"):
    assert name in files, f"{name} missing from the installed package"
assert any(name.startswith("_qkv.") and name.endswith(".so") for name in files), files

print("check_pip_install: imported", qkv.__file__)
rng = np.random.default_rng(0)
q = rng.standard_normal((2, 33, 4, 16), dtype=np.float32)
k = rng.standard_normal((2, 47, 2, 16), dtype=np.float32)
v = rng.standard_normal((2, 47, 2, 16), dtype=np.float32)
out = qkv.attention(q, k, v, causal=True)
# float64 reference: GQA (2 query heads per kv head), bottom-right causal.
q64, k64, v64 = (np.repeat(x.astype(np.float64).transpose(0, 2, 1, 3), r, axis=1)
                 for x, r in ((q, 1), (k, 2), (v, 2)))
s = q64 @ k64.swapaxes(-1, -2) / 4.0
s = np.where(np.arange(47)[None, :] <= np.arange(33)[:, None] + 14, s, -np.inf)
p = np.exp(s - s.max(-1, keepdims=True))
expected = ((p / p.sum(-1, keepdims=True)) @ v64).transpose(0, 2, 1, 3)
error = np.abs(out - expected).max()
print(f"check_pip_install: max |qkv - float64| = {error:.3g}")
assert error < 2e-5, error
PY
