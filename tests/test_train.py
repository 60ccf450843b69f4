"""Training: the recipe's exact values, accumulation, meshes, resume after kills, checkpoints, bad input."""

import copy
import json
import shutil
import signal
import struct
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import meshlm
from meshlm import cli, data, fused_ce, metrics, model, optim, train
from meshlm.config import ConfigError, TrainConfig
from meshlm.formats import native
from meshlm.loader import LoaderState, TrainLoader
from meshlm.run_start import load_train_config
from tests import oracle
from tests.helpers.training import (
    CFG8,
    REPO,
    SEQ,
    metrics_losses,
    run_cli_error,
    run_steps,
    smooth,
    start_run,
    tiny_config,
    wait_for_steps,
    write_dataset,
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    return write_dataset(
        tmp_path_factory.mktemp("train_data"), rng.integers(0, 250, (64, SEQ + 1)), rng.integers(0, 250, (8, SEQ + 1))
    )


# ---------------------------------------------------------------------------------------------------
# The recipe's exact values


def test_schedule_warms_up_linearly_then_anneals_by_half_cosine_then_stays_flat():
    cfg = TrainConfig(lr=1.0, end_lr=0.1, warmup_steps=10, anneal_steps=100)
    sched = optim.lr_schedule(cfg)
    expected = {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.1 + 0.9 * (1 + np.cos(np.pi / 4)) / 2, 60: 0.55, 110: 0.1, 5000: 0.1}
    for step, want in expected.items():
        assert float(sched(step)) == pytest.approx(want, abs=1e-6), step


def test_weight_decay_applies_to_matrices_only():
    mask = optim.decay_mask(CFG8)
    paths = jax.tree_util.tree_leaves_with_path(mask)
    decayed = {jax.tree_util.keystr(k, simple=True, separator=".") for k, v in paths if v}
    assert decayed == {
        "embed.w", "layers.attn.q", "layers.attn.k", "layers.attn.v", "layers.attn.out",
        "layers.mlp.fc_in.w", "layers.mlp.fc_out.w", "head.w",
    }  # fmt: skip


@pytest.mark.slow
def test_one_optimizer_step_is_clipped_adamw_with_masked_decay():
    """A hand-written AdamW in numpy (b1 .9, b2 .999, eps 1e-8, clip 1.0, wd on matrices) is the oracle."""
    cfg = TrainConfig(lr=0.01, warmup_steps=0, anneal_steps=10, weight_decay=0.3)
    params = model.init(CFG8, jax.random.key(0))
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params)  # global norm >> 1: clipping acts
    opt = optim.make_optimizer(cfg, CFG8)
    updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
    new = jax.tree.map(lambda p, u: p + u, params, updates)

    norm = np.sqrt(sum(np.sum(np.square(np.asarray(g))) for g in jax.tree.leaves(grads)))
    for p, g, n, decay in zip(*(jax.tree.leaves(t) for t in (params, grads, new, optim.decay_mask(CFG8))), strict=True):
        p, g = np.asarray(p, np.float64), np.asarray(g, np.float64) / norm
        m_hat = (1 - 0.9) * g / (1 - 0.9)
        v_hat = (1 - 0.999) * g**2 / (1 - 0.999)
        want = p - 0.01 * (m_hat / (np.sqrt(v_hat) + 1e-8) + (0.3 * p if decay else 0))
        np.testing.assert_allclose(np.asarray(n), want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_bf16_adam_moments_are_stored_in_bf16_and_update_like_fp32_ones():
    """`adam_dtype: bfloat16` keeps both moments in bf16 between steps and computes the update in fp32."""
    params = model.init(CFG8, jax.random.key(0))
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params)
    steps = {}
    for dtype in ("float32", "bfloat16"):
        opt = optim.make_optimizer(TrainConfig(lr=0.01, warmup_steps=0, adam_dtype=dtype), CFG8)
        updates, state = jax.jit(opt.update)(grads, opt.init(params), params)
        moments = [x for x in jax.tree.leaves(state) if x.ndim > 0]
        assert {x.dtype for x in moments} == {jnp.dtype(dtype)}
        steps[dtype] = updates
    for want, got in zip(jax.tree.leaves(steps["float32"]), jax.tree.leaves(steps["bfloat16"]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-6)  # bf16's 8-bit mantissa
    with pytest.raises(ConfigError, match="adam_dtype must be float32 or bfloat16"):
        TrainConfig(adam_dtype="float16")


def test_adam_moments_take_adam_dtype_not_the_weights_dtype():
    """bf16 weights with `adam_dtype: float32` keep fp32 moments (optax alone stores a moment in its weight's
    dtype: bf16 moments, which a run asking for fp32 ones got silently, with half the state's bytes)."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), model.init(CFG8, jax.random.key(0)))
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params)
    for dtype in ("float32", "bfloat16"):
        cfg = TrainConfig(lr=0.01, warmup_steps=0, param_dtype="bfloat16", adam_dtype=dtype)
        opt = optim.make_optimizer(cfg, CFG8)
        state = opt.init(params)
        _, state = jax.jit(opt.update)(grads, state, params)
        assert {x.dtype for x in jax.tree.leaves(state) if x.ndim > 0} == {jnp.dtype(dtype)}


def test_noise_scale_recovers_the_true_gradient_and_noise_from_expected_norms():
    """With per-example gradients of mean G and total variance S, E|g_B|^2 = |G|^2 + S/B for a batch of B."""
    g2, s = 3.0, 40.0
    noise = metrics.NoiseScale(b_small=2, b_big=8, alpha=0.5)
    out = noise.update(micro_grad_sq=g2 + s / 2, grad_norm=np.sqrt(g2 + s / 8))
    assert out["noise/G2"] == pytest.approx(g2) and out["noise/S"] == pytest.approx(s)
    assert out["noise/B_simple"] == pytest.approx(s / g2)
    assert metrics.NoiseScale(b_small=8, b_big=8, alpha=0.5).update(1.0, 1.0) == {}
    # a step without any gradient (GRPO rollouts that all earn one reward) logs no scale and does not stop the run
    assert np.isnan(metrics.NoiseScale(b_small=2, b_big=8, alpha=0.5).update(0.0, 0.0)["noise/B_simple"])


# ---------------------------------------------------------------------------------------------------
# The step: accumulation and meshes


@pytest.fixture(scope="module")
def init_params():
    return jax.tree.map(np.asarray, jax.jit(lambda k: model.init(CFG8, k))(jax.random.key(1)))


@pytest.fixture(scope="module")
def single_device_run(dataset, tmp_path_factory, init_params):
    return run_steps(smooth(tiny_config(dataset, tmp_path_factory.mktemp("ref"))), None, 3, dataset, init_params)


@pytest.mark.slow
def test_k_micro_batches_equal_one_batch_k_times_larger(dataset, single_device_run, init_params, tmp_path):
    losses_1, params_1, _ = single_device_run
    cfg = smooth(tiny_config(dataset, tmp_path, micro_batches=4))
    losses_4, params_4, _ = run_steps(cfg, None, 3, dataset, init_params)
    np.testing.assert_allclose(losses_4, losses_1, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(params_4), jax.tree.leaves(params_1), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["data=2,fsdp=2,model=2", "fsdp=8", "model=8"])
def test_training_on_a_mesh_tracks_the_single_device_run(mesh_spec, dataset, single_device_run, init_params, tmp_path):
    ref_losses, ref_params, _ = single_device_run
    losses, params, state = run_steps(smooth(tiny_config(dataset, tmp_path)), mesh_spec, 3, dataset, init_params)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * np.abs(b).max())
    # Adam's moments live where their parameters live (ZeRO-3 under fsdp).
    mu = state.opt_state[1][0].mu
    for m, p in zip(jax.tree.leaves(mu), jax.tree.leaves(state.params), strict=True):
        assert m.sharding.spec == p.sharding.spec
    if mesh_spec == "fsdp=8":
        q_mu = mu["layers"]["attn"]["q"]
        assert {s.data.shape for s in q_mu.addressable_shards} == {(2, 8, 8, 8)}


# ---------------------------------------------------------------------------------------------------
# The loop: memorising, validation, checkpoints on other meshes, fine-tuning


@pytest.fixture(scope="module")
def memorised(tmp_path_factory):
    """Eight fixed sequences trained on until remembered; validation on the same rows."""
    folder = tmp_path_factory.mktemp("memorise")
    rows = np.random.default_rng(5).integers(0, 250, (8, SEQ + 1))
    write_dataset(folder / "data", rows, rows)
    cfg = tiny_config(
        folder / "data", folder / "run", total_steps=120, warmup_steps=10, anneal_steps=110, weight_decay=0.0,
        val_every=60, ckpt_every=60,
    )  # fmt: skip
    return train.train(cfg, progress=False)


@pytest.mark.slow
def test_a_training_run_converts_to_hf_with_its_latest_weights(memorised, tmp_path):
    meshlm.convert(memorised.out_dir, tmp_path / "hf", to="hf")
    tokens = np.arange(2 * SEQ).reshape(2, SEQ)
    want = meshlm.load(memorised.out_dir).logits(tokens)
    np.testing.assert_allclose(oracle.open_hf(tmp_path / "hf").logits(tokens), want, atol=1e-4)


@pytest.mark.slow
def test_loss_falls_to_near_zero_when_memorising(memorised):
    assert memorised.losses[1] > 5.0  # ln(256) = 5.5 at initialisation
    assert memorised.losses[120] < 0.05
    val = {step: losses["val/val"] for step, losses in memorised.val_losses.items()}
    assert val[120] < 0.05 and val[120] < val[60]  # validation (the same rows) falls with the training loss
    records = [json.loads(line) for line in (memorised.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(records[0])
    (events,) = (memorised.out_dir / "tb").glob("events.out.tfevents.*")
    tb_losses = {e.step: v.simple_value for e in tensorboard_events(events) for v in e.summary.value if v.tag == "loss"}
    assert tb_losses == {r["step"]: np.float32(r["loss"]) for r in records if "loss" in r}


@pytest.mark.slow
def test_checkpoint_saved_on_one_mesh_gives_the_same_logits_on_another(memorised, tmp_path):
    tokens = np.random.default_rng(1).integers(0, 250, (2, SEQ))
    want = memorised.lm.logits(tokens)
    restored = meshlm.load(memorised.out_dir, mesh="fsdp=4,model=2")
    assert tuple(restored.params["head"]["w"].sharding.spec) == ("fsdp", "model")
    np.testing.assert_allclose(restored.logits(tokens), want, rtol=0, atol=1e-5 * np.abs(want).max())
    # the slim export: parameters only, in bfloat16, loads on its own
    restored.save(tmp_path / "slim", dtype="bfloat16")
    slim = meshlm.load(tmp_path / "slim", dtype="bfloat16")
    assert not (tmp_path / "slim" / "opt_state").exists()
    np.testing.assert_array_equal(
        np.asarray(slim.params["layers"]["attn"]["q"]),
        np.asarray(memorised.lm.params["layers"]["attn"]["q"].astype(jnp.bfloat16)),
    )


@pytest.mark.slow
def test_training_resumes_on_another_mesh_from_the_saved_batch_position(memorised, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(memorised.out_dir, run)
    desc = native.read_description(native.resolve(run))
    saved = TrainConfig.from_dict(desc["train_config"])
    resumed = train.train(saved.replace(out_dir=str(run), total_steps=121, mesh="fsdp=4,model=2"), progress=False)
    assert list(resumed.losses) == [121]
    loader = TrainLoader(data.TokenDataset(saved.data), 8, seed=0, state=LoaderState.from_dict(desc["loader"]))
    next_batch = next(loader).tokens[0]
    want = jax.jit(lambda p, t: model.loss(p, t, CFG8)[0])(memorised.lm.params, next_batch)
    assert resumed.losses[121] == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    fc_in = resumed.lm.params["layers"]["mlp"]["fc_in"]["w"]
    assert tuple(fc_in.sharding.spec) == (None, "fsdp", "model")


@pytest.mark.slow
def test_loss_in_chunks_equals_torch_cross_entropy_and_its_gradients(hf_tiny, monkeypatch):
    monkeypatch.setattr(fused_ce, "CHUNK_TOKENS", 8)  # 2 rows x 16 positions: the LM head runs on 4 chunks
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 500, (2, SEQ + 1))
    mask = rng.random((2, SEQ)) < 0.6  # which targets count: checks each position keeps its own target
    lm = meshlm.load(hf_tiny.path)
    loss_fn = lambda p: model.loss(p, tokens, lm.config, loss_mask=jnp.asarray(mask))[0]
    loss, grads = jax.value_and_grad(loss_fn)(lm.params)

    torch_model = copy.deepcopy(hf_tiny.torch_model)  # the fixture is shared: its .grad stays untouched
    logits = torch_model(torch.as_tensor(tokens[:, :-1])).logits
    targets = torch.as_tensor(np.where(mask, tokens[:, 1:], -100)).reshape(-1)  # -100: ignored
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
    want.backward()
    assert float(loss) == pytest.approx(want.item(), rel=1e-6)
    np.testing.assert_allclose(grads["head"]["w"], torch_model.lm_head.weight.grad.numpy().T, atol=1e-6)
    np.testing.assert_allclose(grads["embed"]["w"], torch_model.transformer.wte.weight.grad.numpy(), atol=1e-6)


@pytest.mark.slow
def test_fine_tuning_starts_from_the_hf_model_with_its_loss(hf_tiny, tmp_path):
    rows = np.random.default_rng(2).integers(0, 500, (16, SEQ + 1))
    folder = write_dataset(tmp_path / "data", rows)
    cfg = tiny_config(folder, tmp_path / "run", total_steps=2, init_from=str(hf_tiny.path))
    result = train.train(cfg, progress=False)
    first = next(TrainLoader(data.TokenDataset(folder), 8, seed=0)).tokens[0]
    logits = torch.as_tensor(hf_tiny.logits(first[:, :-1]))
    targets = torch.as_tensor(first[:, 1:], dtype=torch.long).reshape(-1)
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
    assert result.losses[1] == pytest.approx(float(want), rel=1e-5)
    assert result.losses[2] < result.losses[1]
    assert meshlm.load(tmp_path / "run").config == meshlm.load(hf_tiny.path).config


def test_built_in_demo_corpus_is_tokenized_python_documentation(gpt2_bpe_file, tmp_path):
    from meshlm.demo_corpus import prepare_demo_corpus
    from meshlm.tokenizer import load_tokenizer

    folder = prepare_demo_corpus(tmp_path / "demo", seq_len=64)
    train_rows, val_rows = data.TokenDataset(folder, "train"), data.TokenDataset(folder, "val")
    assert len(train_rows) > 2000 and len(val_rows) > 100 and train_rows.eos_id == 50256
    text = load_tokenizer(gpt2_bpe_file).decode(train_rows[list(range(5))].tokens.reshape(-1).tolist())
    assert 'The "assert" statement' in text


@pytest.mark.parametrize("name", ["demo:chats", "demo:pairs"])
def test_built_in_chats_and_pairs_carry_loss_on_the_answers_only(name, gpt2_bpe_file, tmp_path):
    """The SFT and DPO demos' data, prepared through `meshlm prepare` with the demo chat template: the loss
    covers each assistant answer and its end-of-text; a pair is the full correct sentence, then another answer."""
    from meshlm.demo_corpus import prepare_demo_records
    from meshlm.tokenizer import load_tokenizer

    tok = load_tokenizer(gpt2_bpe_file)
    folder = prepare_demo_records(tmp_path / "data", name, 128, tok)
    train_rows, val_rows = data.TokenDataset(folder, "train"), data.TokenDataset(folder, "val")
    assert train_rows.kind == ("lm" if name == "demo:chats" else "preference")
    assert len(train_rows) > 8 * len(val_rows) > 0
    rows = train_rows[list(range(4))]
    for tokens, weights in zip(rows.tokens, rows.weights, strict=True):
        text, answers = tok.decode(tokens.tolist()), tok.decode(tokens[weights > 0].tolist())
        assert "User: " in text and "User" not in answers and "Assistant" not in answers
        assert answers.count("<|endoftext|>") == text.count("Assistant: ") >= 1
    chosen, rejected = (tok.decode(r[w > 0].tolist()) for r, w in zip(rows.tokens[:2], rows.weights[:2], strict=True))
    if name == "demo:pairs":
        assert chosen != rejected and chosen.startswith(" The" if "capital" in chosen or "opposite" in chosen else " ")


def tensorboard_events(path: Path) -> list:
    """The `Event`s of a TensorBoard event file, read with tensorboardX's protobuf classes and checksum (the
    oracle: meshlm writes the file itself, without tensorboardX's import)."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    data, pos, events = path.read_bytes(), 0, []
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,), (length_crc,) = struct.unpack("<Q", header), struct.unpack("<I", data[pos + 8 : pos + 12])
        body, (body_crc,) = (
            data[pos + 12 : pos + 12 + length],
            struct.unpack("<I", data[pos + 12 + length : pos + 16 + length]),
        )
        assert (masked_crc32c(header), masked_crc32c(body)) == (length_crc, body_crc)
        events.append(Event.FromString(body))
        pos += 16 + length
    return events


def test_tensorboard_event_file_holds_each_logged_scalar(tmp_path):
    log = metrics.MetricsLog(tmp_path)
    log.write(1, {"loss": 2.5, "lr": 1e-3, "tokens_per_s": 1e39, "mfu": float("nan")})
    log.write(300, {"loss": -0.25})
    log.close()
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    first, *logged = tensorboard_events(path)
    assert first.file_version == "brain.Event:2"
    assert [e.step for e in logged] == [1, 300]
    values = [{v.tag: v.simple_value for v in e.summary.value} for e in logged]
    assert values[0]["loss"] == 2.5 and values[0]["lr"] == np.float32(1e-3) and values[1] == {"loss": -0.25}
    assert values[0]["tokens_per_s"] == np.inf and np.isnan(values[0]["mfu"])  # past float32's range: inf
    assert all(e.wall_time >= first.wall_time > 1.7e9 for e in logged)


# ---------------------------------------------------------------------------------------------------
# Interrupted runs


@pytest.mark.slow
def test_runs_stopped_by_sigterm_and_sigkill_resume_to_the_uninterrupted_losses(dataset, tmp_path):
    values = dict(
        model=CFG8.to_dict(), data=str(dataset), batch_size=8, total_steps=60, lr=1e-2, end_lr=1e-3,
        warmup_steps=5, anneal_steps=50, val_every=0, ckpt_every=3, keep_last=2, keep_every=30, log_every=1000,
        sample_tokens=0,
    )  # fmt: skip
    reference = train.train(TrainConfig.from_dict({**values, "out_dir": str(tmp_path / "ref")}), progress=False)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.json"
    config.write_text(json.dumps({**values, "out_dir": str(run_dir)}))

    proc = start_run(config)
    wait_for_steps(proc, run_dir, 10)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out  # stopped by a signal, as shells expect
    stopped_at = metrics_losses(run_dir)[-1][0]
    assert f"stopped by signal {int(signal.SIGTERM)} at step {stopped_at}" in out
    assert stopped_at < 60

    proc = start_run(config)
    wait_for_steps(proc, run_dir, len(metrics_losses(run_dir)) + 10)
    time.sleep(np.random.default_rng().uniform(0, 0.2))  # an arbitrary moment, checkpoints every 3 steps
    proc.kill()
    proc.wait()

    proc = start_run(config)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    logged = metrics_losses(run_dir)
    assert [s for s, _ in logged] == list(range(1, 61))  # each step once: those rerun after the kill replace theirs
    for step, loss in logged:  # every step, including those run twice around the kill, reproduces exactly
        assert loss == reference.losses[step], step
    kept = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [30, 57, 60]  # the last two, plus every multiple of keep_every


# ---------------------------------------------------------------------------------------------------
# Configuration files and bad input


def test_seed_json_config_is_mapped(tmp_path):
    seed = {
        "layers": 28, "d_model": 4096, "n_heads": 16, "n_vocab": 50400, "norm": "layernorm", "pe": "rotary",
        "pe_rotary_dims": 64, "seq": 2048, "cores_per_replica": 8, "per_replica_batch": 1,
        "gradient_accumulation_steps": 16, "warmup_steps": 3000, "anneal_steps": 300000, "lr": 1.2e-4,
        "end_lr": 1.2e-5, "weight_decay": 0.1, "total_steps": 350000, "tpu_size": 256, "bucket": "neo-models",
        "model_dir": "mesh_jax_pile_6B_rotary", "train_set": "pile.train.index",
        "val_set": {"pile": "pile.val.index", "owt": "openwebtext2_new_inputs.val.index"},
        "eval_harness_tasks": ["lambada"], "val_batches": 100, "val_every": 500, "ckpt_every": 500,
        "keep_every": 10000, "name": "GPT3_6B_pile_rotary", "wandb_project": "mesh-transformer-jax", "comment": "",
    }  # fmt: skip
    path = tmp_path / "6B_roto_256.json"
    path.write_text(json.dumps(seed))
    cfg = load_train_config(path, ["lr=1e-4"])
    assert cfg.model == meshlm.preset("gptj-6b")
    assert (cfg.batch_size, cfg.micro_batches, cfg.mesh) == (32 * 16, 16, "model=8")
    assert (cfg.warmup_steps, cfg.anneal_steps, cfg.end_lr, cfg.total_steps) == (3000, 300000, 1.2e-5, 350000)
    assert (cfg.lr, cfg.keep_every, cfg.val_batches, cfg.out_dir) == (1e-4, 10000, 100, "mesh_jax_pile_6B_rotary")
    assert cfg.val_data == {"pile": "pile.val.index", "owt": "openwebtext2_new_inputs.val.index"}


def test_yaml_config_and_overrides_feed_the_same_dataclass(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {preset: test-tiny, n_layer: 3}\nlr: 3e-4\nbatch_size: 16\nmicro_batches: 4\n")
    cfg = load_train_config(path, ["model.d_ff=128", "total_steps=7"])
    assert cfg.model == meshlm.preset("test-tiny").replace(n_layer=3, d_ff=128)
    assert (cfg.lr, cfg.micro_batch_size, cfg.total_steps) == (3e-4, 4, 7)


def test_shipped_configs_load_and_the_demo_config_is_the_built_in_default():
    assert load_train_config(REPO / "configs" / "demo-tiny.yaml") == TrainConfig()
    sft, dpo = (load_train_config(REPO / "configs" / f"demo-{name}.yaml") for name in ("sft", "dpo"))
    assert (sft.data, dpo.data, dpo.init_from, dpo.objective) == ("demo:chats", "demo:pairs", sft.out_dir, "dpo")
    ft = load_train_config(REPO / "configs" / "gptj-6b-finetune.yaml")
    assert (ft.compute_dtype, ft.remat, ft.mesh, ft.init_from) == ("bfloat16", "full", "fsdp=-1", "gpt-j-6b")
    v5e = load_train_config(REPO / "configs" / "gptj-1b-v5e.yaml")
    assert (v5e.model, v5e.param_dtype, v5e.adam_dtype) == (meshlm.preset("gptj-1b"), "bfloat16", "float32")


def test_training_state_per_device_follows_the_sharding_rules():
    n = model.count_params(meshlm.preset("gptj-6b"))
    assert metrics.state_bytes_per_device(meshlm.preset("gptj-6b"), {}) == 16 * n
    # fsdp splits every weight matrix along its embed axis; only the small biases and norms stay whole
    per_device = metrics.state_bytes_per_device(meshlm.preset("gptj-6b"), {"fsdp": 8})
    assert 16 * n / 8 < per_device < 16 * n / 8 * 1.01


def test_typed_flags_are_not_reparsed_as_yaml(monkeypatch):
    """--out-dir 2024 names a folder "2024", not the integer 2024; flags win over --set."""
    seen = []

    def record(cfg: TrainConfig, progress: bool, evaluate_tasks: object = None) -> train.TrainResult:
        seen.append(cfg)
        return train.TrainResult(Path(cfg.out_dir), 0)

    monkeypatch.setattr(train, "train", record)
    argv = ["train", "--set", "out_dir=elsewhere", "--out-dir", "2024", "--mesh", "data=1", "--init-from", "yes"]
    assert cli.main(argv) == 0
    assert (seen[0].out_dir, seen[0].mesh, seen[0].init_from) == ("2024", "data=1", "yes")


def test_bad_inputs_each_give_one_clear_line(tmp_path, capsys, dataset):
    base = ["--set", "model=test-tiny", "--set", f"out_dir={tmp_path / 'run'}"]
    assert "does not exist; create it with `meshlm prepare`" in run_cli_error(
        capsys, *base, "--set", f"data={tmp_path / 'missing'}"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    data.write_index(empty, SEQ, {"train": data.write_split(empty, "train", [np.zeros((0, SEQ + 1), int)], SEQ)})
    assert "split 'train' holds no sequences" in run_cli_error(capsys, *base, "--set", f"data={empty}")
    wrong = tmp_path / "wrong_dtype"
    write_dataset(wrong, np.ones((4, SEQ + 1), int))
    np.ones((4, SEQ + 1), np.uint32).tofile(wrong / "train" / "00000.bin")  # uint32 where the index says uint16
    assert "holds 272 bytes, index.json implies 136" in run_cli_error(capsys, *base, "--set", f"data={wrong}")
    gpt2 = tmp_path / "gpt2_ids"
    gpt2.mkdir()
    data.write_index(gpt2, SEQ, {"train": data.write_split(gpt2, "train", [np.ones((8, SEQ + 1), int)], SEQ)})
    err = run_cli_error(capsys, *base, "--set", f"data={gpt2}", "--set", "batch_size=8")
    assert "end-of-text id is 50256, beyond the model's vocab_size 512" in err
    assert "unknown key(s) ['bacth_size']" in run_cli_error(capsys, *base, "--set", "bacth_size=8")
    err = run_cli_error(capsys, *base, "--set", f"data={dataset}", "--set", "batch_size=12", "--mesh", "data=8")
    assert "12 sequences per micro-batch, not divisible by the mesh's batch axes data x fsdp = 8" in err
    assert "config file nope.yaml not found" in run_cli_error(capsys, "nope.yaml")
