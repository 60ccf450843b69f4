"""Smokes of the command line itself: `python -m meshlm`, `meshlm demo` on a preset and `meshlm launch`."""

import subprocess
import sys

from meshlm import cli, distributed
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


def test_launch_starts_each_local_process_with_its_place_in_the_job(tmp_path):
    """`meshlm launch` on a command that only writes what it was told (test_multihost runs real jobs)."""
    write = f"import os; open(os.path.join({str(tmp_path)!r}, os.environ['{distributed.ENV_PROCESS_ID}']), 'w')"
    write += f".write(os.environ['{distributed.ENV_NUM_PROCESSES}'])"
    assert cli.main(["launch", "--local", "2", "--", sys.executable, "-c", write]) == 0
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"0": "2", "1": "2"}
