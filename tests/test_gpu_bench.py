"""The GPU benchmark's code paths at a tiny shape on the CPU, so the script cannot rot (no speed asserted)."""

import json
import math
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals

from benchmarks import gpu
from meshlm import model, optim
from meshlm.config import preset
from tests.helpers import without_device_count

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("test-tiny",)
SECTIONS = ("matmul", "copy", *(f"{kind}/{m}" for m in MODELS for kind in ("train", "generate")))


def run_script(out: Path, *args: str) -> dict:
    # One CPU device, and the suite's cheapest compile (conftest.py): this checks code paths, not speed.
    env = {
        **os.environ,
        "OUT": str(out),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": without_device_count(os.environ["XLA_FLAGS"]),
    }
    result = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--tiny", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "gpu.json").read_text())


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu")


@pytest.fixture(scope="module")
def report(out) -> dict:
    return run_script(out, "--optimizer-state", "bfloat16", "--attention", "xla")


@pytest.mark.slow
def test_every_section_runs_and_reports_numbers(report):
    sections = report["sections"]
    assert tuple(sections) == SECTIONS
    assert {name: r["status"] for name, r in sections.items()} == dict.fromkeys(SECTIONS, "ok")
    assert positive(sections["matmul"]["tflops"]) and positive(sections["copy"]["gb_per_s"])
    for name in MODELS:
        tr = sections[f"train/{name}"]
        for key in ("tokens_per_s", "step_s", "compile_s", "mfu", "mfu_vs_matmul", "model_tflops", "state_gb"):
            assert positive(tr[key]), (name, key, tr[key])
        assert tr["tokens_per_step"] == tr["batch"] * tr["seq_len"]
        assert tr["optimizer_state"] == "bfloat16"
        assert tr["attention"] == "xla"
        # A random-init model starts near ln(vocab), and the repeated batch is learnt: the step trains.
        assert abs(tr["first_loss"] - math.log(preset(name).n_vocab_used)) < 0.3
        assert tr["loss"] < tr["first_loss"]
        gen = sections[f"generate/{name}"]
        for key in ("prefill_tokens_per_s", "prefill_mfu_vs_matmul", "weight_gb", "batch1_roofline_fraction"):
            assert positive(gen[key]), (name, key, gen[key])
        assert gen["attention"] == "xla" and len(gen["decode"]) == 2
        for d in gen["decode"].values():
            assert d["status"] == "ok" and positive(d["tokens_per_s"]) and positive(d["roofline_fraction"])
            assert d["bytes_per_step_gb"] > gen["weight_gb"]  # the KV cache is read on top of the weights


@pytest.mark.slow
def test_summary_names_every_section(report, out):
    md = (out / "gpu.md").read_text()
    assert report["machine"]["jax"] in md
    for name in SECTIONS:
        assert f"**{name}**" in md


def test_spent_budget_skips_sections_but_still_reports(tmp_path):
    report = gpu.run(gpu.parse(["--tiny", "--budget-s", "0", "--out", str(tmp_path)]))
    assert tuple(report["sections"]) == SECTIONS
    assert {r["status"] for r in report["sections"].values()} == {"skipped"}
    assert json.loads((tmp_path / "gpu.json").read_text())["sections"] == report["sections"]


@pytest.mark.slow
def test_the_attention_flag_reaches_the_model_through_the_policy(tmp_path):
    """A forced cuDNN attention cannot run on a CPU: the model sections fail, so the flag got to the model."""
    report = gpu.run(gpu.parse(["--tiny", "--attention", "cudnn", "--out", str(tmp_path)]))
    for name in SECTIONS[2:]:
        assert report["sections"][name]["status"] == "error", name
        assert "cudnn" in report["sections"][name]["error"].lower(), report["sections"][name]["error"]


@pytest.mark.slow
def test_models_sections_micro_batches_and_param_dtype_reach_the_run(tmp_path):
    """Only the sections and models asked for run; the step accumulates over the micro-batches asked for,
    on weights stored in the dtype asked for."""
    argv = ["--tiny", "--sections", "train", "--models", "test-tiny", "--micro-batches", "2", "--param-dtype",
            "bfloat16", "--out", str(tmp_path)]  # fmt: skip
    report = gpu.run(gpu.parse(argv))
    assert list(report["sections"]) == ["train/test-tiny"]
    train = report["sections"]["train/test-tiny"]
    assert train["status"] == "ok", train
    assert (train["micro_batches"], train["param_dtype"], train["stored_param_dtypes"]) == (2, "bfloat16", ["bfloat16"])
    assert train["tokens_per_step"] == 2 * train["batch"] * train["seq_len"]
    with pytest.raises(SystemExit):
        gpu.parse(["--sections", "train,everything"])


@pytest.mark.slow
def test_optimizer_memory_host_keeps_the_adam_state_in_host_memory(tmp_path):
    argv = ["--tiny", "--sections", "train", "--optimizer-memory", "host", "--out", str(tmp_path)]
    train = gpu.run(gpu.parse(argv))["sections"]["train/test-tiny"]
    assert train["status"] == "ok", train
    assert (train["optimizer_memory"], train["optimizer_memory_kinds"]) == ("host", ["pinned_host"])
    assert train["optimizer_state"] == "float32"  # auto: moments off the device need no bf16
    assert "Adam state float32 in host memory" in (tmp_path / "gpu.md").read_text()


def test_optimizer_state_goes_to_bf16_only_where_memory_requires():
    h200 = 0.95 * 141e9
    assert gpu.optimizer_dtype(preset("gptj-6b"), h200) == "bfloat16"  # 6.05B x 20 bytes > 85% of 134 GB
    assert gpu.optimizer_dtype(preset("gptj-6b"), 2 * h200) == "float32"
    assert gpu.optimizer_dtype(preset("gptj-1b"), h200) == "float32"
    assert gpu.optimizer_dtype(preset("gptj-6b"), h200, "host") == "float32"


def test_bf16_stored_adam_state_stays_bf16_and_follows_fp32_adam():
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}
    grads = jax.tree.map(lambda p: jnp.cos(3 * p) + 0.5, params)
    adam = optax.adam(1e-2)
    stored = optim.stored_as(adam, jnp.bfloat16)
    state, ref_state = stored.init(params), adam.init(params)
    for _ in range(3):
        updates, state = stored.update(grads, state, params)
        ref_updates, ref_state = adam.update(grads, ref_state, params)
        floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
        assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
        for u, r in zip(jax.tree.leaves(updates), jax.tree.leaves(ref_updates), strict=True):
            assert u.dtype == jnp.float32
            np.testing.assert_allclose(u, r, rtol=2e-2, atol=1e-5)


def saved_float_shapes(remat: str, T: int) -> list[tuple[int, ...]]:
    """Shapes of the float activations the backward pass keeps under a remat policy (traced, not run)."""
    cfg = preset("test-tiny")
    tokens = jnp.zeros((2, T + 1), jnp.int32)
    policy = model.Policy(compute_dtype="bfloat16", remat=remat)
    saved = saved_residuals(lambda p: model.loss(p, tokens, cfg, policy)[0], model.abstract_params(cfg))
    return [a.shape for a, _ in saved if jnp.issubdtype(a.dtype, jnp.floating)]


def test_benchmark_remat_keeps_projections_and_recomputes_attention_scores():
    cfg, T = preset("test-tiny"), 12  # T differs from every model dimension, so T x T means scores
    quadratic = [s for s in saved_float_shapes("dots", T) if s.count(T) >= 2]
    assert quadratic  # the plain "dots" policy keeps the O(T^2) attention scores of every layer...
    kept = saved_float_shapes("dots_no_batch", T)
    assert not [s for s in kept if s.count(T) >= 2]  # ...the benchmark's policy recomputes them
    assert kept.count((cfg.n_layer, 2, T, cfg.n_head, cfg.d_head)) == 3  # and keeps q, k, v
    assert (cfg.n_layer, 2, T, cfg.d_ff) in kept  # and the MLP's up-projection
