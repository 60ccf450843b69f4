"""Post-training parity with trl, step for step: meshlm's SFT (completion-only), DPO (sigmoid and ipo; full
fine-tuning with precomputed or copied reference, and LoRA) and ORPO runs log the same per-step numbers as trl 1.16's
own SFTTrainer, DPOTrainer and ORPOTrainer (`tests/trl_oracle.py`) over 3 optimizer steps, in fp32, on the same tiny
random GPT-J, the same records and the same AdamW (constant learning rate, no warmup, no weight decay, no clipping).

Order: trl reads the records sequentially; meshlm's loader shuffles. Every step here uses the whole record set as
one batch (batch_size = the number of examples or pairs), so both sides see the same rows at every step, and the
losses and metrics are means over the batch, which do not depend on the order of its rows.
"""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from meshlm import cli, train
from meshlm.config import TrainConfig
from meshlm.formats import adapters
from tests import trl_oracle as T

STEPS = 3
LR = 1e-3
SEQ = 32  # every example of the oracle's records fits
TOL = 1e-4  # absolute, or relative where larger (IPO's losses start at 25; DPO's summed log-probs are 35-45)
DPO_COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
ORPO_COMPARED = (*DPO_COMPARED, "nll_loss", "log_odds_ratio", "log_odds_chosen")
LOGPS = ("logps/chosen", "logps/rejected")
LORA_RANK, LORA_ALPHA = 4, 8


# ---------------------------------------------------------------------------------------------------
# Shared folders and the two sides' runs


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("posttrain_trl")


@pytest.fixture(scope="module")
def hf_folder(work) -> Path:
    """The oracle's tiny GPT-J (fp32, every dropout 0) with its tokenizer: what both sides start from."""
    return T.write_hf_folder(work / "model")


def prepared(work: Path, name: str, records: list[dict], tokenizer: Path, fmt: str, *options: str) -> Path:
    """`meshlm prepare` of `records` written as a .jsonl file, one example (or pair) per row (`--no-pack`)."""
    src = work / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = work / f"data_{name}"
    argv = ["prepare", str(src), "--out", str(out), "--seq-len", str(SEQ), "--tokenizer", str(tokenizer),
            "--format", fmt, "--no-pack", "--workers", "1", *options]  # fmt: skip
    assert cli.main(argv) == 0
    index = json.loads((out / "index.json").read_text())
    split = index["splits"]["train"]
    assert (split["examples"], split["truncated"], split["dropped"]) == (len(records), 0, 0), split
    return out


@pytest.fixture(scope="module")
def sft_data(work, hf_folder) -> Path:
    return prepared(work, "sft", T.sft_records(), hf_folder, "prompt-completion", "--train-on", "completion")


@pytest.fixture(scope="module")
def dpo_data(work, hf_folder) -> Path:
    return prepared(work, "dpo", T.preference_records(), hf_folder, "preference", "--objective", "dpo")


@pytest.fixture(scope="module")
def orpo_data(work, hf_folder) -> Path:
    return prepared(work, "orpo", T.preference_records(), hf_folder, "preference", "--objective", "orpo")


def run(hf_folder: Path, data: Path, out_dir: Path, batch_size: int, **changes) -> list[dict]:
    """A meshlm run of STEPS steps from the oracle's model with trl's optimizer settings; its logged steps."""
    cfg = TrainConfig(
        init_from=str(hf_folder), data=str(data), out_dir=str(out_dir), batch_size=batch_size, micro_batches=1,
        total_steps=STEPS, lr=LR, end_lr=LR, warmup_steps=0, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8,
        clip_norm=1e30, param_dtype="float32", compute_dtype="float32", log_every=1, val_every=0, ckpt_every=0,
        sample_tokens=0, **changes,
    )  # fmt: skip
    train.train(cfg, progress=False, sample=False)
    logged = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [entry for entry in logged if "loss" in entry and "step" in entry]
    assert [entry["step"] for entry in steps] == list(range(1, STEPS + 1))
    return steps


def assert_steps_equal(got: list[dict], want: list[dict], keys: tuple[str, ...], logps: tuple[str, ...] = ()) -> None:
    """Each step's `keys` within TOL, `logps` within TOL relative. A DPO run's first step starts at its reference,
    where every pair's rewards tie at exactly 0 in trl (one model, the same torch kernels, run twice) and at
    float rounding in meshlm (the step's program and the reference's are compiled apart): "chosen > rejected"
    of a tie is decided by the rounding, so the first step's accuracy is compared only when its margins are
    clear of rounding."""
    assert len(got) == len(want) == STEPS
    problems = []
    for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
        tied = step == 1 and w.get("rewards/margins") == 0.0
        if tied:
            assert abs(g["rewards/margins"]) < 1e-5, g  # a tie in meshlm too, up to rounding
        for key in keys:
            if tied and key == "rewards/accuracies":
                continue
            if g[key] != pytest.approx(w[key], abs=TOL, rel=TOL):
                problems.append(f"step {step} {key}: meshlm {g[key]!r}, trl {w[key]!r}, diff {g[key] - w[key]:.3g}")
        for key in logps:
            if g[key] != pytest.approx(w[key], rel=TOL, abs=0):
                problems.append(f"step {step} {key}: meshlm {g[key]!r}, trl {w[key]!r} (relative)")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------------
# SFT


@pytest.mark.slow
def test_sft_completion_only_losses_equal_trls_sft_trainer(hf_folder, sft_data, work):
    records = T.sft_records()
    want = T.sft_logs(hf_folder, records, steps=STEPS, batch_size=len(records), lr=LR, completion_only=True)
    got = run(hf_folder, sft_data, work / "run_sft", len(records))
    assert_steps_equal(got, want, ("loss",))
    # no clipping on either side, so the logged gradient norms (before the update) match too
    for g, w in zip(got, want, strict=True):
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
    assert got[0]["loss"] > got[-1]["loss"]  # it trains


# ---------------------------------------------------------------------------------------------------
# DPO, full fine-tuning


@pytest.fixture(scope="module")
def dpo_precompute(hf_folder, dpo_data, work) -> list[dict]:
    pairs = len(T.preference_records())
    return run(hf_folder, dpo_data, work / "run_dpo_pre", pairs, objective="dpo", dpo={"beta": 0.1})


@pytest.fixture(scope="module")
def dpo_copy(hf_folder, dpo_data, work) -> list[dict]:
    pairs = len(T.preference_records())
    return run(
        hf_folder, dpo_data, work / "run_dpo_copy", pairs, objective="dpo", dpo={"beta": 0.1, "reference": "copy"}
    )


@pytest.mark.slow
def test_dpo_sigmoid_equals_trls_dpo_trainer(hf_folder, dpo_copy):
    records = T.preference_records()
    want = T.dpo_metrics(hf_folder, records, steps=STEPS, batch_size=len(records), lr=LR, beta=0.1)
    assert want[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # the policy starts as its reference
    assert_steps_equal(dpo_copy, want, DPO_COMPARED, LOGPS)
    assert dpo_copy[-1]["rewards/margins"] > 0


@pytest.mark.slow
def test_dpo_with_precomputed_reference_logps_equals_trls_precomputed_run(hf_folder, dpo_precompute, work):
    records = T.preference_records()
    want = T.dpo_metrics(
        hf_folder, records, steps=STEPS, batch_size=len(records), lr=LR, beta=0.1, precompute_ref_log_probs=True
    )
    assert_steps_equal(dpo_precompute, want, DPO_COMPARED, LOGPS)
    assert (work / "run_dpo_pre" / "reference_logps.npz").is_file()


@pytest.mark.slow
def test_precomputed_reference_logps_equal_those_computed_on_the_fly(dpo_precompute, dpo_copy, work):
    """`reference: precompute` (stored once before the first step) and `reference: copy` (a frozen copy of the
    starting model run inside every step) log the same numbers."""
    assert not (work / "run_dpo_copy" / "reference_logps.npz").exists()
    for pre, copy in zip(dpo_precompute, dpo_copy, strict=True):
        for key in (*DPO_COMPARED, *LOGPS):
            assert pre[key] == pytest.approx(copy[key], rel=1e-6, abs=1e-6), (pre["step"], key)


@pytest.mark.slow
def test_dpo_ipo_equals_trls_dpo_trainer(hf_folder, dpo_data, work):
    records = T.preference_records()
    want = T.dpo_metrics(hf_folder, records, steps=STEPS, batch_size=len(records), lr=LR, beta=0.1, loss_type="ipo")
    assert want[0]["loss"] == pytest.approx(25.0, rel=1e-6)  # (1 / (2 beta))^2 at the start
    got = run(hf_folder, dpo_data, work / "run_ipo", len(records), objective="dpo",
              dpo={"beta": 0.1, "loss_type": "ipo"})  # fmt: skip
    assert_steps_equal(got, want, DPO_COMPARED, LOGPS)


# ---------------------------------------------------------------------------------------------------
# DPO with LoRA: peft's initial adapter on the trl side, the same adapter on meshlm's


@pytest.mark.slow
def test_dpo_lora_equals_trls_dpo_trainer_with_peft(hf_folder, dpo_data, work, monkeypatch):
    """trl wraps the model with peft (A kaiming-uniform from torch's RNG, B = 0) and uses the base with the adapter
    switched off as the reference. meshlm has no setting to start a LoRA run from a given adapter, so the run's
    fresh-adapter init is replaced by the adapter trl saved before its first step."""
    records = T.preference_records()
    initial = work / "peft_initial"
    want = T.dpo_metrics(
        hf_folder, records, steps=STEPS, batch_size=len(records), lr=LR, beta=0.1,
        lora=T.lora_config(r=LORA_RANK, alpha=LORA_ALPHA), save_initial_adapter=initial,
    )  # fmt: skip

    import meshlm

    base_cfg = meshlm.load(hf_folder).config
    peft = adapters.read_peft(initial, base_cfg)
    assert set(peft) == {"q", "k", "v", "out", "fc_in", "fc_out"}
    assert all(not np.any(parts["b"]) for parts in peft.values())  # peft's B starts at zero

    calls = []

    def init_from_peft(projections, lora, key, dtype="float32"):
        calls.append(dtype)
        assert lora.rank == LORA_RANK and lora.scale == LORA_ALPHA / LORA_RANK
        return {role: {name: jnp.asarray(x, jnp.float32) for name, x in parts.items()} for role, parts in peft.items()}

    monkeypatch.setattr(train, "init_adapter", init_from_peft)
    lora = {"rank": LORA_RANK, "alpha": float(LORA_ALPHA), "dropout": 0.0,
            "targets": ["q", "k", "v", "out", "fc_in", "fc_out"]}  # fmt: skip
    got = run(hf_folder, dpo_data, work / "run_dpo_lora", len(records), objective="dpo", dpo={"beta": 0.1}, lora=lora)
    assert calls, "the LoRA run did not start from peft's adapter"
    assert got[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert_steps_equal(got, want, DPO_COMPARED, LOGPS)


# ---------------------------------------------------------------------------------------------------
# ORPO


@pytest.mark.slow
def test_orpo_equals_trls_orpo_trainer(hf_folder, orpo_data, work):
    records = T.preference_records()
    want = T.orpo_metrics(hf_folder, records, steps=STEPS, batch_size=len(records), lr=LR, beta=0.1)
    got = run(hf_folder, orpo_data, work / "run_orpo", len(records), objective="orpo", orpo={"beta": 0.1})
    assert_steps_equal(got, want, ORPO_COMPARED, LOGPS)
