"""Multi-controller start-up: the same program runs on every host and the hosts form one global mesh.

No orchestrator: each process calls `initialize` before touching devices. Where JAX's own cluster
detection finds the job (TPU pod slices, SLURM, Open MPI, Kubernetes; see `detected_cluster`), JAX
finds the coordinator itself; elsewhere it comes from `--coordinator/--num-processes/--process-id` or
the `MESHLM_*` variables that `meshlm launch` sets.
A process that dies makes the others stop after `heartbeat_timeout_s` instead of hanging.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import jax

from meshlm.config import ConfigError

ENV_COORDINATOR = "MESHLM_COORDINATOR"
ENV_NUM_PROCESSES = "MESHLM_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHLM_PROCESS_ID"
DEFAULT_HEARTBEAT_S = 60


def detected_cluster() -> str | None:
    """The cluster that `jax.distributed.initialize()` would join by itself, by JAX's own detection (TPU
    pod slices on GCE and GKE, SLURM, Open MPI, Kubernetes), or "JAX_COORDINATOR_ADDRESS" when that
    variable is set; None on a lone machine. JAX's detectors have no public entry point, so this asks
    the same registry `initialize` consults."""
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        return "JAX_COORDINATOR_ADDRESS"
    from jax._src import clusters

    detectors = (c for c in clusters.ClusterEnv._cluster_types if not c.opt_in_only_method)
    return next((c.__name__ for c in detectors if c.is_env_present()), None)


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_S,
) -> None:
    """Join the cluster if this is a multi-process run; a single process needs nothing and gets nothing."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and ENV_NUM_PROCESSES in os.environ:
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
    if process_id is None and ENV_PROCESS_ID in os.environ:
        process_id = int(os.environ[ENV_PROCESS_ID])
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise ConfigError("multi-process start needs all of --coordinator HOST:PORT, --num-processes and --process-id")
    if all(given):
        assert num_processes is not None and process_id is not None
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id must lie in [0, {num_processes}), got {process_id}")
        if num_processes == 1:
            return
        jax.distributed.initialize(
            coordinator, num_processes, process_id, heartbeat_timeout_seconds=heartbeat_timeout_s
        )
    elif detected_cluster():
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s)


def is_main_process() -> bool:
    """Only process 0 prints, logs and writes single-writer files."""
    return jax.process_index() == 0


def launch_local(
    command: Sequence[str], num_processes: int, port: int = 12355, devices_per_process: int | None = None
) -> int:
    """Run `command` as `num_processes` local processes of one multi-process job (for trying multi-host).

    If one process fails, the others are stopped and its exit code is returned.
    """
    if num_processes < 1:
        raise ConfigError(f"--local must be >= 1, got {num_processes}")
    if not command:
        raise ConfigError("nothing to launch: give the command after `--`")
    procs = []
    for i in range(num_processes):
        env = {
            **os.environ,
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(i),
        }
        if devices_per_process:
            flags = env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices_per_process}"
            env.update(XLA_FLAGS=flags.strip(), JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"))
        procs.append(subprocess.Popen(list(command), env=env))
    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next(((i, c) for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    finally:
        if failed:
            print(
                f"meshlm launch: process {failed[0]} exited with code {failed[1]}; stopping the others", file=sys.stderr
            )
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    return failed[1] if failed else 0
