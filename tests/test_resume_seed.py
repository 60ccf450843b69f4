"""`meshlm train --init-from STEP_DIR --resume-optimizer`: a seed run continued where it stopped.

The oracles are the fixture's own weights and moments (imported through Hugging Face, not the seed
reader) and one AdamW step written out in numpy.
"""

import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import meshlm
from meshlm import cli, data, model, optim
from meshlm.loader import TrainLoader
from tests import oracle
from tests.helpers.seed_adam import ANNEAL, END_LR, EPS, LR, WD, adamw_step, lr_at, saved_opt_state
from tests.helpers.training import SEQ, run_cli_error, tiny_config, write_dataset
from tests.mtj_fixture import SeedCheckpoint, write_seed_checkpoint

CONFIG = dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, vocab_size=128, n_inner=64, n_positions=64)


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory) -> SeedCheckpoint:
    source = oracle.random_gptj(seed=3, **CONFIG)
    return write_seed_checkpoint(tmp_path_factory.mktemp("seed"), source, shards=2, dtype="float32", full=True)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    rows = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (16, SEQ + 1))
    return write_dataset(tmp_path_factory.mktemp("data"), rows)  # end-of-text id 0, inside the vocabulary


def hf_params(m, folder: Path) -> dict:
    """A torch GPT-J's tensors in meshlm's layout, through the Hugging Face import."""
    m.save_pretrained(folder)
    return jax.tree.map(np.asarray, meshlm.load(folder).params)


@pytest.mark.slow
def test_resumed_run_continues_the_seeds_adam_state_and_step(seed_run, dataset, tmp_path):
    cfg = tiny_config(dataset, tmp_path / "run", total_steps=seed_run.step + 1, mesh="fsdp=2,model=2")
    cfg = cfg.replace(lr=LR, end_lr=END_LR, anneal_steps=ANNEAL, weight_decay=WD, eps=EPS)
    config = tmp_path / "run.json"
    config.write_text(json.dumps(cfg.to_dict()))
    resume = ["--init-from", str(seed_run.step_dir), "--seed-config", str(seed_run.seed_config), "--resume-optimizer"]
    assert cli.main(["train", str(config), *resume, "--no-progress"]) == 0

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [seed_run.step + 1]
    assert records[0]["lr"] == pytest.approx(lr_at(seed_run.adam_count), rel=1e-6)  # the seed's count, not its step
    assert abs(lr_at(seed_run.step) - lr_at(seed_run.adam_count)) > 1e-5

    params = hf_params(seed_run.model, tmp_path / "hf_params")
    mu, nu = hf_params(seed_run.mu, tmp_path / "hf_mu"), hf_params(seed_run.nu, tmp_path / "hf_nu")
    tokens = next(TrainLoader(data.TokenDataset(dataset), cfg.batch_size, seed=cfg.seed)).tokens[0]
    model_cfg = meshlm.load(seed_run.step_dir, seed_config=seed_run.seed_config).config
    grads = jax.tree.map(np.asarray, jax.grad(lambda p: model.loss(p, tokens, model_cfg)[0])(params))
    mask = optim.decay_mask(model_cfg)
    want, want_mu, want_nu = adamw_step(params, grads, mu, nu, seed_run.adam_count, mask)
    fresh, _, _ = adamw_step(params, grads, *(jax.tree.map(np.zeros_like, params),) * 2, 0, mask)

    got = meshlm.load(tmp_path / "run").params
    opt_state = saved_opt_state(tmp_path / "run", seed_run.step + 1, cfg)
    adam = optax.tree_utils.tree_get(opt_state, "ScaleByAdamState")
    for name, tree, expected in (("params", got, want), ("mu", adam.mu, want_mu), ("nu", adam.nu, want_nu)):
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-6, err_msg=name)
    assert int(adam.count) == seed_run.adam_count + 1 == int(optim.schedule_count(opt_state))
    far = max(np.abs(np.asarray(a) - b).max() for a, b in zip(*map(jax.tree.leaves, (got, fresh)), strict=True))
    assert far > 1e-4  # a fresh optimizer's step lands elsewhere

    # Restarted, the run continues from its own checkpoint, not from the seed's again.
    assert cli.main(["train", str(config), *resume, "--set", f"total_steps={seed_run.step + 2}", "--no-progress"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [seed_run.step + 1, seed_run.step + 2]
    restarted = saved_opt_state(tmp_path / "run", seed_run.step + 2, cfg)
    assert int(optax.tree_utils.tree_get(restarted, "ScaleByAdamState").count) == seed_run.adam_count + 2


@pytest.mark.slow
def test_a_bf16_run_resumes_the_seeds_float32_moments(seed_run, dataset, tmp_path):
    """bf16 weights continue the seed's moments in float32 (adam_dtype), as they were stored, not in the weights'
    dtype: the compiled step holds float32 moments, and bf16 ones failed its first call."""
    cfg = tiny_config(dataset, tmp_path / "run", total_steps=seed_run.step + 1).replace(param_dtype="bfloat16")
    config = tmp_path / "run.json"
    config.write_text(json.dumps(cfg.to_dict()))
    resume = ["--init-from", str(seed_run.step_dir), "--seed-config", str(seed_run.seed_config), "--resume-optimizer"]
    assert cli.main(["train", str(config), *resume, "--no-progress"]) == 0
    adam = optax.tree_utils.tree_get(saved_opt_state(tmp_path / "run", seed_run.step + 1, cfg), "ScaleByAdamState")
    assert {np.asarray(x).dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype("float32")}
    assert int(adam.count) == seed_run.adam_count + 1


def test_resume_optimizer_errors_are_one_line(seed_run, dataset, hf_tiny, tmp_path, capsys):
    base = ["--set", f"data={dataset}", "--set", f"out_dir={tmp_path / 'run'}", "--set", "batch_size=8"]
    err = run_cli_error(capsys, *base, "--resume-optimizer")
    assert "resume_optimizer needs init_from (the seed checkpoint to start from)" in err
    err = run_cli_error(capsys, *base, "--init-from", str(hf_tiny.path), "--resume-optimizer")
    assert "is not a seed checkpoint; only a full seed (mesh-transformer-jax) checkpoint carries Adam's moments" in err
    slim = write_seed_checkpoint(tmp_path / "slim", seed_run.model, shards=2, full=False)
    seed_args = ["--seed-config", str(slim.seed_config), "--resume-optimizer"]
    err = run_cli_error(capsys, *base, "--init-from", str(slim.step_dir), *seed_args)
    assert "a slim checkpoint (parameters only); Adam's moments need the full checkpoint" in err
    seed_args[1] = str(seed_run.seed_config)
    err = run_cli_error(capsys, *base, "--init-from", str(seed_run.step_dir), *seed_args, "--set", "total_steps=1234")
    assert "is at step 1234, total_steps is 1234; total_steps counts from the seed run's start" in err
