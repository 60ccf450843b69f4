"""Multi-process runs (2 processes x 4 simulated CPU devices on 127.0.0.1) equal one process x 8 devices."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from meshlm import data
from tests.helpers import without_device_count

# Every test here shares a live server (or processes) started by a module fixture: the whole file is slow.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(processes: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`meshlm launch` (or one plain process) over 8 simulated devices in all."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = without_device_count(os.environ.get("XLA_FLAGS", ""))  # each process gets its own below
    worker = [sys.executable, "-m", "tests.multihost_worker", *args]
    cmd = [
        sys.executable,
        "-m",
        "meshlm",
        "launch",
        "--local",
        str(processes),
        "--port",
        str(free_port()),
        "--devices-per-process",
        str(8 // processes),
        "--",
        *worker,
    ]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, bucket) -> Path:
    """One process, then two processes, then one again, handing checkpoints across: the two processes
    save theirs into a (local emulator's) GCS bucket, from which this process (8 devices, as the single
    process had) restores it."""
    root = tmp_path_factory.mktemp("multihost")
    for name in ("one", "two", "back", "data"):
        (root / name).mkdir()
    rows = np.random.default_rng(0).integers(0, 500, (32, 17))
    data.write_index(root / "data", 16, {"train": data.write_split(root / "data", "train", [rows], 16)}, eos_id=0)
    ok(run(1, str(root / "one"), "grads", f"train={root / 'data'}", f"save={root / 'ckpt1'}"))
    ok(
        run(
            2,
            str(root / "two"),
            "grads",
            f"train={root / 'data'}",
            f"restore={root / 'ckpt1'}",
            f"save={bucket}/multihost/ckpt2",
        )
    )
    from tests import multihost_worker

    multihost_worker.restore(str(root / "back"), f"{bucket}/multihost/ckpt2")
    return root


@pytest.mark.slow
def test_two_processes_give_the_single_process_gradients(runs):
    one, two = np.load(runs / "one" / "grads.npz"), np.load(runs / "two" / "grads.npz")
    assert set(one.files) == set(two.files) and len(one.files) > 10
    for name in one.files:
        np.testing.assert_allclose(two[name], one[name], atol=1e-5 * np.abs(one[name]).max(), rtol=0, err_msg=name)


def test_two_processes_train_like_one(runs):
    one, two = np.load(runs / "one" / "trained.npz"), np.load(runs / "two" / "trained.npz")
    assert len(one["losses"]) == 4 and np.isfinite(one["losses"]).all()
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    for name in one.files:
        np.testing.assert_allclose(two[name], one[name], atol=1e-5 * np.abs(one[name]).max(), rtol=0, err_msg=name)


def test_checkpoint_saved_by_one_process_restores_in_two(runs):
    np.testing.assert_array_equal(
        np.load(runs / "two" / "restored_logits.npy"), np.load(runs / "one" / "saved_logits.npy")
    )


def test_checkpoint_saved_by_two_processes_into_a_bucket_restores_in_one(runs):
    saved = np.load(runs / "two" / "saved_logits.npy")
    assert not np.allclose(saved, np.load(runs / "one" / "saved_logits.npy"))  # a different model was saved
    np.testing.assert_array_equal(np.load(runs / "back" / "restored_logits.npy"), saved)


def test_a_dying_process_stops_the_job_with_a_clear_message(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = without_device_count(os.environ.get("XLA_FLAGS", ""))
    script = (
        "import os, sys, time; from meshlm import distributed; distributed.initialize(heartbeat_timeout_s=5);"
        "import jax; jax.devices();"
        "os._exit(7) if jax.process_index() == 1 else time.sleep(120)"
    )
    start = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshlm",
            "launch",
            "--local",
            "2",
            "--port",
            str(free_port()),
            "--",
            sys.executable,
            "-c",
            script,
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 7
    assert "process 1 exited with code 7; stopping the others" in result.stderr
    assert time.monotonic() - start < 60


def test_a_cluster_is_joined_by_jaxs_own_detection_and_a_lone_machine_is_not(monkeypatch):
    """SLURM's variables make `initialize` call `jax.distributed.initialize()` with nothing of meshlm's;
    without them, nothing is called."""
    from meshlm import distributed

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kwargs: calls.append((args, kwargs)))
    for var in ("MESHLM_COORDINATOR", "MESHLM_NUM_PROCESSES", "MESHLM_PROCESS_ID", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.detected_cluster() is None
    distributed.initialize()
    assert calls == []
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0"}  # fmt: skip
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    assert distributed.detected_cluster() == "SlurmCluster"
    distributed.initialize(heartbeat_timeout_s=5)
    assert calls == [((), {"heartbeat_timeout_seconds": 5})]
