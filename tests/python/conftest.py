"""Shared fixtures for the end-to-end tests of the qkv command-line tool.

The binary comes from the QKV_BIN environment variable (ctest sets it to the built `qkv`).
"""

import os
import subprocess
import zlib

import numpy as np
import pytest


@pytest.fixture(scope="session")
def qkv_bin():
    path = os.environ.get("QKV_BIN")
    if not path:
        pytest.fail("QKV_BIN is not set; run through ctest or set QKV_BIN=build/<dir>/qkv")
    if not os.access(path, os.X_OK):
        pytest.fail(f"QKV_BIN={path} is not an executable")
    return os.path.abspath(path)


class Cli:
    """Runs `qkv` in a per-test directory that holds its .npy inputs and outputs."""

    def __init__(self, binary, directory):
        self.binary = binary
        self.dir = directory

    def path(self, name):
        return str(self.dir / name)

    def save(self, name, array):
        np.save(self.path(name), array)
        return self.path(name)

    def load(self, name):
        return np.load(self.path(name))

    def files(self):
        return sorted(p.name for p in self.dir.iterdir())

    def snapshot(self):
        """{relative path: bytes (None for a directory, FIFO or link)} of everything under the
        directory, hidden files included."""
        return {str(p.relative_to(self.dir)):
                p.read_bytes() if p.is_file() and not p.is_symlink() else None
                for p in self.dir.rglob("*")}

    def run(self, *args):
        return subprocess.run([self.binary, *map(str, args)], cwd=self.dir, capture_output=True,
                              text=True, timeout=120)

    def ok(self, *args):
        """Runs a command that must succeed silently on stderr; returns its stdout."""
        result = self.run(*args)
        assert result.returncode == 0, (
            f"qkv {' '.join(map(str, args))} exited {result.returncode}: {result.stderr}")
        assert result.stderr == ""
        return result.stdout

    def fails(self, *args, expect=()):
        """Runs a command that must fail per DESIGN.md section 4: exit status 2, one line on
        stderr starting 'qkv: error:' and containing every string in `expect`, and no file
        created, changed or removed in the directory. Returns the error line."""
        before = self.snapshot()
        result = self.run(*args)
        assert result.returncode == 2, (
            f"qkv {' '.join(map(str, args))}: expected exit 2, got {result.returncode}; "
            f"stderr: {result.stderr}")
        lines = result.stderr.splitlines()
        assert len(lines) == 1, f"expected one line on stderr, got: {result.stderr!r}"
        message = lines[0]
        assert message.startswith("qkv: error: "), message
        for fragment in expect:
            assert fragment in message, f"{fragment!r} not in {message!r}"
        after = self.snapshot()
        assert sorted(after) == sorted(before), (
            f"files changed: before {sorted(before)}, after {sorted(after)}")
        for name, data in before.items():
            assert after[name] == data, f"{name} was modified by a failing command"
        return message


@pytest.fixture
def cli(qkv_bin, tmp_path):
    return Cli(qkv_bin, tmp_path)


@pytest.fixture
def rng(request):
    # A fixed seed per test, so failures reproduce.
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))
