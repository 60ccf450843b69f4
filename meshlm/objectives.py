"""Training objectives, one table: each turns the per-token quantities of one micro-batch into its loss and
its metrics under trl's names. The step (`meshlm.train_step`) runs the model and looks the objective up in
`OBJECTIVES`; it never branches on which one it is.

The math is trl 1.16's (`DPOTrainer._compute_loss`, `ORPOTrainer.odds_ratio_loss`), on these conventions:
- a row's log-prob is the sum of log p over its loss-weighted targets (a preference row's completion);
- preference rows come interleaved, chosen_0, rejected_0, chosen_1, ...: a pair is rows 2j and 2j + 1;
- each objective's loss and metrics are means over its units, tokens for `lm` and pairs for `dpo` and
  `orpo`, and a step's micro-batches combine by their unit counts: `lm` is then normalised by the loss
  tokens of the whole batch (trl's `num_items_in_batch`), and a preference step is the mean over its pairs;
- `grpo` (trl's `GRPOTrainer._compute_loss`, math in `meshlm.grpo`) counts each micro-batch as one unit: trl
  divides each micro-batch's grpo, bnpo or dr_grpo loss by the gradient-accumulation steps, so a step is the
  mean of its micro-batches' losses, and its dapo loss by the whole batch's loss tokens, which the rollout
  loop hands each micro-batch divided by their number (`dapo_tokens`), so that their mean is trl's sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshlm import grpo as grpo_math
from meshlm.config import DpoConfig, TrainConfig

LN2 = 0.6931471805599453


class Inputs(NamedTuple):
    """What an objective sees of one micro-batch of R rows with T targets each."""

    nll: jax.Array  # [R, T] -log p of each target under the trained model
    log_z: jax.Array  # [R, T] log of each prediction's softmax normaliser (for the z-loss)
    weights: jax.Array  # [R, T] loss weights of the targets (0 on prompts, padding and rows that only pad a batch)
    in_document: jax.Array  # [R, T] 1 for each target inside a document, prompt included (ORPO's NLL term)
    examples: jax.Array  # [R] 1 for a row of the data, 0 for a row that only pads an evaluation batch
    reference: jax.Array | None  # [R] each row's log-prob under the frozen reference model (DPO)
    # sum of weights * (nll + z_loss * log_z^2), computed by the model with its gradient (an objective that
    # declares `token_sum`); the same number from nll and log_z costs the backward pass a sweep over the head
    total: jax.Array | None = None
    entropy: jax.Array | None = None  # [R, T] each prediction's entropy, at the sampling temperature (GRPO)
    rollout: dict[str, jax.Array] | None = None  # what the rollout loop computed for each row (GRPO: ROLLOUT_KEYS)

    @classmethod
    def of(
        cls,
        nll: jax.Array,
        log_z: jax.Array,
        batch: dict[str, jax.Array],
        reference: jax.Array | None = None,
        total: jax.Array | None = None,
        entropy: jax.Array | None = None,
    ) -> Inputs:
        """From the model's per-target outputs and a batch of rows {"tokens", "weights", "segments"}
        [R, T + 1] (and "examples" [R] for an evaluation batch, the `ROLLOUT_KEYS` of a GRPO batch): a
        target lies inside a document when its input token belongs to the same one."""
        examples = _examples(batch)
        segments = batch["segments"]
        in_document = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
        weights = target_weights(batch)
        rollout = {k: batch[k] for k in ROLLOUT_KEYS if k in batch} or None
        return cls(nll, log_z, weights, in_document * examples[:, None], examples, reference, total, entropy, rollout)


def _examples(batch: dict[str, jax.Array]) -> jax.Array:
    return batch.get("examples", jnp.ones(batch["tokens"].shape[0], jnp.float32))


def target_weights(batch: dict[str, jax.Array]) -> jax.Array:
    """[R, T] each target's loss weight: the row's weight of the token it predicts, 0 in a row that only pads."""
    return batch["weights"][:, 1:].astype(jnp.float32) * _examples(batch)[:, None]


class Result(NamedTuple):
    loss: jax.Array  # the micro-batch's loss: a mean over its units (what is differentiated)
    metrics: dict[str, jax.Array]  # means over the same units, under trl's names ("loss" among them)
    count: jax.Array  # how many units the means are over: micro-batches and evaluation batches combine by it


def sequence_logps(nll: jax.Array, weights: jax.Array) -> jax.Array:
    """Each row's log-prob [R]: the sum of log p over its weighted targets. The reference model's log-probs,
    precomputed or not, are this same function of its own nll."""
    return -(nll * weights).sum(axis=-1)


def pairs(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) of interleaved preference rows."""
    return rows[0::2], rows[1::2]


def _mean(values: jax.Array, weights: jax.Array) -> jax.Array:
    return (values * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def lm(cfg: TrainConfig, x: Inputs) -> Result:
    """Next-token cross-entropy over the weighted targets, plus `z_loss` * log Z^2 (the PaLM z-loss)."""
    tokens = x.weights.sum()
    ce = _mean(x.nll, x.weights)
    if x.total is None:
        loss = ce + cfg.z_loss * _mean(jnp.square(x.log_z), x.weights)
    else:
        loss = x.total / jnp.maximum(tokens, 1.0)
    return Result(loss, {"loss": ce, "loss_with_z": loss}, tokens)


def _sigmoid(s: DpoConfig, chosen: jax.Array, rejected: jax.Array, lengths: tuple[jax.Array, jax.Array]) -> jax.Array:
    """DPO; with label smoothing eps, conservative DPO: the label of each pair is flipped with probability eps."""
    d = s.beta * (chosen - rejected)
    return -(1 - s.label_smoothing) * jax.nn.log_sigmoid(d) - s.label_smoothing * jax.nn.log_sigmoid(-d)


def _ipo(s: DpoConfig, chosen: jax.Array, rejected: jax.Array, lengths: tuple[jax.Array, jax.Array]) -> jax.Array:
    """IPO on log-ratios averaged per completion token, as trl computes it (the IPO authors' normalisation)."""
    return jnp.square(chosen / lengths[0] - rejected / lengths[1] - 1 / (2 * s.beta))


def _hinge(s: DpoConfig, chosen: jax.Array, rejected: jax.Array, lengths: tuple[jax.Array, jax.Array]) -> jax.Array:
    """SLiC's hinge on the log-ratio margin."""
    return jax.nn.relu(1 - s.beta * (chosen - rejected))


# Each pair's DPO loss from the log-ratios log pi/pi_ref of its chosen and rejected rows and their completion lengths.
DPO_LOSSES: dict[str, Callable[..., jax.Array]] = {"sigmoid": _sigmoid, "ipo": _ipo, "hinge": _hinge}


def dpo(cfg: TrainConfig, x: Inputs) -> Result:
    """DPO and its variants against the reference's row log-probs; rewards are beta * log pi/pi_ref."""
    s = cfg.dpo
    logps = pairs(sequence_logps(x.nll, x.weights))
    reference = pairs(x.reference)
    chosen, rejected = (p - r for p, r in zip(logps, reference, strict=True))
    lengths = pairs(jnp.maximum(x.weights.sum(axis=-1), 1.0))
    w = pairs(x.examples)[0]
    loss = _mean(DPO_LOSSES[s.loss_type](s, chosen, rejected, lengths), w)
    return Result(loss, {"loss": loss, **_reward_metrics(s.beta * chosen, s.beta * rejected, logps, w)}, w.sum())


def log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, each branch where it is accurate (at -ln 2, as trl's); each branch is fed
    a safe value where it is not taken, so that neither puts a NaN into the gradient."""
    near_zero = x > -LN2
    return jnp.where(
        near_zero,
        jnp.log(-jnp.expm1(jnp.where(near_zero, x, -1.0))),
        jnp.log1p(-jnp.exp(jnp.where(near_zero, -1.0, x))),
    )


def orpo(cfg: TrainConfig, x: Inputs) -> Result:
    """ORPO: the chosen rows' NLL (every target of prompt and completion, as trl computes it) minus
    beta * log sigmoid(log odds ratio), the odds from each completion's per-token average log-prob."""
    beta = cfg.orpo.beta
    lengths = jnp.maximum(x.weights.sum(axis=-1), 1.0)
    average = pairs(sequence_logps(x.nll, x.weights) / lengths)
    chosen, rejected = average
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = jax.nn.log_sigmoid(log_odds)
    nll = _mean(pairs(x.nll)[0], pairs(x.in_document)[0])
    w = pairs(x.examples)[0]
    loss = nll - beta * _mean(ratio, w)
    metrics = {
        "loss": loss,
        **_reward_metrics(beta * chosen, beta * rejected, average, w),
        "nll_loss": nll,
        "log_odds_ratio": _mean(ratio, w),
        "log_odds_chosen": _mean(log_odds, w),
    }
    return Result(loss, metrics, w.sum())


def _reward_metrics(
    chosen: jax.Array, rejected: jax.Array, logps: tuple[jax.Array, jax.Array], w: jax.Array
) -> dict[str, jax.Array]:
    """trl's reward metrics of each pair's rewards and its rows' log-probs, as means over the pairs."""
    chosen, rejected = jax.lax.stop_gradient((chosen, rejected))
    return {
        "rewards/chosen": _mean(chosen, w),
        "rewards/rejected": _mean(rejected, w),
        "rewards/accuracies": _mean((chosen > rejected).astype(jnp.float32), w),
        "rewards/margins": _mean(chosen - rejected, w),
        "logps/chosen": _mean(jax.lax.stop_gradient(logps[0]), w),
        "logps/rejected": _mean(jax.lax.stop_gradient(logps[1]), w),
    }


# A GRPO batch's arrays beside its rows: per row the advantage and DAPO's normaliser, per token (aligned with
# "tokens", as "weights" are) the log-probs under the rollout's weights (num_iterations > 1) and the reference's
# (beta > 0), each computed by the rollout loop before the step.
ROLLOUT_KEYS = ("advantages", "dapo_tokens", "old_logps", "ref_logps")


def grpo(cfg: TrainConfig, x: Inputs) -> Result:
    """GRPO and its variants (`meshlm.grpo.policy_loss`) on the completions' log-probs at the sampling temperature
    (-nll), the completion tokens' weights as the mask; one unit per micro-batch (see the module's notes)."""
    r = x.rollout
    per_token = {k: r[k][:, 1:] for k in ("old_logps", "ref_logps") if k in r}
    dapo_tokens = r["dapo_tokens"][0] if "dapo_tokens" in r else None
    loss, metrics = grpo_math.policy_loss(
        cfg.grpo, -x.nll, x.entropy, r["advantages"], x.weights, per_token.get("old_logps"),
        per_token.get("ref_logps"), dapo_tokens,
    )  # fmt: skip
    return Result(loss, metrics, jnp.ones((), jnp.float32))


def rollout_keys(cfg: TrainConfig) -> tuple[str, ...]:
    """The `ROLLOUT_KEYS` a GRPO run's batches carry: the ones its settings need."""
    s = cfg.grpo
    needed = {"advantages": True, "dapo_tokens": s.loss_type == "dapo", "old_logps": s.num_iterations > 1,
              "ref_logps": s.beta > 0}  # fmt: skip
    return tuple(k for k in ROLLOUT_KEYS if needed[k]) if cfg.objective == "grpo" else ()


@dataclass(frozen=True)
class Objective:
    loss: Callable[[TrainConfig, Inputs], Result]
    # the kind of dataset it trains on: "lm" (text), "preference" (interleaved pairs) or "prompts" (it trains on
    # completions sampled for them: its rows are a prompt and a completion, their logits taken whole)
    data: str
    reference: bool  # whether it needs the reference model's row log-probs (`Inputs.reference`)
    # whether its loss is `Inputs.total` divided by the summed weights: the model then computes its LM
    # head's whole gradient in the forward pass (`meshlm.fused_ce`)
    token_sum: bool = False

    @property
    def rows_per_example(self) -> int:
        """Rows of the data per example that `batch_size` counts: a preference pair is two."""
        return 2 if self.data == "preference" else 1


OBJECTIVES: dict[str, Objective] = {
    "lm": Objective(lm, "lm", reference=False, token_sum=True),
    "dpo": Objective(dpo, "preference", reference=True),
    "orpo": Objective(orpo, "preference", reference=False),
    "grpo": Objective(grpo, "prompts", reference=False),
}
