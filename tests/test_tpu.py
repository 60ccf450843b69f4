"""The TPU tier: the chip against the CPU, on the programs users run there (docs/testing.md).

Every test needs a TPU chip and is skipped anywhere else. The chip's run and the CPU's run train the same config
on the same data, the chip's in this process and the CPU's as `meshlm train` in another, both at the highest
matmul precision so that the chip's float32 is float32 and only the order of rounding differs.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from meshlm import api, train
from meshlm.sharding import make_mesh
from tests.helpers import preferences
from tests.helpers.training import CFG8, REPO, SEQ, smooth, tiny_config, write_dataset

pytestmark = pytest.mark.tpu


def train_on(platform: str, cfg, folder: Path) -> list[dict]:
    """A training run of `cfg` on one platform; returns its logged metrics. The chip's runs in this process
    (one process at a time holds a TPU), the CPU's as `meshlm train` in its own (`JAX_PLATFORMS=cpu`)."""
    out = folder / platform
    cfg = cfg.replace(out_dir=str(out))
    if platform == "tpu":
        with jax.default_matmul_precision("highest"):
            train.train(cfg, progress=False)
    else:
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / f"{platform}.yaml"
        config.write_text(yaml.safe_dump(cfg.to_dict()))
        env = {**os.environ, "JAX_PLATFORMS": platform, "JAX_DEFAULT_MATMUL_PRECISION": "highest",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "meshlm", "train", str(config), "--no-progress"],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_runs_agree(tpu: list[dict], cpu: list[dict], names: tuple[str, ...]) -> None:
    assert [r["step"] for r in tpu] == [r["step"] for r in cpu]
    for t, c in zip(tpu, cpu, strict=True):
        # A DPO step whose pairs' rewards tie (step 1: the policy is its reference) has an accuracy of rounding.
        tied = abs(c.get("rewards/margins", 1.0)) < 1e-4
        for name in names:
            if name in c and not (tied and name == "rewards/accuracies"):
                assert t[name] == pytest.approx(c[name], rel=2e-4, abs=2e-4), (c["step"], name)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    rows = np.random.default_rng(0).integers(1, CFG8.vocab_size, (64, SEQ + 1), dtype=np.int32)
    return write_dataset(tmp_path_factory.mktemp("tpu_tokens"), rows)


def test_logits_on_the_chip_match_the_cpu():
    tokens = np.random.default_rng(1).integers(0, CFG8.vocab_size, (2, 24))
    on = {}
    for platform in ("tpu", "cpu"):
        with jax.default_matmul_precision("highest"):  # the same random weights: threefry is exact everywhere
            lm = api.from_config(CFG8, make_mesh("data=1", jax.devices(platform)[:1]), seed=0)
            on[platform] = np.asarray(lm.logits(tokens))
    np.testing.assert_allclose(on["tpu"], on["cpu"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("changes", [{}, {"lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "out"]}}],
                         ids=["full", "lora"])  # fmt: skip
def test_a_training_run_on_the_chip_matches_the_cpu(tokens, tmp_path, changes):
    cfg = smooth(tiny_config(tokens, tmp_path, total_steps=6, log_every=1, **changes))
    assert_runs_agree(train_on("tpu", cfg, tmp_path), train_on("cpu", cfg, tmp_path), ("loss", "grad_norm"))


def test_a_dpo_run_on_the_chip_matches_the_cpu(tmp_path):
    data = preferences.write_preferences(tmp_path / "prefs")
    cfg = smooth(preferences.run_config(data, tmp_path, log_every=1))
    names = ("loss", *preferences.TRL_DPO_METRICS)
    assert_runs_agree(train_on("tpu", cfg, tmp_path), train_on("cpu", cfg, tmp_path), names)


# heads of 128 lanes (the TPU paged kernel's) and a context past a 128-token page
ENGINE_CFG = CFG8.replace(n_head=2, d_model=256, d_ff=512, max_seq_len=320)


def engine_outputs(
    platform: str,
    dtype: str,
    attention: str | None = None,
    kv_cache_dtype: str | None = None,
    quantize: str | None = None,
    top: int = 0,
) -> list:
    """Greedy completions of prompts of 5 to 200 tokens (past a page of 128: a prefill writes whole pages, a decode
    step a token, both by `meshlm.kv_dma`'s kernels on a TPU), then of one that shares the longest one's first
    page (a prefill after a cached prefix) and scores its prompt (its cached last token run again, not written),
    by the engine over random weights on `platform`."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, ENGINE_CFG.vocab_size, n).tolist() for n in (5, 130, 200)]
    with jax.default_matmul_precision("highest"):
        mesh = make_mesh("data=1", jax.devices(platform)[:1])
        lm = api.from_config(ENGINE_CFG, mesh, dtype, seed=0, quantize=quantize)
        engine = lm.engine(max_batch=4, max_len=300, attention=attention, kv_cache_dtype=kv_cache_dtype)
        greedy = lm.sampling(40, temperature=0.0, ignore_eos=True, logprobs=top)
        first = engine.generate(prompts, [greedy] * len(prompts))
        shared = prompts[2][:150] + rng.integers(1, ENGINE_CFG.vocab_size, 20).tolist()
        return first + engine.generate([shared], [greedy.replace(prompt_logprobs=0)])


def test_the_engine_on_the_chip_generates_the_cpus_greedy_tokens():
    """float32: the chip's prefill and decode steps (the write kernels, pages of 128) choose the CPU's tokens."""
    tpu, cpu = engine_outputs("tpu", "float32"), engine_outputs("cpu", "float32")
    assert [c.tokens for c in tpu] == [c.tokens for c in cpu]
    for t, c in zip(tpu, cpu, strict=True):
        np.testing.assert_allclose(t.logprobs, c.logprobs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(tpu[-1].prompt_logprobs[1:], cpu[-1].prompt_logprobs[1:], rtol=1e-4, atol=1e-4)


def arrival_outputs(platform: str, mixed_steps: bool) -> tuple[list, int]:
    """Greedy completions (float32) of prompts of 5 and 130 tokens, then of a 200-token one arriving while they
    decode, prefilled a 128-token page a step, with or without `mixed_steps`; and how many steps ran a prefill and
    a decode step in one pass."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, ENGINE_CFG.vocab_size, n).tolist() for n in (5, 130, 200)]
    with jax.default_matmul_precision("highest"):
        lm = api.from_config(ENGINE_CFG, make_mesh("data=1", jax.devices(platform)[:1]), "float32", seed=0)
        engine = lm.engine(max_batch=4, max_len=300, prefill_tokens=128, mixed_steps=mixed_steps)
        mixed = []
        run_mixed = engine.runner.run_mixed
        engine.runner.run_mixed = lambda prefill, decode: mixed.append(1) or run_mixed(prefill, decode)
        greedy = lm.sampling(40, temperature=0.0, ignore_eos=True, logprobs=0)
        rows = engine.add_requests(prompts[:2], [greedy] * 2)
        engine.step(4)
        rows.append(engine.add_request(prompts[2], greedy))
        while engine.has_work():
            engine.step(4)
        return [r.output for r in rows], len(mixed)


def test_mixed_steps_on_the_chip_choose_the_cpus_tokens():
    """float32: a prompt's chunks prefilled in one pass with the decoding rows' steps on the chip (a paged kernel for
    the decode rows, the page kernels for the chunk) choose the tokens the CPU's engine chooses without mixing."""
    (tpu, mixed), (cpu, _) = arrival_outputs("tpu", True), arrival_outputs("cpu", False)
    assert mixed == 4  # with the first row decoding: the 130- and the 200-token prompts' two pieces each
    assert [c.tokens for c in tpu] == [c.tokens for c in cpu]
    for t, c in zip(tpu, cpu, strict=True):
        np.testing.assert_allclose(t.logprobs, c.logprobs, rtol=1e-4, atol=1e-4)


def parted_at(one: list[int], other: list[int]) -> int:
    """The first position where two greedy rows of one length choose different tokens (their length if none)."""
    return next((i for i, (a, b) in enumerate(zip(one, other, strict=True)) if a != b), len(one))


def test_the_paged_kernel_on_the_chip_reads_what_the_gather_path_reads():
    """bfloat16, on the chip: decode steps by meshlm's paged kernel, reading the pool in place, give the
    log-probs of the same tokens as the gather path (attention "xla") within bfloat16's rounding."""
    paged, gathered = engine_outputs("tpu", "bfloat16"), engine_outputs("tpu", "bfloat16", attention="xla")
    for p, g in zip(paged, gathered, strict=True):
        same = parted_at(p.tokens, g.tokens)
        assert same >= 8, (p.tokens, g.tokens)  # bf16 rounding may flip a near tie later in a random model
        np.testing.assert_allclose(p.logprobs[:same], g.logprobs[:same], atol=0.05)


def test_an_int8_pool_on_the_chip_serves_what_it_serves_on_the_cpu():
    """float32 compute over an int8 pool: on the chip meshlm's paged kernel reads the pages and their scales in
    place (the scales written by the DMA kernels), on the CPU the gather path dequantizes them; both quantize the
    same keys and values, so they choose the same tokens, their log-probs within a rounding step's effect."""
    tpu, cpu = (engine_outputs(platform, "float32", kv_cache_dtype="int8") for platform in ("tpu", "cpu"))
    assert [c.tokens for c in tpu] == [c.tokens for c in cpu]
    for t, c in zip(tpu, cpu, strict=True):
        np.testing.assert_allclose(t.logprobs, c.logprobs, rtol=0, atol=2e-3)


def test_w8a8_projections_on_the_chip_serve_what_they_serve_on_the_cpu():
    """float32 compute over w8a8 projections: the chip's matrix unit multiplies the int8 codes and the per-token int8
    activations into int32 exactly, as the CPU does. But a float32 activation may differ from the CPU's in its last
    bits (the order of rounding, the transcendentals), and one on a rounding boundary then takes the next code. So
    the chip's log-probs move by less than the activations' rounding itself moves them (the CPU's w8a8 against its
    float weights) on the scored prompt (teacher-forced: nothing can part there), within twice that on the generated
    tokens before any parting (40 of them, each moved by the ones before), and a greedy row parts from the CPU's only
    where the CPU's two best tokens nearly tie, the chip taking the second. A fault of layout or scale moves them by
    far more."""
    # Measured 2026-12-07 (v5e, JAX 0.10.2): the prompt's log-probs moved 0.0072 at most (mean 0.0018) against the
    # rounding's 0.0138 (0.0049); the first row parted at its sixth token, where the CPU's two best lie 0.0011 apart.
    # On the CPU, activations perturbed by 1e-5 of themselves before their rounding move them 0.0070 (0.0013).
    tpu, cpu = (engine_outputs(platform, "float32", quantize="w8a8", top=2) for platform in ("tpu", "cpu"))
    exact = engine_outputs("cpu", "float32")

    def prompt_gap(a: list, b: list) -> np.ndarray:
        return np.abs(np.array(a[-1].prompt_logprobs[1:]) - np.array(b[-1].prompt_logprobs[1:]))

    chip, rounding = prompt_gap(tpu, cpu), prompt_gap(cpu, exact)
    assert chip.max() < rounding.max() and chip.mean() < 0.5 * rounding.mean(), (chip, rounding)
    for t, c in zip(tpu, cpu, strict=True):
        same = parted_at(t.tokens, c.tokens)
        np.testing.assert_allclose(t.logprobs[:same], c.logprobs[:same], rtol=0, atol=2 * rounding.max())
        if same < len(c.tokens):
            (best, best_lp), (second, second_lp) = c.top_logprobs[same][:2]
            assert (best, second) == (c.tokens[same], t.tokens[same]), (same, c.top_logprobs[same], t.tokens[same])
            assert best_lp - second_lp < rounding.max(), (same, c.top_logprobs[same])
