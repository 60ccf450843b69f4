"""The device mesh and the rule sets that map logical axis names to mesh axes.

Mesh axes:
  data   pure data parallelism: the batch is split, parameters are replicated
  fsdp   ZeRO-3: the batch is split AND parameters / optimizer state are sharded
  model  Megatron tensor parallelism: heads, d_ff and vocabulary are split

A rule set is a value, as MaxText keeps `logical_axis_rules` in its config: training lays parameters
out by `TRAINING`, serving by `SERVING`, and the functions that place parameters take the set to use.
Changing the parallelism means editing a rule set, never the model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from meshlm.config import ConfigError

MESH_AXES = ("data", "fsdp", "model")

# logical axis -> mesh axis (or tuple of mesh axes, or None for replicated)
Rules = Mapping[str, str | tuple[str, ...] | None]

# Activations lie alike under either set: the model's own constraints (`constrain`) name no set.
ACTIVATIONS: Rules = MappingProxyType(
    {
        "batch": ("data", "fsdp"),
        "seq": None,
        "act_embed": None,
        "act_heads": "model",
        "act_mlp": "model",
        "act_vocab": "model",
        "cache_seq": None,
    }
)

# Training: parameters and optimizer state split over `fsdp` too (ZeRO-3), each gathered as a layer needs it.
TRAINING: Rules = MappingProxyType(
    {
        "vocab": "model",
        "heads": "model",
        "mlp": "model",
        "embed": "fsdp",
        "layers": None,
        "head_dim": None,
        "norm": None,
        **ACTIVATIONS,
    }
)

# Serving: a decode step reads every weight for one token per row, so weights split over the batch axes
# would be all-gathered at every step; they lie whole over data and fsdp, split over `model` only.
SERVING: Rules = MappingProxyType({**TRAINING, "embed": None})


def parse_mesh_spec(spec: str, n_devices: int) -> dict[str, int]:
    """ "data=2,fsdp=2,model=2" -> sizes per axis. Omitted axes are 1, except that `data` takes the
    devices left over when it is omitted; one axis may be -1 to take the rest."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\w+)\s*=\s*(-?\d+)", part)
        if not m:
            raise ConfigError(f"mesh spec {spec!r}: cannot read {part!r}; expected e.g. 'data=2,fsdp=2,model=2'")
        name, size = m.group(1), int(m.group(2))
        if name not in MESH_AXES:
            raise ConfigError(f"mesh spec {spec!r}: unknown axis {name!r}; axes are {list(MESH_AXES)}")
        if name in sizes:
            raise ConfigError(f"mesh spec {spec!r}: axis {name!r} given twice")
        if size == 0 or size < -1:
            raise ConfigError(f"mesh spec {spec!r}: axis {name!r} must be a positive size or -1")
        sizes[name] = size
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError(f"mesh spec {spec!r}: at most one axis may be -1")
    if -1 not in sizes.values() and "data" not in sizes:
        sizes["data"] = -1
    known = math.prod(s for s in sizes.values() if s != -1)
    if n_devices % known:
        raise ConfigError(f"mesh spec {spec!r} needs a multiple of {known} devices; {n_devices} are visible")
    sizes = {a: (n_devices // known if s == -1 else s) for a, s in sizes.items()}
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(
            f"mesh spec {spec!r} uses {math.prod(sizes.values())} devices; {n_devices} are visible "
            "(make the sizes multiply to the device count, or set one axis to -1)"
        )
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def make_mesh(spec: str | Mesh | None = None, devices: list[Any] | None = None) -> Mesh:
    """A mesh with axes (data, fsdp, model) over `devices` (default: all visible devices).

    `None` means one device. Axis types are Auto: shardings of parameters and a few activation
    constraints are declared, and XLA propagates the rest.
    """
    if isinstance(spec, Mesh):
        missing = [a for a in MESH_AXES if a not in spec.axis_names]
        if missing:
            raise ConfigError(f"mesh must have axes {list(MESH_AXES)}; missing {missing}")
        return spec
    devices = list(devices if devices is not None else jax.devices())
    if spec is None:
        devices, spec = devices[:1], "data=1"
    sizes = parse_mesh_spec(spec, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def using(mesh: Mesh | AbstractMesh) -> AbstractContextManager:
    """`mesh` as the traced program's (`traced_backend`): `jax.set_mesh` for a mesh of devices, else the abstract
    mesh of a target without devices (a GPU plan's)."""
    return jax.set_mesh(mesh) if isinstance(mesh, Mesh) else jax.sharding.use_abstract_mesh(mesh)


def traced_backend() -> str:
    """The platform the program being traced is for: the devices' of the mesh set by `jax.set_mesh` (a TPU
    topology's when `meshlm plan` compiles for a TPU it does not have), else JAX's default backend. Where a
    choice depends on the chip (an attention kernel, how the KV pool is written), this names the chip."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def spec_for(axes: Iterable[str | None], rules: Rules = TRAINING) -> PartitionSpec:
    """PartitionSpec for a tuple of logical axis names, through `rules`."""
    out = []
    for name in axes:
        if name is not None and name not in rules:
            raise ConfigError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        out.append(None if name is None else rules[name])
    return PartitionSpec(*out)


def _mesh_axes(rule: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else rule


def named_sharding(mesh: Mesh, axes: Iterable[str | None], rules: Rules = TRAINING) -> NamedSharding:
    return NamedSharding(mesh, spec_for(axes, rules))


def param_shardings(logical: Any, mesh: Mesh, rules: Rules = TRAINING) -> Any:
    """NamedShardings for a pytree of logical-axis tuples (e.g. `model.logical_axes(cfg)`)."""
    return jax.tree.map(lambda axes: named_sharding(mesh, axes, rules), logical, is_leaf=_is_axes)


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def check_divisible(shapes: Any, logical: Any, mesh: Mesh, rules: Rules = TRAINING) -> None:
    """Raise a ConfigError naming the first parameter whose dimension a mesh axis does not divide.

    `shapes` is a pytree of arrays or ShapeDtypeStructs with the structure of `logical`.
    """
    flat_axes = jax.tree_util.tree_flatten_with_path(logical, is_leaf=_is_axes)[0]
    for (path, axes), leaf in zip(flat_axes, jax.tree.leaves(shapes), strict=True):
        for dim, (size, name) in enumerate(zip(leaf.shape, axes, strict=True)):
            mesh_axes = _mesh_axes(rules.get(name)) if name else ()
            ways = math.prod(mesh.shape[a] for a in mesh_axes)
            if size % ways:
                raise ConfigError(
                    f"parameter {jax.tree_util.keystr(path, simple=True, separator='.')} dimension {dim} "
                    f"({name}={size}) is not divisible by mesh axis {'x'.join(mesh_axes)} "
                    f"(size {ways}); choose a mesh whose sizes divide the model's shapes"
                )


def plan(abstract: Any, logical: Any, mesh: Mesh, rules: Rules = TRAINING) -> Any:
    """Checked NamedShardings for parameters laid out by `rules`: `abstract` gives the shapes, `logical`
    the axis names."""
    check_divisible(abstract, logical, mesh, rules)
    return param_shardings(logical, mesh, rules)


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `abstract` laid out as `shardings`: arguments to lower and compile a program
    for, or a restore target, without allocating anything."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def shard_bytes(tree: Any, itemsize: int | None = None) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (or arrays), each element
    `itemsize` bytes if given, else its dtype's."""
    return sum(
        math.prod(a.sharding.shard_shape(a.shape)) * (itemsize or a.dtype.itemsize) for a in jax.tree.leaves(tree)
    )


def batch_ways(mesh: Mesh) -> int:
    """How many ways the batch dimension is split."""
    return math.prod(mesh.shape[a] for a in _mesh_axes(ACTIVATIONS["batch"]))


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's sharding by logical names; a no-op outside a mesh context (`jax.set_mesh`). The
    training set names it: both sets place activations alike."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec_for(axes))


def embedding_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """`table[ids]` for a table whose rows ("vocab") are split over `model`, Megatron-style.

    Each model shard looks up the ids that fall in its slice of the vocabulary (zeros elsewhere) and
    one all-reduce over `model` sums the pieces, instead of XLA gathering the whole table first.
    """
    mesh = jax.sharding.get_abstract_mesh()
    vocab_axes = _mesh_axes(TRAINING["vocab"])  # both sets split the vocabulary alike
    if mesh.empty or math.prod(mesh.shape[a] for a in vocab_axes) == 1:
        return jnp.take(table, ids, axis=0)
    batch_split = batch_ways(mesh)
    batch = spec_for(("batch", "seq")) if ids.shape[0] % batch_split == 0 else PartitionSpec(None, None)

    def local_lookup(shard: jax.Array, local_ids: jax.Array) -> jax.Array:
        rows = shard.shape[0]
        offset = jax.lax.axis_index(vocab_axes) * rows
        local = local_ids - offset
        hit = (local >= 0) & (local < rows)
        x = jnp.take(shard, jnp.where(hit, local, 0), axis=0) * hit[..., None].astype(shard.dtype)
        return jax.lax.psum(x, vocab_axes)

    return jax.shard_map(
        local_lookup,
        in_specs=(PartitionSpec(TRAINING["vocab"], None), batch),
        out_specs=PartitionSpec(*batch, None),
    )(table, ids)


def to_host(tree: Any) -> Any:
    """Arrays (possibly sharded, possibly multi-host) as numpy arrays on this host. Every copy starts before the
    first is awaited, so a step's dozen outputs cost about one round trip to the device, not one each."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            x.copy_to_host_async()
    return jax.tree.map(_gathered, tree)


def _gathered(x: jax.Array | np.ndarray) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def from_host(tree: Any, shardings: Any) -> Any:
    """Global arrays from numpy arrays that every process holds in full (`shardings`: one, or a tree of them that
    is a prefix of `tree`'s). With one process all go in one batched transfer (`jax.device_put`), not one at a time."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if not isinstance(shardings, jax.sharding.Sharding):
        is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)
        return jax.tree.map(lambda s, t: from_host(t, s), shardings, tree, is_leaf=is_sharding)
    return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, shardings, lambda index: x[index]), tree)


def describe(mesh: Mesh) -> str:
    sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    platform = mesh.devices.flat[0].platform
    return f"mesh({sizes}) over {mesh.devices.size} {platform} device(s)"
