"""Smokes of the command line itself: `python -m meshlm`, and `meshlm demo` on a preset."""

import subprocess
import sys

from meshlm import cli
from tests.helpers.training import REPO


def test_python_dash_m_meshlm_lists_every_command():
    done = subprocess.run([sys.executable, "-m", "meshlm", "--help"], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    (sub,) = [a for a in cli.build_parser()._actions if a.dest == "command"]
    assert all(command in done.stdout for command in sub.choices)


def test_demo_shards_a_preset_over_the_devices_and_runs_it(capsys):
    assert cli.main(["demo", "--preset", "test-tiny", "--mesh", "data=2,fsdp=2,model=2"]) == 0
    out = capsys.readouterr().out
    assert "layers.attn.q" in out and "spec" in out
