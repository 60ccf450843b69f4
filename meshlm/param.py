"""A parameter declared once: its shape, its logical axis names (which `meshlm.sharding` maps to mesh
axes) and its initialiser. The model's parameters and a LoRA adapter's are both tables of `Param`s
(`model.param_table`, `lora.adapter_table`); their axes and their random values come from here."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from meshlm.config import dtype_of


class Param(NamedTuple):
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # one logical axis name per dimension
    init: str  # "normal", "uniform", "zeros" or "constant"
    value: float = 0.0  # the normal's standard deviation, the uniform's bound, or the constant


def is_param(x: Any) -> bool:
    return isinstance(x, Param)


def axes_of(table: Any) -> Any:
    """The logical axis names of a table of `Param`s, same structure."""
    return jax.tree.map(lambda p: p.axes, table, is_leaf=is_param)


def init_table(table: Any, key: jax.Array, dtype: str) -> Any:
    """Arrays for a table of `Param`s, same structure, each drawn with its own key split from `key`."""
    leaves, treedef = jax.tree.flatten(table, is_leaf=is_param)
    keys = jax.random.split(key, len(leaves))
    dt = dtype_of(dtype)

    def make(p: Param, k: jax.Array) -> jax.Array:
        if p.init == "zeros":
            return jnp.zeros(p.shape, dt)
        if p.init == "constant":
            return jnp.full(p.shape, p.value, dt)
        if p.init == "uniform":
            return jax.random.uniform(k, p.shape, jnp.float32, -p.value, p.value).astype(dt)
        return (p.value * jax.random.normal(k, p.shape, jnp.float32)).astype(dt)

    return jax.tree.unflatten(treedef, [make(p, k) for p, k in zip(leaves, keys, strict=True)])
