"""TPU kernels that move keys and values between the paged pool and a call, by DMA on the pool as it lies:
a decode step's and a prompt's stored in place, and the rows' pages read back for a prompt's attention.

A decode step adds one token per row to each layer's pool [H, L, pages, page_size, K]. XLA's ways of
writing it on a TPU both cost: a scatter (or a write whose window spans the heads) gives the pool a layout
apart from the paged-attention kernel's, so XLA copies the whole pool in every layer of every step, and
one dynamic-update-slice per row and head is B * H tiny ops a layer (gptj-1b on a v5e: 3.8 ms a step at
1 row, 24.7 ms at 16). Here one Pallas call per layer writes every row with DMAs on the pool as it lies.

A TPU DMA moves whole tiles: a token's slot is one sublane of a [tile_rows, K] tile of its page, so each
row reads that tile of every head into VMEM, sets the slot there, and writes it back (bfloat16 gptj-1b:
16 heads x 16 tokens x 128, 64 KB each way). Rows are done `GROUP` at a time, their DMAs in flight
together. Rows whose token is not stored (padding, `written` false) rewrite a tile of page 0, which no row
holds, with what it holds.

A prompt (`write_pages`) is written a page at a time: its first written token starts a page (a row's cached
prefix is whole pages), so each of its pages is one DMA from the new keys to the pool, HBM to HBM, with the
padding past its last token landing in the row's own page, beyond its length (where nothing reads). XLA's
scatter there copied the pool to its own layout and back around every prefill call, and rewrote it in every
layer: a call's cost grew with the pool, so with the rows a server holds.
A prompt's attention reads its rows' pages back (`read_pages`) a page per DMA too: XLA's gather of them
from the pool, for heads of 256 lanes, split the whole pool into two 128-lane halves first, in every layer
of every prefill call (GPT-J-6B on a v5e: 2 x 6.5 ms a layer and call at 16 rows, 5.8 of the 6.7 s to their
first token).
Both move a prompt's tokens heads major ([B, H, tokens, K]), as a page holds them: token major, XLA laid each
layer's pages out again around the DMAs (a v5e's mixed step of GPT-J-6B with a 10-page chunk: 2 x 40 us a layer).
An int8 pool's scales ([L, pages, H, page_size] float32, page-major: `kv_cache.KVCache`) move by the same
kernels: a page's scales are [H, page_size], one lane a token, so a decode step's tile is the whole page.
Off a TPU the kernels run in Pallas' TPU interpreter (`pltpu.force_tpu_interpret_mode`), as the tests do.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshlm.sharding import spec_for

GROUP = 8  # rows whose tile DMAs are in flight together (their tiles share VMEM: 8 x 64 KB for gptj-1b)
POOL_AXES = ("act_heads", None, None, None, None)  # the pool's logical axes: heads split over `model`
SCALE_POOL_AXES = (None, None, "act_heads", None)  # an int8 pool's scales, page-major


def _pool_axes(pool: jax.Array) -> tuple:
    return POOL_AXES if pool.ndim == 5 else SCALE_POOL_AXES


def _page(ref: Any, layer: jax.Array, page: jax.Array) -> Any:
    """Page `page` of `layer`: [H, page_size, K] of keys or values [H, L, pages, page_size, K], [H, page_size] of
    their scales [L, pages, H, page_size]."""
    return ref.at[:, layer, page] if len(ref.shape) == 5 else ref.at[layer, page]


def _tokens(ref: Any, layer: jax.Array, page: jax.Array, start: jax.Array, count: int) -> Any:
    """Tokens [start, start + count) of a page (as `_page`): [H, count, K] or [H, count]."""
    if len(ref.shape) == 5:
        return ref.at[:, layer, page, pl.ds(start, count)]
    return ref.at[layer, page, :, pl.ds(start, count)]


def over_heads(kernel: Any, in_axes: tuple, out_axes: tuple, *args: jax.Array) -> jax.Array:
    """`kernel(*args)`, or under a mesh one call per shard of the heads (the arguments' and result's logical
    `in_axes` and `out_axes`): every shard moves every row's tokens of the heads it holds, the pool as it lies."""
    if jax.sharding.get_abstract_mesh().empty:
        return kernel(*args)
    in_specs = tuple(spec_for(a) for a in in_axes)
    return jax.shard_map(kernel, in_specs=in_specs, out_specs=spec_for(out_axes), check_vma=False)(*args)


def _write_kernel(layer_ref, pages_ref, offsets_ref, new_ref, pool_ref, out_ref, tiles_vmem, sems, *, group: int):
    """Rows [g * group, (g + 1) * group) of program g: the tile holding each row's slot in, the slot set
    there, the tile out (a scale pool's tile is the whole page: its tokens are lanes)."""
    del pool_ref  # the same buffer as out_ref (aliased)
    layer, first, tile = layer_ref[0], pl.program_id(0) * group, tiles_vmem.shape[2]
    starts = [pl.multiple_of(jnp.maximum(offsets_ref[first + i], 0) // tile * tile, tile) for i in range(group)]

    def copy_tiles(into_vmem: bool) -> None:
        """Every row's tile from the pool into VMEM, or back: all the group's DMAs in flight, then awaited."""
        copies = []
        for i in range(group):
            hbm = _tokens(out_ref, layer, pages_ref[first + i], starts[i], tile)
            src, dst = (hbm, tiles_vmem.at[i]) if into_vmem else (tiles_vmem.at[i], hbm)
            copies.append(pltpu.make_async_copy(src, dst, sems.at[i]))
            copies[-1].start()
        for copy in copies:
            copy.wait()

    copy_tiles(into_vmem=True)
    slot = jax.lax.broadcasted_iota(jnp.int32, tiles_vmem.shape[1:], 1)
    for i in range(group):
        at = offsets_ref[first + i] - starts[i]  # -1 for a row not written
        tiles_vmem[i] = jnp.where(slot == at, new_ref[i], tiles_vmem[i])  # new [H, 1, K] or [H, 1]
    copy_tiles(into_vmem=False)


def tile_rows(page_size: int, dtype: jnp.dtype) -> int:
    """Tokens a DMA moves at least: the sublanes of the pool's [page_size, K] tiles (8 of 32 bits, packed:
    16 bfloat16, 32 int8), or the whole page where it does not divide into them."""
    rows = 8 * 4 // jnp.dtype(dtype).itemsize
    return rows if page_size % rows == 0 else page_size


def _write(pool: jax.Array, new: jax.Array, layer: jax.Array, pages: jax.Array, offsets: jax.Array) -> jax.Array:
    B, H = new.shape[:2]  # new [B, H, 1, K], or [B, H, 1] scales
    group = next(g for g in range(min(GROUP, B), 0, -1) if B % g == 0)
    size = pool.shape[3]  # a page's scales' window is the page: its tokens are lanes
    window = (H, tile_rows(size, pool.dtype), pool.shape[4]) if pool.ndim == 5 else (H, size)
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_write_kernel, group=group),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B // group,),
            in_specs=[pl.BlockSpec((group, *new.shape[1:]), lambda g, *_: (g,) + (0,) * (new.ndim - 1)), anywhere],
            out_specs=anywhere,
            scratch_shapes=[pltpu.VMEM((group, *window), pool.dtype), pltpu.SemaphoreType.DMA((group,))],
        ),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={4: 0},  # operands count the three prefetched scalars
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    )(layer.reshape(1).astype(jnp.int32), pages, offsets, new.astype(pool.dtype), pool)


def write_tokens(
    pool: jax.Array, new: jax.Array, layer: jax.Array, pages: jax.Array, offsets: jax.Array, written: jax.Array
) -> jax.Array:
    """pool [H, L, pages, page_size, K] with new [B, H, K] stored at slot offsets[b] of page pages[b] of
    `layer`, for the rows `written` [B]; in place where the pool is donated. Or an int8 pool's scales
    [L, pages, H, page_size] with new [B, H]."""
    pages = jnp.where(written, pages, 0).astype(jnp.int32)
    offsets = jnp.where(written, offsets, -1).astype(jnp.int32)  # no slot: page 0 is written back as it is
    new = new[:, :, None]  # as the slot's window in the page: [B, H, 1, K] or [B, H, 1]
    axes = (_pool_axes(pool), (None, "act_heads", None, None)[: new.ndim], (), (None,), (None,))
    return over_heads(_write, axes, _pool_axes(pool), pool, new, layer, pages, offsets)


NO_PAGE = -1  # a `write_pages` chunk that holds no written token
MAX_PAGE_COPIES = 64  # pages a row's prompt writes at most by `write_pages` (its DMAs are unrolled)


def _pages_kernel(layer_ref, pages_ref, new_ref, pool_ref, out_ref, sems, *, chunks: int):
    """Row b = program b: each of its chunks of page_size new tokens that holds a written one, DMA'd to its page
    (a chunk is new_ref[b, :, j], [H, page_size, K]: whole trailing tiles, as the page's, whatever the page size; of
    scales [H, page_size], a row of lanes per head, strided)."""
    del pool_ref  # the same buffer as out_ref (aliased)
    b, layer = pl.program_id(0), layer_ref[0]
    copies = [
        pltpu.make_async_copy(new_ref.at[b, :, j], _page(out_ref, layer, jnp.maximum(pages_ref[b, j], 0)), sems.at[j])
        for j in range(chunks)
    ]
    for j, copy in enumerate(copies):
        pl.when(pages_ref[b, j] != NO_PAGE)(copy.start)
    for j, copy in enumerate(copies):
        pl.when(pages_ref[b, j] != NO_PAGE)(copy.wait)


def _write_pages(pool: jax.Array, new: jax.Array, layer: jax.Array, pages: jax.Array) -> jax.Array:
    B, chunks = pages.shape
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_pages_kernel, chunks=chunks),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B,),
            in_specs=[anywhere, anywhere],
            out_specs=anywhere,
            scratch_shapes=[pltpu.SemaphoreType.DMA((chunks,))],
        ),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={3: 0},  # operands count the two prefetched scalars
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    )(layer.reshape(1).astype(jnp.int32), pages, new.astype(pool.dtype), pool)


def write_pages(pool: jax.Array, new: jax.Array, layer: jax.Array, slots: jax.Array, written: jax.Array) -> jax.Array:
    """pool [H, L, pages, page_size, K] with each row's written tokens of new [B, H, T, K] (heads major, as a page
    holds them) stored at their flat `slots` [B, T] (page * page_size + offset) of `layer`; in place where the pool
    is donated. A row's written tokens are consecutive from a page's first slot (a prompt after a cached prefix of
    whole pages), in at most MAX_PAGE_COPIES pages; what a row does not write is padding. Or an int8 pool's scales
    [L, pages, H, page_size] with new [B, H, T]."""
    size = pool.shape[3]
    T = slots.shape[1]
    chunks = -(-T // size)
    first = jnp.argmax(written, axis=1)  # the row's first written token
    starts = first[:, None] + size * jnp.arange(chunks)
    held = size * jnp.arange(chunks) < written.sum(axis=1, keepdims=True)
    pages = jnp.where(held, jnp.take_along_axis(slots, jnp.minimum(starts, T - 1), axis=1) // size, NO_PAGE)
    # the written tokens first, in whole pages: each row's window of its own (a gather of single tokens was
    # relaid out twice on a TPU)
    padded = jnp.pad(new, [(0, 0), (0, 0), (0, chunks * size)] + [(0, 0)] * (new.ndim - 3))
    new = jax.vmap(lambda row, at: jax.lax.dynamic_slice_in_dim(row, at, chunks * size, axis=1))(padded, first)
    new = new.reshape(*new.shape[:2], chunks, size, *new.shape[3:])  # [B, H, chunks, size(, K)]
    axes = (_pool_axes(pool), (None, "act_heads", None, None, None)[: new.ndim], (), (None, None))
    return over_heads(_write_pages, axes, _pool_axes(pool), pool, new, layer, pages.astype(jnp.int32))


def _read_kernel(layer_ref, table_ref, pool_ref, out_ref, sem, *, width: int):
    """Row b = program b: each page of its table ([H, page_size, K], or its scales) DMA'd from the pool to
    out[b, :, j], all in flight on one semaphore, then awaited."""
    b, layer = pl.program_id(0), layer_ref[0]

    def copy(j: jax.Array) -> pltpu.AsyncCopyDescriptor:
        return pltpu.make_async_copy(_page(pool_ref, layer, table_ref[b, j]), out_ref.at[b, :, j], sem)

    jax.lax.fori_loop(0, width, lambda j, _: copy(j).start(), None)
    jax.lax.fori_loop(0, width, lambda j, _: copy(j).wait(), None)


def _read_pages(pool: jax.Array, layer: jax.Array, table: jax.Array) -> jax.Array:
    H = pool.shape[0] if pool.ndim == 5 else pool.shape[2]  # a page: [H, page_size(, K)] = [H, *pool.shape[3:]]
    B, width = table.shape
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_read_kernel, width=width),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B,),
            in_specs=[anywhere],
            out_specs=anywhere,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct((B, H, width, *pool.shape[3:]), pool.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    )(layer.reshape(1).astype(jnp.int32), table.astype(jnp.int32), pool)


def read_pages(pool: jax.Array, layer: jax.Array, table: jax.Array) -> jax.Array:
    """The pages of `table` [B, n] of `layer` of pool [H, L, pages, page_size, K], as [B, H, n, page_size, K] (of an
    int8 pool's scales [L, pages, H, page_size], as [B, H, n, page_size]): heads major, so that a row's tokens of a
    head lie one after another, [n * page_size, K] as attention's products take them."""
    out_axes = (None, "act_heads", None, None, None)[: pool.ndim]
    return over_heads(_read_pages, (_pool_axes(pool), (), (None, None)), out_axes, pool, layer, table)
