"""What the conversion benchmarks share: a child process's wall time and peak RSS, folder sizes, the
disk check before a run, and the results table."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

Row = tuple[str, float, float, float]  # (step, wall seconds, peak RSS GiB, output GiB)


# Starts the command and reports its exit code, wall seconds and peak RSS (KiB, from wait4) into a file.
# A process's peak RSS starts from its parent's RSS at the fork (Linux keeps the high-water mark across
# exec), so the command is started from this small launcher, not from the benchmark's own large process.
LAUNCHER = """
import json, os, subprocess, sys, time
start = time.perf_counter()
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
wall = time.perf_counter() - start
with open(sys.argv[1], "w") as f:
    json.dump([os.waitstatus_to_exitcode(status), wall, usage.ru_maxrss], f)
"""


def run(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of one command, in a process of its own (only it counts)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        subprocess.run([sys.executable, "-c", LAUNCHER, report.name, *cmd], env=env, check=True)
        code, wall, max_rss_kib = json.loads(Path(report.name).read_text())
    if code != 0:
        sys.exit(f"failed ({code}): {' '.join(cmd)}")
    return wall, max_rss_kib / 2**20


def meshlm_convert(src: Path, dst: Path, to: str, dtype: str) -> tuple[float, float]:
    """`meshlm convert SRC DST --to TO --dtype DTYPE` in a child process: wall seconds, peak RSS GiB."""
    return run([sys.executable, "-m", "meshlm", "convert", str(src), str(dst), "--to", to, "--dtype", dtype])


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check_disk(workdir: str, need: float) -> None:
    free = shutil.disk_usage(workdir).free
    if free < need:
        sys.exit(f"{workdir}: {free / 2**30:.0f} GiB free, this run needs about {need / 2**30:.0f} GiB")


def print_table(title: str, rows: list[Row]) -> None:
    """The rows, with each step's wall time against the first row's (the peer: `cp -r`)."""
    peer = rows[0][1]
    print(f"\n{title}")
    print(f"{'step':<42} {'wall s':>8} {'vs cp':>6} {'peak RSS GiB':>13} {'output GiB':>11}")
    for name, wall, rss, out in rows:
        print(f"{name:<42} {wall:>8.1f} {wall / peer:>5.2f}x {rss:>13.2f} {out:>11.2f}")
