"""The sharded train state and the train step: one jitted function per config and mesh, with gradient
accumulation over micro-batches inside it, built before anything is allocated (`step_program`), so that
`meshlm train` runs and `meshlm plan` measures the same compiled program.

The step runs the model on a batch of rows (tokens, loss weights, document segments) and takes the loss
from the objective table (`meshlm.objectives`): next-token loss, DPO, ORPO or GRPO, never a branch here.

Parameters are kept in `param_dtype` and cast to `compute_dtype` inside the model; the optimizer state
takes the parameters' shardings, so with an `fsdp` axis it is sharded ZeRO-3 style; with `optimizer_memory:
host` it stays in pinned host memory between steps, and each step brings it to the device for the update and
returns it, one parameter array at a time (the JAX memories API: memory kinds on the shardings). With a `lora`
section only the adapter has gradients and optimizer state; the frozen base is a separate argument, as is
a full DPO run's frozen copy of its starting model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from meshlm import footprint, grpo, model
from meshlm.config import ConfigError, LoraConfig, ModelConfig, Policy, TrainConfig
from meshlm.lora import base_storage
from meshlm.objectives import OBJECTIVES, Inputs, Result, rollout_keys, sequence_logps, target_weights
from meshlm.optim import lr_schedule, make_optimizer, schedule_count, trainable_abstract, trainable_axes
from meshlm.sharding import batch_ways, named_sharding, plan, with_shardings


class TrainState(NamedTuple):
    step: jax.Array
    params: model.Params  # what is trained: the model, or a LoRA run's adapter
    opt_state: Any


# The memory kind of optimizer state kept on the host between steps (`optimizer_memory: host`): pinned host
# memory, which the device reads and writes directly, and which TPU, GPU and CPU backends have.
HOST_MEMORY = "pinned_host"


def state_shardings(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    lora: LoraConfig | None = None,
    memory: str = "device",
) -> TrainState:
    """Trained parameters by the sharding rules; each optimizer moment like its parameter; counters replicated.
    With `memory` "host" (the config's `optimizer_memory`) the optimizer state's shardings name host memory."""
    abstract = trainable_abstract(model_cfg, lora)
    params = plan(abstract, trainable_axes(model_cfg, lora), mesh)
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_abstract = jax.eval_shape(optimizer.init, abstract)
    opt = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_abstract, params, transform_non_params=lambda _: replicated
    )
    if memory == "host":
        check_host_memory(mesh)
        opt = jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), opt)
    return TrainState(replicated, params, opt)


def check_host_memory(mesh: Mesh) -> None:
    """A ConfigError unless the mesh's devices have pinned host memory to keep the optimizer state in."""
    if isinstance(mesh, AbstractMesh):  # no devices to ask (a GPU plan): every GPU backend has it
        return
    device = mesh.devices.flat[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # a device known only by its topology (a TPU plan) has no runtime to ask; TPUs have it
        return
    if HOST_MEMORY not in kinds:
        raise ConfigError(
            f"optimizer_memory host: {device.platform} devices have no {HOST_MEMORY} memory (they have "
            f"{sorted(kinds)}); keep optimizer_memory device"
        )


def on_device(shardings: Any) -> Any:
    """`shardings` in device memory: where the step updates an optimizer state kept on the host."""
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def offloaded(shardings: TrainState) -> bool:
    """Whether the optimizer state stays in host memory between steps."""
    return any(s.memory_kind == HOST_MEMORY for s in jax.tree.leaves(shardings.opt_state))


def streamed_update(
    optimizer: optax.GradientTransformation,
    clip_norm: float,
    grads: Any,
    state: Any,
    params: Any,
    shardings: TrainState,
) -> tuple[Any, Any]:
    """The updated parameters and `state` of `optimizer` for a `state` kept in host memory, one parameter array at
    a time: each array's state comes to the device, is updated with the array and goes back before the next one
    comes (`lax.optimization_barrier` orders them; XLA would otherwise bring the whole state in at once). The
    gradients are clipped to `clip_norm` by their global norm as the optimizer's clip does it, array by array;
    its own clip then sees one array whose norm is within it, and leaves it as it is."""
    norm = optax.tree.norm(grads)
    treedef = jax.tree.structure(params)
    index = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    replicated = shardings.step

    def empty(x: Any) -> jax.Array:
        return jnp.zeros((0,) * x.ndim, x.dtype)

    def only(i: int, tree: Any) -> Any:
        return jax.tree.map(lambda x, k: x if k == i else empty(x), tree, index)

    def clipped(g: jax.Array) -> jax.Array:  # optax.clip_by_global_norm's arithmetic
        return jnp.where(norm < clip_norm, g, (g / norm.astype(g.dtype)) * clip_norm)

    def move(i: int, tree: Any, kind: str) -> Any:
        """Parameter `i`'s state (and the counters) in `tree` moved to memory `kind`; the other arrays empty."""
        return optax.tree_map_params(
            optimizer,
            lambda x, s, k: jax.device_put(x, s.with_memory_kind(kind)) if k == i else empty(x),
            tree,
            shardings.params,
            index,
            transform_non_params=lambda x: jax.device_put(x, replicated.with_memory_kind(kind)),
        )

    new_params, states, done = [], [], None
    for i in range(treedef.num_leaves):
        state_i = move(i, state, "device")
        if done is not None:
            state_i, _ = jax.lax.optimization_barrier((state_i, done))
        params_i = only(i, params)
        update_i, new_i = optimizer.update(jax.tree.map(clipped, only(i, grads)), state_i, params_i)
        new_params.append(jax.tree.leaves(optax.apply_updates(params_i, update_i))[i])
        states.append(move(i, new_i, HOST_MEMORY))
        done = (states[-1], new_params[-1])
    owner = optax.tree_map_params(optimizer, lambda _, k: k, state, index, transform_non_params=lambda _: -1)
    leaves = [jax.tree.leaves(states[k])[j] for j, k in enumerate(jax.tree.leaves(owner))]
    return jax.tree.unflatten(treedef, new_params), jax.tree.unflatten(jax.tree.structure(states[-1]), leaves)


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


# The arrays of a batch: per row and token [..., rows, seq_len + 1], or per row [..., rows]. A GRPO batch's
# per-token log-probs are aligned with its tokens, as the weights are (0 at the first token).
ROW_TOKENS = {"tokens": jnp.int32, "weights": jnp.float32, "segments": jnp.int32}
PER_TOKEN = {**ROW_TOKENS, "old_logps": jnp.float32, "ref_logps": jnp.float32}
PER_ROW = {"reference": jnp.float32, "examples": jnp.float32, "rows": jnp.int32, "advantages": jnp.float32,
           "dapo_tokens": jnp.float32}  # fmt: skip


def frozen_model(cfg: TrainConfig) -> str | None:
    """What the step's frozen argument (after the batch) is: a LoRA run's "base", a full DPO run's frozen copy
    of its starting model ("reference", with `dpo.reference: copy`; a full GRPO run's with beta > 0, whose
    reference log-probs the rollout loop computes from it), or None: no such argument."""
    if cfg.lora is not None:
        return "base"
    if OBJECTIVES[cfg.objective].reference and cfg.dpo.reference == "copy":
        return "reference"
    if cfg.objective == "grpo" and cfg.grpo.beta:
        return "reference"
    return None


def reference_in_step(cfg: TrainConfig) -> bool:
    """Whether each step runs a reference model's forward pass: DPO with LoRA (the base, adapter off) or with
    a frozen copy; a full DPO run's precomputed log-probs cost the step nothing."""
    return OBJECTIVES[cfg.objective].reference and frozen_model(cfg) is not None


def batch_keys(cfg: TrainConfig) -> tuple[str, ...]:
    """The arrays of a training batch: the rows, and for a full DPO run without a frozen copy the reference
    log-probs precomputed before training."""
    precomputed = OBJECTIVES[cfg.objective].reference and not reference_in_step(cfg)
    return (*ROW_TOKENS, *(("reference",) if precomputed else ()), *rollout_keys(cfg))


def rows_per_micro_batch(cfg: TrainConfig) -> int:
    """Rows in a micro-batch: `batch_size` counts examples, and a preference pair is two rows."""
    return cfg.micro_batch_size * OBJECTIVES[cfg.objective].rows_per_example


def batch_shardings(mesh: Mesh, keys: tuple[str, ...], leading: int = 0) -> dict[str, NamedSharding]:
    """Rows split over the mesh's batch axes; `leading` axes (the micro-batches) whole."""
    lead = (None,) * leading
    return {k: named_sharding(mesh, (*lead, "batch", "seq") if k in PER_TOKEN else (*lead, "batch")) for k in keys}


def abstract_batch(mesh: Mesh, keys: tuple[str, ...], rows: tuple[int, ...], seq_len: int) -> dict[str, Any]:
    """ShapeDtypeStructs with shardings of a batch's arrays, `rows` [..., rows] of `seq_len + 1` tokens each."""
    shardings = batch_shardings(mesh, keys, len(rows) - 1)
    return {
        k: jax.ShapeDtypeStruct((*rows, seq_len + 1), PER_TOKEN[k], sharding=s)
        if k in PER_TOKEN
        else jax.ShapeDtypeStruct(rows, PER_ROW[k], sharding=s)
        for k, s in shardings.items()
    }


def row_logps(params: model.Params, batch: dict[str, jax.Array], model_cfg: ModelConfig, policy: Policy) -> jax.Array:
    """Each row's log-prob [R] of its weighted targets, without dropout: the DPO reference's, computed in
    the step or once before training by the same code."""
    nll = model.target_nll(params, batch["tokens"], model_cfg, policy, segments=batch["segments"]).nll
    return sequence_logps(nll, batch["weights"][:, 1:])


def token_logps(
    params: model.Params,
    batch: dict[str, jax.Array],
    model_cfg: ModelConfig,
    policy: Policy,
    temperature: float,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Each target's log-prob and each prediction's entropy [R, T] of rows {"tokens", "segments"} [R, T + 1]
    under the logits over the sampling temperature (`grpo.token_logps_and_entropy`): what a GRPO step trains
    on, and what the rollout loop computes its old and reference log-probs with. The logits exist whole."""
    tokens, segments = batch["tokens"], batch["segments"]
    x = model.hidden_states(
        params, tokens[:, :-1], model_cfg, policy, segments=segments[:, :-1], dropout_key=dropout_key
    )
    return grpo.token_logps_and_entropy(model.unembed(params, x, model_cfg), tokens[:, 1:], temperature)


def objective_forward(cfg: TrainConfig, model_cfg: ModelConfig, policy: Policy) -> Callable[..., Result]:
    """`forward(params, frozen, batch, dropout_key=None) -> Result`: the run's objective on a batch of rows.
    The model is `params`, or a LoRA run's `frozen` base with `params` as its adapter; DPO's reference
    log-probs come with the batch, or from the `frozen` model (a LoRA run's base: the adapter switched off).
    An objective on prompts (GRPO) sees the targets' log-probs and entropies at the sampling temperature."""
    objective = OBJECTIVES[cfg.objective]

    def forward(
        params: model.Params, frozen: model.Params | None, batch: dict[str, jax.Array], key: jax.Array | None = None
    ) -> Result:
        full = params if cfg.lora is None else {**frozen, "lora": params}
        if objective.data == "prompts":
            logps, entropy = token_logps(full, batch, model_cfg, policy, cfg.grpo.temperature, key)
            return objective.loss(cfg, Inputs.of(-logps, jnp.zeros_like(logps), batch, entropy=entropy))
        weights = target_weights(batch) if objective.token_sum else None
        tokens, segments = batch["tokens"], batch["segments"]
        out = model.target_nll(
            full, tokens, model_cfg, policy, segments=segments, dropout_key=key, weights=weights, z_loss=cfg.z_loss
        )
        reference = batch.get("reference")
        if objective.reference and reference is None:
            reference = jax.lax.stop_gradient(row_logps(frozen, batch, model_cfg, policy))
        return objective.loss(cfg, Inputs.of(out.nll, out.log_z, batch, reference, out.total))

    return forward


def _nonzero(count: jax.Array) -> jax.Array:
    return jnp.where(count > 0, count, 1.0)


def make_train_step(
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    shardings: TrainState,
    frozen_shardings: Any = None,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """One optimizer step over a batch {"tokens", "weights", "segments"} [micro_batches, rows, seq_len + 1]
    (and "reference" [micro_batches, rows] where `batch_keys` says): `step(state, batch)`, or
    `step(state, batch, frozen)` with the frozen model that `frozen_model` names, laid out as
    `frozen_shardings`. In a LoRA run only the adapter in `state.params` has gradients and optimizer state.

    Each micro-batch's objective is a mean over its units (tokens, pairs); its gradient is weighted by its
    count of units and the sum divided by the batch's count, so a step's loss and update are the same
    whatever `micro_batches` is. The gradients are summed inside a `lax.scan`: accumulation costs one
    compiled step and one micro-batch of activation memory. The state's buffers are donated; the frozen
    model's are not.
    """
    forward = objective_forward(cfg, model_cfg, cfg.policy)
    schedule = lr_schedule(cfg)
    host = offloaded(shardings)

    def weighted(params: model.Params, frozen: Any, batch: dict[str, jax.Array], key: jax.Array) -> Any:
        result = forward(params, frozen, batch, key)
        return result.loss * result.count, result

    grad_fn = jax.value_and_grad(weighted, has_aux=True)

    def step(state: TrainState, batch: dict[str, jax.Array], frozen: Any) -> tuple[TrainState, dict[str, Any]]:
        micro_batches = batch["tokens"].shape[0]
        keys = jax.random.split(jax.random.fold_in(jax.random.key(cfg.seed), state.step), micro_batches)

        def micro(acc: model.Params, xs: tuple[dict[str, jax.Array], jax.Array]) -> tuple[model.Params, Any]:
            rows, key = xs
            (_, result), grads = grad_fn(state.params, frozen, rows, key)
            acc = jax.tree.map(jnp.add, acc, grads)
            acc = jax.lax.with_sharding_constraint(acc, shardings.params)
            mean_sq = jnp.square(optax.tree.norm(grads) / _nonzero(result.count))  # the micro-batch's mean gradient
            return acc, (result.metrics, result.count, mean_sq)

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, (metrics, counts, micro_sq) = jax.lax.scan(micro, zeros, (batch, keys))
        count = _nonzero(counts.sum())
        grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
        if host:  # the state comes to the device array by array for the update and goes back
            lr = schedule(jax.device_put(schedule_count(state.opt_state), shardings.step))
            params, opt_state = streamed_update(
                optimizer, cfg.clip_norm, grads, state.opt_state, state.params, shardings
            )
        else:
            lr = schedule(schedule_count(state.opt_state))
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        metrics = {k: (v * counts).sum() / count for k, v in metrics.items()}
        metrics |= {"grad_norm": optax.tree.norm(grads), "micro_grad_sq": micro_sq.mean(), "lr": lr}
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_sharding = batch_shardings(shardings.step.mesh, batch_keys(cfg), leading=1)
    if frozen_shardings is None:
        return jax.jit(
            lambda state, batch: step(state, batch, None),
            in_shardings=(shardings, batch_sharding),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sharding, frozen_shardings),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )


@dataclass(frozen=True)
class StepProgram:
    """`meshlm train`'s step for one config on one mesh before anything is allocated: the jitted step,
    ShapeDtypeStructs (with their shardings) of its arguments, and what it was built from. `meshlm train`
    runs what `compile()` returns; `meshlm plan` reports its footprint."""

    fn: Callable[..., Any]
    inputs: tuple[Any, ...]  # (state, batch), or (state, batch, frozen): see `frozen_model`
    optimizer: optax.GradientTransformation
    shardings: TrainState
    mesh: Mesh

    def compile(self) -> Any:
        """The compiled step (`footprint.OutOfMemory` where the compiler refuses it for the device's memory)."""
        with jax.set_mesh(self.mesh):  # the activation constraints apply inside the mesh
            return footprint.compile_for(self.fn.lower(*self.inputs))

    @property
    def frozen_shardings(self) -> Any:
        return None if len(self.inputs) < 3 else jax.tree.map(lambda a: a.sharding, self.inputs[2])


def _frozen_abstract(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh, shardings: TrainState) -> Any:
    """ShapeDtypeStructs with shardings of the step's frozen model (`frozen_model`): a LoRA run's base as
    `base_storage` keeps it, a DPO reference laid out like the model it copies; None without one."""
    kind = frozen_model(cfg)
    if kind == "reference":
        return with_shardings(model.abstract_params(model_cfg, cfg.param_dtype), shardings.params)
    if kind == "base":
        dtype, quantize = base_storage(cfg)
        return model.placed_params(model_cfg, mesh, dtype, quantize)  # int8 codes laid out as the base was loaded
    return None


def step_program(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh, seq_len: int) -> StepProgram:
    """The train step of `cfg` for `model_cfg` on `mesh` over sequences of `seq_len` tokens."""
    optimizer = make_optimizer(cfg, model_cfg)
    shardings = state_shardings(model_cfg, optimizer, mesh, cfg.lora, cfg.optimizer_memory)
    params, opt_state = abstract_state(shardings, model_cfg, optimizer, cfg.lora, cfg.param_dtype)
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=shardings.step), params, opt_state)
    batch = abstract_batch(mesh, batch_keys(cfg), (cfg.micro_batches, rows_per_micro_batch(cfg)), seq_len)
    frozen = _frozen_abstract(cfg, model_cfg, mesh, shardings)
    frozen_shardings = None if frozen is None else jax.tree.map(lambda a: a.sharding, frozen)
    fn = make_train_step(cfg, model_cfg, optimizer, shardings, frozen_shardings)
    inputs = (state, batch) if frozen is None else (state, batch, frozen)
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
    if cfg.lora is None and cfg.optimizer_memory == "device" and mesh.devices.flat[0].platform != "cpu":
        tries.append("optimizer_memory=host")
    if cfg.lora is None:
        tries.append("a lora section")
    needs = "more memory than the device has" if needed is None else f"{footprint.gib(needed)} per device"
    has = "" if capacity is None else f", the device has {footprint.gib(capacity)}"
    try_line = f"; try {' or '.join(tries[:3])}" if tries else ""
    return f"the train step needs {needs}{has}{try_line} (`meshlm plan` finds a setting that fits)"


def eval_keys(cfg: TrainConfig) -> tuple[str, ...]:
    """The arrays of an evaluation batch: a training batch's, and each row's weight (0: it only pads)."""
    return (*batch_keys(cfg), "examples")


def make_eval_step(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> Callable[..., Result]:
    """`evaluate(params, frozen, batch) -> Result`: the objective on a batch of rows [rows, seq_len + 1]
    (`eval_keys`), without dropout; batches combine by their `count`, as the step's micro-batches do."""
    forward = objective_forward(cfg, model_cfg, replace(cfg.policy, remat="none"))
    shardings = batch_shardings(mesh, eval_keys(cfg))
    return jax.jit(lambda params, frozen, batch: forward(params, frozen, batch), in_shardings=(None, None, shardings))


def make_reference_step(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> Callable[..., Any]:
    """`reference(params, batch) -> (logps, rows)`, both [rows] and on every process: the row log-probs of a
    batch {"tokens", "weights", "segments", "rows"} (the rows' ids, -1 for a row that only pads) under the
    model `params`, for the pass over the data before training."""
    policy = replace(cfg.policy, remat="none")
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(
        lambda params, batch: (row_logps(params, batch, model_cfg, policy), batch["rows"]),
        in_shardings=(None, batch_shardings(mesh, (*ROW_TOKENS, "rows"))),
        out_shardings=(replicated, replicated),
    )


def make_logps_step(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> Callable[..., jax.Array]:
    """`logps(params, batch) -> [rows, seq_len + 1]`: `token_logps` of a GRPO micro-batch under the model
    `params` (the policy, or its reference), without dropout, aligned with the tokens as the step's
    "old_logps" and "ref_logps" are (0 before the first target)."""
    policy = replace(cfg.policy, remat="none")

    def logps(params: model.Params, batch: dict[str, jax.Array]) -> jax.Array:
        values, _ = token_logps(params, batch, model_cfg, policy, cfg.grpo.temperature)
        return jnp.pad(values, ((0, 0), (1, 0)))

    return jax.jit(logps, in_shardings=(None, batch_shardings(mesh, tuple(ROW_TOKENS))))


def check_batch(cfg: TrainConfig, mesh: Mesh) -> None:
    ways = batch_ways(mesh)
    if cfg.micro_batch_size % ways:
        raise ConfigError(
            f"batch_size {cfg.batch_size} / micro_batches {cfg.micro_batches} = {cfg.micro_batch_size} sequences per "
            f"micro-batch, not divisible by the mesh's batch axes data x fsdp = {ways}"
        )
