"""Decode attention straight from the paged KV pool with Pallas paged-attention kernels.

A decode step's query (one token per row) attends over the row's pages without gathering them into a
contiguous [B, S, H, K] copy first. Two kernels take the same pool layout, [H, pages, page_size, K]:

- "gpu": `jax.experimental.pallas.ops.gpu.paged_attention` (Triton); on a CPU it runs in Pallas'
  interpreter, which is how the tests check it against the gather path;
- "tpu": this module's own Mosaic kernel (`_tpu`), for float and int8 pools; the tests run it in the TPU
  interpreter.

JAX's TPU paged kernel did the work of a page as two matrix-unit products per head, each waiting on the last
(about 4.6 us a 2 MB page of GPT-J's 16 heads on a v5e, from its decode steps' times, where the page's DMA takes
3.2), and took an int8 pool's scales only as a [H, pages, page_size, K] array broadcast in HBM over the whole pool
in every layer. `_tpu` makes two products a page per group of heads, and reads an int8 pool's float32 scales
(`kv_cache.KVCache`: [pages, H, page_size] here, one lane a token) as they lie, a page's [H, page_size] tile
beside its keys, applying them where they are constant: a key's to its score, a value's to its probability. The
GPU kernel takes the scales heads-first, [H, pages, page_size]: here every layer's call transposes the whole scale
pool (all layers), 2 / 64 of the int8 pool's bytes a layer at GPT-J's heads of 256, about 0.9x the pool a step
over 28 layers (not measured on a GPU).

Under a mesh a kernel runs per shard: rows split over the batch axes, heads over `model`, the pool
(heads over `model`, every page on every batch shard) as it lies.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import paged_attention as gpu_kernel

from meshlm.sharding import spec_for, traced_backend

Array = jax.Array
Scale = jax.Array | None

BLOCK_H = 16  # the GPU kernel's query heads per block (its minimum; one KV head's queries are padded to it)
HEAD_GROUP = 16  # heads whose page `_tpu_kernel` takes in one product a side (its work grows as their square)


def _tpu_kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, *refs):
    """Program (b, j): page j of row b, every head. Keys [H, page_size, K] (int8 ones with their scales
    [H, page_size], the refs before the output's) in; per head the page's scores, an online softmax's running
    max (m), sum (l) and weighted values (acc) updated; row b's output from them after its last page. Pages
    past the row's length are neither read (their block index repeats the last page's) nor computed.

    A group of up to HEAD_GROUP heads makes two matrix-unit products a page: its queries [G, K] against all
    its keys [G * page_size, K] (head h's scores: row h of its own block of lanes), and block-diagonal
    weights [G, G * page_size] against all its values. One product per head and side left the core waiting
    on each result in turn: an int8 page of 16 heads of 256 took 4.6 us on a v5e, 1.6 us now, the time its
    DMAs take (BENCHMARKS.md)."""
    *scale_refs, o_ref, m_ref, l_ref, acc_ref = refs
    b, j = pl.program_id(0), pl.program_id(1)
    H, size, K = k_ref.shape
    length = lengths_ref[b]

    def scaled(x: Array, side: int, heads: slice) -> Array:
        """Scores (side 0) or probabilities (side 1) of `heads` times their keys' or values' scales, if any."""
        return x * scale_refs[side][heads, :] if scale_refs else x

    @pl.when(j == 0)
    def _start() -> None:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j * size < length)
    def _page() -> None:
        dtype = q_ref.dtype
        exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT
        product = functools.partial(jax.lax.dot_general, precision=exact, preferred_element_type=jnp.float32)
        held = j * size + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1) < length
        for first in range(0, H, HEAD_GROUP):
            heads = slice(first, min(first + HEAD_GROUP, H))
            G = heads.stop - first
            every = product(q_ref[heads, :], k_ref[heads].reshape(G * size, K).astype(dtype), (((1,), (1,)), ((), ())))
            own = jax.lax.broadcasted_iota(jnp.int32, (G, size), 0)  # [G, page_size]: each row's head
            scores = jnp.zeros((G, size), jnp.float32)
            for g in range(G):
                scores = jnp.where(own == g, every[:, g * size : (g + 1) * size], scores)
            scores = jnp.where(held, scaled(scores, 0, heads), -jnp.inf)
            m_prev = m_ref[heads, :]  # [G, 128], its lanes equal
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
            p = jnp.exp(scores - m_next[:, :1])
            alpha = jnp.exp(m_prev - m_next)
            m_ref[heads, :], l_ref[heads, :] = m_next, alpha * l_ref[heads, :] + jnp.sum(p, axis=1, keepdims=True)
            weights = jnp.where(held, scaled(p, 1, heads), 0.0)  # a NaN scale past the length stays out
            blocks = jnp.concatenate([jnp.where(own == g, weights, 0.0) for g in range(G)], axis=1)
            values = v_ref[heads].reshape(G * size, K).astype(dtype)
            out = product(blocks.astype(dtype), values, (((1,), (0,)), ((), ())))  # [G, K]
            acc_ref[heads, :] = alpha[:, :1] * acc_ref[heads, :] + out

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish() -> None:
        total = l_ref[:, :1]
        o_ref[...] = jnp.where(total > 0, acc_ref[...] / jnp.where(total > 0, total, 1.0), 0.0).astype(o_ref.dtype)


def _tpu(q: Array, k: Array, v: Array, table: Array, lengths: Array, k_scale: Scale, v_scale: Scale) -> Array:
    """`_tpu_kernel` over rows' tables [B, n] of pools [H, pages, page_size, K] (int8 ones with scales [pages,
    H, page_size]): [B, H, K] in q's dtype."""
    H, _, size, K = k.shape
    B, n = table.shape

    def page(b: Array, j: Array, lengths: Array, table: Array) -> Array:
        last = jax.lax.div(jnp.maximum(lengths[b] - 1, 0), size)  # not `//`: its sign test needs the chip's kind
        return table[b, jnp.minimum(j, last)]

    rows = pl.BlockSpec((None, H, K), lambda b, j, *_: (b, 0, 0))
    pool = pl.BlockSpec((H, None, size, K), lambda b, j, *refs: (0, page(b, j, *refs), 0, 0))
    scales = [pl.BlockSpec((None, H, size), lambda b, j, *refs: (page(b, j, *refs), 0, 0))] * 2
    quantized = k_scale is not None
    return pl.pallas_call(
        _tpu_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, n),
            in_specs=[rows, pool, pool] + (scales if quantized else []),
            out_specs=rows,
            scratch_shapes=[pltpu.VMEM((H, 128), jnp.float32)] * 2 + [pltpu.VMEM((H, K), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((B, H, K), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(lengths.astype(jnp.int32), table.astype(jnp.int32), q, k, v, *((k_scale, v_scale) if quantized else ()))


def _kernel(name: str, pages_per_row: int) -> Callable[..., jax.Array]:
    """kernel(q, k_pages, v_pages, table, lengths, k_scale, v_scale) for a table of `pages_per_row` pages
    (the scales None for a float pool)."""
    if name == "tpu":
        return _tpu
    splits = math.gcd(pages_per_row, 16)  # the sequence is split over up to 16 partitions of whole blocks
    call = functools.partial(
        gpu_kernel.paged_attention,
        block_h=BLOCK_H,
        k_splits=splits,
        pages_per_compute_block=math.gcd(pages_per_row // splits, 8),
        interpret=traced_backend() == "cpu",
    )

    def gpu(q: Array, k: Array, v: Array, table: Array, lengths: Array, k_scale: Scale, v_scale: Scale) -> Array:
        if k_scale is not None:  # heads first, as the kernel indexes them
            k_scale, v_scale = (jnp.swapaxes(s, 0, 1) for s in (k_scale, v_scale))
        return call(q, k, v, table, lengths, k_scale, v_scale)

    return gpu


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    table: jax.Array,
    lengths: jax.Array,
    kernel: str,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T) v for q [B, H, K] (already scaled) over the first `lengths[b]` tokens of row b's
    pages `table[b]` in the pools [H, pages, page_size, K] (int8 ones with their scales [pages, H,
    page_size]), by the `kernel` ("gpu" or "tpu"): [B, H, K]."""
    call = _kernel(kernel, table.shape[1])
    if jax.sharding.get_abstract_mesh().empty:
        return call(q, k_pages, v_pages, table, lengths, k_scale, v_scale)
    rows = spec_for(("batch", "act_heads", None))
    pool = spec_for(("act_heads", None, None, None))
    scales = spec_for((None, "act_heads", None)) if k_scale is not None else None
    return jax.shard_map(
        call,
        in_specs=(rows, pool, pool, spec_for(("batch", None)), spec_for(("batch",)), scales, scales),
        out_specs=rows,
        check_vma=False,  # the kernels' outputs declare no varying axes; each shard's rows are its own
    )(q, k_pages, v_pages, table, lengths, k_scale, v_scale)
