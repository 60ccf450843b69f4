"""Smokes of the command line itself: `python -m meshlm`, `meshlm demo` on a preset, the compiled programs it
keeps, and `meshlm launch`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_a_command_keeps_its_compiled_programs_unless_told_otherwise(tmp_path):
    """In meshlm's cache folder by default (each program, however quickly compiled, here), none where
    JAX_COMPILATION_CACHE_DIR is set empty; the suite's own setting of it is what every other test runs under."""

    def demo(cache: Path, **settings: str) -> None:
        env = {name: value for name, value in os.environ.items() if name != "JAX_COMPILATION_CACHE_DIR"}
        env |= {"MESHLM_CACHE": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **settings}
        done = subprocess.run([sys.executable, "-m", "meshlm", "demo", "--preset", "test-tiny"], env=env,
                              capture_output=True, text=True, cwd=REPO, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr

    demo(tmp_path / "kept")
    assert list((tmp_path / "kept" / "xla").glob("*-cache"))  # JAX's entries
    demo(tmp_path / "none", JAX_COMPILATION_CACHE_DIR="")
    assert not (tmp_path / "none" / "xla").exists()


def test_launch_starts_each_local_process_with_its_place_in_the_job(tmp_path):
    """`meshlm launch` on a command that only writes what it was told (test_multihost runs real jobs)."""
    write = f"import os; open(os.path.join({str(tmp_path)!r}, os.environ['{distributed.ENV_PROCESS_ID}']), 'w')"
    write += f".write(os.environ['{distributed.ENV_NUM_PROCESSES}'])"
    assert cli.main(["launch", "--local", "2", "--", sys.executable, "-c", write]) == 0
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"0": "2", "1": "2"}
