"""Multi-controller start-up: the same program runs on every host and the hosts form one global mesh.

No orchestrator: each process calls `initialize` before touching devices. A run joins a cluster only
where something explicitly describes more than one process: `--coordinator/--num-processes/--process-id`
or the `MESHLM_*` variables that `meshlm launch` sets; else a cluster whose own variables say it runs
several processes (SLURM, Open MPI, TPU slices on GKE; see `environment_cluster`), or
`JAX_COORDINATOR_ADDRESS`; or `MESHLM_CLUSTER=jax`, which hands the question to JAX's own detection
(TPU pod slices on GCE, whose hosts only the metadata server lists; Kubernetes). A lone host, a TPU VM
among them, never calls `jax.distributed.initialize`, however its environment looks: JAX's detection
would ask a metadata server that may not answer. A failed join names what it tried, in one line.
A process that dies makes the others stop after `heartbeat_timeout_s` instead of hanging.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax

from meshlm.config import ConfigError

ENV_COORDINATOR = "MESHLM_COORDINATOR"
ENV_NUM_PROCESSES = "MESHLM_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHLM_PROCESS_ID"
ENV_CLUSTER = "MESHLM_CLUSTER"  # "jax": let JAX's own cluster detection decide (it may ask a metadata server)
DEFAULT_HEARTBEAT_S = 60
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


class Cluster(NamedTuple):
    """A cluster the environment describes: its name as JAX's detector calls it, how many processes it
    runs (None where only JAX can tell), and the variables that say so."""

    name: str
    processes: int | None
    evidence: str


def _count(var: str) -> int:
    try:
        return int(os.environ[var])
    except ValueError:
        raise ConfigError(f"${var} must be a whole number of processes, got {os.environ[var]!r}") from None


def environment_cluster() -> Cluster | None:
    """The multi-process cluster this process's environment variables describe, read without asking any
    server; None for a run of one process (a lone machine, a one-host TPU VM, a SLURM job of one task)."""
    if os.environ.get(ENV_CLUSTER) == "jax":
        return Cluster("JAX's own detection", None, f"{ENV_CLUSTER}=jax")
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        return Cluster(
            "JAX_COORDINATOR_ADDRESS", None, "JAX_COORDINATOR_ADDRESS=" + os.environ["JAX_COORDINATOR_ADDRESS"]
        )
    if all(var in os.environ for var in SLURM_VARS) and _count("SLURM_NTASKS") > 1:
        return Cluster("SlurmCluster", _count("SLURM_NTASKS"), f"SLURM_NTASKS={os.environ['SLURM_NTASKS']}")
    ompi = "OMPI_MCA_orte_hnp_uri" in os.environ and "OMPI_COMM_WORLD_SIZE" in os.environ
    if ompi and _count("OMPI_COMM_WORLD_SIZE") > 1:
        return Cluster(
            "OmpiCluster", _count("OMPI_COMM_WORLD_SIZE"), f"OMPI_COMM_WORLD_SIZE={_count('OMPI_COMM_WORLD_SIZE')}"
        )
    for var in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):
        hosts = [h for h in os.environ.get(var, "").split(",") if h.strip()]
        if len(hosts) > 1:
            return Cluster("GkeTpuCluster", len(hosts), f"{var} lists {len(hosts)} hosts")
        if var in os.environ:
            break  # the first one set is the one JAX reads
    return None


def detected_cluster() -> str | None:
    """The name of the cluster `initialize` would join without meshlm's own flags (`environment_cluster`),
    or None: a run of one process."""
    cluster = environment_cluster()
    return None if cluster is None else cluster.name


def _join(what: str, join: Callable[[], None]) -> None:
    """Call `join`; a failure becomes one line naming `what` was tried."""
    try:
        join()
    except Exception as e:
        detail = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"could not join the cluster ({what}): {type(e).__name__}: {detail}. A run of one process needs no "
            f"cluster: unset the variables named, or set them to describe one process"
        ) from None


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_S,
) -> None:
    """Join the cluster if this is a multi-process run; a single process needs nothing and gets nothing."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and ENV_NUM_PROCESSES in os.environ:
        num_processes = _count(ENV_NUM_PROCESSES)
    if process_id is None and ENV_PROCESS_ID in os.environ:
        process_id = _count(ENV_PROCESS_ID)
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise ConfigError("multi-process start needs all of --coordinator HOST:PORT, --num-processes and --process-id")
    if all(given):
        assert num_processes is not None and process_id is not None
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id must lie in [0, {num_processes}), got {process_id}")
        if num_processes == 1:
            return
        _join(
            f"coordinator {coordinator}, process {process_id} of {num_processes}",
            lambda: jax.distributed.initialize(
                coordinator, num_processes, process_id, heartbeat_timeout_seconds=heartbeat_timeout_s
            ),
        )
    elif (cluster := environment_cluster()) is not None:
        processes = "" if cluster.processes is None else f", {cluster.processes} processes"
        _join(
            f"{cluster.name}{processes}, from {cluster.evidence}",
            lambda: jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s),
        )


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
