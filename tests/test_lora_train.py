"""LoRA training: only the adapter trains over a frozen float, int8 or NF4 base; checkpoints hold the adapter
alone; a run killed mid-way resumes to the uninterrupted adapter; bad configs give one clear line."""

import json
import math
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import meshlm
from meshlm import metrics, model, quant, train, train_step
from meshlm.config import CheckpointError, ConfigError, LoraConfig, ModelConfig, TrainConfig
from meshlm.formats import native
from meshlm.lora import adapter_size
from meshlm.sharding import make_mesh
from tests.helpers.training import SEQ, metrics_losses, start_run, tiny_config, write_dataset

# d_model and d_ff 128: every projection has two NF4 blocks of 64 inputs per output, which fsdp=2 splits.
CFG = ModelConfig(
    n_layer=2, d_model=128, n_head=4, d_ff=128, rotary_dim=4, vocab_size=256, n_vocab_used=256, max_seq_len=32
)
MESH = "data=2,fsdp=2,model=2"
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["q", "v", "fc_in"]}
ADAPTER_SIZE = 2 * (3 * 128 * 4 + 3 * 4 * 128)  # layers x targets x (A + B)
STEPS = 24


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """Eight fixed sequences, which every batch of 8 is: the adapter's loss on them falls step by step."""
    rows = np.random.default_rng(7).integers(0, 250, (8, SEQ + 1))
    return write_dataset(tmp_path_factory.mktemp("lora_rows"), rows, rows)


def lora_config(dataset: Path, out_dir: Path, **changes) -> TrainConfig:
    return tiny_config(dataset, out_dir, **{"model": CFG, "mesh": MESH, "lora": LORA, "seed": 3, **changes})


def base_arrays(params: dict) -> list[np.ndarray]:
    """Every array of a (possibly quantized) base, on the host, in tree order; an adapter is left out."""
    return [np.asarray(x) for x in jax.tree.leaves({k: v for k, v in params.items() if k != "lora"})]


def assert_base_unchanged(lm: meshlm.LanguageModel, fresh: meshlm.LanguageModel) -> None:
    assert jax.tree.structure({k: v for k, v in lm.params.items() if k != "lora"}) == jax.tree.structure(fresh.params)
    for after, before in zip(base_arrays(lm.params), base_arrays(fresh.params), strict=True):
        np.testing.assert_array_equal(after, before)


@pytest.fixture(scope="module")
def lora_run(rows, tmp_path_factory) -> train.TrainResult:
    """A rank-4 adapter (dropout on) over a float32 base made from the seed: validated every 12 steps,
    saved every 4. The reference for the interrupted run too."""
    cfg = lora_config(rows, tmp_path_factory.mktemp("lora") / "run", total_steps=STEPS, val_every=12, ckpt_every=4)
    return train.train(cfg, progress=False)


@pytest.mark.slow
def test_a_lora_run_trains_the_adapter_and_leaves_the_base_bit_identical(lora_run):
    assert_base_unchanged(lora_run.lm, meshlm.from_config(CFG, MESH, "float32", seed=3))
    adapter = lora_run.lm.params["lora"]
    assert sorted(adapter) == ["fc_in", "q", "v"]
    for role, parts in adapter.items():
        assert np.abs(np.asarray(parts["b"])).max() > 0, role  # B starts at zero
        np.testing.assert_array_equal(np.asarray(parts["scale"]), 2.0)  # alpha / rank, never trained
    assert tuple(adapter["q"]["b"].sharding.spec) == (None, None, "model", None)  # [layers, rank, heads, head_dim]
    losses, val = lora_run.losses, lora_run.val_losses
    assert losses[1] > losses[2] > losses[3] and losses[STEPS] < losses[1] - 0.3
    assert val[12]["val/val"] > val[STEPS]["val/val"]  # validation runs the base with the adapter
    records = [json.loads(line) for line in (lora_run.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert np.isfinite(records[0]["mfu"]) and records[0]["mfu"] > 0


@pytest.mark.slow
def test_the_checkpoint_holds_the_adapter_and_its_optimizer_state_only(lora_run):
    step = lora_run.out_dir / "checkpoints" / str(STEPS)
    tree = json.loads((step / "params" / "_METADATA").read_text())["tree_metadata"]
    saved = {tuple(k["key"] for k in leaf["key_metadata"]) for leaf in tree.values()}
    assert saved == {(role, part) for role in ("q", "v", "fc_in") for part in ("a", "b", "scale")}
    # What each item stores, by orbax's own record of every array's shape (file sizes are not a measure
    # here: OCDBT keeps the data twice, compressed, beside metadata that outweighs a tiny adapter): the
    # adapter (A, B and the per-layer scales), and Adam's two moments of it plus its scalar counters.
    adapter = ADAPTER_SIZE + 3 * CFG.n_layer
    for item, values in (("params", adapter), ("opt_state", 2 * adapter)):
        stored = jax.tree.leaves(ocp.StandardCheckpointer().metadata(step / item).item_metadata)
        assert sum(math.prod(a.shape) for a in stored if a.shape) == values, item
        assert sum(not a.shape for a in stored) <= 4, item  # counters only, no other state
    assert 10 * adapter < model.count_params(CFG)  # and the adapter is a small fraction of the base
    desc = native.read_description(step)
    assert desc["lora"] == {**LORA, "rslora": False}
    assert desc["base"] == {"init_from": None, "seed_config": None, "dtype": "float32", "seed": 3}
    with pytest.raises(CheckpointError, match="a LoRA run's checkpoint holds an adapter, not a model"):
        native.restore_params(lora_run.out_dir, make_mesh(None))  # nor does it convert


def test_flops_of_a_lora_step_skip_the_frozen_weights_gradients():
    assert adapter_size(model.projections(CFG), LoraConfig(**LORA)) == ADAPTER_SIZE
    full, lora = metrics.flops_per_token(CFG, SEQ), metrics.flops_per_token(CFG, SEQ, LoraConfig(**LORA))
    matmul_params = model.count_params(CFG) - CFG.vocab_size * CFG.d_model  # the embedding is a gather
    assert full - lora == 2 * matmul_params - 6 * ADAPTER_SIZE
    # DPO's reference, the base with the adapter off, adds one forward pass: a third of a full step's count
    dpo = metrics.flops_per_token(CFG, SEQ, LoraConfig(**LORA), reference_pass=True)
    assert dpo - lora == pytest.approx(full / 3)
    dpo_cfg = TrainConfig(model=CFG, lora=LoraConfig(**LORA), objective="dpo")
    assert train_step.reference_in_step(dpo_cfg) and not train_step.reference_in_step(dpo_cfg.replace(lora=None))


@pytest.fixture(scope="module")
def saved_base(tmp_path_factory) -> Path:
    """A one-layer base (one layer compiles fast) saved as a meshlm checkpoint, for runs that start from one."""
    folder = tmp_path_factory.mktemp("lora_base") / "base"
    meshlm.from_config(CFG.replace(n_layer=1), seed=5).save(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_quantized_bases_train_and_stay_unchanged(kind, rows, saved_base, tmp_path):
    cfg = lora_config(rows, tmp_path / "run", base_dtype=kind, total_steps=2, init_from=str(saved_base))
    result = train.train(cfg, progress=False)
    assert np.isfinite(result.losses[1]) and result.losses[1] > result.losses[2]
    assert result.lm.quantized == kind
    weight_type = quant.Int8Weight if kind == "int8" else quant.NF4Weight
    assert isinstance(result.lm.params["layers"]["attn"]["q"], weight_type)
    assert_base_unchanged(result.lm, meshlm.load(saved_base, MESH, quantize=kind))
    desc = native.read_description(native.resolve(tmp_path / "run"))
    assert desc["base"] == {"init_from": str(saved_base.absolute()), "seed_config": None, "dtype": kind, "seed": None}
    assert TrainConfig.from_dict(desc["train_config"]).init_from == str(saved_base.absolute())
    loaded = meshlm.load(tmp_path / "run", MESH, quantize=kind)  # the run: its recorded base with its adapter
    tokens = np.random.default_rng(1).integers(0, 250, (2, SEQ))
    np.testing.assert_allclose(loaded.logits(tokens), result.lm.logits(tokens), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_lora_run_killed_mid_way_resumes_to_the_uninterrupted_adapter(lora_run, tmp_path):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.json"
    values = native.read_description(native.resolve(lora_run.out_dir))["train_config"]
    config.write_text(json.dumps({**values, "out_dir": str(run_dir)}))

    proc = start_run(config)
    deadline = time.time() + 120
    while not [p for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()]:  # a complete checkpoint
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    saved = [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert max(saved) < STEPS, saved  # killed mid-way

    proc = start_run(config)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert f"LoRA rank 4 on q, v, fc_in: {ADAPTER_SIZE:,} trainable of 263,680 params; base float32 on" in out
    logged = metrics_losses(run_dir)
    assert {s for s, _ in logged} == set(range(1, STEPS + 1))
    for step, loss in logged:  # every step, including those run twice around the kill, reproduces exactly
        assert loss == lora_run.losses[step], step
    want = lora_run.lm.params["lora"]
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), want)
    got = ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / str(STEPS) / "params", target)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------------
# Bad configs: one line each


def one_line_error(error: type[Exception], fn, *args, **kwargs) -> str:
    with pytest.raises(error) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_lora_configs_give_one_clear_line(rows, tmp_path):
    err = one_line_error(ConfigError, TrainConfig, base_dtype="int8")
    assert "base_dtype 'int8' needs a lora section" in err
    err = one_line_error(ConfigError, TrainConfig, lora={"targets": ["q", "qkv"]})
    assert "target 'qkv' is not a projection of the GPT-J family" in err
    err = one_line_error(ConfigError, train.train, lora_config(rows, tmp_path / "r1", lora={**LORA, "rank": 200}))
    assert "rank 200 exceeds projection 'q' (128 -> 128)" in err
    cfg = lora_config(rows, tmp_path / "r2", init_from=str(rows), resume_optimizer=True)
    assert "a LoRA run trains a new adapter" in one_line_error(ConfigError, train.train, cfg)


@pytest.mark.slow
def test_resuming_a_lora_run_with_other_settings_is_refused(lora_run, rows, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(lora_run.out_dir, run)
    cfg = lora_config(rows, run, total_steps=STEPS + 4)
    err = one_line_error(ConfigError, train.train, cfg.replace(lora=None))
    assert "holds a LoRA adapter (rank 4 on q, v, fc_in), but the config has no lora section" in err
    err = one_line_error(ConfigError, train.train, cfg.replace(lora={**LORA, "rank": 8}))
    assert "'rank': 8" in err and "differs from" in err and "was trained with" in err
    err = one_line_error(ConfigError, train.train, cfg.replace(init_from=str(rows)))
    assert "is not the base the adapter in" in err and "a random model of seed 3" in err
    err = one_line_error(ConfigError, train.train, cfg.replace(base_dtype="nf4"))
    assert "base_dtype nf4 differs from float32" in err
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [STEPS - 4, STEPS]  # nothing written
    # the description of a full run's checkpoint, where the config trains an adapter
    metadata = run / "checkpoints" / str(STEPS) / native.TRAIN_DESCRIPTION
    desc = json.loads(metadata.read_text())
    metadata.write_text(json.dumps({k: v for k, v in desc.items() if k not in ("lora", "base")}))
    err = one_line_error(ConfigError, train.train, cfg)
    assert "is a full training run's checkpoint, but the config has a lora section" in err


@pytest.mark.slow
def test_a_lora_run_loads_as_its_base_with_its_adapter(lora_run):
    """The run folder alone: the seed's random base rebuilt, the adapter of the last step on it."""
    loaded = meshlm.load(lora_run.out_dir, MESH)
    tokens = np.random.default_rng(2).integers(0, 250, (2, SEQ))
    np.testing.assert_allclose(loaded.logits(tokens), lora_run.lm.logits(tokens), rtol=0, atol=1e-5)
