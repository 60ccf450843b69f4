"""The seed's optimizer and schedule: AdamW (b1 0.9, b2 0.999, eps 1e-8), global-norm clipping at 1.0,
decoupled weight decay on matrices only, the learning rate warmed up linearly and then annealed along a
half cosine to `end_lr` over `anneal_steps`, flat after that; optionally its moments stored in bf16."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from meshlm import model
from meshlm.config import LoraConfig, ModelConfig, TrainConfig, dtype_of
from meshlm.lora import adapter_abstract, adapter_axes


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The seed's `gpt3_schedule`: linear warmup from 0, half-cosine to `end_lr` over `anneal_steps`, then flat."""
    warmup, anneal, peak, end = cfg.warmup_steps, cfg.anneal_steps, cfg.lr, cfg.end_lr

    def schedule(step: jax.Array) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.clip(step, 0, warmup) / warmup if warmup else 1.0
        anneal_pct = jnp.clip(step - warmup, 0, anneal) / anneal
        return warm * peak - (peak - end) * (1 - jnp.cos(jnp.pi * anneal_pct)) / 2

    return schedule


def trainable_axes(model_cfg: ModelConfig, lora: LoraConfig | None = None) -> model.Params:
    """Logical axes of what a run trains: the whole model, or with `lora` only the adapter."""
    return model.logical_axes(model_cfg) if lora is None else adapter_axes(model.projections(model_cfg), lora)


def trainable_abstract(model_cfg: ModelConfig, lora: LoraConfig | None = None, dtype: str = "float32") -> Any:
    """ShapeDtypeStructs of what a run trains (see `trainable_axes`)."""
    if lora is None:
        return model.abstract_params(model_cfg, dtype)
    return adapter_abstract(model.projections(model_cfg), lora, dtype)


def decay_mask(cfg: ModelConfig, lora: LoraConfig | None = None) -> model.Params:
    """True for weight matrices (two or more axes besides the stacked `layers` axis, LoRA's A and B
    included); biases, norms and adapter scales: False."""
    return jax.tree.map(
        lambda axes: sum(a != "layers" for a in axes) >= 2,
        trainable_axes(cfg, lora),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def make_optimizer(
    cfg: TrainConfig, model_cfg: ModelConfig, state_dtype: str | None = None
) -> optax.GradientTransformation:
    """The seed's AdamW. `state_dtype` (default: the config's `adam_dtype`) is how both moments are stored
    between steps, whatever the trained weights' dtype (optax would store them in the weights' own: bf16
    moments for bf16 weights), and they are updated in fp32; "bfloat16" saves 4 bytes per parameter where
    memory is short."""
    adamw = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            lr_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask(model_cfg, cfg.lora),
        ),
    )
    state_dtype = state_dtype or cfg.adam_dtype
    return stored_as(adamw, dtype_of(state_dtype))


def stored_as(inner: optax.GradientTransformation, dtype: jnp.dtype) -> optax.GradientTransformation:
    """`inner` with its floating-point state kept in `dtype` between steps and computed in fp32."""

    def cast(tree: Any, dt: jnp.dtype) -> Any:
        return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)


def schedule_count(opt_state: Any) -> jax.Array:
    """The count the learning rate is taken at: the step in a meshlm run; a continued seed run's may differ."""
    return optax.tree_utils.tree_get(
        opt_state, "count", filtering=lambda path, _: path[-1].tuple_name == "ScaleByScheduleState"
    )
