"""Fixtures for the tests of the Python module qkv (python/qkv, src/python).

ctest puts the build tree's package (<build>/python) on PYTHONPATH; torch, jax and ml_dtypes
come from the test venv (scripts/python_env.sh). Nothing here skips: a missing module fails.
"""

import os
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

# The shared case table and references live one folder up (tests/python/).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture(scope="session", autouse=True)
def qkv_module():
    import qkv
    # The package under test must be the build tree's, not some other installed qkv.
    expected = os.environ.get("QKV_PYTHON_PACKAGE")
    if expected:
        assert Path(qkv.__file__).resolve().parent == Path(expected).resolve(), qkv.__file__
    return qkv


@pytest.fixture
def rng(request):
    # A fixed seed per test, so failures reproduce.
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture(scope="session")
def model_dir():
    directory = os.environ.get("QKV_MODEL_DIR")
    if not directory:
        pytest.fail("QKV_MODEL_DIR is not set (scripts/test.sh sets it)")
    return directory
