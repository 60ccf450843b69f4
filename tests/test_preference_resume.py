"""A full DPO run as `meshlm train` runs it, stopped by SIGTERM and by kill -9 and resumed: the same numbers
as one uninterrupted run (a file of its own: three processes start here, beside the other files' tests)."""

import json
import signal
import time

import numpy as np
import pytest

from meshlm import train
from tests.helpers.preferences import TRL_DPO_METRICS, logged, run_config
from tests.helpers.training import metrics_losses, start_run, wait_for_steps


@pytest.mark.slow
def test_a_dpo_run_stopped_by_sigterm_and_sigkill_resumes_to_the_uninterrupted_numbers(preferences, tmp_path):
    """A full DPO fine-tune with precomputed reference log-probs, run as `meshlm train` in a subprocess,
    stopped by SIGTERM, resumed, killed (kill -9) at an arbitrary moment and resumed to the end: every step's
    loss and rewards equal those of one uninterrupted run, and the reference pass ran once."""
    cfg = run_config(preferences, tmp_path / "ref", total_steps=12, ckpt_every=2, keep_last=1)
    train.train(cfg, progress=False)
    want = {r["step"]: r for r in logged(tmp_path / "ref") if "loss" in r}
    run_dir = tmp_path / "run"
    config = tmp_path / "run.json"
    config.write_text(json.dumps(cfg.replace(out_dir=str(run_dir)).to_dict()))

    proc = start_run(config)
    wait_for_steps(proc, run_dir, 3)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out
    reference = (run_dir / "reference_logps.npz").stat().st_mtime_ns

    proc = start_run(config)
    wait_for_steps(proc, run_dir, len(metrics_losses(run_dir)) + 3)
    time.sleep(np.random.default_rng().uniform(0, 0.2))
    proc.kill()
    proc.wait()

    proc = start_run(config)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    got = {r["step"]: r for r in logged(run_dir) if "loss" in r}
    assert sorted(got) == list(range(1, 13))
    for step, record in want.items():
        for name in ("loss", *TRL_DPO_METRICS):
            assert got[step][name] == record[name], (step, name)
    assert (run_dir / "reference_logps.npz").stat().st_mtime_ns == reference
