"""Quantized projections: int8 per output channel (weights only, or "w8a8": activations too, per token), and NF4
(QLoRA's 4-bit NormalFloat) for a frozen base.

A quantized weight is a small pytree (`Int8Weight`, `NF4Weight`) that stands where the float array stood
in the parameter tree. Its arrays keep the weight's leading `layers` axis, so the model's scan over
layers slices them like any other parameter, and `dense` rebuilds one layer's float weight inside the
jitted matmul: the whole model is never held dequantized.

- int8: `codes = round(w / s)` with `s = max|w| / 127` over the input dimensions, one scale per output
  channel (LLM.int8()'s vector-wise absmax, without its outlier decomposition).
- w8a8 (inference only): int8's codes, and each product quantizes its activations too, per token by their absmax over
  the input dimensions (`absmax_int8`), multiplying int8 by int8 into int32 (`Int8Weight.times`). A TPU v5e's
  matrix unit does twice as many int8 operations as bfloat16 ones: GPT-J-6B's MLP over 272 tokens ran 1.55x as
  fast as with the weights dequantized to bfloat16, 1.92x over 1,024 (`benchmarks/int8_matmul.py`); a decode step,
  bound by reading the weights, gains nothing. The price is the activations' rounding: 2.7% relative error of the
  8-layer MLP stack's output there, against weight-only int8's, on Gaussian activations; a model whose activations have
  outlier features (LLM.int8()) loses more. Rounding has no gradient, so a trained base is never w8a8.
- NF4 (Dettmers et al. 2023, "QLoRA", section 3 and appendix; bitsandbytes' `quantize_4bit`): each block
  of `NF4_BLOCK` consecutive input weights of one output channel is scaled by its absmax to [-1, 1]
  and rounded to the nearest of the 16 NF4 values, which are quantiles of a standard normal
  (`nf4_code`). Blocks run along the input dimension, as bitsandbytes blocks a torch [out, in]
  weight, so the output dimensions (heads, d_ff) keep their names and their tensor-parallel sharding.
  Two codes share a byte (first in the high nibble). Scales stay float32 (no double quantization).

Why not Google's qwix: it quantizes a Flax (Linen/NNX) model by intercepting its layers' ops, and
meshlm's model is pure functions over a plain parameter pytree scanned over layers; what is needed
here is two formulas and a pytree that the scan slices, and NF4 must be bitsandbytes' exactly (the
tests check it against bitsandbytes' own quantizer), so the formulas are written out below.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import QUANTIZED, ConfigError, dtype_of
from meshlm.sharding import traced_backend

NF4_BLOCK = 64  # bitsandbytes' and QLoRA's block size
NF4_OFFSET = 0.9677083  # bitsandbytes' `create_normal_map` offset: the outermost quantile used
INT8_KINDS = ("int8", "w8a8")  # stored alike, as `Int8Weight`


@functools.cache
def nf4_code() -> np.ndarray:
    """The 16 NF4 values, built as bitsandbytes' `create_normal_map` builds them: 8 positive and 7
    negative quantiles of N(0, 1) evenly spaced in probability from 0.5 to `NF4_OFFSET`, zero, all
    divided by the largest so that they span [-1, 1] exactly."""
    positive = [NormalDist().inv_cdf(p) for p in np.linspace(NF4_OFFSET, 0.5, 9)[:-1]]
    negative = [-NormalDist().inv_cdf(p) for p in np.linspace(NF4_OFFSET, 0.5, 8)[:-1]]
    values = np.sort(np.array([*positive, 0.0, *negative]))
    return (values / values.max()).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Int8Weight:
    """A weight [layers, in..., out...] as int8 codes of that shape and float32 scales [layers, out...]; with
    `heads_first` (on a TPU: `heads_first_here`) the codes are stored [layers, out[:-1]..., in..., out[-1]]. `dense`
    rebuilds one layer's weight (the model's scan slices off `layers`; vmap it for all of them)."""

    codes: jax.Array
    scale: jax.Array
    heads_first: bool = field(default=False, metadata={"static": True})
    activations: bool = field(default=False, metadata={"static": True})  # w8a8: `times` quantizes them too

    def _ordered(self) -> tuple[jax.Array, int]:
        """One layer's codes [in..., out...] and how many input dims they have."""
        n_in = self.codes.ndim - self.scale.ndim  # one layer's weight: the scale covers the output dims
        if not self.heads_first:
            return self.codes, n_in
        # back to [in..., out...]: the inverse of the stack's order, without its layers
        return jnp.transpose(self.codes, tuple(np.argsort(_heads_first_order(self.codes.ndim + 1, n_in))[1:] - 1)), n_in

    def dense(self, dtype: jnp.dtype) -> jax.Array:
        codes, n_in = self._ordered()
        return (codes.astype(jnp.float32) * self.scale.reshape((1,) * n_in + self.scale.shape)).astype(dtype)

    def times(self, x: jax.Array) -> jax.Array:
        """x [..., in...] times this layer's weight, int8 by int8 into int32: x quantized per token (w8a8)."""
        codes, n_in = self._ordered()
        q, x_scale = absmax_int8(x, n_in)
        product = jnp.tensordot(q, codes, n_in, preferred_element_type=jnp.int32)
        x_scale = x_scale.reshape(x_scale.shape + (1,) * self.scale.ndim)
        return (product.astype(jnp.float32) * x_scale * self.scale).astype(x.dtype)


def absmax_int8(x: jax.Array, dims: int = 1) -> tuple[jax.Array, jax.Array]:
    """x [..., in...] (`dims` trailing dims) as int8 in [-127, 127] and its scales [...] (x = q * scale, to half a
    step): each vector over those dims scaled by its largest magnitude."""
    x = x.astype(jnp.float32)
    axes = tuple(range(x.ndim - dims, x.ndim))
    top = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    q = jnp.rint(x * (127 / jnp.where(top > 0, top, 1.0))).astype(jnp.int8)
    return q, top.reshape(top.shape[: x.ndim - dims]) / 127


def _heads_first(heads_first: bool | None) -> bool:
    return heads_first_here() if heads_first is None else heads_first


def _heads_first_order(ndim: int, n_in: int) -> tuple[int, ...]:
    """The dimensions of stacked codes [layers, in..., out...] heads first: [layers, out[:-1]..., in..., out[-1]]."""
    return (0, *range(1 + n_in, ndim - 1), *range(1, 1 + n_in), ndim - 1)


def heads_first_here() -> bool:
    """Whether int8 codes are stored heads first for the devices of the program being traced (`traced_backend`):
    on a TPU, where a projection to heads [in, heads, head_dim] then keeps each head's [in, head_dim] matrix whole
    in the chip's int8 tiles of 32 rows, and its products read the weights where they lie (stored [in, 16 heads,
    256], GPT-J-6B's q, k and v went through a copy of all their layers at every decode call on a v5e, 4 ms of a
    16-row call's 17). Elsewhere the products read [in, heads x head_dim] as one matrix, which heads first would
    transpose at every step (8 rows of int8 decode on a CPU: 1.07-1.09x the time, `benchmarks/int8_layout.py`)."""
    return traced_backend() == "tpu"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class NF4Weight:
    """A weight [layers, in..., out...] as packed 4-bit codes [layers, blocks, NF4_BLOCK / 2, out...] and
    float32 block absmax [layers, blocks, out...]; `in_shape` is one layer's input dimensions. `dense`
    rebuilds one layer's weight, as `Int8Weight.dense`."""

    codes: jax.Array
    absmax: jax.Array
    in_shape: tuple[int, ...] = field(metadata={"static": True})

    def dense(self, dtype: jnp.dtype) -> jax.Array:
        high, low = self.codes >> 4, self.codes & 15
        index = jnp.stack([high, low], axis=2).reshape(self.absmax.shape[0], NF4_BLOCK, *self.absmax.shape[1:])
        # looked up and scaled in `dtype`: no float32 copy of the layer's weight is ever made
        values = _nf4_values(index, dtype) * self.absmax[:, None].astype(dtype)
        return values.reshape(*self.in_shape, *self.absmax.shape[1:])


def _nf4_values(index: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The NF4 value of each 4-bit code, by a tree of selects on the code's bits: elementwise, so it fuses
    with the scaling. Indexing the 16-value table is a gather, which a TPU runs an element at a time (a
    GPT-J-6B QLoRA step on a v5e took minutes)."""
    values = [jnp.asarray(v, dtype) for v in nf4_code()]
    for bit in range(4):
        odd = (index >> bit) & 1 == 1
        values = [jnp.where(odd, high, low) for low, high in zip(values[::2], values[1::2], strict=True)]
    return values[0]


QuantizedWeight = Int8Weight | NF4Weight


def dense(w: jax.Array | QuantizedWeight, dtype: jnp.dtype) -> jax.Array:
    """One layer's weight as a float array in `dtype`, whatever it is stored as."""
    return w.astype(dtype) if isinstance(w, jax.Array | np.ndarray) else w.dense(dtype)


def times(x: jax.Array, w: jax.Array | QuantizedWeight, n_in: int) -> jax.Array:
    """x [..., in...] times one layer's weight w [in..., out...] (`n_in` input dims): in x's dtype, or int8 by int8
    for a w8a8 weight."""
    if kind_of(w) == "w8a8":
        return w.times(x)
    return jnp.tensordot(x, dense(w, x.dtype), n_in)


def kind_of(w: jax.Array | QuantizedWeight) -> str | None:
    """ "int8", "w8a8" or "nf4" for a quantized weight, None for a float one."""
    if isinstance(w, Int8Weight) and w.activations:
        return "w8a8"
    return {Int8Weight: "int8", NF4Weight: "nf4"}.get(type(w))


def quantize(w: jax.Array, kind: str, n_in: int, heads_first: bool | None = None) -> QuantizedWeight:
    """Quantize stacked weights w [layers, in..., out...] (`n_in` input dimensions) to `kind` (int8's codes
    `heads_first` or not; None: `heads_first_here`)."""
    w = w.astype(jnp.float32)
    if kind in INT8_KINDS:
        in_axes = tuple(range(1, 1 + n_in))
        scale = jnp.max(jnp.abs(w), axis=in_axes) / 127
        safe = jnp.where(scale == 0, 1.0, scale)
        codes = jnp.clip(jnp.round(w / jnp.expand_dims(safe, in_axes)), -127, 127).astype(jnp.int8)
        first = _heads_first(heads_first)
        codes = jnp.transpose(codes, _heads_first_order(codes.ndim, n_in)) if first else codes
        return Int8Weight(codes, scale, first, kind == "w8a8")
    if kind == "nf4":
        layers, in_shape, out_shape = w.shape[0], w.shape[1 : 1 + n_in], w.shape[1 + n_in :]
        blocks = math.prod(in_shape) // NF4_BLOCK
        w = w.reshape(layers, blocks, NF4_BLOCK, *out_shape)
        absmax = jnp.max(jnp.abs(w), axis=2)
        scaled = w / jnp.expand_dims(jnp.where(absmax == 0, 1.0, absmax), 2)
        code = jnp.asarray(nf4_code())
        # nearest code value: count the midpoints at or below (ties between two values round up), compared
        # elementwise (a sorted search is a gather on a TPU)
        index = sum((scaled >= mid).astype(jnp.uint8) for mid in (code[1:] + code[:-1]) / 2)
        pairs = index.reshape(layers, blocks, NF4_BLOCK // 2, 2, *out_shape)
        packed = (pairs[:, :, :, 0] << 4) | pairs[:, :, :, 1]
        return NF4Weight(packed, absmax, tuple(in_shape))
    raise ConfigError(f"unknown quantization {kind!r}; choose one of {list(QUANTIZED)}")


def quantize_into(
    stack: QuantizedWeight, w: jax.Array, layer: int | jax.Array, kind: str, n_in: int
) -> QuantizedWeight:
    """`stack` (a quantized [layers, ...] weight) with layer `layer` replaced by `w`, one layer's float
    weight [in..., out...], quantized. Both kinds quantize within one layer (int8's scales are per output
    channel, NF4's blocks run along one layer's inputs), so a stack filled layer by layer equals the
    stack quantized whole; a loader needs only one layer in float at a time."""
    one = quantize(w[None], kind, n_in, getattr(stack, "heads_first", None))
    return jax.tree.map(lambda a, x: jax.lax.dynamic_update_slice_in_dim(a, x, layer, 0), stack, one)


def check(kind: str, name: str, shape: tuple[int, ...], n_in: int) -> None:
    """A ConfigError if weights of `shape` (stacked) cannot be quantized to `kind`."""
    if kind not in QUANTIZED:
        raise ConfigError(f"unknown quantization {kind!r}; choose one of {list(QUANTIZED)}")
    inputs = math.prod(shape[1 : 1 + n_in])
    if kind == "nf4" and inputs % NF4_BLOCK:
        raise ConfigError(
            f"nf4 quantizes blocks of {NF4_BLOCK} input weights, but {name} has {inputs} inputs per output; "
            "use int8 for this model"
        )


def quantized_axes(
    axes: tuple[str | None, ...], shape: tuple[int, ...], kind: str, n_in: int, heads_first: bool | None = None
) -> QuantizedWeight:
    """Logical axis names of a quantized weight's arrays, from the float weight's (stacked) names and
    shape: the codes keep the weight's names (int8's in their order, `quantize`'s `heads_first`), the scales
    their output dims'; NF4's blocks take the first input dim's name."""
    layers, inputs, outputs = axes[:1], axes[1 : 1 + n_in], axes[1 + n_in :]
    if kind in INT8_KINDS:
        first = _heads_first(heads_first)
        codes = tuple(axes[i] for i in _heads_first_order(len(axes), n_in)) if first else axes
        return Int8Weight(codes, (*layers, *outputs), first, kind == "w8a8")
    return NF4Weight((*layers, inputs[0], None, *outputs), (*layers, inputs[0], *outputs), tuple(shape[1 : 1 + n_in]))


# ---------------------------------------------------------------------------------------------------
# The projections of a parameter tree

# role -> (where the projection's stacked weight sits in a parameter tree, how many input dimensions it has)
Projections = Mapping[str, tuple[tuple[str, ...], int]]


def weight(tree: Any, path: tuple[str, ...]) -> Any:
    """The leaf at `path` of a nested dict."""
    for key in path:
        tree = tree[key]
    return tree


def _replace(tree: Any, projections: Projections, fn: Callable[[str, Any, int], Any]) -> Any:
    """A copy of `tree` with each projection's leaf replaced by fn(role, leaf, n_in); the rest shared."""
    copy = lambda t: {k: copy(v) for k, v in t.items()} if isinstance(t, dict) else t
    tree = copy(tree)
    for role, (path, n_in) in projections.items():
        parent = weight(tree, path[:-1])
        parent[path[-1]] = fn(role, parent[path[-1]], n_in)
    return tree


def quantize_projections(params: Any, projections: Projections, kind: str, heads_first: bool | None = None) -> Any:
    """`params` with the projections' weights quantized to `kind`. Under `jax.jit` with `out_shardings` from
    `projection_axes`, each device quantizes its shard."""
    return _replace(params, projections, lambda _, w, n_in: quantize(w, kind, n_in, heads_first))


def dequantize_projections(params: Any, projections: Projections, dtype: str = "float32") -> Any:
    """`params` with quantized projections rebuilt whole as float arrays (for checks and merging, not for running)."""
    dt = dtype_of(dtype)
    return _replace(params, projections, lambda _, w, n_in: jax.vmap(lambda one: dense(one, dt))(w))


def projection_axes(axes: Any, table: Any, projections: Projections, kind: str, heads_first: bool | None = None) -> Any:
    """The logical axis names `axes` of a parameter tree with its projections' replaced by their quantized
    arrays' (`quantized_axes`); `table` gives each projection's float shape."""
    shape = lambda role: weight(table, projections[role][0]).shape
    return _replace(axes, projections, lambda role, a, n_in: quantized_axes(a, shape(role), kind, n_in, heads_first))


def check_projections(table: Any, projections: Projections, kind: str) -> None:
    """A ConfigError if a projection of `table` (a tree of anything with a `shape`) cannot be quantized to `kind`."""
    for role, (path, n_in) in projections.items():
        check(kind, role, weight(table, path).shape, n_in)
