"""Training under faults: bad values refused up front, a non-finite loss or a full disk stops the run with
one line and keeps the last good checkpoint, Ctrl-C at any moment exits 130 without a crash."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from meshlm import api, cli, data, model, run_start, train
from meshlm.config import TrainConfig, TrainingStopped
from meshlm.formats import native
from tests.helpers.preferences import CFG as PREF_CFG
from tests.helpers.preferences import logged, write_preferences
from tests.helpers.preferences import run_config as pref_config
from tests.helpers.training import CFG8, REPO, SEQ, metrics_losses, run_cli_error, start_run, tiny_config, write_dataset
from tests.small_disk import tmpfs


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    return write_dataset(tmp_path_factory.mktemp("faults_data"), rng.integers(0, 250, (64, SEQ + 1)))


def test_non_finite_and_unreadable_settings_are_refused_before_any_work(tmp_path, capsys, dataset):
    base = ["--set", f"data={dataset}", "--set", f"out_dir={tmp_path / 'run'}"]
    for value in ("inf", ".inf", "nan", "-inf"):
        err = run_cli_error(capsys, *base, "--set", f"lr={value}")
        assert "lr must be a number >= 0" in err, err
    assert "eps must be a number > 0" in run_cli_error(capsys, *base, "--set", "eps=.nan")
    assert not (tmp_path / "run").exists()  # refused before the run folder was made

    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("lr: 1e-3  # r\xe9glage\n".encode("latin-1"))
    assert "latin1.yaml: not a text file in UTF-8 (byte 13)" in run_cli_error(capsys, str(latin1), *base)
    broken = tmp_path / "broken.yaml"
    broken.write_text("lr: [1e-3\nbatch_size: 8\n")
    assert "broken.yaml: cannot parse (" in run_cli_error(capsys, str(broken), *base)

    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    err = run_cli_error(capsys, "--set", f"data={dataset}", "--out-dir", str(a_file))
    assert f"out_dir {a_file}: is a file, not a folder" in err


@pytest.mark.parametrize("recorded", [True, False], ids=["index-records-max", "older-index-scanned"])
def test_token_ids_beyond_the_vocabulary_are_refused_before_the_first_step(recorded, tmp_path, capsys):
    rows = np.random.default_rng(1).integers(0, 250, (16, SEQ + 1))
    rows[11, 5] = CFG8.vocab_size + 44  # one id the model has no embedding for
    folder = write_dataset(tmp_path / "data", rows)
    index = json.loads((folder / data.INDEX).read_text())
    assert index["splits"]["train"]["max_token"] == CFG8.vocab_size + 44
    if not recorded:  # a folder prepared before the index recorded it
        del index["splits"]["train"]["max_token"]
        (folder / data.INDEX).write_text(json.dumps(index))
    run = tmp_path / "run"
    config = tmp_path / "run.json"
    config.write_text(json.dumps(tiny_config(folder, run).to_dict()))
    err = run_cli_error(capsys, str(config), "--no-progress")
    assert f"{folder}: split 'train' holds token id 300, beyond the model's vocab_size 256" in err
    assert not list((run / "checkpoints").glob("[0-9]*"))


def poison_loss(monkeypatch, at: int) -> None:
    """The training step's loss turns NaN at step `at`, as a diverging run's does."""
    compile_step = train.compile_step

    def compile_poisoned(*args):
        program, step_fn, used = compile_step(*args)

        def step(state, batch, *base):
            state, metrics = step_fn(state, batch, *base)
            if int(state.step) == at:
                metrics = {**metrics, "loss": metrics["loss"] * np.nan}
            return state, metrics

        return program, step, used

    monkeypatch.setattr(train, "compile_step", compile_poisoned)


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_and_its_last_checkpoint_resumes_exactly(
    tmp_path, capsys, monkeypatch, dataset
):
    cfg = tiny_config(dataset, tmp_path / "run", total_steps=8, ckpt_every=2)
    reference = train.train(cfg.replace(out_dir=str(tmp_path / "ref")), progress=False)
    config = tmp_path / "run.json"
    config.write_text(json.dumps(cfg.to_dict()))
    with monkeypatch.context() as patch:
        poison_loss(patch, at=5)
        err = run_cli_error(capsys, str(config), "--no-progress")
    assert "error: step 5: the loss is nan (grad norm " in err
    assert "stopped without saving, the last checkpoint, step 4, is intact" in err
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").glob("[0-9]*")) == [2, 4]
    resumed = train.train(cfg, progress=False)
    assert resumed.losses == {s: loss for s, loss in reference.losses.items() if s > 4}
    assert [s for s, _ in metrics_losses(tmp_path / "run")] == list(range(1, 9))


@pytest.mark.slow
def test_a_diverging_learning_rate_stops_the_run_in_one_line(tmp_path, capsys, dataset):
    # lr 0 at step 1 (warm-up), then 1e30: the weights overflow and the loss turns non-finite a few steps on
    cfg = tiny_config(dataset, tmp_path / "run", total_steps=12, lr=1e30, end_lr=1e30, warmup_steps=2, ckpt_every=1)
    config = tmp_path / "run.json"
    config.write_text(json.dumps(cfg.to_dict()))
    err = run_cli_error(capsys, str(config), "--no-progress")
    stopped = int(err.split("error: step ")[1].split(":")[0])
    assert "the loss is nan" in err or "the loss is inf" in err or "parameters are no longer finite" in err
    saved = max(int(p.name) for p in (tmp_path / "run" / "checkpoints").glob("[0-9]*"))
    assert saved < stopped and f"the last checkpoint, step {saved}, is intact" in err
    logged = metrics_losses(tmp_path / "run")
    assert [s for s, _ in logged] == list(range(1, stopped)) and all(np.isfinite(loss) for _, loss in logged)


def disk_bytes(folder: Path) -> int:
    """What a folder takes on a filesystem of 4 KiB blocks."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in folder.rglob("*") if p.is_file())


FULL_DISK_RUN = dict(total_steps=16, ckpt_every=4, keep_last=2)


@pytest.fixture(scope="module")
def full_disk_reference(dataset, tmp_path_factory) -> train.TrainResult:
    """The full-disk cases' run with room to spare: their oracle (its losses) and the size of one checkpoint,
    both only read."""
    return train.train(tiny_config(dataset, tmp_path_factory.mktemp("ref"), **FULL_DISK_RUN), progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("noticed", ["before-the-save", "in-the-background-save"])
def test_a_full_disk_stops_the_run_at_that_save_and_the_resume_is_exact(
    noticed, tmp_path, monkeypatch, dataset, full_disk_reference
):
    settings, reference = FULL_DISK_RUN, full_disk_reference
    one_checkpoint = disk_bytes(reference.out_dir / "checkpoints" / "16")
    if noticed == "in-the-background-save":  # free space unknown (as for a bucket): the write itself fails
        monkeypatch.setattr(native, "_free_bytes", lambda folder: None)
    # room for the first checkpoint and the run's logs, not for a second checkpoint
    with tmpfs(tmp_path / "disk", f"{(one_checkpoint * 3 // 2) >> 10}k") as disk:
        cfg = tiny_config(dataset, disk / "run", **settings)
        with pytest.raises(TrainingStopped) as stopped:
            train.train(cfg, progress=False)
        message = str(stopped.value)
        assert "\n" not in message
        assert message.startswith(f"{disk / 'run' / 'checkpoints'}")
        assert "no space left for the checkpoint of step 8 (it needs about 1,19" in message
        assert "the previous checkpoint is intact" in message
        assert [p.name for p in (disk / "run" / "checkpoints").iterdir() if p.name.isdigit()] == ["4"]
        subprocess.run(["mount", "-o", "remount,size=20000k", str(disk)], check=True)  # space freed
        resumed = train.train(cfg, progress=False)
    assert min(resumed.losses) == 5
    assert resumed.losses == {s: loss for s, loss in reference.losses.items() if s > 4}


@pytest.mark.slow
def test_a_full_disk_is_one_line_on_the_command_line(tmp_path, capsys, dataset):
    with tmpfs(tmp_path / "disk", "1000k") as disk:  # less than one checkpoint (1.2 MB)
        config = tmp_path / "run.json"
        config.write_text(json.dumps(tiny_config(dataset, disk / "run", total_steps=16, ckpt_every=4).to_dict()))
        err = run_cli_error(capsys, str(config), "--no-progress")
    assert "no space left for the checkpoint of step 4" in err and "bytes free); the run stopped there" in err


def interrupt(proc: subprocess.Popen, run: Path, when: str, rng: np.random.Generator) -> None:
    """Send SIGINT at a moment of the kind `when` names."""
    if when == "start-up":
        time.sleep(rng.uniform(1.5, 4.0))
    else:
        lines, deadline = [], time.time() + 120
        while time.time() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "step compiled" in line:
                break
            assert line, "".join(lines)
        if when == "after-compile":
            time.sleep(rng.uniform(0.0, 2.0))
        else:  # stepping and saving (a checkpoint every step)
            while len(metrics_losses(run)) < 2:
                assert proc.poll() is None
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
    proc.send_signal(signal.SIGINT)


@pytest.mark.slow
def test_ctrl_c_at_any_moment_exits_130_without_a_crash(tmp_path, dataset):
    rng = np.random.default_rng()
    for trial, when in enumerate(["start-up", "after-compile", "stepping", "stepping"]):
        run = tmp_path / f"run{trial}"
        config = tmp_path / f"run{trial}.json"
        config.write_text(json.dumps(tiny_config(dataset, run, total_steps=10_000, ckpt_every=1).to_dict()))
        proc = start_run(config)
        interrupt(proc, run, when, rng)
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 130, (when, out)
        assert "Traceback" not in out and "SIGSEGV" not in out, (when, out)
        assert "stopped by signal 2" in out, (when, out)
        if when == "stepping":
            saved = max(int(p.name) for p in (run / "checkpoints").glob("[0-9]*"))
            assert saved == metrics_losses(run)[-1][0]  # the final checkpoint is the last step run


@pytest.mark.slow
def test_resumed_metrics_hold_each_step_once(tmp_path, dataset):
    cfg = tiny_config(dataset, tmp_path / "run", total_steps=6, ckpt_every=3)
    train.train(cfg, progress=False)
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    # as a kill after step 5 leaves it: steps 4 and 5 logged, their checkpoint never written, a line torn
    metrics.write_text("\n".join(lines[:5]) + '\n{"step": 6, "lo')
    (tmp_path / "run" / "checkpoints" / "6").rename(tmp_path / "gone")
    resumed = train.train(cfg, progress=False)
    assert sorted(resumed.losses) == [4, 5, 6]
    assert [s for s, _ in metrics_losses(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]


def test_config_values_are_checked_as_finite_numbers():
    with pytest.raises(ValueError, match="must be a number >= 0, got inf"):
        TrainConfig(lr=float("inf"))


def test_a_run_whose_newest_checkpoint_is_damaged_is_refused_not_replaced_by_an_older_one(tmp_path, capsys, dataset):
    run = tmp_path / "run"
    train.train(tiny_config(dataset, run, total_steps=4, ckpt_every=2), progress=False)
    shutil.rmtree(run / "checkpoints" / "4" / "meshlm")
    assert cli.main(["sample", str(run), "--prompt", "x"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"meshlm sample: error: {run / 'checkpoints' / '4'}: the run's newest checkpoint has no meshlm/metadata "
        "(damaged, or not meshlm's); remove it to use step 2, or load that step's folder"
    )


def test_resuming_from_a_damaged_checkpoint_names_the_parameter_in_one_line(tmp_path, capsys, dataset):
    cfg = tiny_config(dataset, tmp_path / "run", total_steps=2, ckpt_every=2)
    train.train(cfg, progress=False)
    chunks = sorted((tmp_path / "run" / "checkpoints" / "2" / "params").rglob("d/*"), key=lambda p: p.stat().st_size)
    chunks[-1].write_bytes(chunks[-1].read_bytes()[:100])  # the largest data file, cut short
    config = tmp_path / "run.json"
    config.write_text(json.dumps(cfg.replace(total_steps=4).to_dict()))
    err = run_cli_error(capsys, str(config), "--no-progress")
    assert "error: parameter " in err and ": chunk missing or corrupt (" in err, err


# --- issue 42: DPO's stored reference log-probs are those of the starting weights, never stale ones ---


def save_model(path: Path, seed: int) -> None:
    """A random model of the preference tests' config at `path`, written over what was there (as `meshlm
    convert --overwrite` or a retrained SFT run does)."""
    shutil.rmtree(path, ignore_errors=True)
    api.from_config(PREF_CFG, seed=seed).save(path)


def first_step(run: Path) -> dict:
    return next(r for r in logged(run) if r.get("step") == 1 and "loss" in r)


@pytest.mark.slow
def test_a_fresh_dpo_run_recomputes_a_reference_of_changed_starting_weights_saying_why(preferences, tmp_path, capsys):
    """A DPO run killed after its reference pass and before its first checkpoint leaves reference_logps.npz
    and no checkpoint; the model at init_from is then replaced. The next run in that folder starts fresh: its
    policy is the new model, and so must its reference be (step 1's rewards ~0), not the old file's."""
    sft = tmp_path / "sft"
    save_model(sft, seed=1)
    run = tmp_path / "run"
    cfg = pref_config(preferences, run, init_from=str(sft), total_steps=1)
    train.train(cfg, progress=False)
    shutil.rmtree(run / "checkpoints")  # as the kill leaves it: the reference stored, no step saved
    stored = np.load(run / "reference_logps.npz")["train"]
    capsys.readouterr()

    save_model(sft, seed=2)
    train.train(cfg, progress=False)
    err = capsys.readouterr().err
    assert f"{run / 'reference_logps.npz'}: holds the reference log-probs of other starting weights: {sft}" in err
    assert "computing them again" in err
    assert first_step(run)["rewards/chosen"] == pytest.approx(0.0, abs=1e-5)
    assert first_step(run)["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert not np.allclose(np.load(run / "reference_logps.npz")["train"], stored)


@pytest.mark.slow
def test_a_fresh_dpo_run_recomputes_a_reference_of_data_prepared_again_saying_why(tmp_path, capsys):
    """The data folder prepared again between the two starts, differing in one row that the identity's sample
    of rows does not read: the stored values are of the old rows."""
    pairs = write_preferences(tmp_path / "pairs")
    run = tmp_path / "run"
    cfg = pref_config(pairs, run, total_steps=1)
    train.train(cfg, progress=False)
    shutil.rmtree(run / "checkpoints")  # killed before its first checkpoint
    shard = pairs / "train" / "00000.bin"
    tokens = np.memmap(shard, np.uint16, "r+").reshape(-1, SEQ + 1)
    tokens[1, :4] = tokens[3, :4]  # pair 0's rejected row gets pair 1's prompt: same lengths, same index.json
    tokens.flush()
    capsys.readouterr()
    train.train(cfg, progress=False)
    err = capsys.readouterr().err
    assert f"{pairs} split 'train' as it was before it changed; computing them again" in err
    assert first_step(run)["rewards/rejected"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.slow
def test_a_resume_that_must_rebuild_its_reference_refuses_changed_starting_weights(preferences, tmp_path, capsys):
    """The run's checkpoints record its starting weights' fingerprint: its reference lost, a resume rebuilds it
    from init_from only while that is still the same model."""
    sft = tmp_path / "sft"
    save_model(sft, seed=1)
    run = tmp_path / "run"
    cfg = pref_config(preferences, run, init_from=str(sft), total_steps=1, ckpt_every=1)
    train.train(cfg, progress=False)
    (run / "reference_logps.npz").unlink()
    save_model(sft, seed=2)
    config = tmp_path / "run.json"
    config.write_text(json.dumps(cfg.replace(total_steps=2).to_dict()))
    err = run_cli_error(capsys, str(config), "--no-progress")
    assert f"init_from {sft}: not the starting model the run's checkpoints were trained from" in err
    assert sorted(p.name for p in (run / "checkpoints").glob("[0-9]*")) == ["1"]


@pytest.mark.slow
def test_the_weights_fingerprint_is_the_same_on_any_mesh_and_tells_values_apart():
    from jax.sharding import NamedSharding, PartitionSpec

    from meshlm.sharding import make_mesh

    params = model.init(PREF_CFG, jax.random.key(0))
    one = run_start.weights_fingerprint(params, make_mesh(None))
    mesh = make_mesh("model=8")

    def split(x: jax.Array) -> jax.Array:  # each leaf split over 8 devices along its first axis that divides
        axes = [None] * x.ndim
        axes[next((i for i, n in enumerate(x.shape) if n % 8 == 0), 0)] = "model" if x.ndim else None
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*axes)))

    assert run_start.weights_fingerprint(jax.tree.map(split, params), mesh) == one
    nudged = jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1e-3) if x.size == 64 else x, params)
    assert run_start.weights_fingerprint(nudged, make_mesh(None)) != one


@pytest.fixture(scope="module")
def uninterrupted_dpo(preferences, tmp_path_factory) -> train.TrainResult:
    """Two DPO steps straight through: the oracle of both cases below, which only read its losses."""
    return train.train(pref_config(preferences, tmp_path_factory.mktemp("full"), total_steps=2), progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
def test_a_corrupt_reference_file_is_computed_again_saying_so_and_the_run_goes_on_exactly(
    resumed, preferences, uninterrupted_dpo, tmp_path, capsys
):
    full = uninterrupted_dpo
    run = tmp_path / "run"
    cfg = pref_config(preferences, run, total_steps=1, ckpt_every=1)
    train.train(cfg, progress=False)
    if not resumed:
        shutil.rmtree(run / "checkpoints")
    (run / "reference_logps.npz").write_bytes((run / "reference_logps.npz").read_bytes()[:200])  # cut short
    capsys.readouterr()
    again = train.train(cfg.replace(total_steps=2), progress=False)
    err = capsys.readouterr().err
    assert f"{run / 'reference_logps.npz'}: unreadable (" in err and "computing the reference log-probs again" in err
    assert "Traceback" not in err
    assert again.losses == {s: v for s, v in full.losses.items() if s in again.losses}


# --- issue 42: a refused run prints its one line, waits for orbax, and leaves no folder it made ---


def test_a_refused_run_leaves_no_folder_it_made_and_keeps_those_that_were_there(tmp_path, capsys):
    rows = np.random.default_rng(1).integers(0, 250, (16, SEQ + 1))
    rows[3, 3] = CFG8.vocab_size + 44  # refused once the model is known, after the run folder was made
    folder = write_dataset(tmp_path / "data", rows)
    new = tmp_path / "new" / "run"
    config = tmp_path / "run.json"
    config.write_text(json.dumps(tiny_config(folder, new, log_dir=str(tmp_path / "logs")).to_dict()))
    assert "beyond the model's vocab_size 256" in run_cli_error(capsys, str(config), "--no-progress")
    assert not (tmp_path / "new").exists() and not (tmp_path / "logs").exists()

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    config.write_text(json.dumps(tiny_config(folder, mine).to_dict()))
    assert "beyond the model's vocab_size 256" in run_cli_error(capsys, str(config), "--no-progress")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]  # no empty checkpoints/ left beside it
    assert (mine / "notes.txt").read_text() == "keep me"


SLOW_ORBAX_CLEANUP = """
import asyncio, sys
from orbax.checkpoint._src.path import temporary_paths
from meshlm import cli

cleanup = temporary_paths.cleanup_temporary_paths


async def slow_cleanup(*args, **kwargs):  # a slow filesystem (a bucket): the listing takes a moment
    await asyncio.sleep(0.5)
    return await cleanup(*args, **kwargs)


temporary_paths.cleanup_temporary_paths = slow_cleanup
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_refused_run_prints_one_line_even_while_orbax_is_cleaning_up(tmp_path):
    """Orbax lists a run's folder for a crashed save's leftovers on a thread of its own; a run refused before
    that listing ended exited under it, and the thread's traceback followed the one-line error."""
    rows = np.random.default_rng(1).integers(0, 250, (16, SEQ + 1))
    rows[3, 3] = CFG8.vocab_size + 44
    config = tmp_path / "run.json"
    config.write_text(json.dumps(tiny_config(write_dataset(tmp_path / "data", rows), tmp_path / "run").to_dict()))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", SLOW_ORBAX_CLEANUP, "train", str(config), "--no-progress"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.startswith("meshlm") or "Traceback" in line]
    assert lines == [f"meshlm train: error: {tmp_path / 'data'}: split 'train' holds token id 300, beyond the "
                     "model's vocab_size 256; the data was tokenized for another vocabulary"], done.stderr  # fmt: skip
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


@pytest.mark.slow  # lm-eval indexes its ~15,000 task files to know that a name is none of them
def test_unknown_lm_eval_tasks_are_refused_in_one_line_before_any_model_is_loaded(
    tmp_path, capsys, monkeypatch, dataset
):
    from tests.helpers.harness import TASK_DIR

    def no_load(*_):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "_load", no_load)
    tasks = ["--tasks", "meshlm_test_lambada,no_such_task", "--include-path", str(TASK_DIR)]
    assert cli.main(["eval", str(tmp_path / "model"), *tasks]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm eval: error: unknown lm-eval task(s) ['no_such_task']") and "\n" not in err

    cfg = tiny_config(
        dataset, tmp_path / "run", eval_tasks=["no_such_task"], eval_every=2, eval_include_path=str(TASK_DIR)
    )
    config = tmp_path / "run.json"
    config.write_text(json.dumps(cfg.to_dict()))
    assert "unknown lm-eval task(s) ['no_such_task']" in run_cli_error(capsys, str(config), "--no-progress")
    assert not (tmp_path / "run").exists()  # refused before the run began, not at its first evaluation
