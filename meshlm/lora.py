"""LoRA: what an adapter is and computes, in one place. A projection W gains a low-rank update
W + s·A·B, where A [in..., rank] and B [rank, out...] are trained and s = alpha / rank is a constant of
the adapter; the frozen base can be kept in a low-precision or quantized form (QLoRA).

Why one module: the model runs adapters, the training step trains them, the formats merge them into a
base and the planner sizes them, and all of them must agree on what an adapter is. So its parameters
(shapes, logical axes, initialisation), its size, the update it makes (`delta`: the forward pass and
merging compute the same s·A·B), its dropout and how a LoRA run stores its frozen base are defined here
once. It sits beside the model, not above it: what it needs to know of the base's projections comes in
as `Projection`s (`model.projections`). PEFT's files are read and written by `meshlm.formats.adapters`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import PROJECTIONS, QUANTIZED, ConfigError, LoraConfig, TrainConfig
from meshlm.param import Param, axes_of, init_table


class Projection(NamedTuple):
    """A base projection as an adapter sees it (`model.projections` gives each of them)."""

    weight: Param  # the stacked weight [layers, in..., out...]
    n_in: int  # how many of its dimensions after `layers` are inputs

    @property
    def ins(self) -> tuple[int, ...]:
        return self.weight.shape[1 : 1 + self.n_in]

    @property
    def outs(self) -> tuple[int, ...]:
        return self.weight.shape[1 + self.n_in :]


# ---------------------------------------------------------------------------------------------------
# The adapter's parameters


def adapter_params(projection: Projection, rank: int, scale: float) -> dict[str, Param]:
    """One projection's adapter: A [layers, in..., rank] initialised as PEFT does (kaiming-uniform, bound
    1 / sqrt(fan_in)), B [layers, rank, out...] zero (so a fresh adapter changes nothing), and `scale`
    per layer. A and B take the base weight's axis names on its input and output sides (heads and d_ff
    split as in the base); the rank axis is replicated."""
    (L, *_), (_, *axes), n_in = projection.weight.shape, projection.weight.axes, projection.n_in
    ins, outs = projection.ins, projection.outs
    return {
        "a": Param((L, *ins, rank), ("layers", *axes[:n_in], None), "uniform", 1 / math.sqrt(math.prod(ins))),
        "b": Param((L, rank, *outs), ("layers", None, *axes[n_in:]), "zeros"),
        "scale": Param((L,), ("layers",), "constant", scale),
    }


def placed_axes(projections: dict[str, Projection], adapter: Any) -> Any:
    """The logical axis names of an adapter's arrays (role -> {"a", "b", "scale"}), whatever its rank."""
    return {role: axes_of(adapter_params(projections[role], parts["a"].shape[-1], 0.0))
            for role, parts in adapter.items()}  # fmt: skip


def slot_table(projections: dict[str, Projection], slots: int, rank: int) -> dict[str, dict[str, Param]]:
    """An engine's adapter slots: an adapter of `rank` on every projection, with a slot axis (replicated)
    after layers, all zeros. Slot 0 stays zero: the base's rows run it."""
    table = {}
    for role, projection in projections.items():
        one = adapter_params(projection, rank, 0.0)
        table[role] = {k: Param((p.shape[0], slots, *p.shape[1:]), (p.axes[0], None, *p.axes[1:]), "zeros")
                       for k, p in one.items()}  # fmt: skip
    return table


def fill_slot(adapter: dict[str, dict[str, np.ndarray]], projections: dict[str, Projection], rank: int) -> Any:
    """A host adapter (role -> {"a", "b", "scale"}) as one slot's contents: every projection, its rank
    zero-padded to the slots' `rank` (zeros change nothing), zeros for projections it does not adapt."""
    if (widest := max(parts["a"].shape[-1] for parts in adapter.values())) > rank:
        raise ConfigError(f"the adapter's rank {widest} exceeds the adapter slots' rank {rank} (max_lora_rank)")
    slot = {}
    for role, projection in projections.items():
        (L, *ins), outs = projection.weight.shape[: 1 + projection.n_in], projection.outs
        a, b, scale = np.zeros((L, *ins, rank), np.float32), np.zeros((L, rank, *outs), np.float32), np.zeros(L)
        if role in adapter:
            r = adapter[role]["a"].shape[-1]
            a[..., :r], b[:, :r], scale[:] = adapter[role]["a"], adapter[role]["b"], adapter[role]["scale"]
        slot[role] = {"a": a, "b": b, "scale": scale.astype(np.float32)}
    return slot


def adapter_table(projections: dict[str, Projection], lora: LoraConfig) -> dict[str, dict[str, Param]]:
    """A LoRA adapter's parameters (`adapter_params` for each target), its rank checked against each projection."""
    for role in lora.targets:
        fan_in, fan_out = math.prod(projections[role].ins), math.prod(projections[role].outs)
        if lora.rank > min(fan_in, fan_out):
            raise ConfigError(f"lora: rank {lora.rank} exceeds projection {role!r} ({fan_in} -> {fan_out})")
    return {role: adapter_params(projections[role], lora.rank, lora.scale) for role in lora.targets}


def init_adapter(
    projections: dict[str, Projection], lora: LoraConfig, key: jax.Array, dtype: str = "float32"
) -> dict[str, dict[str, jax.Array]]:
    """A fresh LoRA adapter, role -> {"a", "b", "scale"} (see `adapter_table`); the model runs it when it
    is `params["lora"]`."""
    return init_table(adapter_table(projections, lora), key, dtype)


def adapter_abstract(projections: dict[str, Projection], lora: LoraConfig, dtype: str = "float32") -> Any:
    """ShapeDtypeStructs of a fresh adapter, computed without allocating anything."""
    return jax.eval_shape(lambda: init_adapter(projections, lora, jax.random.key(0), dtype))


def adapter_axes(projections: dict[str, Projection], lora: LoraConfig) -> Any:
    """The adapter's logical axis names, same structure as its parameters."""
    return axes_of(adapter_table(projections, lora))


def adapter_size(projections: dict[str, Projection], lora: LoraConfig) -> int:
    """The parameters a LoRA run trains: its As and Bs (the per-layer scales are constants)."""
    table = adapter_table(projections, lora)
    return sum(math.prod(p["a"].shape) + math.prod(p["b"].shape) for p in table.values())


# ---------------------------------------------------------------------------------------------------
# What an adapter computes


def dropout(x: jax.Array, rate: float, key: jax.Array | None, layer: jax.Array, role: str) -> jax.Array:
    """PEFT's lora_dropout on the input x of layer `layer`'s adapter of `role`: each element kept with
    probability 1 - rate and scaled by 1 / (1 - rate), each projection of each layer with its own mask.
    Without a key (inference) or at rate 0, x as is."""
    if key is None or rate == 0:
        return x
    key = jax.random.fold_in(jax.random.fold_in(key, layer), PROJECTIONS.index(role))
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0).astype(x.dtype)


def delta(a: Any, b: Any, scale: Any, x: Any = None) -> Any:
    """One layer's update: what the adapter A [in..., rank], B [rank, out...] adds to its projection's
    output for an input x [..., in...], scale · (x A) B in x's dtype; or, without x (the identity input),
    what it adds to the weight, scale · A B [in..., out...]. numpy arrays (merging on the host) or jax
    arrays (the forward pass)."""
    dtype = a.dtype if x is None else x.dtype
    down = a.astype(dtype) if x is None else _contract(x, a.astype(dtype), a.ndim - 1)
    return scale.astype(dtype) * _contract(down, b.astype(dtype), 1)


def row_delta(a: jax.Array, b: jax.Array, scale: jax.Array, x: jax.Array) -> jax.Array:
    """What each row's own adapter adds to its projection's output: `delta` with one adapter per row of
    x [B, T, in...], gathered from an engine's adapter slots as a [B, in..., rank], b [B, rank, out...] and
    scale [B]. The base's rows carry a zero adapter, so a batch of any mix of adapters runs one program."""
    n_in = a.ndim - 2
    shared, rest = "ijklmnop"[:n_in], "qrstuvwx"[: b.ndim - 2]
    down = jnp.einsum(f"bt{shared},b{shared}z->btz", x, a.astype(x.dtype))
    up = jnp.einsum(f"btz,bz{rest}->bt{rest}", down, b.astype(x.dtype))
    return scale.astype(x.dtype).reshape(-1, *(1,) * (up.ndim - 1)) * up


def _contract(x: Any, y: Any, n: int) -> Any:
    """x's last n dimensions against y's first n, as tensordot but written as an einsum: for jax arrays
    the two are one dot_general, and numpy's einsum sums in the order merging has always used."""
    xp = np if isinstance(x, np.ndarray) else jnp
    shared, rest = "ijklmnop"[:n], "qrstuvwx"[: y.ndim - n]
    return xp.einsum(f"...{shared},{shared}{rest}->...{rest}", x, y)


# ---------------------------------------------------------------------------------------------------
# The frozen base


def base_storage(cfg: TrainConfig) -> tuple[str, str | None]:
    """How a LoRA run keeps its frozen base: (dtype, quantize). A quantized base keeps its other weights
    (embedding, norms, head) in the compute dtype."""
    if cfg.frozen_dtype in QUANTIZED:
        return cfg.compute_dtype, cfg.frozen_dtype
    return cfg.frozen_dtype, None
