"""The project's own lint and format rules (pyproject's [tool.ruff]), enforced by the suite so CI runs them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ["meshlm", "tests", "benchmarks"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, *PYTHON], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
