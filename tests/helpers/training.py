"""A tiny training setup: the model, its dataset, its config, and runs in-process or as `meshlm train`."""

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from meshlm import cli, data, optim, train_step
from meshlm.config import ModelConfig, TrainConfig
from meshlm.loader import TrainLoader
from meshlm.sharding import make_mesh

REPO = Path(__file__).resolve().parents[2]

SEQ = 16


# n_head 8 and d_ff / vocab multiples of 8, so that model=8 and fsdp=8 both divide every sharded axis.
CFG8 = ModelConfig(
    n_layer=2, d_model=64, n_head=8, d_ff=128, rotary_dim=4, vocab_size=256, n_vocab_used=256, max_seq_len=32
)


def write_dataset(folder: Path, rows: np.ndarray, val_rows: np.ndarray | None = None) -> Path:
    splits = {"train": data.write_split(folder, "train", [rows], SEQ)}
    if val_rows is not None:
        splits["val"] = data.write_split(folder, "val", [val_rows], SEQ)
    data.write_index(folder, SEQ, splits, eos_id=0)
    return folder


def tiny_config(dataset: Path, out_dir: Path, **changes) -> TrainConfig:
    base = dict(
        model=CFG8, data=str(dataset), out_dir=str(out_dir), batch_size=8, total_steps=4, lr=1e-2, end_lr=1e-3,
        warmup_steps=0, anneal_steps=10, val_every=0, ckpt_every=0, log_every=1000, sample_tokens=0,
    )  # fmt: skip
    return TrainConfig(**{**base, **changes})


def run_steps(cfg: TrainConfig, mesh_spec: str | None, n_steps: int, dataset: Path, init_params):
    """n optimizer steps straight through `make_train_step`; returns (losses, params, state)."""
    mesh = make_mesh(mesh_spec)
    opt = optim.make_optimizer(cfg, cfg.model)
    shardings = train_step.state_shardings(cfg.model, opt, mesh)
    step_fn = train_step.make_train_step(cfg, cfg.model, opt, shardings)
    loader = TrainLoader(data.TokenDataset(dataset), cfg.batch_size, cfg.micro_batches, seed=cfg.seed)
    batch_shardings = train_step.batch_shardings(mesh, train_step.batch_keys(cfg), leading=1)
    with jax.set_mesh(mesh):
        params = jax.device_put(init_params, shardings.params)
        opt_state = jax.jit(opt.init, out_shardings=shardings.opt_state)(params)
        state = train_step.TrainState(jax.device_put(jnp.int32(0), shardings.step), params, opt_state)
        losses = []
        for _ in range(n_steps):
            batch = next(loader)._asdict()
            state, metrics = step_fn(state, {k: jax.device_put(batch[k], s) for k, s in batch_shardings.items()})
            losses.append(float(metrics["loss"]))
    return losses, jax.tree.map(np.asarray, state.params), state


def smooth(cfg: TrainConfig) -> TrainConfig:
    """eps=1 makes each Adam update ~ lr * gradient, so parameters compare gradients at fp32 tolerance (with
    eps=1e-8 an early update is ~ lr * sign(g), and rounding can flip the sign of a 1e-9 gradient)."""
    return cfg.replace(eps=1.0, lr=1.0, end_lr=1.0)


def metrics_losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def start_run(config: Path) -> subprocess.Popen:
    """`meshlm train CONFIG` as a process. It inherits the session's persistent compilation cache (conftest.py):
    it reuses the executables of the same run made in-process, and the resumed processes those of the first."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "meshlm", "train", str(config), "--no-progress"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_until(proc: subprocess.Popen, done: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    """Wait until `done()` while `proc` (a `start_run`) runs: its output when it ends first."""
    deadline = time.time() + timeout_s
    while not done():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, f"no {what} after {timeout_s:.0f} s"
        time.sleep(0.02)


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int) -> None:
    wait_until(proc, lambda: len(metrics_losses(run_dir)) >= n, f"step {n} in {run_dir}/metrics.jsonl")


def run_cli_error(capsys, *argv) -> str:
    assert cli.main(["train", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("meshlm train: error: ")
    return err
