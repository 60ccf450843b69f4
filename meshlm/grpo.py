"""GRPO's math: group-relative advantages from rewards, the clipped policy loss with its KL penalty, and the
step's metrics under trl's names. Pure functions of arrays; the rollout loop that feeds them is issue 41's.

Every formula is trl 1.16's (trl/trainer/grpo_trainer.py), on its conventions:
- completions come grouped: rows [g * num_generations, (g + 1) * num_generations) answer prompt g;
- per-token arrays are [B, T] over completion tokens, right-padded, with `mask` 1 on the tokens that count;
- a reward of NaN is trl's None (the function does not apply): it is left out of every mean and std, and a
  completion no function scored gets advantage 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshlm.config import GrpoConfig

# What trl adds to a reward std before dividing by it (`_generate_and_score_completions`)
STD_EPS = 1e-4


def nanstd(x: jax.Array, axis: int | None = None) -> jax.Array:
    """The std of the non-NaN values, with Bessel's correction; NaN where fewer than two (trl utils.nanstd)."""
    mean = jnp.nanmean(x, axis=axis, keepdims=True)
    variance = jnp.nanmean((x - mean) ** 2, axis=axis)
    count = jnp.sum(~jnp.isnan(x), axis=axis)
    return jnp.sqrt(jnp.where(count > 1, variance * count / jnp.maximum(count - 1, 1), jnp.nan))


def total_rewards(rewards_per_func: jax.Array, weights: jax.Array) -> jax.Array:
    """[N] the weighted sum of each completion's rewards [N, F]; NaN where no function scored it, so that it
    stays out of its group's baseline (trl's "sum_then_normalize")."""
    total = jnp.nansum(rewards_per_func * weights, axis=1)
    return jnp.where(jnp.isnan(rewards_per_func).all(axis=1), jnp.nan, total)


def reward_std(rewards: jax.Array, num_generations: int, scale_rewards: str) -> jax.Array:
    """[N] the std each advantage is scaled by: its group's, or the batch's for "batch". With "none" it is the
    group's, which then only tells a group without spread (`frac_reward_zero_std`)."""
    if scale_rewards == "batch":
        return jnp.broadcast_to(nanstd(rewards), rewards.shape)
    return jnp.repeat(nanstd(rewards.reshape(-1, num_generations), axis=1), num_generations)


def group_advantages(rewards: jax.Array, num_generations: int, scale_rewards: str) -> jax.Array:
    """[N] each completion's reward minus its group's mean, over the std of `reward_std` (plus trl's 1e-4)
    unless `scale_rewards` is "none"; 0 where that is undefined (an unscored completion)."""
    means = jnp.repeat(jnp.nanmean(rewards.reshape(-1, num_generations), axis=1), num_generations)
    advantages = rewards - means
    if scale_rewards != "none":
        advantages = advantages / (reward_std(rewards, num_generations, scale_rewards) + STD_EPS)
    return jnp.nan_to_num(advantages, nan=0.0)


def reward_metrics(
    rewards_per_func: jax.Array, weights: jax.Array, names: list[str], num_generations: int, scale_rewards: str
) -> dict[str, jax.Array]:
    """The rewards' metrics as trl logs them: their weighted sum's mean and std, each function's mean and std
    over the completions it scored, and the share of completions whose scaling std is 0."""
    rewards = total_rewards(rewards_per_func, weights)
    std = reward_std(rewards, num_generations, scale_rewards)
    metrics = {
        "reward": jnp.nanmean(rewards),
        "reward_std": nanstd(rewards),
        # torch.isclose(std, 0) with its default atol: |std| <= 1e-8 (NaN is not close)
        "frac_reward_zero_std": jnp.mean(jnp.abs(std) <= 1e-8),
    }
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = jnp.nanmean(rewards_per_func[:, i])
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i])
    return metrics


def completion_mask(lengths: jax.Array, width: int, truncated: jax.Array, mask_truncated: bool) -> jax.Array:
    """[B, width] 1 on each completion's tokens (EOS included); with `mask_truncated` (trl's
    mask_truncated_completions) a completion cut off before its EOS counts for nothing, so a reward judged on
    a half-written answer does not train the policy."""
    mask = (jnp.arange(width)[None, :] < lengths[:, None]).astype(jnp.float32)
    return mask * (1.0 - truncated[:, None]) if mask_truncated else mask


def completion_metrics(lengths: jax.Array, truncated: jax.Array) -> dict[str, jax.Array]:
    """Completion lengths and the share cut off at max_completion_tokens, as trl's `_generate` logs them; a
    batch where nothing terminated reports its terminated lengths as 0."""
    lengths = lengths.astype(jnp.float32)
    ended = ~truncated.astype(bool)
    any_ended = ended.any()
    return {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": truncated.astype(jnp.float32).mean(),
        "completions/mean_terminated_length": jnp.where(any_ended, (lengths * ended).sum() / ended.sum(), 0.0),
        "completions/min_terminated_length": jnp.where(any_ended, jnp.min(jnp.where(ended, lengths, jnp.inf)), 0.0),
        "completions/max_terminated_length": jnp.where(any_ended, jnp.max(jnp.where(ended, lengths, -jnp.inf)), 0.0),
    }


def token_logps_and_entropy(logits: jax.Array, targets: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """Each target's log-prob [B, T] and each prediction's entropy [B, T] under the logits [B, T, V] divided by
    the sampling temperature: the distribution the completions were drawn from (trl's fused LM head)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    target_logps = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return target_logps, -(jnp.exp(logp) * logp).sum(axis=-1)


def log_importance_weights(log_ratio: jax.Array, mask: jax.Array, level: str) -> jax.Array:
    """[B, T] per token, or [B, 1] per sequence (GSPO: the mean log-ratio over the completion's tokens)."""
    if level == "token":
        return log_ratio
    return ((log_ratio * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0))[:, None]


def per_token_loss(
    s: GrpoConfig,
    logps: jax.Array,
    old_logps: jax.Array,
    ref_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The clipped surrogate plus beta * KL, per token, with the importance ratio and the KL it used
    (trl `GRPOTrainer._compute_loss`). The ratio is [B, T], or [B, 1] at sequence level; the loss broadcasts
    to [B, T] where the KL is per token. The KL is the k3 estimator exp(ref - logp) - (ref - logp) - 1, which
    is >= 0 and unbiased for KL(policy || reference) on the policy's own samples; with
    `use_bias_correction_kl` it is weighed by the ratio, so that its gradient is unbiased too (the ratio's
    gradient counts even on-policy, where its value is 1)."""
    ratio = jnp.exp(log_importance_weights(logps - old_logps, mask, s.importance_sampling_level))
    clipped = jnp.clip(ratio, 1 - s.epsilon, 1 + s.upper_epsilon)
    adv = advantages[:, None]
    loss = -jnp.minimum(ratio * adv, clipped * adv)
    if not s.beta:
        return loss, ratio, None
    kl = jnp.exp(ref_logps - logps) - (ref_logps - logps) - 1
    if s.use_bias_correction_kl:
        kl = kl * ratio
    return loss + s.beta * kl, ratio, kl


def reduce_loss(s: GrpoConfig, per_token: jax.Array, mask: jax.Array, dapo_tokens: jax.Array | None) -> jax.Array:
    """The step's loss from the per-token one, as `loss_type` weighs completions (trl `_compute_loss`):
    grpo: each completion's mean, then their mean (short completions weigh more per token);
    bnpo: the mean over the batch's tokens;
    dr_grpo: the sum over B * max_completion_tokens (a constant: no length bias);
    dapo: the sum over `dapo_tokens`, the loss tokens of the whole generation batch per optimizer step it feeds
    (trl: num_items_in_batch * gradient_accumulation_steps / steps_per_generation), else this batch's."""
    total = per_token * mask
    if s.loss_type == "grpo":
        return (total.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).mean()
    if s.loss_type == "bnpo":
        return total.sum() / jnp.maximum(mask.sum(), 1.0)
    if s.loss_type == "dr_grpo":
        return total.sum() / (mask.shape[0] * s.max_completion_tokens)
    return total.sum() / jnp.maximum(mask.sum() if dapo_tokens is None else dapo_tokens, 1.0)


def _masked_means(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x's mean over the batch's tokens and [B] over each completion's (NaN for an empty one); a per-sequence
    x [B, 1] is already one value a completion, each counted once (trl's global_masked_mean, masked_seq_mean)."""
    if x.shape[1] == 1:
        return x.mean(), x[:, 0]
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0), (x * mask).sum(-1) / mask.sum(-1)


def loss_metrics(
    s: GrpoConfig,
    ratio: jax.Array,
    kl: jax.Array | None,
    entropy: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
) -> dict[str, jax.Array]:
    """kl (when beta > 0), entropy and the clip ratios under trl's names: the share of tokens (of completions,
    at sequence level) whose ratio fell outside the clip range on the side where clipping stops the gradient,
    with the smallest low and the largest high share of one completion."""
    adv = advantages[:, None]
    low = ((ratio < 1 - s.epsilon) & (adv < 0)).astype(jnp.float32)
    high = ((ratio > 1 + s.upper_epsilon) & (adv > 0)).astype(jnp.float32)
    (low_mean, low_rows), (high_mean, high_rows) = _masked_means(low, mask), _masked_means(high, mask)
    metrics = {
        "entropy": _masked_means(entropy, mask)[0],
        "clip_ratio/low_mean": low_mean,
        "clip_ratio/low_min": jnp.nanmin(low_rows),
        "clip_ratio/high_mean": high_mean,
        "clip_ratio/high_max": jnp.nanmax(high_rows),
        "clip_ratio/region_mean": _masked_means(jnp.maximum(low, high), mask)[0],
    }
    if kl is not None:
        metrics["kl"] = _masked_means(kl, mask)[0]
    return metrics


def policy_loss(
    s: GrpoConfig,
    logps: jax.Array,
    entropy: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    old_logps: jax.Array | None = None,
    ref_logps: jax.Array | None = None,
    dapo_tokens: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO's loss of one batch of completions and its metrics, from the policy's per-token log-probs and
    entropies [B, T]. `old_logps` are the log-probs the completions were sampled with, needed when
    num_iterations > 1; without them the ratio is exp(logp - stop_gradient(logp)) = 1, whose gradient is the
    plain policy gradient. `ref_logps` are the reference model's, needed when beta > 0."""
    old = jax.lax.stop_gradient(logps) if old_logps is None else old_logps
    per_token, ratio, kl = per_token_loss(s, logps, old, ref_logps, advantages, mask)
    loss = reduce_loss(s, per_token, mask, dapo_tokens)
    return loss, {"loss": loss, **loss_metrics(s, ratio, kl, entropy, advantages, mask)}
