"""A disk that fills up: a small tmpfs of its own, for the tests of full-disk failures (root only)."""

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """`folder`, made the mount point of a tmpfs of `size` (e.g. "256k"); the test is skipped, with the
    reason, where mounting is not allowed."""
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
