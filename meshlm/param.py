"""A parameter declared once: its shape, its logical axis names (which `meshlm.sharding` maps to mesh
axes) and its initialiser. The model's parameters and a LoRA adapter's are both tables of `Param`s
(`model.param_table`, `lora.adapter_table`); their axes and their random values come from here."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from meshlm.config import dtype_of


class Param(NamedTuple):
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # one logical axis name per dimension
    init: str  # "normal", "uniform", "zeros" or "constant"
    value: float = 0.0  # the normal's standard deviation, the uniform's bound, or the constant

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def is_param(x: Any) -> bool:
    return isinstance(x, Param)


def axes_of(table: Any) -> Any:
    """The logical axis names of a table of `Param`s, same structure."""
    return jax.tree.map(lambda p: p.axes, table, is_leaf=is_param)


def is_stacked(p: Param) -> bool:
    """Whether `p` is a stack of per-layer weights (its first axis is `layers`)."""
    return bool(p.axes) and p.axes[0] == "layers"


def _draw(p: Param, key: jax.Array, shape: tuple[int, ...], dt: Any) -> jax.Array:
    if p.init == "zeros":
        return jnp.zeros(shape, dt)
    if p.init == "constant":
        return jnp.full(shape, p.value, dt)
    if p.init == "uniform":
        return jax.random.uniform(key, shape, jnp.float32, -p.value, p.value).astype(dt)
    return (p.value * jax.random.normal(key, shape, jnp.float32)).astype(dt)


def init_layer(p: Param, key: jax.Array, layer: int | jax.Array, dtype: str) -> jax.Array:
    """Layer `layer` of a stacked `Param`, drawn with `fold_in(key, layer)`: exactly that layer of
    `init_leaf(p, key, dtype)`, made without the other layers (so a loader can stream a stack)."""
    return _draw(p, jax.random.fold_in(key, layer), p.shape[1:], dtype_of(dtype))


def init_leaf(p: Param, key: jax.Array, dtype: str) -> jax.Array:
    """The array of one `Param`. A stacked one draws each layer with its own key (`init_layer`), not
    the whole stack from one: threefry's draw of a slice is not the slice of a draw, and a loader
    that quantizes a stack layer by layer must get the values a whole draw gets."""
    if is_stacked(p) and p.init in ("normal", "uniform"):
        return jax.vmap(lambda layer: init_layer(p, key, layer, dtype))(jnp.arange(p.shape[0]))
    return _draw(p, key, p.shape, dtype_of(dtype))


def leaf_keys(table: Any, key: jax.Array) -> Any:
    """Each `Param`'s own key, split from `key`, in a tree of the table's structure."""
    leaves, treedef = jax.tree.flatten(table, is_leaf=is_param)
    return jax.tree.unflatten(treedef, list(jax.random.split(key, len(leaves))))


def init_table(table: Any, key: jax.Array, dtype: str) -> Any:
    """Arrays for a table of `Param`s, same structure, each drawn with its own key split from `key`
    (`init_leaf`)."""
    return jax.tree.map(lambda p, k: init_leaf(p, k, dtype), table, leaf_keys(table, key), is_leaf=is_param)
