"""Training objectives: lm, DPO (sigmoid, ipo, hinge, label smoothing) and ORPO equal trl's own loss code on the
same numbers; lm's loss is normalised over the whole batch; precomputed reference log-probs equal those computed in
the step; DPO, ORPO and LoRA-DPO runs train, validate, resume and refuse what they cannot use."""

import dataclasses
import functools
import json
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from meshlm import data, model, objectives, run_start, train, train_step
from meshlm.config import ConfigError, TrainConfig
from meshlm.objectives import Inputs
from meshlm.sharding import make_mesh
from tests.helpers.preferences import CFG, SEQ, TRL_DPO_METRICS, logged, preference_rows, run_config, write_preferences

# ---------------------------------------------------------------------------------------------------
# The formulas, against trl's own loss code called on the same numbers


class Accelerator:
    """What trl's loss code asks of `accelerate` on one CPU process."""

    device = torch.device("cpu")
    gather = gather_for_metrics = staticmethod(lambda x: x)


def interleave(chosen: np.ndarray, rejected: np.ndarray) -> np.ndarray:
    """trl's batches are [chosen..., rejected...]; meshlm's rows are [chosen_0, rejected_0, chosen_1, ...]."""
    return np.stack([chosen, rejected], axis=1).reshape(-1, *chosen.shape[1:])


def random_pairs(pairs: int = 4, targets: int = 10, seed: int = 0) -> dict[str, np.ndarray]:
    """Per-token log-probs and completion masks [2 * pairs, targets] in trl's order, and reference log-probs."""
    rng = np.random.default_rng(seed)
    mask = (rng.random((2 * pairs, targets)) < 0.6).astype(np.float32)
    mask[:, -1] = 1  # every completion has a token
    logps = -rng.gamma(2.0, 0.5, (2 * pairs, targets)).astype(np.float32) * mask
    reference = (logps.sum(1) + rng.normal(0, 1.5, 2 * pairs)).astype(np.float32)
    return {"logps": logps, "mask": mask, "reference": reference}


def meshlm_inputs(nll: np.ndarray, weights: np.ndarray, reference=None, in_document=None) -> Inputs:
    """Inputs of rows given in trl's order, reordered as meshlm's interleaved rows."""
    half = len(nll) // 2

    def rows(x):
        return None if x is None else jnp.asarray(interleave(x[:half], x[half:]))

    in_document = weights if in_document is None else in_document
    ones = jnp.ones(len(nll), jnp.float32)
    return Inputs(rows(nll), jnp.zeros(nll.shape), rows(weights), rows(in_document), ones, rows(reference))


def trl_dpo(numbers: dict[str, np.ndarray], loss_type: str, beta: float) -> tuple[float, dict[str, float]]:
    """trl 1.16's `DPOTrainer._compute_loss` with precomputed reference log-probs, on a model whose per-token
    log-probs are `numbers["logps"]`."""
    from trl import DPOTrainer

    logps, mask = torch.tensor(numbers["logps"]), torch.tensor(numbers["mask"])
    rows, targets = logps.shape
    metrics = defaultdict(list)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=Accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=0.0, use_weighting=False, _metrics={"train": metrics}, _total_train_tokens=0,
        _tp_size=1, args=SimpleNamespace(),
    )  # fmt: skip
    zeros = torch.zeros(rows, targets)
    outputs = SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    reference = torch.tensor(numbers["reference"])
    inputs = {
        "input_ids": torch.zeros(rows, targets + 1, dtype=torch.long),
        "attention_mask": torch.ones(rows, targets + 1, dtype=torch.long),
        "completion_mask": torch.cat([torch.zeros(rows, 1), mask], dim=1).long(),
        "ref_chosen_logps": reference[: rows // 2],
        "ref_rejected_logps": reference[rows // 2 :],
    }
    loss = DPOTrainer._compute_loss(trainer, lambda **_: outputs, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in metrics.items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_loss_and_metrics_equal_trl_dpo_trainers(loss_type):
    numbers = random_pairs()
    want_loss, want = trl_dpo(numbers, loss_type, beta=0.3)
    cfg = TrainConfig(objective="dpo", dpo={"beta": 0.3, "loss_type": loss_type})
    got = objectives.dpo(cfg, meshlm_inputs(-numbers["logps"], numbers["mask"], numbers["reference"]))
    assert float(got.loss) == pytest.approx(want_loss, rel=1e-6)
    assert set(TRL_DPO_METRICS) <= set(want)
    for name in TRL_DPO_METRICS:
        assert float(got.metrics[name]) == pytest.approx(want[name], rel=1e-6, abs=1e-7), name
    assert float(got.metrics["loss"]) == float(got.loss) and float(got.count) == 4


def test_label_smoothed_dpo_is_conservative_dpo_as_trls_cpo_computes_it():
    """trl 1.16's DPOTrainer leaves label smoothing out of its sigmoid loss; conservative DPO is trl's CPO
    sigmoid loss (and pre-1.0 DPO's) on the log-ratios log pi / pi_ref."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    numbers = random_pairs(seed=3)
    cfg = TrainConfig(objective="dpo", dpo={"beta": 0.5, "label_smoothing": 0.2})
    got = objectives.dpo(cfg, meshlm_inputs(-numbers["logps"], numbers["mask"], numbers["reference"]))
    ratios = torch.tensor(numbers["logps"].sum(1) - numbers["reference"])
    cpo = SimpleNamespace(alpha=0.0, loss_type="sigmoid", beta=0.5, label_smoothing=0.2, accelerator=Accelerator())
    losses = CPOTrainer.cpo_loss(cpo, ratios[:4], ratios[4:])[0]
    assert float(got.loss) == pytest.approx(float(losses.mean()), rel=1e-6)


def test_orpo_loss_and_metrics_equal_trl_orpo_trainers():
    """trl's ORPOTrainer from its logits on: NLL of the chosen rows over prompt and completion, average
    completion log-probs, log odds; meshlm's objective from the per-token NLL of the same logits."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    pairs, length, vocab = 3, 12, 20
    rng = np.random.default_rng(1)
    ids = rng.integers(0, vocab, (2 * pairs, length))
    prompt = rng.integers(2, 5, 2 * pairs)  # tokens of prompt, then completion, then padding
    end = np.minimum(prompt + rng.integers(2, 7, 2 * pairs), length)
    position = np.arange(length)
    attention = position < end[:, None]
    completion = attention & (position >= prompt[:, None])
    logits = torch.tensor(rng.normal(0, 2, (2 * pairs, length, vocab)), dtype=torch.float32)

    def part(rows):
        return {
            "input_ids": torch.tensor(np.where(attention, ids, 0)[rows]),
            "attention_mask": torch.tensor(attention[rows].astype(np.int64)),
            "labels": torch.tensor(np.where(completion, ids, -100)[rows]),
        }

    batch = {f"{side}_{k}": v for side, rows in (("chosen", slice(0, pairs)), ("rejected", slice(pairs, None)))
             for k, v in part(rows).items()}  # fmt: skip
    trainer = SimpleNamespace(
        is_encoder_decoder=False, padding_value=0, aux_loss_enabled=False, beta=0.25, accelerator=Accelerator()
    )
    trainer.concatenated_inputs = ORPOTrainer.concatenated_inputs
    trainer.get_batch_logps = ORPOTrainer.get_batch_logps
    trainer.concatenated_forward = functools.partial(ORPOTrainer.concatenated_forward, trainer)
    trainer.odds_ratio_loss = functools.partial(ORPOTrainer.odds_ratio_loss, trainer)
    forward = lambda *_, **__: SimpleNamespace(logits=logits)
    want_loss, want = ORPOTrainer.get_batch_loss_metrics(trainer, forward, batch)

    log_probs = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.tensor(ids[:, 1:, None])).squeeze(-1)
    cfg = TrainConfig(objective="orpo", orpo={"beta": 0.25})
    got = objectives.orpo(
        cfg, meshlm_inputs(-log_probs.numpy(), completion[:, 1:].astype(np.float32), in_document=attention[:, 1:])
    )
    assert float(got.loss) == pytest.approx(float(want_loss), rel=1e-6)
    for name in [*TRL_DPO_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"]:
        assert float(got.metrics[name]) == pytest.approx(want[name], rel=1e-5, abs=1e-6), name


def test_log1mexp_equals_trls_with_a_finite_gradient_on_both_sides_of_its_branch():
    from trl.experimental.orpo.orpo_trainer import log1mexp

    x = np.array([-30.0, -5.0, -0.7, -0.69, -0.3, -1e-4], np.float32)
    np.testing.assert_allclose(objectives.log1mexp(jnp.asarray(x)), log1mexp(torch.tensor(x)).numpy(), rtol=1e-6)
    assert np.all(np.isfinite(jax.vmap(jax.grad(objectives.log1mexp))(jnp.asarray(x))))


@pytest.mark.parametrize(("loss_type", "want"), [("sigmoid", np.log(2)), ("ipo", 1 / (4 * 0.1**2)), ("hinge", 1.0)])
def test_a_policy_equal_to_its_reference_has_zero_rewards_and_the_losss_starting_value(loss_type, want):
    numbers = random_pairs(seed=2)
    reference = np.asarray(objectives.sequence_logps(-numbers["logps"], numbers["mask"]))
    got = objectives.dpo(
        TrainConfig(objective="dpo", dpo={"loss_type": loss_type}),
        meshlm_inputs(-numbers["logps"], numbers["mask"], reference),
    )
    assert float(got.loss) == pytest.approx(want, rel=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert float(got.metrics[name]) == pytest.approx(0.0, abs=1e-6)


# ---------------------------------------------------------------------------------------------------
# The step: lm's loss over the whole batch, whatever micro_batches is


@pytest.mark.slow
def test_lm_loss_is_normalised_by_the_loss_tokens_of_the_whole_batch_whatever_micro_batches_is():
    """Rows with very different numbers of loss tokens (and two packed documents in one): the step's loss is
    sum(nll * w) / sum(w) over the batch, and its update the same, in one micro-batch or four."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 250, (4, SEQ + 1)).astype(np.int32)
    segments = np.ones((4, SEQ + 1), np.int32)
    segments[1, 9:] = 2
    segments[3, 12:] = 0  # padding
    weights = np.zeros((4, SEQ + 1), np.float32)
    weights[0, 1:] = 1
    weights[1, [3, 4, 12]] = 1  # one target of document 1, one of document 2... and 4
    weights[2, -1] = 1
    weights[3, 1:12] = 1
    params = jax.tree.map(np.asarray, model.init(CFG, jax.random.key(0)))
    nll = jax.jit(functools.partial(model.target_nll, cfg=CFG))(params, tokens, segments=segments).nll
    want = float((nll * weights[:, 1:]).sum() / weights[:, 1:].sum())

    results = []
    for micro_batches in (1, 4):
        cfg = TrainConfig(model=CFG, batch_size=4, micro_batches=micro_batches, lr=1.0, end_lr=1.0, eps=1.0,
                          warmup_steps=0, weight_decay=0.0)  # fmt: skip
        program = train_step.step_program(cfg, CFG, make_mesh(None), SEQ)
        opt_state = jax.jit(program.optimizer.init)(params)
        state = train_step.TrainState(jnp.int32(0), jax.tree.map(jnp.asarray, params), opt_state)
        batch = {k: v.reshape(micro_batches, -1, SEQ + 1) for k, v in
                 {"tokens": tokens, "weights": weights, "segments": segments}.items()}  # fmt: skip
        state, metrics = program.fn(state, batch)
        results.append((float(metrics["loss"]), jax.tree.map(np.asarray, state.params)))
    for loss, new_params in results:
        assert loss == pytest.approx(want, rel=1e-6)
        for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(results[0][1]), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# Training runs on a tiny hand-written preference dataset


@pytest.fixture(scope="module")
def dpo_run(preferences, tmp_path_factory):
    """Full fine-tuning with precomputed reference log-probs, validated at steps 3 and 6."""
    out = tmp_path_factory.mktemp("dpo")
    return train.train(run_config(preferences, out, val_every=3), progress=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"objective": "orpo", "dpo": {}, "orpo": {"beta": 0.5}, "mesh": "data=2,model=4"},
        {
            "dpo": {"beta": 0.5, "loss_type": "ipo"},
            "lora": {"rank": 4, "targets": ["q", "v", "fc_in"]},
            "lr": 3e-2,
            "end_lr": 3e-2,
            "val_every": 3,
        },
        {  # QLoRA on GPT-NeoX: an NF4 base, two LayerNorms per block, rotate-half rotary, biased projections
            "model": dataclasses.replace(
                CFG, residual="parallel_two_norms", rotary_style="half", qkv_bias=True, out_bias=True, head_bias=False
            ),
            "lora": {"rank": 4, "targets": ["q", "k", "v", "out", "fc_in"]},
            "base_dtype": "nf4",
            "lr": 3e-2,
            "end_lr": 3e-2,
        },
        {  # ORPO with LoRA on GPT-Neo: an int8 base, sequential blocks, learned positions, a local window, tied head
            "model": dataclasses.replace(
                CFG,
                rotary_dim=0,
                residual="sequential",
                position="learned",
                attention_layers=("global", "local"),
                local_window=4,
                scale_attn=False,
                out_bias=True,
                tie_embeddings=True,
                head_bias=False,
            ),
            "objective": "orpo",
            "dpo": {},
            "orpo": {"beta": 0.5},
            "lora": {"rank": 4, "targets": ["q", "v", "fc_in", "fc_out"]},
            "base_dtype": "int8",
            "lr": 3e-2,
            "end_lr": 3e-2,
        },
    ],
    ids=["dpo", "orpo", "lora-ipo", "neox-qlora-nf4", "neo-orpo-lora-int8"],
)
def test_preference_runs_log_trls_metrics_and_raise_the_reward_margin(changes, dpo_run, preferences, tmp_path):
    out = dpo_run.out_dir if not changes else tmp_path
    if changes:
        train.train(run_config(preferences, out, **changes), progress=False)
    records = [r for r in logged(out) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 7))
    for record in records:
        assert set(TRL_DPO_METRICS) <= set(record) and all(np.isfinite(v) for v in record.values())
    margins = [r["rewards/margins"] for r in records]
    # A step's accuracy is over its batch's 2 pairs: one step can tie (0.5) whatever was learned, so the claim
    # is the trend, the last three steps against the first three (the int8 GPT-Neo case's last batch ties).
    accuracies = [r["rewards/accuracies"] for r in records]
    assert margins[-1] > margins[0] + 0.05 and np.mean(accuracies[3:]) > np.mean(accuracies[:3])
    if changes.get("objective") == "orpo":
        assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(records[0])
    else:  # the policy starts as the reference: no margin, DPO's log 2 (IPO: 1 / (4 beta^2) less the lengths' share)
        assert margins[0] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_validation_on_preference_data_reports_trls_names(dpo_run):
    assert set(dpo_run.val_losses) == {3, 6}
    values = dpo_run.val_losses[6]
    assert {"val/val", *(f"val/val/{name}" for name in TRL_DPO_METRICS)} <= set(values)
    assert values["val/val/rewards/margins"] > dpo_run.val_losses[3]["val/val/rewards/margins"]


@pytest.mark.slow
def test_precomputed_reference_logps_equal_the_frozen_copys_in_the_step(dpo_run, preferences, tmp_path):
    """Stored once before training, looked up by row: the same numbers as the reference copy computes in each
    step (here sharded ZeRO-3 and tensor-parallel), so the two runs log the same values."""
    stored = np.load(dpo_run.out_dir / "reference_logps.npz")
    train_ds = data.TokenDataset(preferences)
    cfg = run_config(preferences, tmp_path)
    rows = train_ds[np.arange(train_ds.rows)]._asdict()
    on_the_fly = train_step.row_logps(model.init(CFG, jax.random.key(cfg.seed)), rows, CFG, cfg.policy)
    np.testing.assert_allclose(stored["train"], on_the_fly, rtol=1e-6)
    identity = json.loads(str(stored["identity"]))
    assert identity["datasets"]["train"]["rows"] == 32 and set(identity["datasets"]) == {"train", "val/val"}

    copy_cfg = run_config(
        preferences, tmp_path, val_every=3, dpo={"beta": 0.5, "reference": "copy"}, mesh="fsdp=2,model=4"
    )
    copy = train.train(copy_cfg, progress=False)
    assert not (tmp_path / "reference_logps.npz").exists()
    # Rewards are beta x a difference of two log-probs near -32, where a float32 ulp is 3.8e-6: the two programs'
    # few ulps of rounding show as ~1e-5 in a reward however small it is.
    reward_rounding = 2e-5
    for want, got in zip(logged(dpo_run.out_dir), logged(tmp_path), strict=True):
        # At step 1 the policy is its reference: each pair's rewards tie up to that rounding, so "chosen >
        # rejected" of a tie is noise (as in test_posttrain_trl's assert_steps_equal).
        tied = want["step"] == 1 and abs(want.get("rewards/margins", 1.0)) < reward_rounding
        for name in ("loss", "val/val", *TRL_DPO_METRICS):
            if name in want and not (tied and name == "rewards/accuracies"):
                slack = reward_rounding if name.startswith("rewards/") else 1e-6
                assert got[name] == pytest.approx(want[name], rel=1e-5, abs=slack), (want["step"], name)
    assert copy.step == 6


@pytest.mark.slow
def test_a_resumed_dpo_run_continues_exactly_with_its_stored_reference_and_refuses_other_data(
    dpo_run, preferences, tmp_path
):
    cfg = run_config(preferences, tmp_path / "run", val_every=3, total_steps=3, ckpt_every=3)
    train.train(cfg, progress=False)
    resumed = train.train(cfg.replace(total_steps=6), progress=False)
    assert resumed.losses == {s: v for s, v in dpo_run.losses.items() if s > 3}

    other = write_preferences(tmp_path / "other", seed=7)
    with pytest.raises(ConfigError, match=r"reference_logps.npz: the run's reference log-probs are of .*preferences"):
        train.train(cfg.replace(total_steps=7, data=str(other)), progress=False)


# ---------------------------------------------------------------------------------------------------
# Bad configurations and data of the wrong kind


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"objective": "kto"}, "objective must be one of ['lm', 'dpo', 'orpo', 'grpo'], got 'kto'"),
        ({"objective": "dpo", "dpo": {"beta": 0}}, "dpo.beta must be a number > 0, got 0"),
        ({"objective": "orpo", "orpo": {"beta": -1.0}}, "orpo.beta must be a number > 0, got -1.0"),
        ({"objective": "dpo", "dpo": {"loss_type": "kto"}}, "dpo.loss_type must be one of ['sigmoid', 'ipo', 'hinge']"),
        ({"objective": "dpo", "dpo": {"label_smoothing": 0.5}}, "dpo.label_smoothing must be a number in [0, 0.5)"),
        ({"objective": "dpo", "dpo": {"loss_type": "ipo", "label_smoothing": 0.1}}, "applies to loss_type sigmoid"),
        ({"objective": "dpo", "dpo": {"reference": "disk"}}, "dpo.reference must be one of ['precompute', 'copy']"),
        ({"objective": "dpo", "dpo": {"betta": 1}}, "dpo: unknown key(s) ['betta']; allowed: ['beta', "),
        ({"dpo": {"beta": 0.3}}, "dpo settings apply to objective dpo, but objective is lm"),
        ({"objective": "orpo", "z_loss": 1e-4}, "z_loss applies to objective lm only, not orpo"),
        ({"objective": "dpo", "lora": {}, "dpo": {"reference": "copy"}}, "dpo.reference copy is for full fine-tuning"),
    ],
)
def test_bad_objective_settings_are_one_line_errors(values, message):
    with pytest.raises(ConfigError) as error:
        TrainConfig(**values)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_data_of_the_wrong_kind_is_refused_at_start_naming_the_dataset(preferences, tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    rows = np.random.default_rng(0).integers(0, 250, (8, SEQ + 1))
    data.write_index(text, SEQ, {"train": data.write_split(text, "train", [rows], SEQ)}, eos_id=0)
    with pytest.raises(ConfigError, match=f"{text}: split 'train' holds text, not the preference pairs objective dpo"):
        train.train(run_config(text, tmp_path / "a"), progress=False)
    with pytest.raises(ConfigError, match=f"{preferences}: split 'train' holds preference pairs, but objective is lm"):
        train.train(run_config(preferences, tmp_path / "b", objective="lm", dpo={}), progress=False)
    with pytest.raises(ConfigError, match="objective orpo trains on preference pairs: set data to a folder"):
        train.train(run_config(None, tmp_path / "c", objective="orpo", dpo={}), progress=False)
    assert not list(tmp_path.glob("*/checkpoints/[0-9]*"))


def test_pairs_tokenized_for_the_other_preference_objective_are_trained_with_a_warning(tmp_path, capsys):
    folder = tmp_path / "orpo-pairs"
    rows = preference_rows(2, seed=0)
    data.write_index(folder, SEQ, {"train": data.write_split(folder, "train", [rows], SEQ)}, eos_id=0,
                     kind="preference", objective="orpo")  # fmt: skip
    run_start.check_kind(run_config(folder, tmp_path / "run"), data.TokenDataset(folder))
    err = capsys.readouterr().err.strip()
    assert err == (
        f"meshlm train: warning: {folder} holds pairs tokenized for orpo, trained with dpo; "
        "`meshlm prepare --objective dpo` tokenizes them as trl does for it"
    )
    run_start.check_kind(run_config(folder, tmp_path / "run", objective="orpo", dpo={}), data.TokenDataset(folder))
    assert capsys.readouterr().err == ""
