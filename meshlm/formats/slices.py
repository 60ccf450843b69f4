"""What every checkpoint format offers: its parameters as slices, read lazily, and the one function
that places such a source onto a device mesh.

A `SliceSource` maps a meshlm parameter name ("layers.mlp.fc_in.w") and its full shape to a
`SliceReader`, which returns any slice of that parameter in meshlm's layout as a numpy array. Loading
places a source onto a mesh (each device reads only its own shard); converting streams it into another
format's writer. Either way the model is never held whole on the host. Saving a loaded model hands the
same writers its placed parameters as a source (`Placed`), so each format has one writer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlm import model, quant
from meshlm.config import ConfigError, ModelConfig
from meshlm.sharding import plan, to_host

Index = tuple[slice, ...]
# read(index) -> that slice of one parameter, in meshlm's layout, as a numpy array
SliceReader = Callable[[Index], np.ndarray]
# source(name, full shape) -> the SliceReader of parameter `name`
SliceSource = Callable[[str, tuple[int, ...]], SliceReader]


def normalise(index: Index, shape: tuple[int, ...]) -> Index:
    """Explicit start and stop for every dimension (jax passes `slice(None)` for whole dimensions)."""
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


class Placed:
    """Parameters already placed on a mesh, as a SliceSource: a slice read is gathered to the host. Every
    process of a job reads the same slices together (a sharded array's slice spans hosts), so a writer
    given a `Placed` source runs on every process; the arrays stay at hand for a writer that saves them
    whole from the devices (orbax)."""

    def __init__(self, params: model.Params):
        self.params = params
        self._arrays = {model.param_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}

    def __call__(self, name: str, shape: tuple[int, ...]) -> SliceReader:
        array = self._arrays[name]
        return lambda index: to_host(array[index])


def place(
    cfg: ModelConfig,
    source: SliceSource,
    mesh: jax.sharding.Mesh,
    dtype: str = "float32",
    quantize: str | None = None,
) -> model.Params:
    """The parameters of `cfg` from `source`, as global arrays sharded over `mesh` by the logical-axis
    rules: each device's shard is read from the source directly, so no host holds the whole model.

    With `quantize` ("int8", "w8a8" or "nf4") the six projections are read and quantized one layer at a time
    into their quantized stacks (`quantize_stream`), so the devices hold the quantized model plus one
    layer of one projection in float, never a whole float projection."""
    abstract = model.abstract_params(cfg, dtype)
    shardings = plan(abstract, model.logical_axes(cfg), mesh)
    streams = projection_streams(cfg, quantize, mesh, dtype) if quantize else {}

    def build(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct, sharding: Any) -> Any:
        name = model.param_name(path)
        read = source(name, leaf.shape)
        if name not in streams:
            return jax.make_array_from_callback(leaf.shape, sharding, read)
        one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))

        def layer(i: int) -> jax.Array:
            # the reader is asked for [i:i+1, ...] of the whole parameter; the device gets layer i's shard
            at = lambda index: read((slice(i, i + 1), *index))[0]
            return jax.make_array_from_callback(leaf.shape[1:], one, at)

        return streams[name](_as_given, lambda i: (layer(i),))

    return jax.tree_util.tree_map_with_path(build, abstract, shardings)


Make = Callable[..., jax.Array]


def _as_given(w: jax.Array, layer: Any) -> jax.Array:
    return w  # make(*args, layer) -> one layer's float weight, inside the jitted step


@functools.cache  # one program for q, k and v, and for every model of the same shapes
def layer_step(kind: str | None, n_in: int, sharding: Any, make: Make) -> Callable[..., Any]:
    """The jitted program that fills one layer of a quantized stack (a float one, `kind` None): step(stack,
    layer, *args) quantizes make(*args, layer) into the stack, which it donates (updated in place)."""

    def fill(stack: Any, layer: Any, *args: Any) -> Any:
        w = make(*args, layer)
        if kind is None:  # a float stack: the layer as it is made
            return jax.lax.dynamic_update_slice_in_dim(stack, w[None].astype(stack.dtype), layer, 0)
        return quant.quantize_into(stack, w, layer, kind, n_in)

    return jax.jit(
        fill,
        donate_argnums=0,
        out_shardings=sharding,
    )


@functools.cache
def _zeros(abstract: Any, sharding: Any) -> Callable[[], Any]:
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), out_shardings=sharding)


def projection_streams(
    cfg: ModelConfig, kind: str, mesh: jax.sharding.Mesh, dtype: str = "float32"
) -> dict[str, Callable[[Make, Callable[[int], tuple[Any, ...]]], Any]]:
    """Parameter name -> stream(make, args_of): that projection's quantized stack, built on the devices
    one layer at a time (layer i from make(*args_of(i), i)) and laid out by `model.logical_axes(cfg,
    quantize=kind)`. The peak is the quantized stack plus one layer in float and its quantization."""
    quant.check_projections(model.param_table(cfg), model.PROJECTION_PATHS, kind)
    quantized = model.placed_params(cfg, mesh, dtype, kind)
    targets = jax.tree.map(lambda a: a.sharding, quantized)

    return {
        model.projection_name(role): stack_stream(
            kind, n_in, model.projection(quantized, role), model.projection(targets, role), cfg.n_layer
        )
        for role, (_, n_in) in model.PROJECTION_PATHS.items()
    }


def stack_stream(
    kind: str | None, n_in: int, abstract: Any, sharding: Any, layers: int
) -> Callable[[Make, Callable[[int], tuple[Any, ...]]], Any]:
    """stream(make, args_of): a stack (`abstract`, laid out as `sharding`; quantized to `kind`, or float
    where `kind` is None) filled on the devices one layer at a time, layer i from make(*args_of(i), i)."""

    def run(make: Make, args_of: Callable[[int], tuple[Any, ...]]) -> Any:
        stack, step = _zeros(abstract, sharding)(), layer_step(kind, n_in, sharding, make)
        for i in range(layers):
            stack = step(stack, i, *args_of(i))
        return stack

    return run


@dataclass
class OptimizerState:
    """Adam's state read from a checkpoint that carries it (the seed's full checkpoints), in meshlm's
    parameter layout, for a run that continues it."""

    mu: model.Params
    nu: model.Params
    count: int  # Adam's update count (the seed's scale_by_schedule count equals it)
    step: int  # the checkpoint's training step

    def into(self, opt_state: Any) -> Any:
        """`opt_state` (from `tx.init(params)` of any optax chain with Adam) continuing this run: every
        `mu`, `nu` and `count` in it replaced (so schedules resume at the checkpoint's count too)."""
        import jax.numpy as jnp
        import optax

        try:
            state = optax.tree_utils.tree_set(
                opt_state, mu=self.mu, nu=self.nu, count=jnp.asarray(self.count, jnp.int32)
            )
        except KeyError as e:
            raise ConfigError(f"the optimizer state has no Adam moments to resume into ({e})") from None
        # Each count its own buffer: tree_set put one array in every place, and a jitted step that
        # donates the state must not be given the same buffer twice.
        return jax.tree.map(lambda x: jnp.array(x) if x.ndim == 0 else x, state)
