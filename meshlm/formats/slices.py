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

    With `quantize` ("int8" or "nf4") the six projections are quantized on the devices as each is
    placed, so the devices never hold more than one of them unquantized."""
    abstract = model.abstract_params(cfg, dtype)
    shardings = plan(abstract, model.logical_axes(cfg), mesh)
    quantizers = projection_quantizers(cfg, quantize, mesh, dtype) if quantize else {}

    def build(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct, sharding: Any) -> Any:
        name = model.param_name(path)
        array = jax.make_array_from_callback(leaf.shape, sharding, source(name, leaf.shape))
        return quantizers[name](array) if name in quantizers else array

    return jax.tree_util.tree_map_with_path(build, abstract, shardings)


def projection_quantizers(
    cfg: ModelConfig, kind: str, mesh: jax.sharding.Mesh, dtype: str = "float32"
) -> dict[str, Callable[[jax.Array], Any]]:
    """Parameter name -> a jitted function that quantizes that placed projection weight to `kind` on the
    devices, its output laid out by `model.logical_axes(cfg, quantize=kind)`: one projection at a time."""
    quant.check_projections(model.param_table(cfg), model.PROJECTION_PATHS, kind)
    quantized = model.abstract_params(cfg, dtype, kind)
    targets = plan(quantized, model.logical_axes(cfg, quantize=kind), mesh)
    return {
        model.projection_name(role): jax.jit(
            functools.partial(quant.quantize, kind=kind, n_in=n_in),
            out_shardings=model.projection(targets, role),
        )
        for role, (_, n_in) in model.PROJECTION_PATHS.items()
    }


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
