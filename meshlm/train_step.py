"""The sharded train state and the train step: one jitted function per config and mesh, with gradient
accumulation over micro-batches inside it, built before anything is allocated (`step_program`), so that
`meshlm train` runs and `meshlm plan` measures the same compiled program.

Parameters are kept in `param_dtype` and cast to `compute_dtype` inside the model; the optimizer state
takes the parameters' shardings, so with an `fsdp` axis it is sharded ZeRO-3 style. With a `lora`
section only the adapter has gradients and optimizer state; the frozen base is a separate argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from meshlm import footprint, model
from meshlm.config import ConfigError, LoraConfig, ModelConfig, TrainConfig
from meshlm.lora import base_storage
from meshlm.optim import lr_schedule, make_optimizer, schedule_count, trainable_abstract, trainable_axes
from meshlm.sharding import batch_ways, named_sharding, plan, with_shardings


class TrainState(NamedTuple):
    step: jax.Array
    params: model.Params  # what is trained: the model, or a LoRA run's adapter
    opt_state: Any


def state_shardings(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh, lora: LoraConfig | None = None
) -> TrainState:
    """Trained parameters by the sharding rules; each optimizer moment like its parameter; counters replicated."""
    abstract = trainable_abstract(model_cfg, lora)
    params = plan(abstract, trainable_axes(model_cfg, lora), mesh)
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_abstract = jax.eval_shape(optimizer.init, abstract)
    opt = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_abstract, params, transform_non_params=lambda _: replicated
    )
    return TrainState(replicated, params, opt)


def abstract_state(
    shardings: TrainState,
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    lora: LoraConfig | None = None,
    dtype: str = "float32",
) -> Any:
    """ShapeDtypeStructs with shardings of the trained parameters (stored as `dtype`) and their optimizer
    state: the target that restores a checkpoint onto this mesh."""
    abstract = trainable_abstract(model_cfg, lora, dtype)
    opt = jax.eval_shape(optimizer.init, abstract)
    return with_shardings(abstract, shardings.params), with_shardings(opt, shardings.opt_state)


def make_train_step(
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    shardings: TrainState,
    base_shardings: Any = None,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """One optimizer step over a batch [micro_batches, micro_batch_size, seq_len + 1]: `step(state, batch)`,
    or for a LoRA run `step(state, batch, base)`, where `base` is the frozen model (laid out as
    `base_shardings`): only the adapter in `state.params` has gradients and optimizer state.

    Gradients of the micro-batches are summed inside a `lax.scan`, so accumulation costs one compiled
    step and one micro-batch of activation memory. The state's buffers are donated; the base's are not.
    """
    policy = cfg.policy
    schedule = lr_schedule(cfg)

    def objective(params: model.Params, tokens: jax.Array, base: model.Params | None, key: jax.Array) -> Any:
        full = params if base is None else {**base, "lora": params}
        return model.loss(full, tokens, model_cfg, policy, z_loss=cfg.z_loss, dropout_key=key)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def step(state: TrainState, batch: jax.Array, base: model.Params | None) -> tuple[TrainState, dict[str, Any]]:
        keys = jax.random.split(jax.random.fold_in(jax.random.key(cfg.seed), state.step), batch.shape[0])

        def micro(acc: model.Params, xs: tuple[jax.Array, jax.Array]) -> tuple[model.Params, tuple[jax.Array, ...]]:
            tokens, key = xs
            (total, aux), grads = grad_fn(state.params, tokens, base, key)
            acc = jax.tree.map(jnp.add, acc, grads)
            acc = jax.lax.with_sharding_constraint(acc, shardings.params)
            return acc, (total, aux["ce"], jnp.square(optax.tree.norm(grads)))

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, (totals, ces, micro_sq) = jax.lax.scan(micro, zeros, (batch, keys))
        grads = jax.tree.map(lambda g: g / batch.shape[0], grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": ces.mean(),
            "loss_with_z": totals.mean(),
            "grad_norm": optax.tree.norm(grads),
            "micro_grad_sq": micro_sq.mean(),
            "lr": schedule(schedule_count(state.opt_state)),
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_sharding = named_sharding(shardings.step.mesh, (None, "batch", "seq"))
    if cfg.lora is None:
        return jax.jit(
            lambda state, batch: step(state, batch, None),
            in_shardings=(shardings, batch_sharding),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sharding, base_shardings),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )


@dataclass(frozen=True)
class StepProgram:
    """`meshlm train`'s step for one config on one mesh before anything is allocated: the jitted step,
    ShapeDtypeStructs (with their shardings) of its arguments, and what it was built from. `meshlm train`
    runs what `compile()` returns; `meshlm plan` reports its footprint."""

    fn: Callable[..., Any]
    inputs: tuple[Any, ...]  # (state, batch), or (state, batch, base) for a LoRA run
    optimizer: optax.GradientTransformation
    shardings: TrainState
    mesh: Mesh

    def compile(self) -> Any:
        """The compiled step (`footprint.OutOfMemory` where the compiler refuses it for the device's memory)."""
        with jax.set_mesh(self.mesh):  # the activation constraints apply inside the mesh
            return footprint.compile_for(self.fn.lower(*self.inputs))

    @property
    def base_shardings(self) -> Any:
        return None if len(self.inputs) < 3 else jax.tree.map(lambda a: a.sharding, self.inputs[2])


def step_program(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh, seq_len: int) -> StepProgram:
    """The train step of `cfg` for `model_cfg` on `mesh` over sequences of `seq_len` tokens."""
    optimizer = make_optimizer(cfg, model_cfg)
    shardings = state_shardings(model_cfg, optimizer, mesh, cfg.lora)
    params, opt_state = abstract_state(shardings, model_cfg, optimizer, cfg.lora, cfg.param_dtype)
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step), params, opt_state)
    batch_shape = (cfg.micro_batches, cfg.micro_batch_size, seq_len + 1)
    batch = jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=named_sharding(mesh, (None, "batch", "seq")))
    inputs: tuple[Any, ...] = (state, batch)
    base_shardings = None
    if cfg.lora is not None:
        dtype, quantize = base_storage(cfg)
        base = model.abstract_params(model_cfg, dtype, quantize)
        base_shardings = plan(base, model.logical_axes(model_cfg, quantize=quantize), mesh)
        inputs += (with_shardings(base, base_shardings),)
    fn = make_train_step(cfg, model_cfg, optimizer, shardings, base_shardings)
    return StepProgram(fn, inputs, optimizer, shardings, mesh)


def check_fits(compiled: Any, mesh: Mesh, cfg: TrainConfig) -> footprint.Footprint:
    """The compiled step's footprint per device, once it is known to fit the devices' memory."""
    used = footprint.Footprint.of(compiled)
    capacity = footprint.device_capacity(mesh.devices.flat[0])
    if capacity is not None and used.total > capacity:
        raise footprint.OutOfMemory(out_of_memory(cfg, mesh, used.total, capacity), used.total, capacity)
    return used


def out_of_memory(cfg: TrainConfig, mesh: Mesh, needed: int | None, capacity: int | None) -> str:
    """One line: what the step needs, what the device has, and the first settings worth trying."""
    tries = []
    if cfg.remat != "full":
        tries.append("remat=full")
    sizes = dict(mesh.shape)
    if sizes["data"] > 1:
        tries.append(f'mesh "fsdp={sizes["data"] * sizes["fsdp"]},model={sizes["model"]}"')
    if cfg.micro_batch_size > batch_ways(mesh) and (cfg.batch_size // (2 * cfg.micro_batches)) % batch_ways(mesh) == 0:
        tries.append(f"micro_batches={2 * cfg.micro_batches}")
    if cfg.lora is None and cfg.adam_dtype == "float32":
        tries.append("adam_dtype=bfloat16")
    if cfg.lora is None:
        tries.append("a lora section")
    needs = "more memory than the device has" if needed is None else f"{footprint.gib(needed)} per device"
    has = "" if capacity is None else f", the device has {footprint.gib(capacity)}"
    try_line = f"; try {' or '.join(tries[:3])}" if tries else ""
    return f"the train step needs {needs}{has}{try_line} (`meshlm plan` finds a setting that fits)"


def make_eval_step(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> Callable:
    """Summed target loss and target count over rows [B, seq_len + 1] weighted per row."""
    policy = replace(cfg.policy, remat="none")

    def evaluate(params: model.Params, tokens: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        mask = jnp.broadcast_to(weights[:, None], (tokens.shape[0], tokens.shape[1] - 1))
        _, aux = model.loss(params, tokens, model_cfg, policy, loss_mask=mask)
        return aux["ce"] * aux["tokens"], aux["tokens"]

    shard = named_sharding(mesh, ("batch", "seq"))
    return jax.jit(evaluate, in_shardings=(None, shard, named_sharding(mesh, ("batch",))))


def check_batch(cfg: TrainConfig, mesh: Mesh) -> None:
    ways = batch_ways(mesh)
    if cfg.micro_batch_size % ways:
        raise ConfigError(
            f"batch_size {cfg.batch_size} / micro_batches {cfg.micro_batches} = {cfg.micro_batch_size} sequences per "
            f"micro-batch, not divisible by the mesh's batch axes data x fsdp = {ways}"
        )
